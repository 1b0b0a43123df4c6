"""flashnb's kernels beyond the stages' lessons, laid out by feature and by backend.

* :mod:`flashnb.kernels.policies`: the features as small device-function policies every loop calls at the same
  place, one per file (storage, block mask, modifiers, dropout, GQA, K/V rows, the causal tile range).
* :mod:`flashnb.kernels.simt`: the product kernels on CUDA cores -- the fast loop's building blocks
  (:mod:`~flashnb.kernels.simt.blocks`, shared with stage 6's lessons), the forward and the backward.
* :mod:`flashnb.kernels.tensorcore`: the product kernels on tensor cores -- the intrinsics (``tensorcore.mma``, with
  simulator twins), their GPU check (``tensorcore.check``), fragment layouts, geometry, the forward and the backward
  in its phases (``impl="fa2-tc"``).
* :mod:`flashnb.kernels.launch`: the host launchers (``impl="flash"``: :mod:`~flashnb.kernels.launch.flash`;
  ``impl="fa2-tc"``: :mod:`~flashnb.kernels.launch.tensorcore`; flash-decoding) and the tile fitting both backends
  share (:mod:`~flashnb.kernels.launch.fit`); :mod:`flashnb.kernels.models`: the traffic models.
* :mod:`flashnb.kernels.decode`: flash-decoding's kernels (split K/V, merge, append).
* The default, ``impl="auto"`` (:mod:`flashnb.kernels.auto`): fa2-tc for half inputs on a checked sm_80+ GPU,
  else the product kernel.

The modules' old names (``flashnb.kernels.flash``, ``.flash_tc``, ``.mma``, ``.mma_check``, ``.blocks``, ``.tiles``,
``.models``) still import and give the names they had.

Importing the package imports none of its modules: the building blocks a lesson imports (``tensorcore.mma``,
``simt.blocks``, ``policies.tiles``) bring nothing above them, and the modules that register an impl are imported
when the impl is first asked for (:data:`flashnb.registry.IMPL_MODULES`).
"""


def __getattr__(name):
    """A submodule not imported yet (an old name, or one ``import flashnb`` defers), imported on first use as an
    attribute."""
    import importlib
    import importlib.util

    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
