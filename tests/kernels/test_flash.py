"""The product kernel (impl="flash", flashnb.kernels.flash): stage 6's loop with every feature as a policy.

Dense and causal (both alignments, Nq != Nk, odd head dims, d = 128's dynamic tiles) forward and backward against the
float64 reference; every feature at once against the reference, and counted traffic equal to the model with every
feature on; the dynamic-shared-memory fallback; block masks on the product's tiles; the sanitizer's four tools with
every feature on.  The features one by one run through the feature tests of stage 4 (tests/kernels/test_half.py,
test_dropout.py, test_flex.py, test_block_sparse.py: parametrised over conftest.FEATURE_IMPLS); the SASS and memory
parity with stage 6 is tests/kernels/test_flash_parity.py."""

import numpy as np
import pytest
from conftest import assert_close, qkv

import flashnb
from flashnb import common, flex, reference, sim
from flashnb import rng as frng
from flashnb.instruments import traffic
from flashnb.kernels import flash, policies
from flashnb.kernels.launch import flash as launch_flash
from flashnb.stages import block_sparse as bs

# As tests/stages/test_fa2.py and test_fa2_fast.py: float32 sums of <= 128 products of O(1) values (forward); the
# backward chains four such sums with values up to O(10) and adds dQ by atomics in any order.  A wrong index, mask or
# skipped tile changes outputs by O(0.1 - 1).
FWD = dict(atol=2e-5, rtol=2e-5)
BWD = dict(atol=1e-4, rtol=1e-4)
# With dropout the weights are scaled by 1/(1-p) <= 2: the same bounds times 2 (as tests/kernels/test_dropout.py).
FWD_DROP = dict(atol=4e-5, rtol=4e-5)
BWD_DROP = dict(atol=2e-4, rtol=2e-4)

ONE_WARP = dict(Br=16, Bc=8, warps=1)

# (leading axes, Nq, Nk, d, tiles, causal): Nq != Nk both ways (with fully masked rows under "lower_right" when Nq >
# Nk, and key blocks no query sees under "upper_left" when Nq < Nk), lengths that are not multiples of the tiles,
# N = 1, odd head dims, two warps, the default tiles with d = 70 (Dp = 96: the general tile load).
SHAPES = [
    ((1,), 1, 1, 1, ONE_WARP, True),
    ((2,), 19, 37, 5, ONE_WARP, True),
    ((1, 2), 33, 20, 7, dict(Br=16, Bc=16, warps=2), True),
    ((1,), 8, 40, 3, dict(Br=8, Bc=8, warps=1), "upper_left"),
    ((1,), 40, 24, 12, dict(Br=16, Bc=8, warps=2), "upper_left"),
    ((1,), 24, 40, 64, ONE_WARP, False),
    ((1,), 20, 40, 70, {}, False),
]
IDS = [f"{'x'.join(map(str, s[0]))}-{s[1]}x{s[2]}-d{s[3]}-{s[5]}" for s in SHAPES]


def _grads_close(grads, refs, tol):
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, refs):
        assert_close(g, g_ref, **tol, what=name)          # also: no NaN poison left


@pytest.mark.parametrize("lead, Nq, Nk, d, tiles, causal", SHAPES, ids=IDS)
def test_forward_and_backward_match_reference(rng, lead, Nq, Nk, d, tiles, causal):
    q, k, v, do = qkv(rng, (*lead, Nq, d), Nk, do=True)
    o, lse = flashnb.attention_forward(q, k, v, causal=causal, impl="flash", **tiles)
    o_ref, lse_ref = reference.attention_forward(q, k, v, causal=causal)
    assert_close(o, o_ref, **FWD, what="o")   # also: no NaN poison left, -inf exactly where expected
    assert_close(lse, lse_ref, **FWD, what="lse")
    grads = flashnb.attention_backward(q, k, v, o, lse, do, causal=causal, impl="flash", **tiles)
    _grads_close(grads, reference.attention_backward(q, k, v, do, causal=causal), BWD)


