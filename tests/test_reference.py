"""The float64 reference (flashnb.reference) checked against first principles and, when present, PyTorch."""

import contextlib
import math
import warnings

import numpy as np
import pytest

from flashnb import reference as ref


def _qkv(seed, lead, Nq, Nk, d, dv=None):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal(lead + (Nq, d))
    k = rng.standard_normal(lead + (Nk, d))
    v = rng.standard_normal(lead + (Nk, dv or d))
    do = rng.standard_normal(lead + (Nq, dv or d))
    return q, k, v, do


def _causal(Nq, Nk):
    """Bottom-right aligned causal mask, written out the slow way."""
    return np.array([[j <= i + Nk - Nq for j in range(Nk)] for i in range(Nq)])


def _mask_with_empty_row(seed, Nq, Nk):
    rng = np.random.default_rng(seed)
    mask = rng.random((Nq, Nk)) < 0.6
    mask[:, 0] = True     # every row but the next one keeps at least one key
    mask[1, :] = False    # query 1 may attend to nothing
    return mask


@contextlib.contextmanager
def _strict():
    """Any NumPy warning, or a divide/overflow/invalid floating-point event, becomes an error.
    (Underflow of exp() to 0 is expected and harmless, so it keeps NumPy's default 'ignore'.)"""
    with warnings.catch_warnings(), np.errstate(divide="raise", over="raise", invalid="raise"):
        warnings.simplefilter("error")
        yield


# (lead, Nq, Nk, d, causal, use_mask): Nq != Nk both ways; causal with Nq > Nk leaves the first
# Nq - Nk rows with no key at all; the mask cases include a fully masked row.
CASES = [
    ((), 4, 4, 3, False, False),
    ((2,), 3, 5, 4, True, False),
    ((2,), 5, 3, 2, True, False),
    ((1, 2), 4, 6, 3, False, True),
    ((2,), 4, 6, 3, True, True),
]


@pytest.mark.parametrize("lead,Nq,Nk,d,causal,use_mask", CASES)
def test_backward_matches_finite_differences(lead, Nq, Nk, d, causal, use_mask):
    q, k, v, do = _qkv(1, lead, Nq, Nk, d, dv=d + 1)
    mask = _mask_with_empty_row(2, Nq, Nk) if use_mask else None
    kw = dict(causal=causal, mask=mask, scale=0.7)

    def f(q_, k_, v_):
        return np.sum(ref.attention(q_, k_, v_, **kw) * do)

    grads = ref.attention_backward(q, k, v, do, **kw)
    h = 1e-6
    for which, (x, g) in enumerate(zip((q, k, v), grads)):
        assert g.shape == x.shape and g.dtype == np.float64
        num = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            args = [q, k, v]
            xp, xm = x.copy(), x.copy()
            xp[idx] += h
            xm[idx] -= h
            args[which] = xp
            fp = f(*args)
            args[which] = xm
            num[idx] = (fp - f(*args)) / (2 * h)
        # Central differences: truncation error ~h² (1e-12) plus round-off ~eps·|f|/h (1e-10);
        # 1e-7 leaves a wide margin while any wrong term in the gradient is O(1).
        np.testing.assert_allclose(g, num, rtol=1e-6, atol=1e-7, err_msg=f"grad {'qkv'[which]}")


@pytest.mark.parametrize("lead,Nq,Nk,d,causal,use_mask", CASES)
def test_forward_matches_row_by_row_definition(lead, Nq, Nk, d, causal, use_mask):
    q, k, v, _ = _qkv(3, lead, Nq, Nk, d)
    mask = _mask_with_empty_row(4, Nq, Nk) if use_mask else None
    o, lse = ref.attention_forward(q, k, v, causal=causal, mask=mask)   # default scale 1/sqrt(d)
    assert o.shape == q.shape and lse.shape == q.shape[:-1] and o.dtype == lse.dtype == np.float64
    allowed = np.ones((Nq, Nk), bool)
    if causal:
        allowed &= _causal(Nq, Nk)
    if mask is not None:
        allowed &= mask
    for b in np.ndindex(lead):
        for i in range(Nq):
            s = [float(q[b][i] @ k[b][j]) / math.sqrt(d) for j in range(Nk) if allowed[i, j]]
            if not s:
                assert lse[b][i] == -np.inf and np.all(o[b][i] == 0)
                continue
            expected_lse = math.log(math.fsum(math.exp(x) for x in s))
            p = [math.exp(x - expected_lse) for x in s]
            expected_o = sum(pj * v[b][j] for pj, j in zip(p, np.flatnonzero(allowed[i])))
            # float64 throughout; only the summation order differs, so agreement is to a few ulps.
            assert lse[b][i] == pytest.approx(expected_lse, rel=1e-13, abs=1e-13)
            np.testing.assert_allclose(o[b][i], expected_o, rtol=1e-12, atol=1e-13)


def test_fully_masked_rows_are_zero_without_nan_or_warnings():
    q, k, v, do = _qkv(5, (2, 3), 6, 4, 8)
    mask = np.ones((2, 1, 6, 4), bool)    # per-batch mask broadcast over heads
    mask[0, :, 4] = False
    with _strict():
        # causal with Nq = 6 > Nk = 4: queries 0 and 1 see no key; the mask empties query 4 of batch 0.
        o, lse = ref.attention_forward(q, k, v, causal=True, mask=mask)
        dq, dk, dv = ref.attention_backward(q, k, v, do, causal=True, mask=mask)
    empty = np.zeros((2, 3, 6), bool)
    empty[:, :, :2] = True
    empty[0, :, 4] = True
    for a in (o, lse, dq, dk, dv):
        assert not np.any(np.isnan(a))
    assert np.all(lse[empty] == -np.inf) and np.all(np.isfinite(lse[~empty]))
    assert np.all(o[empty] == 0) and np.all(dq[empty] == 0)
    assert np.all(o[~empty].any(axis=-1))
    # a mask that allows nothing at all: every gradient is exactly zero
    none = np.zeros((6, 4), bool)
    with _strict():
        o, lse = ref.attention_forward(q, k, v, mask=none)
        grads = ref.attention_backward(q, k, v, do, mask=none)
    assert np.all(o == 0) and np.all(lse == -np.inf)
    assert all(np.all(g == 0) for g in grads)


