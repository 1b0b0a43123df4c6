"""``impl="auto"``, the default: which kernel it runs, and that it runs exactly that kernel.

No GPU here, so the GPU's side of the rule is exercised by standing in for the two facts only a GPU gives -- its
compute capability (``auto._device_cc``) and the tensor-core check (``auto._run_check``); the kernels themselves run
on the simulator either way."""

from __future__ import annotations

import numpy as np
import pytest

import flashnb
from flashnb import reference
from flashnb.kernels import auto
from flashnb.registry import impl_names

# float16 inputs and outputs: o is rounded to float16 once (2^-11 relative) and fa2-tc rounds P to float16 before
# P·V; with |o| <= max|v| ~ 3 the error stays below 1e-2, where a wrong kernel (or a wrong route) is O(1) off.
HALF_TOL = 1e-2


@pytest.fixture
def gpu(monkeypatch):
    """Stand in for an sm_80 GPU whose tensor-core check passes; returns the list of check calls."""
    calls = []

    def check():
        calls.append(1)
        return [dict(intrinsic="mma m16n8k16.f16", ok=True)]

    monkeypatch.setattr(auto, "_device_cc", lambda: (8, 0))
    monkeypatch.setattr(auto, "_run_check", check)
    monkeypatch.setattr(auto, "_CHECKED", {})
    monkeypatch.delenv(auto.ENV, raising=False)
    return calls


def _qkv(dtype=np.float16, BH=2, Nq=24, Nk=40, d=16, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(dtype) for shape in ((BH, Nq, d), (BH, Nk, d), (BH, Nk, d))]


def test_auto_is_the_default_and_a_listed_name():
    import inspect

    for fn in (flashnb.attention, flashnb.attention_forward, flashnb.attention_backward):
        assert inspect.signature(fn).parameters["impl"].default == "auto"
    assert impl_names()[0] == "auto" and "auto" not in flashnb.registry.IMPLS   # the tour and tests walk IMPLS
    with pytest.raises(ValueError, match=r"impl must be one of \['auto', "):
        flashnb.attention(*_qkv(), impl="fa3")


def test_on_the_simulator_the_default_runs_the_product_kernel():
    q, k, v = _qkv()
    o = flashnb.attention(q, k, v, causal=True)
    assert auto.last_choice["impl"] == "flash" and "simulator" in auto.last_choice["reason"]
    assert np.array_equal(o, flashnb.attention(q, k, v, causal=True, impl="flash"))


@pytest.mark.parametrize("options, cc, want", [
    (dict(storage="float16"), (8, 0), "fa2-tc"),
    (dict(storage="bfloat16"), (9, 0), "fa2-tc"),
    (dict(storage="float16", dropout_p=0.1, seed=3), (8, 0), "fa2-tc"),
    ({}, (8, 0), "flash"),                                           # float32: fa2-tc would round it to TF32
    (dict(storage="float16"), (7, 5), "flash"),                      # fa2-tc's backward needs sm_80
    (dict(storage="float16", Br=32), (8, 0), "flash"),               # tile options name flash's tiles
    (dict(storage="float16", block_mask=np.ones((1, 1), bool)), (8, 0), "fa2-tc"),
    (dict(storage="bfloat16", score_mod=lambda s, b, h, i, j: s, heads=2), (8, 0), "fa2-tc"),
])
def test_the_rule(gpu, monkeypatch, options, cc, want):
    monkeypatch.setattr(auto, "_device_cc", lambda: cc)
    impl, reason = auto.choose(options)
    assert impl == want, reason
    assert len(gpu) == (1 if want == "fa2-tc" else 0)                 # the check runs only where it decides


def test_the_check_runs_once_per_gpu_and_a_failure_keeps_flash_with_a_warning(gpu, monkeypatch):
    calls = []

    def failing():
        calls.append(1)
        return [dict(intrinsic="mma m16n8k16.f16", ok=True), dict(intrinsic="ldmatrix x4 .trans", ok=False)]

    monkeypatch.setattr(auto, "_run_check", failing)
    with pytest.warns(RuntimeWarning, match="ldmatrix x4 .trans"):
        impl, reason = auto.choose(dict(storage="float16"))
    assert impl == "flash" and "ldmatrix x4 .trans" in reason
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")                                 # remembered: no second run, no second warning
        assert auto.choose(dict(storage="bfloat16"))[0] == "flash"
    assert len(calls) == 1


