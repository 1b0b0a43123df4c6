"""Stage 1 (standard attention) against the float64 reference, over a small FlashAttention-style shape matrix."""

import numpy as np
import pytest
from conftest import assert_close, qkv

import flashnb
from flashnb import reference
from flashnb.stages import naive

# Float32 kernels vs the float64 reference.  Each output element is a dot product / softmax over at most
# max(Nk, d) <= 64 terms of O(1) values, so float32 rounding is ~64 * 6e-8 ~ 4e-6 relative; the backward
# chains four such products (dP, dS, dQ/dK) and values grow to O(10): 1e-4 absolute still catches any
# wrong index or mask (those give O(0.1-1) errors).
FWD = dict(atol=2e-5, rtol=2e-5)
BWD = dict(atol=1e-4, rtol=1e-4)

# (BH-shape, Nq, Nk, d): Nq != Nk both ways, lengths that are not multiples of the 16-wide tile, N = 1.
SHAPES = [
    ((1,), 1, 1, 1),
    ((1,), 1, 19, 8),
    ((2,), 19, 1, 8),
    ((1, 2), 33, 20, 5),
    ((2,), 16, 16, 16),
    ((1,), 40, 56, 32),
    ((1,), 21, 21, 64),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lead, Nq, Nk, d", SHAPES)
def test_forward_matches_reference(rng, lead, Nq, Nk, d, causal):
    q, k, v = qkv(rng, (*lead, Nq, d), Nk)
    o, lse = flashnb.attention_forward(q, k, v, causal=causal, impl="naive")
    o_ref, lse_ref = reference.attention_forward(q, k, v, causal=causal)
    assert_close(o, o_ref, **FWD, what="o")
    assert_close(lse, lse_ref, **FWD, what="lse")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lead, Nq, Nk, d", SHAPES[::2] + [SHAPES[3]])
def test_backward_matches_reference(rng, lead, Nq, Nk, d, causal):
    q, k, v, do = qkv(rng, (*lead, Nq, d), Nk, do=True)
    o, lse = reference.attention_forward(q, k, v, causal=causal)
    grads = flashnb.attention_backward(q, k, v, o, lse, do, causal=causal, impl="naive")
    for name, g, r in zip(("dq", "dk", "dv"), grads, reference.attention_backward(q, k, v, do, causal=causal)):
        assert_close(g, r, **BWD, what=name)


def test_causal_rows_without_keys_give_zero_and_minus_inf(rng):
    # Nq > Nk with bottom-right alignment: query i sees keys j <= i - (Nq - Nk); the first Nq - Nk rows see none.
    q, k, v, do = qkv(rng, (9, 4), 3, do=True)
    o, lse = flashnb.attention_forward(q, k, v, causal=True, impl="naive")
    assert np.all(o[:6] == 0) and np.all(lse[:6] == -np.inf)
    assert_close(o, reference.attention_forward(q, k, v, causal=True)[0], **FWD, what="o")
    grads = flashnb.attention_backward(q, k, v, o, lse, do, causal=True, impl="naive")
    for name, g, r in zip(("dq", "dk", "dv"), grads, reference.attention_backward(q, k, v, do, causal=True)):
        assert_close(g, r, **BWD, what=name)


def test_forward_then_backward_end_to_end(rng):
    """The backward fed with the naive forward's own (o, lse), causal with Nq < Nk, scale != 1/sqrt(d)."""
    q, k, v, do = qkv(rng, (2, 13, 6), 21, do=True)
    o, lse = flashnb.attention_forward(q, k, v, causal=True, scale=0.6, impl="naive")
    grads = flashnb.attention_backward(q, k, v, o, lse, do, causal=True, scale=0.6, impl="naive")
    for name, g, r in zip(("dq", "dk", "dv"), grads, reference.attention_backward(q, k, v, do, causal=True, scale=0.6)):
        assert_close(g, r, **BWD, what=name)


def test_every_output_is_written(rng):
    """The device outputs start as NaN (common.empty); after the launches none may remain."""
    q, k, v = (flashnb.common.to_device(a) for a in qkv(rng, (1, 17, 3), 18))
    o, lse = naive.forward(q, k, v, causal=False, scale=0.5)
    assert not np.isnan(o.copy_to_host()).any() and not np.isnan(lse.copy_to_host()).any()
