"""Attention dropout (issue #17, item 2): Philox4x32-10 against published known answers, the NumPy twin against
the device functions bit for bit, the FA2 forward and backward (stage 4's and the product kernel's) against the
float64 reference with the twin's mask, forward/backward mask agreement without the twin, keep-rate statistics,
counted traffic (no N×N mask crosses HBM), p = 0 against no dropout, and the errors of bad arguments.

Tolerances.  The kernels compute in float32 and the reference in float64 on the same inputs.  Every output
element is a sum of at most max(Nk, d) <= 40 products of O(1) values (standard-normal inputs, softmax weights
<= 1), each now also multiplied by a dropout factor W <= 1/(1-p) <= 2; test_fa2's bounds (2e-5 forward, 1e-4
backward, from ~64 · 6e-8 per float32 sum, chained and with values up to O(10) in the backward) are scaled by
that factor, 2.  A wrong mask element changes an output by O(0.1 - 1): far above these bounds.
"""

import numpy as np
import pytest
from conftest import FEATURE_IMPLS, MODULE_OF, assert_close, qkv

import flashnb
from flashnb import common, reference, sim
from flashnb import rng as frng  # (the name rng is conftest's seeded-generator fixture)
from flashnb.instruments import traffic

FWD = dict(atol=4e-5, rtol=4e-5)
BWD = dict(atol=2e-4, rtol=2e-4)
SMALL = dict(Br=16, Bc=16, warps=1)

# Random123's known-answer vectors for Philox4x32-10: DEShawResearch/random123, tests/kat_vectors (commit
# 9545ff6413f258be2f04c1d319d99aaef7521150), lines 27-29, columns: counter (4 words), key (2 words), output.
KAT = [
    ((0x00000000, 0x00000000, 0x00000000, 0x00000000), (0x00000000, 0x00000000),
     (0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8)),
    ((0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff), (0xffffffff, 0xffffffff),
     (0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd)),
    ((0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344), (0xa4093822, 0x299f31d0),
     (0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1)),
]


@pytest.mark.parametrize("counter, key, expected", KAT, ids=["zeros", "ones", "pi"])
def test_philox_known_answers(counter, key, expected):
    twin = tuple(int(x) for x in frng.philox4x32_10_np(*counter, *key))
    assert twin == expected
    device = tuple(int(x) for x in frng.philox4x32_10(*counter, *key))   # the device function's Python (simulator)
    assert device == expected


def _mask(seed, p, lead, Nq, Nk):
    """The twin's dropout factors W = Z/(1-p) for q of leading shape ``lead`` (flattened batch·heads)."""
    BH = int(np.prod(lead))
    return frng.dropout_scale_np(seed, p, BH, Nq, Nk).reshape(tuple(lead) + (Nq, Nk))


@pytest.mark.parametrize("seed, p, BH, Nq, Nk", [(2**40 + 77, 0.3, 2, 3, 40), (5, 0.9, 1, 2, 33)])
def test_twin_equals_device_bit_for_bit(seed, p, BH, Nq, Nk):
    """The mask kernel (the same device functions the FA2 kernels call) against the vectorised twin: every 32-bit
    word and every keep decision identical (the factors start as NaN, so every element was written); a kept
    element's factor is float32(1/(1 - p)) of the float64 value, a dropped one's 0.  A seed above 2^32 puts bits in
    the key's high word."""
    W, Zs = frng.device_mask(seed, p, BH, Nq, Nk)
    z, i, j = np.ogrid[:BH, :Nq, :Nk]
    assert W.dtype == np.uint32 and np.array_equal(W.astype(np.uint64), frng.dropout_word_np(seed, z, i, j))
    keep = frng.dropout_keep_np(seed, p, BH, Nq, Nk)
    assert np.array_equal(Zs != 0, keep) and 0 < keep.mean() < 1
    assert np.all(Zs[keep] == np.float32(1.0 / (1.0 - p)))


