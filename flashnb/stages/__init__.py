"""The stages: teaching kernels, one idea each, in the order the notebooks teach them.

| stage | module | what it teaches |
|---|---|---|
| 1 | :mod:`~flashnb.stages.naive` | standard attention: S and P round-trip HBM |
| 2 | :mod:`~flashnb.stages.softmax` | unsafe, safe 3-pass and online 2-pass softmax; one-pass attention |
| 3 | :mod:`~flashnb.stages.fa1` | FlashAttention-1: tiling, split-K warps, recomputation |
| 4 | :mod:`~flashnb.stages.fa2`, :mod:`~flashnb.stages.fa2_steps` | FlashAttention-2 and its ladder |
| 5 | :mod:`~flashnb.stages.block_sparse` | block-sparse FlashAttention: skipped blocks are never loaded |
| 6 | :mod:`~flashnb.stages.fa2_fast`, :mod:`~flashnb.stages.fa2_fast_steps` | from readable to fast |
| 7 | :mod:`~flashnb.stages.tensor_cores` | FA2's forward on tensor cores: mma.sync, ldmatrix, cp.async |

The product kernel every call runs by default is not a lesson: it lives in :mod:`flashnb.kernels`.
"""


def __getattr__(name):
    """A submodule not imported yet (``import flashnb`` defers them), imported on first use as an attribute."""
    import importlib
    import importlib.util

    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
