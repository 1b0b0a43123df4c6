"""flashnb -- FlashAttention built kernel by kernel in Numba CUDA, one notebook per stage.

Importing flashnb chooses the device first (a real GPU when a CUDA driver and device are present, the
Numba CUDA simulator otherwise; ``FLASHNB_DEVICE=gpu|sim`` overrides), then loads the surface: :func:`attention`,
:func:`attention_forward`, :func:`attention_backward`.  The rest is imported on first use: a sub-package when it is
named (``flashnb.instruments``), an impl when it is asked for (``impl="fa2"`` imports :mod:`flashnb.stages.fa2`; see
:data:`flashnb.registry.IMPL_MODULES`).

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

from . import runtime  # noqa: F401  must come first: decides NUMBA_ENABLE_CUDASIM before numba.cuda is imported
from . import sim  # noqa: F401  simulator only: sim.install() (fast barrier, warp intrinsics) when MODE == "sim"
from .runtime import MODE, is_simulator  # noqa: F401
from .api import attention, attention_forward, attention_backward  # noqa: E402

__version__ = "0.1.0"

#: Modules that moved into a sub-package, by their old name: ``import flashnb.fa2`` and ``from flashnb import
#: fa2`` give the module object that lives at the new name (one object, so ``registry.variant`` and
#: ``registry.using`` see the same globals whichever name imported it), imported on first use.
MOVED = {
    **{f"flashnb.{m}": f"flashnb.stages.{m}" for m in
       ("naive", "softmax", "fa1", "fa2", "fa2_steps", "block_sparse", "fa2_fast", "fa2_fast_steps")},
    **{f"flashnb.{m}": f"flashnb.instruments.{m}" for m in
       ("traffic", "roofline", "bench", "rehearsal", "sass", "sass_model")},
    "flashnb.decode": "flashnb.kernels.decode",
    "flashnb.inspect": "flashnb.instruments",
}

#: Names of the surface defined in a module ``import flashnb`` does not import: ``flashnb.create_block_mask`` is
#: :func:`flashnb.flex.create_block_mask`, imported on first use.
LAZY = {"create_block_mask": "flashnb.flex", "BlockMask": "flashnb.masks"}

#: Modules renamed whose new module needs an optional dependency, by their old name: imported on first use of
#: the old name (``import flashnb.torch`` or ``flashnb.torch``), so that ``import flashnb`` never imports torch.
RENAMED = {"flashnb.torch": "flashnb.pytorch"}


def _renamed(name: str) -> str | None:
    """The new name of ``name`` when it is (or lies inside) a moved or renamed module, else None."""
    for old, new in (*MOVED.items(), *RENAMED.items()):
        if name == old or name.startswith(old + "."):
            return new + name[len(old):]
    return None


class _RenamedFinder:
    """``import flashnb.torch`` (or ``flashnb.torch.ops``) gives the module object of ``flashnb.pytorch`` (its
    ``ops``), ``import flashnb.fa2`` that of ``flashnb.stages.fa2``: one module under two names, never a second
    copy."""

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
    """What ``import flashnb`` defers, imported on first use: a sub-package or module (``flashnb.instruments``,
    ``flashnb.flex``), a moved or renamed module by its old name (``flashnb.fa2``, ``flashnb.torch``), a lazy name of
    the surface (:data:`LAZY`)."""
    import importlib
    import importlib.util

    if name in LAZY:
        value = getattr(importlib.import_module(LAZY[name]), name)
    elif f"flashnb.{name}" in MOVED or f"flashnb.{name}" in RENAMED:
        value = importlib.import_module(f"flashnb.{name}")    # through _RenamedFinder: the new module's object
    elif not name.startswith("_") and importlib.util.find_spec(f"flashnb.{name}") is not None:
        value = importlib.import_module(f"flashnb.{name}")
    else:
        raise AttributeError(f"module 'flashnb' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(LAZY) | {m.rsplit(".", 1)[1] for m in (*MOVED, *RENAMED)})


#: What users call: the attention functions, block masks, and the device flashnb runs on.  Everything else stays
#: reachable as an attribute (``flashnb.instruments``, ``flashnb.registry``, ...).
__all__ = ["attention", "attention_forward", "attention_backward", "create_block_mask", "BlockMask", "MODE"]