def test_keep_test_and_factor_are_exact_to_the_stated_precision():
    """Before: the keep test compared 24-bit uniforms with float32(p), and the factor was float32's
    1/(1 - float32(p)) computed in the kernel (1000.013 at p = 0.999, 9998.3 at p = 0.9999; the mean of the
    dropped weights biased by ~0.1 % at p = 0.9999).  Now, as the docs say: kept iff the 32-bit word >=
    ceil(p·2^32), so the keep probability is within 2^-32 of 1 - p; the factor is the float64 1/(1-p) rounded once
    to float32.  Checked on the device at a word's exact threshold (kept at p = w/2^32, dropped at (w+1)/2^32 --
    below the 24-bit grid), and the expected factor E[Z/(1-p)] = (1 - T/2^32)·float32(1/(1-p)) is 1 within
    2^-32/(1-p) + 2^-24 for p up to 0.9999."""
    for p, want in ((0.999, 1000.0), (0.9999, 10000.0)):
        seed = next(s for s in range(10**5) if frng.dropout_keep_np(s, p, 1, 1, 64).any())   # one with a kept element
        _, Zs = frng.device_mask(seed, p, 1, 1, 64)
        assert (Zs != 0).any() and set(np.unique(Zs).tolist()) == {0.0, want}, np.unique(Zs)
        assert frng.keep_scale(p) == np.float32(want)
    words = frng.dropout_word_np(8, 0, 0, np.arange(64))
    w = int(next(x for x in words if int(x) & 0xFF and 2**24 < x < 2**32 - 2))   # low bits the 24-bit grid drops
    j = int(np.flatnonzero(words == w)[0])
    for p, kept in ((w / 2**32, True), ((w + 1) / 2**32, False)):
        _, Zs = frng.device_mask(8, p, 1, 1, 64)
        assert (Zs[0, 0, j] != 0) == kept and frng.dropout_keep_np(8, p, 1, 1, 64)[0, 0, j] == kept
    for p in (1e-9, 0.1, 0.5, 0.9, 0.999, 0.9999, 1 - 2**-30):
        T = int(frng.keep_threshold(p))
        assert 0 <= (1 - p) - (1 - T / 2**32) < 2**-32
        mean = (1 - T / 2**32) * float(frng.keep_scale(p))
        assert abs(mean - 1) <= 2**-32 / (1 - p) + 2**-24, p


# (lead of q, lead of k/v, Nq, Nk, d, causal, p, tiles): Nq != Nk both ways (with fully masked causal rows when
# Nq > Nk), ragged tiles, grouped-query heads, two warps.
CASES = [
    ((1,), (1,), 19, 37, 8, True, 0.5, SMALL),
    ((2,), (2,), 33, 20, 5, False, 0.1, dict(Br=16, Bc=8, warps=2)),
    ((1, 4), (1, 2), 24, 24, 12, True, 0.3, SMALL),
]


@pytest.mark.parametrize("impl", FEATURE_IMPLS)
@pytest.mark.parametrize("lead_q, lead_kv, Nq, Nk, d, causal, p, tiles", CASES,
                         ids=["causal-19x37", "full-2heads-33x20", "gqa-causal"])
def test_forward_and_backward_match_reference_with_the_twins_mask(rng, lead_q, lead_kv, Nq, Nk, d, causal, p, tiles,
                                                                  impl):
    r = rng
    q = r.standard_normal((*lead_q, Nq, d))
    k, v = r.standard_normal((*lead_kv, Nk, d)), r.standard_normal((*lead_kv, Nk, d))
    do = r.standard_normal(q.shape)
    seed = int(r.integers(0, 2**63))
    o, lse = flashnb.attention_forward(q, k, v, causal=causal, impl=impl, dropout_p=p, seed=seed, **tiles)
    W = _mask(seed, p, lead_q, Nq, Nk)
    o_ref, lse_ref = reference.attention_forward(q, k, v, causal=causal, dropout_mask=W)
    assert_close(o, o_ref, **FWD, what="o")
    assert_close(lse, lse_ref, **FWD, what="lse")          # the statistics of the undropped P~
    grads = flashnb.attention_backward(q, k, v, o, lse, do, causal=causal, impl=impl, dropout_p=p, seed=seed,
                                       **tiles)
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads,
                              reference.attention_backward(q, k, v, do, causal=causal, dropout_mask=W)):
        assert_close(g, g_ref, **BWD, what=name)


