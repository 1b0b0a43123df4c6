"""flashnb.pytorch: autograd interop checked against torch.nn.functional.scaled_dot_product_attention in float64.

Skipped when PyTorch is not installed (it is an optional extra: ``pip install "flashnb[torch]"``).

Tolerances.  flashnb computes in float32 (unit roundoff u = 2^-24 ≈ 6e-8); SDPA runs in float64 on the same
float32-representable inputs, so the difference is flashnb's float32 rounding alone.  Each output or gradient
element is a few chained sums of at most n = max(Nq, Nk, d) <= 64 products of O(1) numbers (standard-normal
inputs, softmax weights <= 1): the standard bound for a float32 dot product is n·u·sum|terms|, about
64 · 6e-8 ≈ 4e-6 per sum.  TOL = 2e-5 (atol and rtol) covers a chain of several such sums; the errors measured
here are about 1e-6 or less, so it is not loose enough to hide a wrong mask or a missing term (those give
errors of order 0.1-1).
"""

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import flashnb  # noqa: E402
import flashnb.pytorch as ft  # noqa: E402
from flashnb import common  # noqa: E402
from flashnb.instruments.rehearsal import pretend_gpu  # noqa: E402

TOL = 2e-5
SMALL = dict(Br=16, Bc=16, warps=1)   # one-warp fa2 tiles: 32 simulator threads per block instead of 128


def _causal_mask(causal, Nq, Nk):
    """SDPA's boolean attn_mask (True = attend) for flashnb's causal argument, built independently."""
    if not causal:
        return None
    i, j = torch.arange(Nq)[:, None], torch.arange(Nk)[None, :]
    return j <= i + (0 if causal == "upper_left" else Nk - Nq)


def _sdpa64(q, k, v, do, causal, scale=None):
    """SDPA in float64 on float32-valued copies: output and the three gradients."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=_causal_mask(causal, q.shape[-2], k.shape[-2]),
                                       scale=scale)
    o.backward(do.double())
    return o.detach(), q.grad, k.grad, v.grad


def _close(actual, expected, what, tol=TOL):
    actual, expected = actual.detach().double(), expected.detach().double()
    assert actual.shape == expected.shape, what
    assert not torch.isnan(actual).any(), f"{what}: NaN"
    err = (actual - expected).abs().max().item()
    assert torch.allclose(actual, expected, atol=tol, rtol=tol), f"{what}: max abs error {err:.2e}"
    return err


def _inputs(seed, shape_q, Nk, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    *lead, Nq, d = shape_q
    q = torch.randn(shape_q, generator=g, dtype=dtype, requires_grad=True)
    k = torch.randn((*lead, Nk, d), generator=g, dtype=dtype, requires_grad=True)
    v = torch.randn((*lead, Nk, d), generator=g, dtype=dtype, requires_grad=True)
    do = torch.randn(shape_q, generator=g, dtype=dtype)
    return q, k, v, do


def _random_cases(n, seed=15):
    """Seeded random shapes kept small for the simulator (B·H <= 2, N <= 48; CI runs them): odd d, Nq != Nk."""
    rng = np.random.default_rng(seed)
    cases = []
    for c in range(n):
        B, H = [(1, 1), (1, 2), (2, 1)][rng.integers(3)]
        Nq, Nk = (int(x) for x in rng.integers(1, 49, size=2))
        d = int(rng.choice([1, 3, 7, 13, 33]))
        causal = [False, True, "upper_left"][c % 3]
        cases.append((B, H, Nq, Nk, d, causal))
    return cases


def test_import_flashnb_does_not_import_torch():
    code = "import sys, flashnb; assert 'torch' not in sys.modules, 'import flashnb imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True, env={**__import__("os").environ,
                                                                  "FLASHNB_DEVICE": "sim"})


def test_the_old_name_flashnb_torch_is_the_same_module_imported_on_first_use():
    # flashnb.torch was renamed flashnb.pytorch (no module named after a package users import); old imports keep
    # working, give the very same module objects (a second copy would register the torch.library ops twice), and
    # import torch only when used.
    code = "\n".join([
        "import sys, flashnb",
        "assert 'torch' not in sys.modules and 'flashnb.pytorch' not in sys.modules",
        "import flashnb.torch.ops as old_ops",
        "import flashnb.pytorch.ops as new_ops",
        "from flashnb import torch as old",
        "import flashnb.pytorch as new",
        "assert old_ops is new_ops and old is new and flashnb.torch is new, 'two module objects'",
        "assert new.__spec__.name == 'flashnb.pytorch' and old.attention is new.attention",
        "assert not any(k.startswith('flashnb.torch') and sys.modules[k].__name__ == k for k in sys.modules)",
    ])
    subprocess.run([sys.executable, "-c", code], check=True, env={**__import__("os").environ,
                                                                  "FLASHNB_DEVICE": "sim"})


@pytest.mark.parametrize("B, H, Nq, Nk, d, causal", _random_cases(5))
def test_fa2_matches_sdpa_float64(B, H, Nq, Nk, d, causal):
    q, k, v, do = _inputs(Nq * 1000 + Nk, (B, H, Nq, d), Nk)
    o = ft.attention(q, k, v, causal=causal)
    o.backward(do)
    ref = _sdpa64(q, k, v, do, causal)
    for name, got, want in zip(("o", "dq", "dk", "dv"), (o, q.grad, k.grad, v.grad), ref):
        _close(got, want, f"{name} {(B, H, Nq, Nk, d, causal)}")
    assert o.dtype == torch.float32 and o.shape == q.shape


@pytest.mark.parametrize("impl, shape_q, Nk", [("fa1", (1, 2, 24, 16), 40), ("naive", (1, 1, 12, 8), 20),
                                               ("fa2", (2, 16, 5), 9), ("fa2", (11, 3), 7)])
def test_every_impl_with_backward_and_shape_matches_sdpa(impl, shape_q, Nk):
    assert impl in ft.impls_with_backward()
    q, k, v, do = _inputs(7, shape_q, Nk)
    o = ft.attention(q, k, v, causal="upper_left", impl=impl, scale=0.3)
    o.backward(do)
    for name, got, want in zip(("o", "dq", "dk", "dv"), (o, q.grad, k.grad, v.grad),
                               _sdpa64(q, k, v, do, "upper_left", scale=0.3)):
        _close(got, want, f"{impl} {name}")


def test_gradcheck_float64():
    """torch.autograd.gradcheck on float64 inputs (allow_float64: computed in float32).  Finite differences of
    a float32 function: rounding error ~1e-7 divided by eps = 1e-3 gives ~1e-4 noise, truncation error is
    O(eps²) ≈ 1e-6; atol = rtol = 2e-3 is ten times that noise and far below a wrong gradient's O(1) error."""
    q, k, v, _ = _inputs(3, (1, 1, 5, 3), 7, dtype=torch.float64)
    f = lambda q, k, v: ft.attention(q, k, v, causal="upper_left", allow_float64=True, **SMALL)
    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-3, atol=2e-3, rtol=2e-3, fast_mode=True)


