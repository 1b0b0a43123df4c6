"""``impl="auto"``, the default of every user surface: the fastest kernel that does what the call asks.

The rule, applied to each launch (forward and backward alike):

* ``"fa2-tc"`` (stage 7, tensor cores) when the inputs are kept in half precision (``storage`` float16 or
  bfloat16) and the device is a GPU of compute capability 8.0 or newer whose tensor cores passed
  :func:`tensor_cores_checked` -- with any of fa2-tc's features: causal masks, GQA/MQA, dropout, attention
  modifiers and block masks;
* ``"flash"``, the product kernel, otherwise -- float32 inputs (fa2-tc would round them to TF32), tile options
  (``Br``, ``Bc``, ``warps`` name the product kernel's tiles) and masks prepared for its tiles
  (:class:`~flashnb.kernels.launch.fit.PreparedMask`), the simulator, sm_75 and older GPUs.

:func:`tensor_cores_checked` runs :func:`flashnb.kernels.tensorcore.check.run` once per process and GPU: every
tensor-core intrinsic against its simulator twin on the same random fragments.  The twins' fragment layouts are
what every simulator test of fa2-tc checked; the first call on a new GPU settles that the hardware agrees (a few
seconds, most of them compiling).  A mismatch keeps ``"flash"`` the default, with a ``RuntimeWarning`` naming the
intrinsics.  ``FLASHNB_TENSOR_CORES=off`` (or ``0``) keeps ``"flash"`` without running the check.

:data:`last_choice` says what the latest call chose and why: ``{"direction", "impl", "reason"}``.
"""

from __future__ import annotations

import os
import warnings

from .. import runtime
from ..registry import IMPLS, Impl, register_auto
from .launch import flash, tensorcore  # noqa: F401  (the two impls it chooses between, registered first)

__all__ = ["choose", "tensor_cores_checked", "last_choice", "HALF", "TC_OPTIONS", "ENV"]

#: the storages fa2-tc is the default for
HALF = ("float16", "bfloat16")
#: options a call may carry and still go to fa2-tc (everything else is the product kernel's)
TC_OPTIONS = frozenset({"storage", "dropout_p", "seed", "dropout_at", "block_mask", "score_mod", "mask_mod",
                        "score_mod_grad", "heads"})
#: the environment variable that turns the tensor-core default off
ENV = "FLASHNB_TENSOR_CORES"
_OFF, _ON = ("0", "off", "false", "no"), ("", "auto", "1", "on", "true", "yes")
#: the lowest compute capability fa2-tc is the default on (its backward needs sm_80's instructions)
MIN_CC = (8, 0)

last_choice: dict | None = None
_CHECKED: dict = {}          # GPU id -> (ok, what failed)


def _enabled() -> bool:
    value = os.environ.get(ENV, "").strip().lower()
    if value in _OFF:
        return False
    if value in _ON:
        return True
    raise ValueError(f"{ENV} must be 'auto' (or unset) to let the default use tensor cores, or 'off' to keep "
                     f"impl='flash', got {os.environ[ENV]!r}")


def _device_cc():
    """The current GPU's compute capability, None on the simulator."""
    if runtime.MODE != "gpu":
        return None
    from numba import cuda

    return tuple(cuda.get_current_device().compute_capability)


def _device_id() -> int:
    if runtime.MODE != "gpu":
        return -1
    from numba import cuda

    return int(cuda.get_current_device().id)


def _run_check() -> list[dict]:
    from .tensorcore import check as mma_check

    return mma_check.run(seed=0)


def tensor_cores_checked() -> tuple[bool, str]:
    """``(ok, what failed)``: whether this GPU's tensor-core instructions agree with their simulator twins
    (:func:`flashnb.kernels.tensorcore.check.run`), run once per process and GPU and remembered.  A failure warns
    once."""
    key = _device_id()
    if key not in _CHECKED:
        try:
            rows = _run_check()
            bad = [r["intrinsic"] for r in rows if not r["ok"]]
            failed = ", ".join(bad) if bad else ("no intrinsic was checked" if not rows else "")
        except Exception as exc:  # a driver or compiler error: the check did not pass, whatever the reason
            failed = f"the check could not run ({type(exc).__name__}: {exc})"
        _CHECKED[key] = (not failed, failed)
        if failed:
            warnings.warn(f"this GPU's tensor cores did not match flashnb's fragment layouts ({failed}): the default "
                          "impl stays 'flash'. impl='fa2-tc' would compute wrong results here; please report the "
                          "output of `python scripts/gpu_check.py`", RuntimeWarning, stacklevel=3)
    return _CHECKED[key]


def choose(options: dict) -> tuple[str, str]:
    """``(impl, reason)`` for a launch with these options (``storage`` as the API resolved it)."""
    storage = options.get("storage", "float32")
    if storage not in HALF:
        return "flash", f"storage={storage!r}: fa2-tc is the default for float16 and bfloat16 only"
    extra = sorted(n for n, v in options.items() if n not in TC_OPTIONS and v is not None)
    if extra:
        return "flash", f"option(s) {extra} are the product kernel's"
    from .launch.fit import PreparedMask

    if isinstance(options.get("block_mask"), PreparedMask):
        return "flash", "the block mask was prepared for the product kernel's tiles"
    if not _enabled():
        return "flash", f"{ENV} is off"
    cc = _device_cc()
    if cc is None:
        return "flash", "the simulator runs the product kernel by default (impl='fa2-tc' is there to choose)"
    if cc < MIN_CC:
        return "flash", f"sm_{cc[0]}{cc[1]} is below sm_{MIN_CC[0]}{MIN_CC[1]}"
    ok, failed = tensor_cores_checked()
    if not ok:
        return "flash", f"the tensor-core check failed: {failed}"
    return "fa2-tc", f"half storage on sm_{cc[0]}{cc[1]}, tensor cores checked"


def _chosen(direction: str, options: dict) -> Impl:
    global last_choice
    impl, reason = choose(options)
    last_choice = dict(direction=direction, impl=impl, reason=reason)
    return IMPLS[impl]


def forward(q, k, v, *, causal, scale, **options):
    """The chosen impl's forward (:func:`choose`)."""
    return _chosen("forward", options).forward(q, k, v, causal=causal, scale=scale, **options)


def backward(q, k, v, o, lse, do, *, causal, scale, **options):
    """The chosen impl's backward (:func:`choose`)."""
    return _chosen("backward", options).backward(q, k, v, o, lse, do, causal=causal, scale=scale, **options)


def _entry() -> Impl:
    product = IMPLS["flash"]
    return Impl("auto", "product", "the default: fa2-tc for half inputs on a checked sm_80+ GPU, else flash",
                forward, backward, product.options, None, True, product.mask_tiles, "float32")


register_auto(_entry())