@pytest.mark.parametrize("impl", FEATURE_IMPLS)
def test_backward_uses_the_forwards_mask(rng, impl):
    """Forward/backward agreement without the twin: with v = I (d = Nk) the forward's o is P ∘ W itself, so the
    forward's mask W is read off its output; the backward's gradients must be the reference's with *that* W."""
    Nq, Nk, p, seed = 20, 24, 0.4, 99
    q, k = rng.standard_normal((2, Nq, Nk)), rng.standard_normal((2, Nk, Nk))
    v = np.broadcast_to(np.eye(Nk), (2, Nk, Nk)).copy()
    o, lse = flashnb.attention_forward(q, k, v, impl=impl, dropout_p=p, seed=seed, **SMALL)
    P, _ = reference.attention_forward(q, k, v)             # = softmax, since v = I
    W_fwd = np.where(o > 0.5 * P / (1 - p), 1 / (1 - p), 0.0)   # kept: o = P/(1-p); dropped: o = 0
    assert_close(o, P * W_fwd, **FWD, what="o = P ∘ W")      # the read-off is exact up to rounding
    assert 0.4 < (W_fwd > 0).mean() < 0.8                    # a real mask (1 - p = 0.6 expected), not all kept
    do = rng.standard_normal(o.shape)
    v2 = rng.standard_normal((2, Nk, Nk))                    # any v: the backward regenerates the same W
    o2, lse2 = flashnb.attention_forward(q, k, v2, impl=impl, dropout_p=p, seed=seed, **SMALL)
    grads = flashnb.attention_backward(q, k, v2, o2, lse2, do, impl=impl, dropout_p=p, seed=seed, **SMALL)
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads,
                              reference.attention_backward(q, k, v2, do, dropout_mask=W_fwd)):
        assert_close(g, g_ref, **BWD, what=name)


# --------------------------------------------------------------------------- statistics of the mask


@pytest.mark.parametrize("p", [0.1, 0.5, 0.85])
def test_keep_rate_within_binomial_bound(p):
    """Kept elements of a (4, 128, 128) mask ~ Binomial(n, 1 - p') with p' = ceil(p·2^32)/2^32 (the keep test on
    the 32-bit word): the count must lie within 5 standard deviations (two-sided probability of failing by chance, were
    the bits ideal: 5.7e-7), and so must every row's and column's mean within 5 of their own deviations at the
    Bonferroni-corrected level for 1,024 rows and columns (z = 5 still covers 1024 · 5.7e-7 = 6e-4)."""
    keep = frng.dropout_keep_np(1234567, p, 4, 128, 128)
    q = 1 - int(frng.keep_threshold(p)) / 2.0**32
    n = keep.size
    assert abs(keep.sum() - n * q) <= 5 * np.sqrt(n * q * (1 - q))
    for axis, m in ((2, 128), (1, 128)):
        rates = keep.mean(axis=axis)
        assert np.all(np.abs(rates - q) <= 5 * np.sqrt(q * (1 - q) / m)), f"axis {axis}"


