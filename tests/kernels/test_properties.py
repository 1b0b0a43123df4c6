"""Property tests (hypothesis) of the product kernel (impl="flash") and the tensor-core kernel (impl="fa2-tc"):
random shapes (Nq != Nk, lengths that are no multiple of a tile, a single query or key), both causal alignments,
grouped-query ratios and modifiers, forward and backward, against the float64 reference.

Examples are derandomized (the same ones on every run, so CI is reproducible); ``FLASHNB_HYPOTHESIS_EXAMPLES``
sets how many (the ``slow`` twins run 20x as many).  Head dims are swept on their own
(tests/kernels/test_flash_tc_head_dims.py, tests/test_head_dims.py): here they vary over a few padded widths."""

import os

import numpy as np
import pytest
from conftest import assert_close
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flashnb
from flashnb import flex, reference

pytestmark = pytest.mark.skipif(flashnb.MODE != "sim", reason="simulator checks")

EXAMPLES = int(os.environ.get("FLASHNB_HYPOTHESIS_EXAMPLES", "6"))
CI = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SLOW = settings(CI, max_examples=20 * EXAMPLES)
# float32 sums of at most max(Nk, d) <= 48 O(1) products, a modifier's one rounding per score; the backward sums dQ
# by atomics in any order (as tests/test_flex.py): a wrong mask, alignment or group changes outputs by O(0.01 - 1)
FWD = dict(atol=2e-5, rtol=2e-5)
BWD = dict(atol=1e-4, rtol=1e-4)


@st.composite
def problems(draw, modifiers=True):
    """``(B, Hkv, G, Nq, Nk, d, causal, modifier, tiles)``: G query heads per K/V head (1: MHA, Hkv = 1: MQA)."""
    B = draw(st.integers(1, 2))
    Hkv = draw(st.integers(1, 2))
    G = draw(st.sampled_from([1, 2, 3]))
    Nq = draw(st.integers(1, 40))
    Nk = draw(st.integers(1, 48))
    d = draw(st.sampled_from([8, 16, 20, 33]))
    causal = draw(st.sampled_from([False, "lower_right", "upper_left"]))
    modifier = draw(st.sampled_from(["none", "alibi", "window", "softcap"] if modifiers else ["none", "window"]))
    return B, Hkv, G, Nq, Nk, d, causal, modifier


def _modifier(name, H):
    """(score_mod, mask_mod) of flashnb's gallery; the window is wide enough that causal rows keep a key."""
    return {"none": (None, None), "alibi": (flex.alibi(H), None), "window": (None, flex.sliding_window(9)),
            "softcap": (flex.softcap(3.0), None)}[name]