def test_default_tiles_at_d128(rng):
    """d = 128: the forward's default tiles take dynamic shared memory (Br = Bc = 64, four warps: 100,352 B), the
    backward's are static (Br = 16, Bc = 24); causal with Nq < Nk, one ragged tile each way."""
    q, k, v, do = qkv(rng, (1, 30, 128), 50, do=True)
    o, lse = flashnb.attention_forward(q, k, v, causal=True, impl="flash")
    assert flash.last_forward == dict(d=128, Br=64, Bc=64, warps=4, dynamic=True, shared_bytes=100_352,
                                      fallback=None)
    o_ref, lse_ref = reference.attention_forward(q, k, v, causal=True)
    assert_close(o, o_ref, **FWD, what="o")
    assert_close(lse, lse_ref, **FWD, what="lse")
    grads = flashnb.attention_backward(q, k, v, o, lse, do, causal=True, impl="flash")
    _grads_close(grads, reference.attention_backward(q, k, v, do, causal=True), BWD)


def test_fallback_to_static_tiles_when_the_device_refuses(rng, monkeypatch):
    """A device whose opt-in limit is below the d = 128 defaults' 100,352 B (a faked limit): the launch falls back to
    the static tiles with a warning and says so; explicit tiles beyond the limit are an error."""
    q, k, v = qkv(rng, (1, 9, 128), 11)
    monkeypatch.setattr(launch_flash, "shared_optin_limit", lambda: 48 * 1024 + 512)
    with pytest.warns(RuntimeWarning, match="falling back to the static tiles Br=24, Bc=32"):
        o, lse = flashnb.attention_forward(q, k, v, impl="flash")
    assert flash.last_forward["dynamic"] is False and "opt-in limit of 49,664 B" in flash.last_forward["fallback"]
    o_ref, lse_ref = reference.attention_forward(q, k, v)
    assert_close(o, o_ref, **FWD, what="o")
    x = common.to_device(q.astype(np.float32))
    with pytest.raises(ValueError, match=r"tiles Br=32, Bc=32 at d=128 need 50,176 B .* 49,664 B"):
        flash.forward(x, x, x, scale=1.0, Br=32, Bc=32, warps=2)


# --------------------------------------------------------------------------- every feature at once


def _all_features(rng, Nq=40, Nk=32, d=12, window=12):
    """Multi-query attention (2 query heads, one K/V head) with a score_mod (ALiBi, per head), a mask_mod's block mask
    (a sliding window: empty, full and partial tiles), dropout and a top-left causal mask, Nq != Nk.  (Every feature
    is paid per element on the simulator -- Philox's rounds and the modifiers in Python -- so the problem is small.)"""
    q = rng.standard_normal((1, 2, Nq, d))
    k, v = rng.standard_normal((1, 1, Nk, d)), rng.standard_normal((1, 1, Nk, d))
    do = rng.standard_normal(q.shape)
    sm, mm, seed, p = flex.alibi(2), flex.sliding_window(window), 2**40 + 3, 0.2
    opts = dict(score_mod=sm, mask_mod=mm, dropout_p=p, seed=seed, causal="upper_left")
    W = frng.dropout_scale_np(seed, p, 2, Nq, Nk).reshape(1, 2, Nq, Nk)
    ref = dict(mask=flex.mask_array(mm, 1, 2, Nq, Nk), score_mod=flex.numpy_modifier(sm), dropout_mask=W,
               causal="upper_left")
    return q, k, v, do, sm, mm, opts, ref


def test_every_feature_at_once_matches_reference(rng):
    q, k, v, do, sm, _, opts, ref = _all_features(rng)
    tiles = dict(Br=8, Bc=8, warps=2)
    o, lse = flashnb.attention_forward(q, k, v, impl="flash", **tiles, **opts)
    o_ref, lse_ref = reference.attention_forward(q, k, v, **ref)
    assert_close(o, o_ref, **FWD_DROP, what="o")
    assert_close(lse, lse_ref, **FWD_DROP, what="lse")      # the undropped softmax's
    grads = flashnb.attention_backward(q, k, v, o, lse, do, impl="flash", **tiles, **opts)
    refs = reference.attention_backward(q, k, v, do, score_mod_grad=flex.numpy_modifier(sm.grad), **ref)
    _grads_close(grads, refs, BWD_DROP)


