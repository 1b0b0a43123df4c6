"""Where flashnb.pytorch's kernels run: CPU tensors through the NumPy API (the simulator, or host copies to a GPU),
CUDA tensors zero-copy on torch's current stream (:func:`_forward3`, :func:`_backward3`), and the rehearsal of
the CUDA path on the simulator (:func:`rehearse_cuda`)."""

from __future__ import annotations

import contextlib

import torch

from .. import api, common, runtime
from ..instruments import rehearsal
from ..registry import IMPLS, impl_entry

_HALF = (torch.float16, torch.bfloat16)
_STORAGE_OF = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """What the kernels are given: bfloat16 as its uint16 bit patterns (a view), any other tensor as it is."""
    return t.view(torch.uint16) if t.dtype == torch.bfloat16 else t


def _unbits(t: torch.Tensor, dtype) -> torch.Tensor:
    """A kernel's result back in ``dtype`` (uint16 bit patterns viewed as bfloat16)."""
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 and t.dtype == torch.uint16 else t


def _storage(entry, impl: str, storage, dtype) -> str:
    """The storage of a call: ``None`` keeps half tensors in their dtype when the impl can (else float32);
    an explicit half storage needs that dtype and an impl with half storage."""
    half_ok = "storage" in entry.options
    if storage is None:
        return _STORAGE_OF.get(dtype, "float32") if half_ok else "float32"
    storage = api._explicit_storage(entry, impl, storage)
    if storage == "float32":
        return storage
    if _STORAGE_OF.get(dtype) != storage:
        raise TypeError(f"storage={storage!r} needs q, k, v of dtype torch.{storage}, got {dtype}")
    return storage


def impls_with_backward() -> list[str]:
    """The impls :func:`attention` can differentiate (every registered impl with a backward)."""
    return sorted(name for name, e in IMPLS.items() if e.backward is not None)


# --------------------------------------------------------------------------- devices


class _CudaBridge:
    """CUDA tensors <-> numba device arrays without copies, on torch's current stream."""

    def takes(self, t: torch.Tensor) -> bool:
        return t.device.type == "cuda"

    def context(self, device):
        from numba import cuda

        return cuda.gpus[device.index if device.index is not None else torch.cuda.current_device()]

    def stream(self, device):
        from numba import cuda

        return cuda.external_stream(torch.cuda.current_stream(device).cuda_stream)

    def view(self, t: torch.Tensor):
        from numba import cuda

        # sync=False: the kernels run on torch's current stream, after whatever wrote t on it
        return cuda.as_cuda_array(t.detach(), sync=False)

    def tensor(self, a, device) -> torch.Tensor:
        return torch.as_tensor(a, device=device)   # __cuda_array_interface__: a view that keeps `a` alive


class _SimBridge(_CudaBridge):
    """The same path on the simulator: CPU tensors wrapped as simulator device arrays that share their memory
    (the kernels write into torch's buffers, as on a GPU), and a simulator stream."""

    def __init__(self):
        self.streams = []

    def takes(self, t):
        return t.device.type == "cpu"

    def context(self, device):
        return contextlib.nullcontext()

    def stream(self, device):
        from numba import cuda

        s = cuda.stream()
        self.streams.append(s)
        return s

    def view(self, t):
        from ..sim._numba_adapter import sim

        FakeCUDAArray = sim("cudadrv.devicearray", "FakeCUDAArray")

        return FakeCUDAArray(t.detach().numpy())   # shares t's memory

    def tensor(self, a, device):
        return torch.from_numpy(a._ary)            # shares the simulator array's memory


_bridge: _CudaBridge = _CudaBridge()


@contextlib.contextmanager
def rehearse_cuda():
    """Inside ``flashnb.instruments.rehearsal.pretend_gpu()``: CPU tensors take the CUDA-tensor path (zero-copy views,
    launches on a stream, no host copies), so that path runs before a GPU is lent.  Yields the bridge (its
    ``streams`` lists the streams handed out)."""
    global _bridge
    if not rehearsal.active():
        raise RuntimeError("rehearse_cuda() runs inside flashnb.instruments.rehearsal.pretend_gpu()")
    saved, _bridge = _bridge, _SimBridge()
    try:
        yield _bridge
    finally:
        _bridge = saved


def _on_device_path(t: torch.Tensor) -> bool:
    """True: the zero-copy CUDA path; False: the NumPy API (host copies)."""
    if isinstance(_bridge, _SimBridge):
        return _bridge.takes(t)
    if t.device.type == "cuda":
        if runtime.MODE != "gpu":
            raise ValueError(f"q is a CUDA tensor ({t.device}) but flashnb runs on the Numba CUDA simulator "
                             "(no GPU visible to numba, or FLASHNB_DEVICE=sim): move the tensors to the CPU or "
                             "run with FLASHNB_DEVICE=gpu")
        return True
    if t.device.type != "cpu":
        raise ValueError(f"flashnb runs CPU tensors (simulator) and CUDA tensors (GPU), got device {t.device}")
    return False


def _forward3(q, k, v, causal, scale, impl, options):
    """(BH, N, d) contiguous tensors (float32, or in ``options["storage"]``) -> (o, lse) tensors on q's device;
    o in q's dtype, lse float32."""
    if _on_device_path(q):
        b = _bridge
        with b.context(q.device), common.on_stream(b.stream(q.device)), common.poisoning(False):
            o, lse = impl_entry(impl).forward(*(b.view(_bits(t)) for t in (q, k, v)), causal=causal, scale=scale,
                                         **options)
            return _unbits(b.tensor(o, q.device), q.dtype), b.tensor(lse, q.device)
    o, lse = api.attention_forward(*(_bits(t).detach().numpy() for t in (q, k, v)), causal=causal, scale=scale,
                                   impl=impl, **options)
    return _unbits(torch.from_numpy(o), q.dtype), torch.from_numpy(lse)


def _backward3(q, k, v, o, lse, do, causal, scale, impl, options):
    if _on_device_path(q):
        b = _bridge
        with b.context(q.device), common.on_stream(b.stream(q.device)), common.poisoning(False):
            grads = impl_entry(impl).backward(*(b.view(_bits(t)) for t in (q, k, v, o, lse, do)), causal=causal,
                                         scale=scale, **options)
            return tuple(_unbits(b.tensor(g, q.device), q.dtype) for g in grads)
    grads = api.attention_backward(*(_bits(t).detach().numpy() for t in (q, k, v, o, lse, do)), causal=causal,
                                   scale=scale, impl=impl, **options)
    return tuple(_unbits(torch.from_numpy(g), q.dtype) for g in grads)
