"""Old name of :mod:`flashnb.kernels.simt.blocks` (the fast loop's building blocks), kept for imports from before
the kernels were laid out by backend."""

import importlib


def __getattr__(name):
    return getattr(importlib.import_module("flashnb.kernels.simt.blocks"), name)


def __dir__():
    return dir(importlib.import_module("flashnb.kernels.simt.blocks"))
