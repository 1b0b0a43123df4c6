"""Old name of the product kernel's module, kept for imports from before the kernels were laid out by backend: each
name is looked up where it lives now -- the launchers (:mod:`flashnb.kernels.launch.flash`), the kernels
(:mod:`flashnb.kernels.simt.forward`, :mod:`~flashnb.kernels.simt.backward`) and their blocks
(:mod:`~flashnb.kernels.simt.blocks`), tiles and block masks (:mod:`flashnb.kernels.launch.fit`), traffic models
(:mod:`flashnb.kernels.models.simt`), the tile states (:mod:`flashnb.kernels.policies`) and the SASS time model's
inputs (:mod:`flashnb.instruments.sass_inputs.flash`)."""

import importlib

HOMES = ("flashnb.kernels.launch.flash", "flashnb.kernels.simt.forward", "flashnb.kernels.simt.backward",
         "flashnb.kernels.launch.fit", "flashnb.kernels.models.simt", "flashnb.kernels.simt.blocks",
         "flashnb.kernels.policies", "flashnb.instruments.sass_inputs.flash")


_NAMES = ("make_forward", "make_backward", "make_preprocess", "make_convert", "forward", "backward",
          "default_tiles", "bwd_default_tiles", "mask_tiles", "prepare_block_mask", "PreparedMask", "tiles_visited",
          "model_forward", "model_backward", "itemsizes", "model_bytes", "sass_config", "sass_shape", "launch_order",
          "last_forward", "EMPTY", "FULL", "PARTIAL")
__all__ = list(_NAMES)                           # the names the module had (each forwarded)


def __getattr__(name):
    if name.startswith("__"):                    # a module's own attributes (no __path__: not a package)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    for home in HOMES:
        module = importlib.import_module(home)
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted({n for home in HOMES for n in dir(importlib.import_module(home))})
