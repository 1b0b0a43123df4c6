"""Analytic traffic models of the product kernels: element accesses per launch, equal to the traffic counter's.

The old module ``flashnb.kernels.models`` was the CUDA-core kernels' (:mod:`.simt`): its names are looked up there.
"""


def __getattr__(name):
    import importlib

    if name.startswith("__"):
        raise AttributeError(name)
    return getattr(importlib.import_module("flashnb.kernels.models.simt"), name)