def test_every_feature_at_once_in_half_storage_traffic_equals_model(rng):
    """float16 storage with every other feature on: counted traffic (elements and bytes) equals the model, and the
    outputs are the float32-storage kernels' on the same values rounded once -- o and lse bit for bit; given the
    same o, dK and dV bit for bit and dQ within one float16 spacing (its atomics may add in another order)."""
    q, k, v, do, sm, mm, opts, _ = _all_features(rng, Nq=24, Nk=32, d=8)
    opts.pop("mask_mod")
    causal = opts.pop("causal")
    bm = flex.create_block_mask(mm, 1, 2, 24, 32, Br=8, Bc=8)
    tiles, kw = dict(Br=8, Bc=8, warps=1), dict(causal=causal, scale=0.3, block_mask=bm, heads=2, **opts)
    half = [a.reshape(-1, *a.shape[2:]).astype(np.float16) for a in (q, k, v, do)]
    h = [common.to_device(a, "float16") for a in half]
    f = [common.to_device(a.astype(np.float32)) for a in half]
    with traffic.count() as t:
        o, lse = flash.forward(*h[:3], **kw, **tiles)
        grads = flash.backward(*h[:3], o, lse, h[3], **kw, **tiles)
    model = (flash.model_forward(2, 24, 32, 8, causal=causal, block_mask=bm, group=2, storage="float16",
                                 score_mod=sm, **tiles)
             + flash.model_backward(2, 24, 32, 8, causal=causal, block_mask=bm, group=2, storage="float16", **tiles))
    assert t.summary() == model
    assert [dict(launch=lt.label, read_bytes=lt.read_bytes, write_bytes=lt.write_bytes,
                 atomic_bytes=sum(n * lt.itemsize[a] for a, n in lt.atomics.items())) for lt in t.launches] \
        == flash.model_bytes(model, "float16")
    o16, lse16 = o.copy_to_host(), lse.copy_to_host()
    o32, lse32 = (a.copy_to_host() for a in flash.forward(*f[:3], **kw, **tiles))
    assert o16.dtype == np.float16 and np.array_equal(o16, o32.astype(np.float16)) and np.array_equal(lse16, lse32)
    g32 = flash.backward(*f[:3], common.to_device(o16.astype(np.float32)), lse, f[3], **kw, **tiles)
    dq16, dk16, dv16 = (g.copy_to_host() for g in grads)
    dq32, dk32, dv32 = (g.copy_to_host() for g in g32)
    assert dk16.shape == dv16.shape == (1, 32, 8) and dk16.dtype == np.float16
    assert np.array_equal(dk16, dk32.astype(np.float16)) and np.array_equal(dv16, dv32.astype(np.float16))
    r = dq32.astype(np.float16)
    assert not np.isnan(dq16.astype(np.float32)).any()
    assert np.all(np.abs(dq16.astype(np.float32) - r) <= np.spacing(np.abs(r)))


def test_p_zero_is_no_dropout_bit_for_bit(rng):
    """The dropout kernels launched as p = 0 (threshold 0: every word is at least 0, so every element is kept;
    factor 1/(1-p) = 1) give the dense kernels' bits."""
    BH, Nq, Nk, d = 1, 20, 28, 8
    q, k, v, do = (common.to_device(a.astype(np.float32)) for a in qkv(rng, (BH, Nq, d), Nk, do=True))
    args = (np.float32(0.35), Nk - Nq, flash._device_mask(None), np.uint32(0), np.float32(1.0), np.uint32(123),
            np.uint32(7), *(np.int32(v) for axis in policies.SAME_POSITIONS for v in axis))
    outs = {}
    for dropout in (False, True):
        O, L = common.empty((BH, Nq, d)), common.empty((BH, Nq))
        common.launch(flash.make_forward(16, 16, d, 1, True, dropout=dropout), (2, BH), 32, q, k, v, O, L, *args)
        D, dQ, dK, dV = (common.empty(s) for s in ((BH, Nq), (BH, Nq, d), (BH, Nk, d), (BH, Nk, d)))
        common.launch(flash.make_preprocess(), (common.cdiv(Nq, flash.PRE_WARPS), BH), 32 * flash.PRE_WARPS, O, do,
                      D, dQ)
        common.launch(flash.make_backward(16, 16, d, 1, True, dropout=dropout), (2, BH), 32, q, k, v, do, L, D, dQ,
                      dK, dV, *args)
        outs[dropout] = [a.copy_to_host() for a in (O, L, dQ, dK, dV)]
    for name, a, b in zip(("O", "L", "dQ", "dK", "dV"), outs[False], outs[True]):
        assert not np.isnan(a).any() and np.array_equal(a, b), name


