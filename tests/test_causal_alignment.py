"""Causal alignment when Nq != Nk: True / "lower_right" (bottom-right, FlashAttention >= 2.1, the default) and
"upper_left" (top-left, SDPA's is_causal), in the reference, the NumPy API and every impl's kernels."""

import numpy as np
import pytest
from conftest import FEATURE_IMPLS, MODULE_OF, assert_close, qkv

import flashnb
from flashnb import common, reference
from flashnb.instruments import traffic
from flashnb.registry import IMPLS

# Dense impls with their fastest small options; naive launches one thread per element of S, so it gets the
# smallest problem of all (one head) below.
# fa2 and flash are `slow` here (CI budget): tests/stages/test_fa2.py and tests/kernels/test_flash.py check their
# causal Nq != Nk against the reference, both alignments
FAST = ("onepass", "fa1", pytest.param("fa2", marks=pytest.mark.slow), pytest.param("flash", marks=pytest.mark.slow))


def test_reference_masks_are_the_documented_ones():
    # query i sees key j: lower_right j <= i + Nk - Nq, upper_left j <= i
    for Nq, Nk in ((3, 5), (5, 3), (4, 4)):
        i, j = np.arange(Nq)[:, None], np.arange(Nk)[None, :]
        lr = reference._allowed((Nq, Nk), True, None)
        assert np.array_equal(lr, j <= i + Nk - Nq)
        assert np.array_equal(reference._allowed((Nq, Nk), "lower_right", None), lr)
        assert np.array_equal(reference._allowed((Nq, Nk), "upper_left", None), j <= i)
    assert common.causal_diag(True, 3, 5) == 2 and common.causal_diag("upper_left", 3, 5) == 0


def test_alignments_differ_when_nq_ne_nk_and_agree_when_square(rng):
    q, k, v = qkv(rng, (2, 6, 4), 9)
    lr = reference.attention(q, k, v, causal="lower_right")
    ul = reference.attention(q, k, v, causal="upper_left")
    assert np.abs(lr - ul).max() > 0.1          # the issue measured a max difference of 1.6 at other sizes
    q, k, v = qkv(rng, (2, 7, 4), 7)
    assert np.array_equal(reference.attention(q, k, v, causal=True),
                          reference.attention(q, k, v, causal="upper_left"))


@pytest.mark.parametrize("impl", FAST)
@pytest.mark.parametrize("Nq, Nk", [(24, 40), (40, 24)])
def test_impls_follow_the_reference_for_both_alignments(rng, impl, Nq, Nk):
    q, k, v, do = qkv(rng, (2, Nq, 16), Nk, do=True)
    for causal in ("upper_left", "lower_right"):
        ro, rl = reference.attention_forward(q, k, v, causal=causal)
        o, lse = flashnb.attention_forward(q, k, v, causal=causal, impl=impl)
        # float32 kernels on O(1) data: errors measured <= 4e-7 (fwd) and <= 9e-7 (bwd); 1e-5 leaves room
        assert_close(o, ro, atol=1e-5, rtol=1e-5, what=f"{impl} {causal} o")
        assert_close(lse, rl, atol=1e-5, rtol=1e-5, what=f"{impl} {causal} lse")
        if IMPLS[impl].backward is not None:
            grads = flashnb.attention_backward(q, k, v, o, lse, do, causal=causal, impl=impl)
            for name, g, r in zip("qkv", grads, reference.attention_backward(q, k, v, do, causal=causal)):
                assert_close(g, r, atol=1e-5, rtol=1e-5, what=f"{impl} {causal} d{name}")


def test_naive_upper_left(rng):
    q, k, v, do = qkv(rng, (1, 12, 8), 20, do=True)
    o, lse = flashnb.attention_forward(q, k, v, causal="upper_left", impl="naive")
    assert_close(o, reference.attention(q, k, v, causal="upper_left"), atol=1e-5, rtol=1e-5, what="naive o")
    grads = flashnb.attention_backward(q, k, v, o, lse, do, causal="upper_left", impl="naive")
    for g, r in zip(grads, reference.attention_backward(q, k, v, do, causal="upper_left")):
        assert_close(g, r, atol=1e-5, rtol=1e-5, what="naive grad")


@pytest.mark.parametrize("impl", FEATURE_IMPLS)
@pytest.mark.parametrize("Nq, Nk", [(24, 40), (40, 24)])
def test_fa2_upper_left_traffic_equals_model(rng, Nq, Nk, impl):
    """The top-left diagonal moves the causal skipping: the model follows it exactly."""
    mod = MODULE_OF[impl]
    q, k, v, do = qkv(rng, (1, Nq, 8), Nk, do=True)
    dev = [common.to_device(a) for a in (q, k, v, do)]
    tiles = dict(Br=8, Bc=8, warps=1)
    with traffic.count() as t:
        o, lse = mod.forward(*dev[:3], causal="upper_left", scale=0.25, **tiles)
    assert t.summary() == mod.model_forward(1, Nq, Nk, 8, causal="upper_left", **tiles)
    with traffic.count() as t:
        mod.backward(*dev[:3], o, lse, dev[3], causal="upper_left", scale=0.25, **tiles)
    assert t.summary() == mod.model_backward(1, Nq, Nk, 8, causal="upper_left", **tiles)
    assert mod.model_forward(1, Nq, Nk, 8, causal="upper_left", **tiles) != \
        mod.model_forward(1, Nq, Nk, 8, causal=True, **tiles)


def test_bad_causal_and_sparse_upper_left(rng):
    q, k, v = qkv(rng, (1, 8, 4), 12)
    for bad in ("no", "top_left", 1, None):
        with pytest.raises(TypeError, match="causal"):
            flashnb.attention(q, k, v, causal=bad)
    with pytest.raises(ValueError, match="upper_left"):
        flashnb.attention(q, k, v, causal="upper_left", impl="fa2-sparse")
    q, k, v = qkv(rng, (1, 16, 4), 16)   # square: upper_left is the same mask, so fa2-sparse accepts it
    assert np.array_equal(flashnb.attention(q, k, v, causal="upper_left", impl="fa2-sparse"),
                          flashnb.attention(q, k, v, causal=True, impl="fa2-sparse"))
