"""Old name of :mod:`flashnb.kernels.launch.fit` (the product kernels' tiles and block masks on them), kept for
imports from before the kernels were laid out by backend."""

import importlib


def __getattr__(name):
    return getattr(importlib.import_module("flashnb.kernels.launch.fit"), name)


def __dir__():
    return dir(importlib.import_module("flashnb.kernels.launch.fit"))