def _reference(q, k, v, do, causal, score_mod, mask_mod):
    B, H, Nq = q.shape[:3]
    Nk = k.shape[2]
    G = H // k.shape[1]
    kk, vv = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)      # query head z reads K/V head z // G
    mask = None if mask_mod is None else flex.mask_array(mask_mod, B, H, Nq, Nk)
    sm = None if score_mod is None else flex.numpy_modifier(score_mod)
    g = None if score_mod is None else flex.numpy_modifier(score_mod.grad)
    o, lse = reference.attention_forward(q, kk, vv, causal=causal, mask=mask, score_mod=sm)
    dq, dk, dv = reference.attention_backward(q, kk, vv, do, causal=causal, mask=mask, score_mod=sm,
                                              score_mod_grad=g)
    fold = lambda x: x.reshape(B, H // G, G, *x.shape[2:]).sum(axis=2)   # a K/V head's gradient: its group's sum
    return o, lse, dq, fold(dk), fold(dv)


def _check_product(problem):
    B, Hkv, G, Nq, Nk, d, causal, modifier = problem
    rng = np.random.default_rng(abs(hash(problem)) % 2**32)
    H = Hkv * G
    q, do = rng.standard_normal((B, H, Nq, d)), rng.standard_normal((B, H, Nq, d))
    k, v = rng.standard_normal((B, Hkv, Nk, d)), rng.standard_normal((B, Hkv, Nk, d))
    score_mod, mask_mod = _modifier(modifier, H)
    opts = dict(causal=causal, impl="flash", score_mod=score_mod, mask_mod=mask_mod, Br=16, Bc=16, warps=1)
    o, lse = flashnb.attention_forward(q, k, v, **opts)
    grads = flashnb.attention_backward(q, k, v, o, lse, do, **opts)
    o_ref, lse_ref, *refs = _reference(q, k, v, do, causal, score_mod, mask_mod)
    assert_close(o, o_ref, **FWD, what=f"o {problem}")
    assert_close(lse, lse_ref, **FWD, what=f"lse {problem}")
    for name, g_, r in zip(("dq", "dk", "dv"), grads, refs):
        assert_close(g_, r, **BWD, what=f"{name} {problem}")


@CI
@given(problems())
def test_product_kernel_on_random_problems(problem):
    _check_product(problem)


@pytest.mark.slow
@SLOW
@given(problems())
def test_product_kernel_on_random_problems_exhaustive(problem):
    _check_product(problem)


def _check_tensor_cores(problem):
    """fa2-tc in float16 at FlashAttention's rule (errors at most 2x / 3x PyTorch's in float16): mask_mod as the
    modifier (its element mask goes to PyTorch as a boolean mask)."""
    torch = pytest.importorskip("torch")
    from half_rule import maxerr, torch_half

    B, Hkv, G, Nq, Nk, d, causal, modifier = problem
    rng = np.random.default_rng(abs(hash(problem)) % 2**32)
    H = Hkv * G
    held = [rng.standard_normal(s).astype(np.float16) for s in ((B, H, Nq, d), (B, Hkv, Nk, d), (B, Hkv, Nk, d),
                                                                (B, H, Nq, d))]
    q, k, v, do = held
    _, mask_mod = _modifier(modifier, H)
    opts = dict(causal=causal, impl="fa2-tc", mask_mod=mask_mod)
    o, lse = flashnb.attention_forward(q, k, v, **opts)
    grads = flashnb.attention_backward(q, k, v, o, lse, do, **opts)
    exact = [x.astype(np.float64) for x in held]
    o_ref, lse_ref, *refs = _reference(*exact[:3], exact[3], causal, None, mask_mod)
    mask = None if mask_mod is None else flex.mask_array(mask_mod, B, H, Nq, Nk)
    pt = torch_half(*(torch.tensor(x, dtype=torch.float16) for x in exact), causal, 1 / np.sqrt(d), group=G, mask=mask)
    got = o.astype(np.float64)
    assert not np.isnan(got).any() and not np.isnan(lse).any(), problem
    assert maxerr(got, o_ref) <= 2 * maxerr(pt[0], o_ref), (problem, maxerr(got, o_ref), maxerr(pt[0], o_ref))
    assert_close(lse, lse_ref, atol=2e-5, rtol=2e-5, what=f"lse {problem}")   # float32 from exact half inputs
    for name, g_, r, p in zip(("dq", "dk", "dv"), grads, refs, pt[1:]):
        g64 = g_.astype(np.float64)
        assert not np.isnan(g64).any(), (name, problem)
        # + 1e-6: a gradient exactly zero in exact arithmetic (one key: dS = P (dP - D) = 0) comes out of float32
        # as cancellation residue (~6e-8), where PyTorch's float16 happens to give exact zeros
        assert maxerr(g64, r) <= 3 * maxerr(p, r) + 1e-6, (name, problem, maxerr(g64, r), maxerr(p, r))


@CI
@given(problems(modifiers=False))
def test_tensor_core_kernel_on_random_problems(problem):
    _check_tensor_cores(problem)


@pytest.mark.slow
@SLOW
@given(problems(modifiers=False))
def test_tensor_core_kernel_on_random_problems_exhaustive(problem):
    _check_tensor_cores(problem)