def test_a_check_that_cannot_run_keeps_flash(gpu, monkeypatch):
    def broken():
        raise RuntimeError("ptxas died")

    monkeypatch.setattr(auto, "_run_check", broken)
    with pytest.warns(RuntimeWarning, match="could not run"):
        assert auto.choose(dict(storage="float16"))[0] == "flash"


def test_the_environment_switch(gpu, monkeypatch):
    monkeypatch.setenv(auto.ENV, "off")
    assert auto.choose(dict(storage="float16")) == ("flash", f"{auto.ENV} is off") and not gpu
    monkeypatch.setenv(auto.ENV, "sometimes")
    with pytest.raises(ValueError, match=auto.ENV):
        auto.choose(dict(storage="float16"))
    monkeypatch.setenv(auto.ENV, "auto")
    assert auto.choose(dict(storage="float16"))[0] == "fa2-tc"


def test_the_real_check_passes_on_the_twins(monkeypatch):
    """:func:`auto.tensor_cores_checked` runs :func:`flashnb.kernels.tensorcore.check.run` (on the simulator: the twins
    against their NumPy cores, a rehearsal of what a GPU runs)."""
    monkeypatch.setattr(auto, "_CHECKED", {})
    assert auto.tensor_cores_checked() == (True, "")


def test_on_a_checked_gpu_half_inputs_run_fa2tc_forward_and_backward(gpu):
    """Routed through every layer of the API: the default's results are fa2-tc's, bit for bit, and within the
    half-precision tolerance of the float64 reference."""
    q, k, v = _qkv()
    do = np.random.default_rng(1).standard_normal(q.shape).astype(np.float16)
    o, lse = flashnb.attention_forward(q, k, v, causal=True)
    assert auto.last_choice == dict(direction="forward", impl="fa2-tc", reason=auto.last_choice["reason"])
    o_tc, lse_tc = flashnb.attention_forward(q, k, v, causal=True, impl="fa2-tc")
    assert np.array_equal(o, o_tc) and np.array_equal(lse, lse_tc)
    o64, _ = reference.attention_forward(*(a.astype(np.float64) for a in (q, k, v)), causal=True)
    assert np.abs(o.astype(np.float64) - o64).max() < HALF_TOL
    grads = flashnb.attention_backward(q, k, v, o, lse, do, causal=True)
    assert auto.last_choice["direction"] == "backward" and auto.last_choice["impl"] == "fa2-tc"
    for g, g_tc in zip(grads, flashnb.attention_backward(q, k, v, o, lse, do, causal=True, impl="fa2-tc")):
        assert np.array_equal(g, g_tc)
    assert len(gpu) == 1
    o32 = flashnb.attention(*(a.astype(np.float32) for a in (q, k, v)), causal=True)
    assert auto.last_choice["impl"] == "flash" and o32.dtype == np.float32


def test_pytorch_default_follows_the_same_rule(gpu):
    torch = pytest.importorskip("torch")
    from flashnb import pytorch as fnb

    q, k, v = (torch.from_numpy(a).requires_grad_() for a in _qkv(Nq=16, Nk=16))
    fnb.attention(q, k, v, causal=True).float().square().sum().backward()
    assert auto.last_choice["direction"] == "backward" and auto.last_choice["impl"] == "fa2-tc"
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    fnb.attention(q, k, v, causal=True, impl="fa2-tc").float().square().sum().backward()
    for g, t in zip(grads, (q, k, v)):
        assert torch.equal(g, t.grad)


def test_a_mask_prepared_for_the_product_kernel_stays_there(gpu):
    from flashnb.kernels import flash

    prepared = flash.prepare_block_mask(np.ones((1, 1), bool), direction="forward", BH=1, Nq=16, Nk=16, d=16)
    assert auto.choose(dict(storage="float16", block_mask=prepared))[0] == "flash"


def test_on_a_checked_gpu_modifiers_run_fa2tc(gpu):
    """Attention modifiers with half inputs go to fa2-tc too: the default's results are fa2-tc's, bit for bit."""
    from flashnb import flex

    q, k, v = _qkv(Nq=40, Nk=40)
    opts = dict(score_mod=flex.softcap(2.0), mask_mod=flex.sliding_window(12))
    o = flashnb.attention(q, k, v, **opts)
    assert auto.last_choice["impl"] == "fa2-tc"
    assert np.array_equal(o, flashnb.attention(q, k, v, impl="fa2-tc", **opts))