def test_saves_o_and_lse_not_p_and_backward_does_not_rerun_the_forward():
    q, k, v, do = _inputs(4, (1, 48, 8), 40)
    o, lse = ft.FlashAttentionFunction.apply(q, k, v, True, 0.5, "fa2", SMALL)
    saved = o.grad_fn.saved_tensors
    assert [tuple(t.shape) for t in saved] == [(1, 48, 8), (1, 40, 8), (1, 40, 8), (1, 48, 8), (1, 48)]
    assert all(t.numel() < 48 * 40 for t in saved[3:])      # O and L only: nothing of size Nq x Nk
    assert not lse.requires_grad
    labels = []
    common.launch_hooks.append(lambda label, *a: labels.append(label) or __import__("contextlib").nullcontext())
    try:
        o.backward(do)
    finally:
        common.launch_hooks.pop()
    assert labels == ["D = rowsum(dO∘O)", "FA2 backward"]


def _penalised(attn, q, k, v):
    """``sum(o) + |d sum(o) / dq|²``: a gradient penalty, whose second term needs the backward's own derivative."""
    o = attn(q, k, v)
    (g,) = torch.autograd.grad(o.sum(), q, create_graph=True)
    return o.sum() + g.square().sum()


def test_second_order_gradients_are_refused_naming_flashnb():
    """Before: a gradient penalty ran and silently lost its terms (the backward's gradients came back detached
    when the incoming gradient needed none, so the penalty's backward dropped them: q.grad 4.0 where torch gives
    20.1), and the simplest double backward failed with torch's unrelated "element 0 of tensors does not require
    grad".  Now every path refuses with flashnb's message -- attention, the SDPA drop-in, float16 and bfloat16,
    grouped-query K/V, a Hessian-vector product, an incoming gradient that itself requires grad -- and a
    create_graph=True gradient used only as a value is the plain gradient."""
    q, k, v, _ = _inputs(21, (1, 1, 16, 4), 16)
    refused = r"flashnb's attention backward is not itself differentiable.*sdpa_kernel"
    paths = {
        "attention": lambda q, k, v: ft.attention(q, k, v, **SMALL),
        "sdpa drop-in": lambda q, k, v: ft.scaled_dot_product_attention(q, k, v, is_causal=True, **SMALL),
        "float16": lambda q, k, v: ft.attention(q.half(), k.half(), v.half(), **SMALL).float(),
        "bfloat16": lambda q, k, v: ft.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), **SMALL).float(),
        "gqa": lambda q, k, v: ft.attention(q.expand(1, 2, 16, 4), k, v, **SMALL),   # 2 query heads, 1 K/V
        "o² loss": lambda q, k, v: ft.attention(q, k, v, **SMALL).square(),
    }
    for name, attn in paths.items():
        with pytest.raises(RuntimeError, match=refused):
            _penalised(attn, q, k, v).backward()
    (g,) = torch.autograd.grad(ft.attention(q, k, v, **SMALL).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match=refused):
        g.sum().backward()
    with pytest.raises(RuntimeError, match=refused):
        torch.autograd.functional.hvp(lambda x: ft.attention(x, k, v, **SMALL).sum(), q, torch.ones_like(q))
    (g1,) = torch.autograd.grad(ft.attention(q, k, v, **SMALL).sum(), q)
    assert g.requires_grad and torch.equal(g.detach(), g1)