def test_large_scores_do_not_overflow():
    q, k, v, do = _qkv(6, (), 5, 7, 4)
    with _strict():
        o, lse = ref.attention_forward(q, k, v, scale=500.0)    # scores in the thousands: exp() would overflow
        grads = ref.attention_backward(q, k, v, do, scale=500.0)
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(lse)) and all(np.all(np.isfinite(g)) for g in grads)


def test_inputs_are_promoted_to_float64():
    q, k, v, _ = _qkv(7, (), 4, 4, 4)
    o32, lse32 = ref.attention_forward(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32))
    o, lse = ref.attention_forward(q.astype(np.float32).astype(np.float64), k.astype(np.float32).astype(np.float64),
                                   v.astype(np.float32).astype(np.float64))
    assert o32.dtype == np.float64
    np.testing.assert_array_equal(o32, o)
    np.testing.assert_array_equal(lse32, lse)


@pytest.mark.parametrize("bad,error,match", [
    (dict(k=np.zeros((3, 5))), ValueError, "share"),                      # d differs
    (dict(v=np.zeros((6, 4))), ValueError, "v must"),                      # N_k differs from k's
    (dict(q=np.zeros(4)), ValueError, "q must"),                           # 1-D
    (dict(mask=np.ones((3, 6))), TypeError, "mask"),                       # not boolean
    (dict(mask=np.ones((4, 6), bool)), ValueError, "mask"),                # wrong shape
    (dict(mask=np.ones((2, 3, 5), bool)), ValueError, "mask"),             # adds a leading axis
    (dict(scale=float("nan")), ValueError, "scale"),                      # 0 and negative scales are valid
])
def test_bad_inputs_raise(bad, error, match):
    args = dict(q=np.ones((3, 4)), k=np.ones((5, 4)), v=np.ones((5, 4)))
    args.update(bad)
    kw = {n: args.pop(n) for n in ("mask", "scale") if n in args}
    with pytest.raises(error, match=match):
        ref.attention_forward(args["q"], args["k"], args["v"], **kw)


def test_expand_block_mask():
    rng = np.random.default_rng(8)
    Nq, Nk, Br, Bc = 7, 10, 3, 4                   # ragged: the last block row/column is cut
    bm = rng.random((3, 3)) < 0.5
    mask = ref.expand_block_mask(bm, Nq, Nk, Br, Bc)
    assert mask.shape == (Nq, Nk) and mask.dtype == np.bool_
    for i in range(Nq):
        for j in range(Nk):
            assert mask[i, j] == bm[i // Br, j // Bc]
    heads = rng.random((2, 3, 3)) < 0.5            # leading axes are carried along
    np.testing.assert_array_equal(ref.expand_block_mask(heads, Nq, Nk, Br, Bc)[1],
                                  ref.expand_block_mask(heads[1], Nq, Nk, Br, Bc))
    with pytest.raises(ValueError, match=r"block_mask must have shape \(\.\.\., 3, 3\)"):
        ref.expand_block_mask(np.ones((3, 2), bool), Nq, Nk, Br, Bc)
    with pytest.raises(TypeError, match="block_mask"):
        ref.expand_block_mask(np.ones((3, 3)), Nq, Nk, Br, Bc)
    with pytest.raises(ValueError, match="Br"):
        ref.expand_block_mask(bm, Nq, Nk, 0, Bc)


@pytest.mark.parametrize("Nq,Nk,causal,use_mask",
                         [(5, 5, False, False), (3, 6, True, False), (6, 6, True, False), (4, 7, True, True)])
def test_against_torch_sdpa(Nq, Nk, causal, use_mask):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    q, k, v, do = _qkv(9, (2, 2), Nq, Nk, 8)
    allowed = np.ones((Nq, Nk), bool)
    if causal:
        allowed &= _causal(Nq, Nk)     # torch's is_causal is top-left aligned, so pass the mask explicitly
    mask = None
    if use_mask:
        mask = np.random.default_rng(10).random((Nq, Nk)) < 0.6
        mask[:, 0] = True              # torch gives NaN for a fully masked row; the reference gives 0
        allowed &= mask
    tq, tk, tv = (torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (q, k, v))
    to = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=torch.tensor(allowed), scale=0.3)
    to.backward(torch.tensor(do))
    o = ref.attention(q, k, v, causal=causal, mask=mask, scale=0.3)
    grads = ref.attention_backward(q, k, v, do, causal=causal, mask=mask, scale=0.3)
    # Both sides compute in float64 and differ only in summation order: agreement to ~1e-14.
    np.testing.assert_allclose(o, to.detach().numpy(), rtol=1e-11, atol=1e-12)
    for g, t in zip(grads, (tq, tk, tv)):
        np.testing.assert_allclose(g, t.grad.numpy(), rtol=1e-11, atol=1e-12)
    if Nq == Nk and causal and not use_mask:   # square: torch's top-left is_causal agrees with ours
        t2 = F.scaled_dot_product_attention(tq, tk, tv, is_causal=True, scale=0.3)
        np.testing.assert_allclose(o, t2.detach().numpy(), rtol=1e-11, atol=1e-12)