def test_every_feature_at_once_passes_the_sanitizer(rng):
    """memcheck, racecheck, initcheck, synccheck with every feature on (half storage, GQA, a mask_mod's partial
    tiles, a score_mod, dropout): tiles small enough that the loops reload their shared tiles more than once, two
    warps; forward, preprocessing, backward and the dQ conversion."""
    q, k, v, do, sm, mm, opts, _ = _all_features(rng, Nq=20, Nk=16, d=4, window=6)
    opts.pop("mask_mod")
    bm = flex.create_block_mask(mm, 1, 2, 20, 16, Br=8, Bc=8)
    x = [common.to_device(a.reshape(-1, *a.shape[2:]).astype(np.float16), "float16") for a in (q, k, v, do)]
    with sim.sanitize() as report:
        o, lse = flash.forward(*x[:3], scale=0.3, block_mask=bm, heads=2, Br=8, Bc=8, warps=2, **opts)
        flash.backward(*x[:3], o, lse, x[3], scale=0.3, block_mask=bm, heads=2, Br=8, Bc=8, warps=2, **opts)
    assert "no errors in 4 launch(es)" in str(report), str(report)


# --------------------------------------------------------------------------- block masks on the product's tiles


def test_block_masks_on_the_products_tiles(rng):
    """A plain array is read at mask_tiles(d) (FA2's forward tiles, for every impl); the forward runs at its default
    tiles when they divide it, the backward at the largest dividing tiles (d = 128: Bc 24 -> 16); a mask_mod's block
    mask is recomputed at finer tiles (full, empty and partial tiles of a coarse partial block), and tiles that
    cannot divide the mask are an error naming them."""
    assert flash.mask_tiles(64) == dict(Br=64, Bc=32) and flash.mask_tiles(128) == dict(Br=32, Bc=32)
    arr = np.array([[True, False], [False, True]])
    t, M, _ = flash._mask_at_tiles("forward", 64, None, None, None, arr, 1, 128, 64)
    assert (t["Br"], t["Bc"], t["warps"]) == (64, 32, 2) and M.tolist() == [[[1, 0], [0, 1]]]
    t, M, _ = flash._mask_at_tiles("backward", 128, None, None, None, np.ones((2, 2), bool), 1, 64, 64)
    assert (t["Br"], t["Bc"], t["warps"]) == (16, 16, 2) and M.shape == (1, 4, 4)
    bm = flex.create_block_mask(flex.causal(), 1, 1, 64, 64, Br=32, Bc=32)
    t, M, mod = flash._mask_at_tiles("backward", 32, 16, 16, 1, bm, 1, 64, 64)
    assert mod is bm.mask_mod and M[0, :2, :2].tolist() == [[2, 0], [1, 2]]
    with pytest.raises(ValueError, match="block_mask was built for tiles Br=32, Bc=32; the flash forward tiles "
                                         "Br=24, Bc=32 must divide them"):
        flash._mask_at_tiles("forward", 64, 24, None, 2, bm, 1, 64, 64)
    q, k, v = qkv(rng, (1, 40, 8), 40)
    with pytest.raises(ValueError, match="mask_mod reaches the flash kernels through its block mask"):
        flash.forward(*(common.to_device(a) for a in (q, k, v)), scale=1.0, mask_mod=flex.causal())