def test_uniform_is_flat_and_elements_independent():
    """u over 16 equal bins: chi-square with 15 degrees of freedom below 50 (P(chi2_15 > 50) ≈ 1e-5); and the
    keep decisions of horizontal and vertical neighbours, of two heads and of two seeds agree as often as
    independent coins would (p² + (1-p)² = 0.5 at p = 0.5), within 5 standard deviations."""
    z, i, j = np.ogrid[:2, :128, :128]
    u = frng.dropout_uniform_np(42, z, i, j)
    counts = np.bincount((u * 16).astype(int).ravel(), minlength=16)
    expected = u.size / 16
    assert ((counts - expected) ** 2 / expected).sum() < 50
    keep = u >= 0.5
    other_seed = frng.dropout_uniform_np(43, z, i, j) >= 0.5
    high_bit = frng.dropout_uniform_np(42 + 2**32, z, i, j) >= 0.5         # differs in the key's high word only
    for what, a, b in (("columns", keep[:, :, 1:], keep[:, :, :-1]), ("rows", keep[:, 1:], keep[:, :-1]),
                       ("heads", keep[1], keep[0]), ("seeds", keep, other_seed), ("high word", keep, high_bit)):
        agree = (a == b).mean()
        assert abs(agree - 0.5) <= 5 * np.sqrt(0.25 / a.size), what
    assert len({row.tobytes() for row in keep.reshape(-1, 128)}) == 256          # no two rows alike
    assert len({col.tobytes() for col in keep.transpose(0, 2, 1).reshape(-1, 128)}) == 256


# --------------------------------------------------------------------------- traffic, p = 0


def _dev(*arrays):
    return [common.to_device(np.asarray(a, dtype=np.float32)) for a in arrays]


@pytest.mark.parametrize("impl", FEATURE_IMPLS)
def test_no_mask_crosses_hbm(rng, impl):
    """Counted element accesses with dropout equal those without it and the model of the dense kernels: the
    mask is regenerated in registers, no N×N array is read or written (an N×N float32 mask alone would add
    BH·Nq·Nk·4 = 18,432 B here)."""
    mod = MODULE_OF[impl]
    BH, Nq, Nk, d, tiles = 2, 24, 48, 8, dict(Br=16, Bc=8, warps=2)
    q, k, v, do = qkv(rng, (BH, Nq, d), Nk, do=True)
    counted = {}
    for p in (0.0, 0.3):
        with traffic.count() as t:
            o, lse = mod.forward(*_dev(q, k, v), causal=True, scale=0.3, dropout_p=p, seed=5, **tiles)
            mod.backward(*_dev(q, k, v), o, lse, *_dev(do), causal=True, scale=0.3, dropout_p=p, seed=5, **tiles)
        counted[p] = t
    model = mod.model_forward(BH, Nq, Nk, d, causal=True, **tiles) + mod.model_backward(BH, Nq, Nk, d, causal=True,
                                                                                          **tiles)
    assert counted[0.3].summary() == counted[0.0].summary() == model
    sizes = {name: e["read_bytes"] + e["write_bytes"] for name, e in counted[0.3].totals_by_array().items()
             if e["kind"] == "global"}
    assert sizes == {name: e["read_bytes"] + e["write_bytes"] for name, e in counted[0.0].totals_by_array().items()
                     if e["kind"] == "global"}
    assert all(set(launch["reads"]) | set(launch["writes"]) <= {"Q", "K", "V", "O", "L", "dO", "D", "dQ", "dK", "dV"}
               for launch in counted[0.3].summary())