def test_dtypes_devices_and_contiguity():
    q, k, v, do = _inputs(5, (1, 1, 16, 8), 24)
    o32 = ft.attention(q, k, v, causal=True, **SMALL)
    # bfloat16 / float16: converted to float32 (exactly), computed, returned (with gradients) in the input dtype
    for half in (torch.bfloat16, torch.float16):
        qh, kh, vh = (t.detach().to(half).requires_grad_() for t in (q, k, v))
        oh = ft.attention(qh, kh, vh, causal=True, **SMALL)
        assert oh.dtype == half
        exact = ft.attention(*(t.float() for t in (qh, kh, vh)), causal=True, **SMALL).to(half)
        assert torch.equal(oh, exact)
        oh.sum().backward()
        assert qh.grad.dtype == half and kh.grad.shape == kh.shape
    # float64: refused unless asked for
    with pytest.raises(TypeError, match="allow_float64"):
        ft.attention(q.double(), k.double(), v.double())
    o64 = ft.attention(q.double(), k.double(), v.double(), causal=True, allow_float64=True, **SMALL)
    assert o64.dtype == torch.float64 and torch.equal(o64, o32.double())
    for bad, match in (((q, k.double(), v), "one dtype"), ((q.int(), k.int(), v.int()), "float32"),
                       ((q.detach().numpy(), k, v), "torch.Tensor"),
                       ((q, k, v[..., :4]), "head dim|d"), ((q, k[0], v[0]), "leading")):
        with pytest.raises((TypeError, ValueError), match=match):
            ft.attention(*bad)
    with pytest.raises(ValueError, match="device"):
        ft.attention(q.to("meta"), k.to("meta"), v.to("meta"))
    # non-contiguous views (as a model's (B, N, H, d) -> (B, H, N, d) transpose makes): same values and grads
    qt, kt, vt = (t.detach().transpose(-1, -2).contiguous().transpose(-1, -2).requires_grad_() for t in (q, k, v))
    assert not qt.is_contiguous()
    ot = ft.attention(qt, kt, vt, causal=True, **SMALL)
    assert torch.equal(ot, o32)
    ot.backward(do)
    o32.backward(do)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip((qt, kt, vt), (q, k, v)))
    # only q requires grad: k, v get none
    qq = q.detach().requires_grad_()
    ft.attention(qq, k.detach(), v.detach(), **SMALL).sum().backward()
    assert qq.grad is not None
    # a forward-only impl: fine without gradients, a clear error with them
    with torch.no_grad():
        _close(ft.attention(q, k, v, causal=True, impl="onepass"), o32, "onepass")
    with pytest.raises(ValueError, match="no backward"):
        ft.attention(q, k, v, impl="onepass")
    with pytest.raises(TypeError, match="causal"):
        ft.attention(q, k, v, causal="top_left")


def test_numpy_api_accepts_torch_values_and_refuses_grad():
    q, k, v, _ = _inputs(6, (2, 16, 8), 16)
    with pytest.raises(TypeError, match="flashnb.pytorch"):
        flashnb.attention(q, k, v, impl="fa2")
    o = flashnb.attention(q.detach().bfloat16(), k.detach().bfloat16(), v.detach().bfloat16(), impl="fa2")
    assert isinstance(o, np.ndarray) and o.dtype == np.float32 and o.shape == (2, 16, 8)


