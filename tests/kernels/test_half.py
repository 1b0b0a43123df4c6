"""Half-precision storage (issue #17): fa2 and the product kernel (flash) with Q, K, V, O (dO, dK, dV, dQ) kept in
float16 or bfloat16 and everything else float32 -- against the float64 reference, against the float32 kernels on the
same inputs, the counted bytes against the model, and the errors for combinations that have no meaning."""

import re

import numpy as np
import pytest
from conftest import FEATURE_IMPLS, MODULE_OF, assert_close

import flashnb
from flashnb import common, reference
from flashnb.instruments import traffic

U16 = 2.0 ** -11   # float16's unit roundoff: a round-to-nearest store changes a value by at most this, relative
UBF = 2.0 ** -8    # bfloat16's (8 significand bits)
U32 = 2.0 ** -24   # float32's
TINY16 = 2.0 ** -25  # half the spacing of float16's subnormals: the absolute rounding below 2^-14

SMALL = dict(Br=16, Bc=16, warps=1)   # one warp: the cheapest block on the simulator


def half_inputs(rng, BH, Nq, Nk, d, *, qk=60.0, vo=300.0):
    """float16 q, k (standard normal × ``qk``) and v, do (× ``vo``): large magnitudes (|x| up to ~4.5 σ, a few
    hundred up to ~1350), all representable (float16 reaches 65504), never zero."""
    q = (rng.standard_normal((BH, Nq, d)) * qk).astype(np.float16)
    k = (rng.standard_normal((BH, Nk, d)) * qk).astype(np.float16)
    v = (rng.standard_normal((BH, Nk, d)) * vo).astype(np.float16)
    do = (rng.standard_normal((BH, Nq, d)) * vo).astype(np.float16)
    return q, k, v, do


def f64(*arrays):
    return [np.asarray(a, dtype=np.float64) for a in arrays]


def forward_tolerance(q, k, v, causal, scale, rounding):
    """Per-element bound on |o_kernel - o_exact| for o stored with unit roundoff ``rounding``.

    float32 part: the products of two float16 values are exact in float32 (11 + 11 significand bits <= 24),
    so a score s_ij = scale·q_i·k_j is off by at most (d + 1)·u32·|scale|·Σ_l |q_il k_jl| (d additions, one
    scaling); exp(s - m) then has the relative error ε_ij = δs_ij + δs_i,max + u32·(|s_ij - m_i| + 4) (the
    row max's own error, the subtraction, exp).  To first order, relative errors ε_ij of the weights P_ij move
    o_i by Σ_j P_ij ε_ij (v_j - o_i) (normalisation included); the sums P·V and l add (Nk + 2)·u32·Σ_j P_ij|v_j|.
    A factor 2 covers the second-order terms (ε stays below 0.05 in these tests, checked).  Storage part: one
    rounding of the stored o (``rounding``·|o|, and TINY16 for float16 subnormals)."""
    q, k, v = f64(q, k, v)
    d, Nk = q.shape[-1], k.shape[-2]
    P, _, _, S = reference._softmax(q, k, causal, scale, None)
    o = P @ v
    ds = (d + 1) * U32 * abs(scale) * (np.abs(q) @ np.abs(np.swapaxes(k, -1, -2)))
    m = np.where(P > 0, S, -np.inf).max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    ds_max = np.where(P > 0, ds, 0.0).max(axis=-1, keepdims=True)
    eps = ds + ds_max + U32 * (np.abs(S - m) + 4)
    assert np.all(np.where(P > 1e-30, eps, 0.0) < 0.05), "first-order bound out of its range"
    spread = np.einsum("bij,bijc->bic", P * eps, np.abs(v[:, None, :, :] - o[:, :, None, :]))
    e32 = 2 * (spread + (Nk + 2) * U32 * (P @ np.abs(v)))
    return o, rounding * (np.abs(o) + e32) + e32 + TINY16


# The softmax scale of the large inputs: the default 1/sqrt(d) gives scores up to ~10^4 (rows nearly one-hot:
# o is close to one row of v), "moderate" brings them to O(1-10) (o mixes many rows: rounding shows).
MODERATE = 4.0 / (60.0 * 60.0)   # times 1/sqrt(d)