def test_p_zero_is_no_dropout_bit_for_bit(rng):
    """The product kernel's dropout kernels launched with p = 0 (every element kept, factor 1) give the dense
    kernels' bits."""
    from flashnb.kernels import flash, policies

    BH, Nq, Nk, d = 1, 20, 28, 8
    q, k, v, do = _dev(*qkv(rng, (BH, Nq, d), Nk, do=True))
    scale, diag = np.float32(0.35), Nk - Nq
    M = flash._device_mask(None)                      # the 1x1x1 block mask a dense launch passes
    positions = tuple(np.int32(x) for axis in policies.SAME_POSITIONS for x in axis)
    outs = {}
    for dropout in (False, True):
        drop = frng.dropout_kernel_args(0.0, 123 + 7 * 2**32) if dropout else ()   # threshold 0, factor 1
        assert not dropout or (drop[:2] == (0, 1) and drop[2:] == (123, 7))
        extra = drop + positions if dropout else policies.NO_DROPOUT
        O, L = common.empty((BH, Nq, d)), common.empty((BH, Nq))
        kernel = flash.make_forward(16, 16, d, 1, True, dropout=dropout)
        common.launch(kernel, (2, BH), 32, q, k, v, O, L, scale, diag, M, *extra)
        D, dQ, dK, dV = common.empty((BH, Nq)), common.empty((BH, Nq, d)), common.empty((BH, Nk, d)), \
            common.empty((BH, Nk, d))
        common.launch(flash.make_preprocess(), (common.cdiv(Nq, flash.PRE_WARPS), BH), 32 * flash.PRE_WARPS, O, do,
                      D, dQ)
        kernel = flash.make_backward(16, 16, d, 1, True, dropout=dropout)
        common.launch(kernel, (2, BH), 32, q, k, v, do, L, D, dQ, dK, dV, scale, diag, M, *extra)
        outs[dropout] = [a.copy_to_host() for a in (O, L, dQ, dK, dV)]
    for name, a, b in zip(("O", "L", "dQ", "dK", "dV"), outs[False], outs[True]):
        assert not np.isnan(a).any() and np.array_equal(a, b), name


@pytest.mark.parametrize("impl", FEATURE_IMPLS)
def test_dropout_kernels_pass_the_sanitizer(rng, impl):
    """memcheck, racecheck, initcheck, synccheck on the dropout kernels (tiles small enough that the loops reload
    their shared tiles more than once; two warps in the forward)."""
    q, k, v, do = qkv(rng, (1, 20, 8), 20, do=True)
    with sim.sanitize() as report:
        o, lse = flashnb.attention_forward(q, k, v, impl=impl, causal=True, dropout_p=0.3, seed=9, Br=8, Bc=8,
                                           warps=2)
        flashnb.attention_backward(q, k, v, o, lse, do, impl=impl, causal=True, dropout_p=0.3, seed=9, Br=8, Bc=8,
                                   warps=1)
    assert "no errors in 3 launch(es)" in str(report), str(report)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("kwargs, err, words", [
    (dict(dropout_p=1.0, seed=1), ValueError, "dropout_p must be in"),
    (dict(dropout_p=-0.1, seed=1), ValueError, "dropout_p must be in"),
    (dict(dropout_p=float("nan"), seed=1), ValueError, "dropout_p must be in"),
    (dict(dropout_p=1 - 2**-33, seed=1), ValueError, r"at most 1 - 2\*\*-32"),
    (dict(dropout_p="0.1", seed=1), TypeError, "dropout_p must be a real number"),
    (dict(dropout_p=0.1), ValueError, "needs a seed"),
    (dict(dropout_p=0.1, seed=-1), ValueError, "seed must be an int"),
    (dict(dropout_p=0.1, seed=2**64), ValueError, "seed must be an int"),
    (dict(dropout_p=0.1, seed=1.0), TypeError, "seed must be an int"),
    (dict(dropout_p=0.1, seed=True), TypeError, "seed must be an int"),
    (dict(dropout_p=0.1, seed=1, impl="fa1"), ValueError, "impl 'fa1' has no attention dropout"),
    (dict(dropout_p=0.1, seed=1, impl="fa2"), ValueError, "impl 'fa2' has no attention dropout"),
])
def test_bad_dropout_arguments(rng, kwargs, err, words):
    q, k, v = qkv(rng, (1, 8, 8), 8)
    kwargs = dict(dict(impl="flash"), **kwargs)
    with pytest.raises(err, match=words):
        flashnb.attention_forward(q, k, v, **kwargs)