def test_block_sparse_default_tiles_and_warps(rng):
    """The launcher's own choice for a mask with small blocks (8 x 8): tiles 8 x 8, as many warps as divide them;
    the result is the masked reference's."""
    bm = bs.butterfly(32, 32, 8, 8)
    q, k, v, do = qkv(rng, (1, 32, 8), 32, do=True)
    mask = bm.expand(32, 32)
    o, lse = flashnb.attention_forward(q, k, v, impl="flash", block_mask=bm)
    assert flash.last_forward["Br"] == 8 and flash.last_forward["Bc"] == 8 and flash.last_forward["warps"] == 2
    o_ref, lse_ref = reference.attention_forward(q, k, v, mask=mask)
    assert_close(o, o_ref, **FWD, what="o")
    grads = flashnb.attention_backward(q, k, v, o, lse, do, impl="flash", block_mask=bm)
    _grads_close(grads, reference.attention_backward(q, k, v, do, mask=mask), BWD)


# --------------------------------------------------------------------------- options and the impl


@pytest.mark.parametrize("opts, err, word", [
    (dict(Br=10, Bc=16, warps=1), ValueError, "Br=10"),
    (dict(Br=16, Bc=12, warps=1), ValueError, "Bc=12"),
    (dict(Br=16, Bc=16, warps=8), ValueError, "warps"),
    (dict(Br=0), ValueError, "Br"),
    (dict(Bc=16.0), TypeError, "Bc"),
    (dict(warps=True), TypeError, "warps"),
    (dict(tile=16), TypeError, "tile"),
])
def test_bad_options(rng, opts, err, word):
    q, k, v = qkv(rng, (1, 8, 8), 8)
    with pytest.raises(err, match=word):
        flashnb.attention_forward(q, k, v, impl="flash", **opts)


def test_too_many_elements_for_the_masks():
    """mask_mod and dropout hold a lane's elements in one 64-bit mask: tiles with more are refused by name."""
    with pytest.raises(ValueError, match="128 scores per lane"):
        flash.make_forward(64, 64, 32, 1, False, dropout=True)
    assert policies.MAX_ELEMENTS == 64


def test_the_product_kernel_is_the_default_impl(rng):
    """flashnb.attention, attention_forward, attention_backward and flashnb.pytorch.attention run impl="flash" when no
    impl is given on the simulator (the default, impl="auto", keeps tensor cores for a checked GPU: tests/kernels/
    test_auto.py); counted: its launches' labels."""
    import inspect

    from flashnb import api

    for fn in (api.attention, api.attention_forward, api.attention_backward):
        assert inspect.signature(fn).parameters["impl"].default == "auto", fn.__name__
    q, k, v = qkv(rng, (1, 8, 8), 8)
    with traffic.count() as t:
        flashnb.attention(q, k, v)
    assert [lt.label for lt in t.launches] == ["flash forward"]
    torch = pytest.importorskip("torch")
    import flashnb.pytorch as ft

    assert inspect.signature(ft.attention).parameters["impl"].default == "auto"
    assert inspect.signature(ft.scaled_dot_product_attention).parameters["impl"].default == "auto"
    with traffic.count() as t:
        ft.attention(*(torch.tensor(a, dtype=torch.float32) for a in (q, k, v)))
    assert [lt.label for lt in t.launches] == ["flash forward"]


def test_unfit_block_mask_message_says_what_to_build():
    """A mask whose blocks no tile of the layout divides (Bc = 20 keys: the forward's Bc steps by 8) is refused with
    a complete sentence naming the tiles to build it at -- and a mask built as it says runs in both directions."""
    import re

    bm = flex.create_block_mask(flex.causal(), 1, 1, 40, 40, Br=16, Bc=20)
    with pytest.raises(ValueError, match="Bc a multiple of 8 dividing 20") as err:
        flash._mask_at_tiles("forward", 32, None, None, None, bm, 1, 40, 40)
    advice = re.search(r"build the mask for tiles that are (.*)$", str(err.value))
    assert advice and re.search(r"create_block_mask\(\.\.\., Bc=(\d+)\)$", advice.group(1)), str(err.value)
    Bc = int(re.search(r"Bc=(\d+)\)$", advice.group(1)).group(1))
    fixed = flex.create_block_mask(flex.causal(), 1, 1, 40, 40, Br=16, Bc=Bc)
    for direction in ("forward", "backward"):
        t, M, _ = flash._mask_at_tiles(direction, 32, None, None, None, fixed, 1, 40, 40)
        assert 16 % t["Br"] == 0 and Bc % t["Bc"] == 0, (direction, t)