@pytest.mark.parametrize("impl", FEATURE_IMPLS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("BH, Nq, Nk, d, moderate", [(1, 20, 37, 16, False), (1, 40, 24, 8, True)],
                         ids=["Nq<Nk-default-scale", "Nq>Nk-moderate-scale"])
def test_forward_float16(rng, BH, Nq, Nk, d, moderate, causal, impl):
    """float16 storage, large inputs, Nq != Nk."""
    q, k, v, _ = half_inputs(rng, BH, Nq, Nk, d)
    scale = d ** -0.5 * (MODERATE if moderate else 1.0)
    o, lse = flashnb.attention_forward(q, k, v, causal=causal, scale=scale, impl=impl, **SMALL)
    assert o.dtype == np.float16 and lse.dtype == np.float32
    # The same values in float32 storage: the kernels do the same float32 arithmetic in the same order (the
    # loads widen exactly), so o is the float32 result rounded once, bit for bit, and lse is identical.
    o32, lse32 = flashnb.attention_forward(q, k, v, causal=causal, scale=scale, impl=impl, storage="float32",
                                           **SMALL)
    assert o32.dtype == np.float32
    assert np.array_equal(o, o32.astype(np.float16), equal_nan=True)
    assert np.array_equal(lse, lse32)
    o_ref, bound = forward_tolerance(q, k, v, causal, scale, U16)
    _, lse_ref = reference.attention_forward(*f64(q, k, v), causal=causal, scale=scale)
    assert not np.isnan(o).any(), "o: NaN left (an element was never written?)"
    err = np.abs(o.astype(np.float64) - o_ref)
    assert np.all(err <= bound), f"o: error {err.max():.3e} over the bound (worst {np.max(err - bound):.3e} over)"
    # lse: float32 all the way; |lse| reaches ~10^4 here, so its rounding is relative (a few u32 of |lse|)
    # plus the score errors (the bound's δs, at most (d + 1)·u32·|scale|·max Σ|q||k|)
    qa, ka = (np.abs(a.astype(np.float64)) for a in (q, k))
    ds = (d + 1) * U32 * scale * float((qa @ ka.transpose(0, 2, 1)).max())
    assert_close(lse, lse_ref, atol=2 * ds, rtol=8 * U32, what="lse")


def backward_tolerance(q, k, v, do, o, causal, scale, g_ref, rounding):
    """Bounds on |g_kernel - g_exact| for the gradients (dq, dk, dv) stored with unit roundoff ``rounding``.

    The kernels get o as stored (rounded: |δo| <= rounding·|o|), so D_i = rowsum(dO ∘ O) is off by
    δD_i <= rounding·Σ_c |do_ic o_ic|, and dS_ij = P_ij (dP_ij - D_i) by P_ij δD_i: dq_i moves by at most
    |scale|·δD_i·Σ_j P_ij |k_j|, dk_j by |scale|·Σ_i P_ij δD_i |q_i|, dv not at all.  float32 arithmetic: as
    test_fa2's BWD tolerance (1e-4 for gradients of O(1-10) from unit inputs: sums of <= 64 products, four
    chained, dQ by atomics), here relative to each gradient's largest magnitude.  Then one rounding of the store."""
    q, k, v, do, o = f64(q, k, v, do, o)
    P = reference._softmax(q, k, causal, scale, None)[0]
    dD = rounding * np.sum(np.abs(do * o), axis=-1)                        # (BH, Nq)
    via_D = [abs(scale) * dD[..., None] * (P @ np.abs(k)),
             abs(scale) * (np.swapaxes(P * dD[..., None], -1, -2) @ np.abs(q)),
             np.zeros_like(v)]
    out = []
    for g, extra in zip(g_ref, via_D):
        e32 = 1e-4 * np.abs(g).max() + extra
        out.append(rounding * (np.abs(g) + e32) + e32 + TINY16)
    return out


@pytest.mark.parametrize("impl", FEATURE_IMPLS)
@pytest.mark.parametrize("BH, Nq, Nk, d, causal", [(1, 20, 37, 16, True), (1, 33, 20, 8, False)],
                         ids=["Nq<Nk-causal", "Nq>Nk-full"])
def test_backward_float16(rng, BH, Nq, Nk, d, causal, impl):
    """float16 storage, large q, k, v, do; the scale keeps scores O(1-10) (at the default scale the rows are
    one-hot and dS ≈ 0, which would leave dq and dk untested)."""
    q, k, v, do = half_inputs(rng, BH, Nq, Nk, d)
    scale = d ** -0.5 * MODERATE
    o, lse = flashnb.attention_forward(q, k, v, causal=causal, scale=scale, impl=impl, **SMALL)
    grads = flashnb.attention_backward(q, k, v, o, lse, do, causal=causal, scale=scale, impl=impl, **SMALL)
    assert all(g.dtype == np.float16 for g in grads)
    # Same stored values through the float32 kernels: dK and dV are the float32 results rounded once, bit for
    # bit; dQ is summed by atomics whose order may differ between runs, so up to one float16 spacing apart.
    g32 = flashnb.attention_backward(q, k, v, o, lse, do, causal=causal, scale=scale, impl=impl,
                                     storage="float32", **SMALL)
    assert np.array_equal(grads[1], g32[1].astype(np.float16)) and np.array_equal(grads[2], g32[2].astype(np.float16))
    dq32 = g32[0].astype(np.float16)
    assert np.all(np.abs(grads[0].astype(np.float32) - dq32) <= np.spacing(np.abs(dq32)))
    g_ref = reference.attention_backward(*f64(q, k, v, do), causal=causal, scale=scale)
    bounds = backward_tolerance(q, k, v, do, o, causal, scale, g_ref, U16)
    for name, g, ref, bound in zip(("dq", "dk", "dv"), grads, g_ref, bounds):
        assert not np.isnan(g).any(), f"{name}: NaN left"
        err = np.abs(g.astype(np.float64) - ref)
        assert np.all(err <= bound), f"{name}: error {err.max():.3e} over the bound by {np.max(err - bound):.3e}"


@pytest.mark.parametrize("storage", ["float16", "bfloat16"])
def test_half_gradient_error_is_the_rounded_o_in_D(rng, storage):
    """The documented half-precision gradient error, measured: the backward forms D = rowsum(dO ∘ O) from the
    *stored* (rounded) O, so dq and dk carry |scale|·δD·Σ P|k| and |scale|·Σ P δD |q| with δD <= u·Σ|dO ∘ O|
    (u = 2^-11, 2^-8): an error that scales with |v|·|dO|, not with the gradient.  With v = 256 + N(0, 1) the
    terms dP - D nearly cancel, so dq, dk are O(50) while |v|·|dO| is O(10^4): the measured error is within that
    bound, of its size (at least 1/30 of it), and far above the gradients' own rounding (20x); the same inputs
    with O kept in float32 (storage="float32") are 100x more accurate; dv (no D) stays within its own rounding."""
    u = {"float16": U16, "bfloat16": UBF}[storage]
    half = (lambda a: a.astype(np.float16)) if storage == "float16" else common.to_bfloat16
    values = (lambda a: a) if storage == "float16" else common.from_bfloat16
    q, k = (half(rng.standard_normal((1, n, 16))) for n in (24, 32))
    v = half(256 + rng.standard_normal((1, 32, 16)))
    do = half(64 * rng.standard_normal((1, 24, 16)))
    o, lse = flashnb.attention_forward(q, k, v, impl="flash", storage=storage, **SMALL)
    grads = flashnb.attention_backward(q, k, v, o, lse, do, impl="flash", storage=storage, **SMALL)
    q, k, v, do, o = (values(a) for a in (q, k, v, do, o))
    exact_o = flashnb.attention_forward(q, k, v, impl="flash", storage="float32", **SMALL)
    g32 = flashnb.attention_backward(q, k, v, *exact_o, do, impl="flash", storage="float32", **SMALL)
    g_ref = reference.attention_backward(*f64(q, k, v, do))
    scale = 16 ** -0.5
    P = reference._softmax(*f64(q, k), False, scale, None)[0]
    dD = u * np.sum(np.abs(do.astype(np.float64) * o), axis=-1)[..., None]          # (1, Nq, 1)
    via_D = [scale * dD * (P @ np.abs(k)), scale * (np.swapaxes(P * dD, -1, -2) @ np.abs(q))]
    bounds = backward_tolerance(q, k, v, do, o, False, scale, g_ref, u)
    for name, g, g_f32, ref, bound in zip(("dq", "dk", "dv"), grads, g32, g_ref, bounds):
        err = np.abs(values(g).astype(np.float64) - ref)
        own = u * np.abs(ref).max()
        assert np.all(err <= bound), f"{name}: error {err.max():.3e} over the bound"
        if name == "dv":
            assert err.max() <= own + 1e-3, f"dv: {err.max():.3e} beyond its own rounding {own:.3e}"
            continue
        D_bound = via_D[name == "dk"].max()
        assert D_bound / 30 <= err.max() <= D_bound and err.max() >= 20 * own, (name, err.max(), D_bound, own)
        assert np.abs(g_f32 - ref).max() <= err.max() / 100, name


# --------------------------------------------------------------------------- bfloat16 (uint16 bit patterns)


def test_bfloat16_twins_match_torch():
    """common.to_bfloat16 / from_bfloat16 (the NumPy twins of the kernels' conversions) against torch's own
    bfloat16 rounding, on random values, exact ties (round to even) and the edges of the range."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    x = np.concatenate([rng.standard_normal(2000).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 2000),
                        np.float32([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3.3895e38, 3.4e38, -3.4e38, 1e-40,
                                    -1e-42, 0.0, np.inf, -np.inf])]).astype(np.float32)
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.uint16).numpy()
    assert np.array_equal(common.to_bfloat16(x), want)
    assert np.array_equal(common.from_bfloat16(want), torch.from_numpy(want).view(torch.bfloat16).float().numpy())
    assert np.isnan(common.from_bfloat16(common.to_bfloat16(np.float32([np.nan])))).all()


@pytest.mark.parametrize("impl", FEATURE_IMPLS)
def test_bfloat16_forward_backward(rng, impl):
    """bfloat16 storage (explicit; uint16 bit patterns): the float32 kernels' results rounded to bfloat16 bit for
    bit (dq within one bfloat16 spacing: atomics), and within bfloat16's rounding of the float64 reference."""
    BH, Nq, Nk, d, causal = 1, 24, 33, 8, True
    q, k, v, do = (common.to_bfloat16(a.astype(np.float32)) for a in half_inputs(rng, BH, Nq, Nk, d))
    qf, kf, vf, dof = (common.from_bfloat16(a) for a in (q, k, v, do))
    scale = d ** -0.5 * MODERATE
    o, lse = flashnb.attention_forward(q, k, v, causal=causal, scale=scale, impl=impl, storage="bfloat16", **SMALL)
    assert o.dtype == np.uint16 and lse.dtype == np.float32
    o32, lse32 = flashnb.attention_forward(qf, kf, vf, causal=causal, scale=scale, impl=impl, **SMALL)
    assert np.array_equal(o, common.to_bfloat16(o32)) and np.array_equal(lse, lse32)
    o_ref, bound = forward_tolerance(qf, kf, vf, causal, scale, UBF)
    assert np.all(np.abs(common.from_bfloat16(o) - o_ref) <= bound)
    grads = flashnb.attention_backward(q, k, v, o, lse, do, causal=causal, scale=scale, impl=impl,
                                       storage="bfloat16", **SMALL)
    assert all(g.dtype == np.uint16 for g in grads)
    g32 = flashnb.attention_backward(qf, kf, vf, common.from_bfloat16(o), lse, dof, causal=causal, scale=scale,
                                     impl=impl, **SMALL)
    assert np.array_equal(grads[1], common.to_bfloat16(g32[1])) and np.array_equal(grads[2], common.to_bfloat16(g32[2]))
    dq, dq32 = common.from_bfloat16(grads[0]), common.from_bfloat16(common.to_bfloat16(g32[0]))
    assert np.all(np.abs(dq - dq32) <= 2.0 ** -7 * np.abs(dq32))      # one bfloat16 spacing (8 significand bits)
    g_ref = reference.attention_backward(*f64(qf, kf, vf, dof), causal=causal, scale=scale)
    bounds = backward_tolerance(qf, kf, vf, dof, common.from_bfloat16(o), causal, scale, g_ref, UBF)
    for name, g, ref, bound in zip(("dq", "dk", "dv"), grads, g_ref, bounds):
        err = np.abs(common.from_bfloat16(g) - ref)
        assert np.all(err <= bound), f"{name}: error {err.max():.3e} over the bound by {np.max(err - bound):.3e}"


# --------------------------------------------------------------------------- bytes: counted and modelled


@pytest.mark.parametrize("impl", FEATURE_IMPLS)
def test_counted_bytes_halve(rng, impl):
    """Q, K, V, O (dO, dK, dV) move half the bytes in float16 as in float32 at the same shape; L, D and the dQ
    accumulator do not change; the model (elements × the module's itemsizes) equals the count launch by launch."""
    mod = MODULE_OF[impl]
    BH, Nq, Nk, d, causal = 1, 16, 24, 8, True
    q, k, v, do = half_inputs(rng, BH, Nq, Nk, d, qk=1.0, vo=1.0)
    counted = {}
    for storage in ("float32", "float16"):
        dev = [common.to_device(a, storage) for a in (q, k, v, do)]
        with traffic.count() as t:
            o, lse = mod.forward(*dev[:3], causal=causal, scale=0.01, **SMALL)
            mod.backward(*dev[:3], o, lse, dev[3], causal=causal, scale=0.01, **SMALL)
        model = (mod.model_forward(BH, Nq, Nk, d, causal=causal, storage=storage, **SMALL)
                 + mod.model_backward(BH, Nq, Nk, d, causal=causal, storage=storage, **SMALL))
        assert t.summary() == model                                    # elements: the same tiles either way
        assert [dict(launch=lt.label, read_bytes=lt.read_bytes, write_bytes=lt.write_bytes,
                     atomic_bytes=sum(n * lt.itemsize[a] for a, n in lt.atomics.items())) for lt in t.launches] \
            == mod.model_bytes(model, storage)
        assert all(lt.itemsize[a] == mod.itemsizes(storage)[a] for lt in t.launches for a in lt.itemsize)
        counted[storage] = t.launches
    f32, f16 = counted["float32"], counted["float16"]

    def nbytes(lt, name):
        return (lt.reads.get(name, 0) + lt.writes.get(name, 0)) * lt.itemsize[name]

    halved = {"Q", "K", "V", "O", "dO", "dK", "dV"}
    for lt32, lt16 in zip(f32, f16[:3]):          # forward, D = rowsum(dO∘O), backward: array by array
        assert set(lt32.itemsize) == set(lt16.itemsize)
        for name in set(lt32.reads) | set(lt32.writes):
            assert nbytes(lt16, name) * (2 if name in halved else 1) == nbytes(lt32, name), (lt32.label, name)
        assert lt16.atomics == lt32.atomics and lt16.itemsize.get("dQ", 4) == 4   # dQ: float32 atomics either way
    assert len(f32) == 3 and [lt.label for lt in f16[3:]] == ["dQ -> float16"]   # half: + the conversion launch


@pytest.mark.parametrize("impl", FEATURE_IMPLS)
def test_model_bytes_halve_at_scale(impl):
    """The models at a size the simulator cannot run (N = 4096, d = 64, 8 heads, causal): the bytes of Q, K, V,
    O halve exactly; what stays float32 (L, D, the dQ accumulator) keeps the total above half."""
    mod = MODULE_OF[impl]
    shape = (8, 4096, 4096, 64)
    for model in (mod.model_forward, mod.model_backward):
        b32, b16 = (mod.model_bytes(model(*shape, causal=True, storage=s), s) for s in ("float32", "float16"))
        total32, total16 = (sum(x["read_bytes"] + x["write_bytes"] + x["atomic_bytes"] for x in b) for b in (b32, b16))
        assert total32 / 2 < total16 < total32


# --------------------------------------------------------------------------- bad combinations and range


@pytest.mark.parametrize("impl", FEATURE_IMPLS)
def test_bad_combinations(rng, impl):
    mod = MODULE_OF[impl]
    q, k, v, do = half_inputs(rng, 1, 8, 8, 8, qk=1.0, vo=1.0)
    with pytest.raises(ValueError, match="storage='float16': impl 'naive' has no half-precision storage"):
        flashnb.attention_forward(q, k, v, impl="naive", storage="float16")
    with pytest.raises(ValueError, match="storage must be one of"):
        flashnb.attention_forward(q, k, v, impl=impl, storage="float8")
    with pytest.raises(TypeError, match="k is float32"):                      # mixed dtypes, storage=None
        flashnb.attention_forward(q, k.astype(np.float32), v, impl=impl)
    with pytest.raises(TypeError, match="takes v as float16, got dtype float32"):
        flashnb.attention_forward(q, k, v.astype(np.float32), impl=impl, storage="float16")
    with pytest.raises(TypeError, match="takes q as uint16 bfloat16 bit patterns"):
        flashnb.attention_forward(q, k, v, impl=impl, storage="bfloat16")
    o, lse = flashnb.attention_forward(q, k, v, impl=impl)
    with pytest.raises(TypeError, match="o is float32"):
        flashnb.attention_backward(q, k, v, o.astype(np.float32), lse, do, impl=impl)
    with pytest.raises(TypeError, match="takes k as float16"):                # the launcher checks device arrays
        mod.forward(common.to_device(q, "float16"), common.to_device(k), common.to_device(v, "float16"), scale=1.0)
    with pytest.raises(TypeError, match="uint16 bit patterns"):
        common.to_device(q, "bfloat16")
    # the float32 path stays, explicit in the result's dtype: other impls, or storage="float32"
    assert flashnb.attention_forward(q, k, v, impl="naive")[0].dtype == np.float32
    assert flashnb.attention_forward(q, k, v, impl=impl, storage="float32")[0].dtype == np.float32
    assert flashnb.attention(q, k.astype(np.float32), v, impl="fa1")[0].dtype == np.float32


@pytest.mark.parametrize("impl", FEATURE_IMPLS)
def test_float16_gradient_overflow_is_an_error(rng, impl):
    """dv_j = Σ_i P_ij do_i: 16 queries that all attend to one key with do = 60000 sum to 9.6e5, beyond float16's
    65504 -- a ValueError naming dv, not an inf, and (before: a NumPy "overflow encountered in cast" from the
    simulator's float16 cast came first) no warning; the same inputs in float32 storage give the finite value.
    The simulator's float32 -> float16 store is NumPy's cast below 65520 and inf from there, as on a GPU."""
    import warnings

    Nq, d = 16, 8
    q = np.ones((1, Nq, d), np.float16)
    k = np.ones((1, 1, d), np.float16)
    v = rng.standard_normal((1, 1, d)).astype(np.float16)
    do = np.full((1, Nq, d), 60000, np.float16)
    o, lse = flashnb.attention_forward(q, k, v, impl=impl)
    with warnings.catch_warnings(), pytest.raises(ValueError, match="dv overflows float16"):
        warnings.simplefilter("error")                 # any warning, in any simulator thread, is an error here
        flashnb.attention_backward(q, k, v, o, lse, do, impl=impl)
    x = np.float32([65504, 65519.996, 65520, -65520, -1e6, 3.14159, -2.0 ** -20, 0])
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    assert [common.storage_conversions("float16")[1](e) for e in x] == want.tolist()
    dv = flashnb.attention_backward(q, k, v, o, lse, do, impl=impl, storage="float32")[2]
    assert np.allclose(dv, Nq * 60000.0)


def test_uint16_without_bfloat16_storage_is_refused(rng):
    """Before: bfloat16 bit patterns (common.to_bfloat16's uint16 arrays) passed without storage="bfloat16" were
    computed as integers (outputs ~4e4 instead of ~0.5), without a word.  Now a uint16 array anywhere but with
    storage="bfloat16" is a TypeError naming it and storage="bfloat16": for q of the default storage, do alone in a
    backward, an explicit storage="float32", an impl without half storage, a torch tensor's values, and
    flash-decoding's cache.  Other integer dtypes stay integer values."""
    from flashnb.kernels.launch import decode

    q, k, v = (rng.standard_normal((1, 16, 8)) for _ in range(3))
    bits = [common.to_bfloat16(a) for a in (q, k, v)]
    for kw in (dict(impl="flash"), dict(impl="flash", storage="float32"), dict(impl="naive")):
        with pytest.raises(TypeError, match=r"q has dtype uint16.*bfloat16 bit patterns.*storage='bfloat16'"):
            flashnb.attention_forward(*bits, **kw)
    o, lse = flashnb.attention_forward(q, k, v, impl="flash", **SMALL)
    with pytest.raises(TypeError, match=r"do has dtype uint16.*from_bfloat16\(do\)"):
        flashnb.attention_backward(q, k, v, o, lse, common.to_bfloat16(o), impl="flash", **SMALL)
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="k has dtype uint16"):
        flashnb.attention(q, torch.from_numpy(bits[1]), v, impl="flash")
    with pytest.raises(TypeError, match="k_new has dtype uint16"):
        decode.KVCache(1, 16, 8).append(bits[1], v)
    o16, _ = flashnb.attention_forward(*bits, impl="flash", storage="bfloat16", **SMALL)   # the bits, as meant
    assert_close(common.from_bfloat16(o16), reference.attention(*(common.from_bfloat16(b) for b in bits)),
                 atol=0.02, rtol=0.02, what="o")   # bfloat16's rounding of o (2^-8 relative) and of the inputs