@pytest.mark.parametrize("impl", FEATURE_IMPLS)
def test_p_zero_is_accepted_by_every_impl_and_check_forward_catches_another_seed(rng, impl):
    q, k, v, do = qkv(rng, (1, 12, 8), 12, do=True)
    o, lse = flashnb.attention_forward(q, k, v, impl="naive", dropout_p=0.0, seed=3)
    assert np.array_equal(o, flashnb.attention_forward(q, k, v, impl="naive")[0])
    o, lse = flashnb.attention_forward(q, k, v, impl=impl, dropout_p=0.5, seed=3, **SMALL)
    with pytest.raises(ValueError, match="not the forward"):       # o was made with seed 3's mask, not seed 4's
        flashnb.attention_backward(q, k, v, o, lse, do, impl=impl, dropout_p=0.5, seed=4, **SMALL)


def test_backward_without_the_forwards_dropout_arguments_says_so(rng):
    """Before: a backward given a dropout forward's o and lse but no dropout_p/seed (or another seed) was told to
    "pass the o and lse that attention_forward returned" -- which it had.  lse is the undropped softmax's, so a
    right lse with a wrong o points at the dropout arguments, and the message says so; a wrong lse keeps the
    general message."""
    q, k, v, do = qkv(rng, (1, 12, 8), 12, do=True)
    o, lse = flashnb.attention_forward(q, k, v, impl="flash", dropout_p=0.5, seed=3, **SMALL)
    with pytest.raises(ValueError, match="lse is right but o is not, as after a forward with dropout: pass "
                                         "attention_backward the forward's dropout_p and seed"):
        flashnb.attention_backward(q, k, v, o, lse, do, impl="flash", **SMALL)
    with pytest.raises(ValueError, match=r"the mask of dropout_p=0.5, seed=4 is not the forward's"):
        flashnb.attention_backward(q, k, v, o, lse, do, impl="flash", dropout_p=0.5, seed=4, **SMALL)
    with pytest.raises(ValueError, match="pass the o and lse that attention_forward returned"):
        flashnb.attention_backward(q, k, v, o, lse + 1, do, impl="flash", dropout_p=0.5, seed=3, **SMALL)


# --------------------------------------------------------------------------- PyTorch


@pytest.mark.parametrize("impl", FEATURE_IMPLS)
def test_torch_draws_a_seed_and_the_backward_reuses_it(rng, impl):
    """flashnb.pytorch.attention with dropout_p and no seed: the seed comes from torch's generator (so
    torch.manual_seed repeats it); output and gradients match the reference with that seed's mask."""
    torch = pytest.importorskip("torch")
    import flashnb.pytorch as ft

    q, k, v, do = (torch.tensor(a, dtype=torch.float32) for a in qkv(rng, (1, 2, 18, 8), 18, do=True))
    for t in (q, k, v):
        t.requires_grad_(True)
    torch.manual_seed(11)
    o = ft.attention(q, k, v, causal=True, dropout_p=0.3, impl=impl, **SMALL)
    o.backward(do)
    torch.manual_seed(11)
    seed = ft._draw_seed()
    W = _mask(seed, 0.3, (1, 2), 18, 18)
    args = [t.detach().double().numpy() for t in (q, k, v)]
    assert_close(o.detach().numpy(), reference.attention(*args, causal=True, dropout_mask=W), **FWD, what="o")
    grads = reference.attention_backward(*args, do.double().numpy(), causal=True, dropout_mask=W)
    for name, t, g_ref in zip(("dq", "dk", "dv"), (q, k, v), grads):
        assert_close(t.grad.numpy(), g_ref, **BWD, what=name)
    with pytest.raises(ValueError, match="has no attention dropout"):
        ft.scaled_dot_product_attention(q, k, v, dropout_p=0.2, impl="fa1")


# --------------------------------------------------------------------------- dropout_at: a shard of a longer sequence

