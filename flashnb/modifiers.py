"""Old name of :mod:`flashnb.kernels.policies.modifier_keys` (a modifier as a value: snapshots, keys, the launch
check), kept for imports from before the modifiers policy lived with the kernels' other policies."""

import importlib


def __getattr__(name):
    return getattr(importlib.import_module("flashnb.kernels.policies.modifier_keys"), name)


def __dir__():
    return dir(importlib.import_module("flashnb.kernels.policies.modifier_keys"))