# --------------------------------------------------------------------------- flashnb.pytorch


@pytest.mark.parametrize("impl", FEATURE_IMPLS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_torch_half_tensors(rng, dtype, impl):
    """float16 / bfloat16 tensors (large, Nq != Nk, causal) reach the half kernels as they are (bfloat16 through
    uint16 bit views) and come back in their dtype, o and the gradients within the storage's rounding of the
    float64 reference (the bounds above)."""
    torch = pytest.importorskip("torch")
    import flashnb.pytorch as ft

    tdt = getattr(torch, dtype)
    rounding = UBF if dtype == "bfloat16" else U16
    q, k, v, do = (torch.from_numpy(a.astype(np.float32)).to(tdt) for a in half_inputs(rng, 1, 12, 20, 8))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    scale = 8 ** -0.5 * MODERATE
    o = ft.attention(q, k, v, causal=True, scale=scale, impl=impl, **SMALL)
    o.backward(do)
    assert o.dtype == tdt and all(t.grad.dtype == tdt for t in (q, k, v))
    q64, k64, v64, do64, o64 = (t.detach().double().numpy() for t in (q, k, v, do, o))
    o_ref, bound = forward_tolerance(q64, k64, v64, True, scale, rounding)
    assert np.all(np.abs(o64 - o_ref) <= bound)
    g_ref = reference.attention_backward(q64, k64, v64, do64, causal=True, scale=scale)
    for t, ref, b in zip((q, k, v), g_ref, backward_tolerance(q64, k64, v64, do64, o64, True, scale, g_ref, rounding)):
        assert np.all(np.abs(t.grad.double().numpy() - ref) <= b)
    with pytest.raises(TypeError, match="needs q, k, v of dtype"):
        ft.attention(q.detach().float(), k.detach().float(), v.detach().float(), impl=impl, storage=dtype)
    assert ft.attention(q.detach(), k.detach(), v.detach(), impl="naive").dtype == tdt   # converted path


@pytest.mark.parametrize("impl", FEATURE_IMPLS)
def test_torch_half_cuda_path_rehearsed(rng, impl):
    """The CUDA-tensor path (zero-copy views, torch's stream) with float16 and bfloat16 tensors, rehearsed on
    the simulator: the same results as the host path."""
    torch = pytest.importorskip("torch")
    import flashnb.pytorch as ft
    from flashnb.instruments.rehearsal import pretend_gpu

    for dtype in (torch.float16, torch.bfloat16):
        q, k, v, do = (torch.from_numpy(a.astype(np.float32)).to(dtype) for a in half_inputs(rng, 1, 16, 24, 8))
        host = ft.attention(q, k, v, causal=True, scale=0.01, impl=impl, **SMALL)
        with pretend_gpu(), ft.rehearse_cuda():
            dev = ft.attention(q, k, v, causal=True, scale=0.01, impl=impl, **SMALL)
        assert dev.dtype == dtype and torch.equal(dev, host)


@pytest.mark.slow   # ~7 s on the simulator (six rehearsed timings); like the other notebooks' measurement rehearsals
def test_measure_storage_rehearsed():
    """Notebook 11's GPU measurement (measure.storage.measure_storage) with its GPU branches taken on the simulator:
    rows in every storage and direction, labelled rehearsal, with the modelled bytes (float16 = bfloat16 < float32)."""
    from flashnb.instruments.measure.storage import measure_storage
    from flashnb.instruments.rehearsal import pretend_gpu

    with pretend_gpu():
        rows = measure_storage(BH=1, N=16, d=8, repeats=1, warmup=1)
    assert [(r["storage"], r["direction"]) for r in rows] == [
        (s, dr) for s in ("float32", "float16", "bfloat16") for dr in ("forward", "backward")]
    assert all(r["mode"] == "rehearsal" for r in rows)
    by = {(r["storage"], r["direction"]): r["model_bytes"] for r in rows}
    assert by["float16", "forward"] == by["bfloat16", "forward"] < by["float32", "forward"]


@pytest.mark.slow   # 3 s each on this machine idle, 25 s under load (CI budget); the float32 fa2 is sanitized in CI
@pytest.mark.parametrize("impl", FEATURE_IMPLS)
@pytest.mark.parametrize("storage", ["float16", "bfloat16"])
def test_half_storage_sanitized(rng, storage, impl):
    """memcheck, racecheck, initcheck and synccheck on the half-storage forward, backward and dQ conversion."""
    from flashnb import sim

    mod = MODULE_OF[impl]

    x = [rng.standard_normal((1, 20, 8)).astype(np.float32) for _ in range(4)]
    q, k, v, do = (common.to_device(common.to_bfloat16(a) if storage == "bfloat16" else a, storage) for a in x)
    with sim.sanitize(raise_on_error=False) as report:
        o, lse = mod.forward(q, k, v, causal=True, scale=0.3, **SMALL)
        mod.backward(q, k, v, o, lse, do, causal=True, scale=0.3, Br=16, Bc=8, warps=2)
    assert "no errors in 4 launch(es)" in str(report), str(report)


@pytest.mark.parametrize("impl", FEATURE_IMPLS)
def test_ptx_conversions(impl):
    """What the GPU runs (NVVM's PTX for sm_80; the PTX guard checks every config for .f64, spills and shared
    memory): float16 loads are 2-byte loads widened by cvt.f32.f16 (exact), float16 stores round with
    cvt.rn.f16.f32 (to nearest even), bfloat16 stores are 2-byte stores with no float16 conversion, and the
    float32 kernel has no conversion at all."""
    from flashnb import instruments as fi

    jobs = [(f"{impl}.preprocess", {}, (8, 0)), (f"{impl}.preprocess", dict(storage="float16"), (8, 0)),
            (f"{impl}.convert", dict(storage="float16"), (8, 0)), (f"{impl}.convert", dict(storage="bfloat16"), (8, 0))]
    pre32, pre16, conv16, convbf = (r.ptx for r in fi.resources_many(jobs, keep_ptx=True))
    def half_cvt(ptx):                           # a conversion to or from float16 (not a register named %f16)
        return re.findall(r"\bcvt\.[\w.]*\.f16\b[\w.]*", ptx)

    assert all(".f64" not in p for p in (pre32, pre16, conv16, convbf))
    assert not half_cvt(pre32) and "ld.global.f32" in pre32
    assert set(half_cvt(pre16)) == {"cvt.f32.f16"} and "ld.global.u16" in pre16 and "ld.global.f32" not in pre16
    assert set(half_cvt(conv16)) == {"cvt.rn.f16.f32"} and "st.global.u16" in conv16
    assert not half_cvt(convbf) and "st.global.u16" in convbf and "ld.global.f32" in convbf