# Rows and keys of a sequence of 48 tokens, as context-parallel layouts hold them: striped (every third token from
# 1), zigzag (chunks 0 and 5 of six), contiguous (a middle run), and a single token.
SHARDS = {
    "striped": np.arange(1, 48, 3),
    "zigzag": np.r_[np.arange(0, 8), np.arange(40, 48)],
    "contiguous": np.arange(16, 32),
    "one": np.array([29]),
}


@pytest.mark.parametrize("rows, keys", [("striped", "zigzag"), ("zigzag", "striped"), ("contiguous", "one"),
                                        ("one", "contiguous")])
@pytest.mark.parametrize("causal", [False, True])
def test_dropout_at_draws_the_longer_sequences_mask(rng, rows, keys, causal):
    """The product kernel on rows and keys picked out of a 48-token sequence, with ``dropout_at`` naming their
    positions, draws the whole sequence's mask restricted to them (the twin's, keyed by global positions):
    forward and backward against the float64 reference with that mask.  (``causal`` here is the launch's own
    bottom-right mask, on local indices.)"""
    from flashnb.distributed.blocks import dropout_at

    N, d, p, seed = 48, 16, 0.3, 2**33 + 5
    q, k, v, do = (rng.standard_normal((2, N, d)) for _ in range(4))
    R, K = SHARDS[rows], SHARDS[keys]
    q, do, k, v = q[:, R], do[:, R], k[:, K], v[:, K]
    at = (dropout_at(R), dropout_at(K))
    W = frng.dropout_scale_np(seed, p, 2, N, N)[:, R][:, :, K]
    opts = dict(causal=causal, impl="flash", dropout_p=p, seed=seed, dropout_at=at, **SMALL)
    o, lse = flashnb.attention_forward(q, k, v, **opts)
    o_ref, lse_ref = reference.attention_forward(q, k, v, causal=causal, dropout_mask=W)
    assert_close(o, o_ref, **FWD, what="o")
    assert_close(lse, lse_ref, **FWD, what="lse")
    grads = flashnb.attention_backward(q, k, v, o, lse, do, **opts)    # check_forward regenerates the same mask
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads,
                              reference.attention_backward(q, k, v, do, causal=causal, dropout_mask=W)):
        assert_close(g, g_ref, **BWD, what=name)
    if len(R) > 1 and len(K) > 1:   # and it is not the local mask
        o_local, _ = flashnb.attention_forward(q, k, v, **dict(opts, dropout_at=None))
        assert np.abs(o_local - o).max() > 1e-2


@pytest.mark.parametrize("at, err, words", [
    (((0, 1, 0, 0),), ValueError, "dropout_at must be"),
    (3, TypeError, "dropout_at must be"),
    (((0, 1, 0, 0), (0, 1.0, 0, 0)), TypeError, "col_step = 1.0 is not an int"),
    (((0, 0, 0, 0), (0, 1, 0, 0)), ValueError, "row_step must be >= 1"),
    (((-1, 1, 0, 0), (0, 1, 0, 0)), ValueError, "row positions must be >= 0"),
    (((0, 1, 0, 0), (0, 1, 0, 2**40)), ValueError, "must fit in int32"),
])
def test_bad_dropout_at(rng, at, err, words):
    q, k, v = qkv(rng, (1, 8, 8), 8)
    with pytest.raises(err, match=words):
        flashnb.attention_forward(q, k, v, impl="flash", dropout_p=0.1, seed=1, dropout_at=at)


def test_positions_that_no_dropout_at_describes_are_refused():
    from flashnb.distributed.blocks import dropout_at

    assert dropout_at(np.arange(3, 30, 3)) == (3, 3, 9, 0)
    assert dropout_at(np.r_[0:4, 10:14]) == (0, 1, 4, 6)
    with pytest.raises(ValueError, match="keys: positions"):
        dropout_at([0, 1, 5, 9, 10], "keys")
