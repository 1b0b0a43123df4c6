"""Stage 7 -- the old name of fa2-tc's module: its names now live in :mod:`flashnb.kernels.tensorcore` (the
kernels, by part) and :mod:`flashnb.kernels.launch.tensorcore` (the launchers, ``impl="fa2-tc"``); ``flash_tc.X``
finds ``X`` there.  The SASS time model's inputs moved to :mod:`flashnb.instruments.sass_inputs.fa2_tc`,
``measure_gpu`` to :mod:`flashnb.instruments.measure.tensor_cores`."""

import importlib

_HOMES = ("flashnb.kernels.launch.tensorcore", "flashnb.kernels.tensorcore.forward",
          "flashnb.kernels.tensorcore.backward", "flashnb.kernels.tensorcore.geometry",
          "flashnb.kernels.tensorcore.fragments", "flashnb.kernels.models.tensorcore")
_STUDIES = {"sass_config": "sass_inputs.fa2_tc", "model_options": "sass_inputs.fa2_tc", "sass_shape":
            "sass_inputs.fa2_tc", "launch_order": "sass_inputs.fa2_tc", "edge_tile": "sass_inputs.fa2_tc",
            "bwd_sass_config": "sass_inputs.fa2_tc", "bwd_model_options": "sass_inputs.fa2_tc",
            "bwd_sass_shape": "sass_inputs.fa2_tc", "bwd_launch_order": "sass_inputs.fa2_tc",
            "bwd_edge_tile": "sass_inputs.fa2_tc", "measure_gpu": "measure.tensor_cores"}


def __getattr__(name):
    if name in _STUDIES:     # an old name only: the library itself imports these from their homes
        return getattr(importlib.import_module(f"flashnb.instruments.{_STUDIES[name]}"), name)
    for home in _HOMES:
        module = importlib.import_module(home)
        if name in vars(module):
            return vars(module)[name]
    raise AttributeError(f"module 'flashnb.kernels.flash_tc' has no attribute {name!r}")