def test_sdpa_signature_drop_in():
    from torch.nn.attention.bias import causal_lower_right, causal_upper_left

    q, k, v, do = _inputs(8, (1, 1, 12, 8), 20)
    o = ft.scaled_dot_product_attention(q, k, v, is_causal=True)           # SDPA's is_causal: top-left
    _close(o, F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True), "is_causal")
    assert torch.equal(ft.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(12, 20)),
                       ft.attention(q, k, v, causal=True))
    assert torch.equal(ft.scaled_dot_product_attention(q, k, v, attn_mask=causal_upper_left(12, 20)), o)
    for kwargs, match in ((dict(attn_mask=torch.ones(12, 20, dtype=torch.bool)), "attn_mask"),
                          (dict(dropout_p=1.5), "dropout_p must be in"),   # see tests/kernels/test_dropout.py
                          (dict(attn_mask=causal_lower_right(3, 4)), "causal bias")):
        with pytest.raises(ValueError, match=match):
            ft.scaled_dot_product_attention(q, k, v, **kwargs)


def test_block_mask_matches_sdpa_with_the_expanded_mask():
    from flashnb import reference
    from flashnb.stages import block_sparse

    q, k, v, do = _inputs(9, (1, 1, 32, 8), 32)
    bm = block_sparse.local(32, 32, 8, 8, 2, causal=True)
    o = ft.attention(q, k, v, causal=True, block_mask=bm)
    o.backward(do)
    mask = torch.from_numpy(reference.expand_block_mask(bm.mask, 32, 32, 8, 8)) & _causal_mask(True, 32, 32)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask)
    ref.backward(do.double())
    for name, got, want in zip(("o", "dq", "dk", "dv"), (o, q.grad, k.grad, v.grad), (ref, qd.grad, kd.grad, vd.grad)):
        _close(got, want, f"block-sparse {name}")


def test_cuda_path_rehearsed_zero_copy_on_a_stream(monkeypatch):
    """The CUDA-tensor path (views via the array interface, launches on torch's stream, no host copies), taken
    by CPU tensors on the simulator: same numbers as the NumPy path, every launch on the bridge's stream, no
    cuda.to_device / copy_to_host, and the kernels' inputs and outputs share memory with the tensors."""
    from numba import cuda
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    q, k, v, do = _inputs(10, (1, 1, 24, 8), 40)
    o_host = ft.attention(q, k, v, causal="upper_left")
    o_host.backward(do)
    host_grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None

    def no_copy(*a, **kw):
        raise AssertionError("host<->device copy on the CUDA-tensor path")

    streams, shared = [], []
    with pretend_gpu(), ft.rehearse_cuda() as bridge:
        view, tensor = bridge.view, bridge.tensor
        monkeypatch.setattr(bridge, "view", lambda t: shared.append((t, view(t))) or shared[-1][1])
        monkeypatch.setattr(bridge, "tensor", lambda a, dev: shared.append((tensor(a, dev), a)) or shared[-1][0])
        monkeypatch.setattr(cuda, "to_device", no_copy)
        monkeypatch.setattr(FakeCUDAArray, "copy_to_host", no_copy)
        common.launch_hooks.append(lambda *a: streams.append(common.current_stream()) or
                                   __import__("contextlib").nullcontext())
        try:
            o = ft.attention(q, k, v, causal="upper_left")
            o.backward(do)
        finally:
            common.launch_hooks.pop()
    assert torch.equal(o, o_host)
    assert all(torch.equal(t.grad, g) for t, g in zip((q, k, v), host_grads))
    assert len(streams) == 3 and all(any(s is b for b in bridge.streams) for s in streams)
    assert len(shared) == 3 + 2 + 6 + 3
    for t, a in shared:
        assert np.shares_memory(t.detach().numpy(), a._ary)


def test_notebook_09_gpu_measurement_rehearsed():
    """tiny_transformer.measure_gpu (notebook 09's GPU cell) on the simulator: CUDA-event timing rehearsed, the
    model's flashnb attention through the CUDA-tensor path; rows say mode=rehearsal, never a measurement."""
    from flashnb import tiny_transformer as tt

    with pretend_gpu():
        rows = tt.measure_gpu(impls=("sdpa", "fa2"), batch=1, context=8, width=8, heads=1, layers=1, repeats=1,
                              warmup=1)
    assert [r["impl"] for r in rows] == ["sdpa", "fa2"]
    assert all(r["mode"] == "rehearsal" and r["median_ms"] >= 0 for r in rows)
