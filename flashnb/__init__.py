"""flashnb -- FlashAttention built kernel by kernel in Numba CUDA, one notebook per stage.

Importing flashnb chooses the device first (a real GPU when a CUDA driver and device are present, the
Numba CUDA simulator otherwise; ``FLASHNB_DEVICE=gpu|sim`` overrides), then registers every stage.

The package, from the bottom up:

* :mod:`flashnb.stages` -- the teaching kernels, one lesson each (naive attention to the fast FA2);
* :mod:`flashnb.kernels` -- the product kernel (``impl="flash"``, the default), flash-decoding, tensor cores;
* :mod:`flashnb.instruments` -- traffic counting, rooflines, timing, ptxas resources, SASS;
* :mod:`flashnb.sim` -- the simulator's vectorised mode and its sanitizer tools;
* user surfaces above them: :func:`attention` and friends (:mod:`flashnb.api`), :mod:`flashnb.flex` (attention
  modifiers), :mod:`flashnb.pytorch`, :mod:`flashnb.distributed`; the course kit :mod:`flashnb.course` and the
  notebooks' :mod:`flashnb.exercises`.

Modules that moved keep their old names: ``flashnb.fa2`` is :mod:`flashnb.stages.fa2`, ``flashnb.traffic`` is
:mod:`flashnb.instruments.traffic`, ``flashnb.inspect`` is :mod:`flashnb.instruments` (see :data:`MOVED`);
``flashnb.torch`` is :mod:`flashnb.pytorch`, imported on first use (it needs PyTorch; see :data:`RENAMED`).
"""

import sys as _sys

from . import runtime  # must come first: decides NUMBA_ENABLE_CUDASIM before numba.cuda is imported
from . import sim  # noqa: F401  simulator only: sim.install() (fast barrier, warp intrinsics) when MODE == "sim"
from .runtime import MODE, is_simulator
from . import registry, common  # noqa: E402
from .api import attention, attention_forward, attention_backward  # noqa: E402
from . import rng  # noqa: E402,F401  (Philox4x32-10 for attention dropout, device and NumPy)
from . import stages  # noqa: E402,F401
from .stages import naive  # noqa: E402,F401  (stage 1 registers impl="naive")
from .stages import softmax  # noqa: E402,F401  (stage 2 registers impl="onepass")
from .stages import fa1  # noqa: E402,F401  (stage 3 registers impl="fa1")
from .stages import fa2  # noqa: E402,F401  (stage 4 registers impl="fa2")
from .stages import fa2_steps  # noqa: E402,F401  (stage 4, step by step: impl="fa2-rows", "fa2-splitq")
from .stages import block_sparse  # noqa: E402,F401  (stage 5 registers impl="fa2-sparse"; fa2 takes block_mask=)
from . import flex  # noqa: E402,F401  (attention modifiers: score_mod / mask_mod, the gallery)
from .stages import fa2_fast  # noqa: E402,F401  (stage 6 registers impl="fa2-fast")
from .stages import fa2_fast_steps  # noqa: E402,F401  (stage 6, step by step: the line-8 kernels of notebook 08)
from .stages import tensor_cores  # noqa: E402,F401  (stage 7, the lesson: FA2's forward on tensor cores)
from .kernels import decode  # noqa: E402,F401  (decoding with a KV cache: impl="flash-decoding")
from . import kernels  # noqa: E402,F401  (the product kernel, impl="flash"; stage 7, tensor cores, impl="fa2-tc")
from . import reference, instruments  # noqa: E402,F401  (reference and measurement)
from .instruments import traffic, roofline, bench, rehearsal, sass, sass_model  # noqa: E402,F401

__version__ = "0.1.0"

#: Modules that moved into a sub-package, by their old name: ``import flashnb.fa2`` and ``from flashnb import
#: fa2`` give the module object that lives at the new name (one object, so ``registry.variant`` and
#: ``registry.using`` see the same globals whichever name imported it).
MOVED = {
    **{f"flashnb.{m}": f"flashnb.stages.{m}" for m in
       ("naive", "softmax", "fa1", "fa2", "fa2_steps", "block_sparse", "fa2_fast", "fa2_fast_steps")},
    **{f"flashnb.{m}": f"flashnb.instruments.{m}" for m in
       ("traffic", "roofline", "bench", "rehearsal", "sass", "sass_model")},
    "flashnb.decode": "flashnb.kernels.decode",
    "flashnb.inspect": "flashnb.instruments",
}
for _old, _new in MOVED.items():
    _sys.modules[_old] = _sys.modules[_new]
    globals()[_old.rsplit(".", 1)[1]] = _sys.modules[_new]
del _old, _new

#: Modules renamed whose new module needs an optional dependency, by their old name: imported on first use of
#: the old name (``import flashnb.torch`` or ``flashnb.torch``), so that ``import flashnb`` never imports torch.
RENAMED = {"flashnb.torch": "flashnb.pytorch"}


def _renamed(name: str) -> str | None:
    """The new name of ``name`` when it is (or lies inside) a renamed module, else None."""
    for old, new in RENAMED.items():
        if name == old or name.startswith(old + "."):
            return new + name[len(old):]
    return None


class _RenamedFinder:
    """``import flashnb.torch`` (or ``flashnb.torch.ops``) gives the module object of ``flashnb.pytorch`` (its
    ``ops``): one module under two names, never a second copy."""

    def find_spec(self, name, path=None, target=None):
        if _renamed(name) is None:
            return None
        import importlib.util

        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        import importlib

        module = importlib.import_module(_renamed(spec.name))
        self.own_spec = module.__spec__
        return module

    def exec_module(self, module):
        module.__spec__ = self.own_spec    # the import system stamped the old name's spec on it: give its own back


if not any(isinstance(f, _RenamedFinder) for f in _sys.meta_path):
    _sys.meta_path.insert(0, _RenamedFinder())


def __getattr__(name):
    """``flashnb.torch`` (and ``from flashnb import torch``): the renamed module, imported on first use."""
    if f"flashnb.{name}" in RENAMED:
        import importlib

        return importlib.import_module(RENAMED[f"flashnb.{name}"])
    raise AttributeError(f"module 'flashnb' has no attribute {name!r}")

__all__ = ["MODE", "is_simulator", "attention", "attention_forward", "attention_backward", "registry", "common",
           "runtime", "sim", "stages", "kernels", "instruments", "rng", "flex", "reference", "MOVED", "RENAMED",
           "__version__"]
