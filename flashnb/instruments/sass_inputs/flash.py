"""The SASS time model's inputs for the product kernel's forward (``"flash.forward"``,
:func:`flashnb.instruments.sass_model.forward_time`): its configuration, per-thread shape and launch order, with the
traffic models the model reads (:mod:`flashnb.kernels.models.simt`)."""

from __future__ import annotations

from ...common import cdiv
from ...kernels.launch.fit import _tiles
from ...kernels.models.simt import model_backward, model_bytes, model_forward  # noqa: F401  (the model reads them)
from ...kernels.policies.tiles import heavy_first
from ...kernels.simt.blocks import geometry

__all__ = ["sass_config", "sass_shape", "launch_order", "model_forward", "model_backward", "model_bytes"]


def sass_config(d, causal, Br=None, Bc=None, warps=None, **features) -> dict:
    """The forward kernel's configuration at head dim ``d`` (default tiles unless given), with ``features`` (the
    factory's keyword arguments: ``storage``, ``sparse``, ``score_mod``, ``mask_mod``, ``H``, ``gqa``,
    ``dropout``)."""
    t = _tiles("forward", d, Br, Bc, warps, scored=features.get("score_mod") is not None)
    return dict(Br=t["Br"], Bc=t["Bc"], d=d, warps=t["warps"], causal=bool(causal), dynamic=t["dynamic"], **features)


def sass_shape(config):
    """The fields of a :class:`flashnb.instruments.sass_model.KernelShape` for the forward kernel, per thread: FFMAs of
    line 8 (``TM·TN·Dp``) and line 10 (``TM·DN·Bc``) per K/V tile; K_j and V_j words copied (``2·Bc·Dp`` over the
    block's threads), Q_i's; the O_i words stored row by row, and L; with dropout or a ``mask_mod``, one trip of their
    element loops per element of a lane (``TM·TN``; an upper bound for ``mask_mod``, which runs on PARTIAL tiles
    only)."""
    g = geometry(config["Br"], config["Bc"], config["d"], config["warps"])
    NT, Dp, Bc, Br = g["threads"], g["Dp"], config["Bc"], config["Br"]
    element = config.get("dropout") or config.get("mask_mod") is not None    # Philox, mask_mod: one trip each
    return dict(phases=(g["TM"] * g["TN"] * Dp, g["TM"] * g["DN"] * Bc), tile_loads=cdiv(2 * Bc * Dp, NT),
                prologue_loads=cdiv(Br * Dp, NT), epilogue_stores=cdiv(Br * Dp, NT) + g["TM"],
                element_loops=g["TM"] * g["TN"] if element else 0)


def launch_order(Tr, causal):
    """The Q block each ``blockIdx.x`` computes, in launch order: with a causal mask the heaviest first."""
    return [heavy_first.py_func(b, Tr, bool(causal)) for b in range(Tr)]   # (the kernels' own order)
