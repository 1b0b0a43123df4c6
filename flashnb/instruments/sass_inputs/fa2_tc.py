"""The SASS time model's inputs for fa2-tc (``"fa2_tc.forward"``, ``"fa2_tc.backward"``):
:func:`flashnb.instruments.sass_model.forward_time` and ``backward_time`` read them from here."""

from __future__ import annotations

from ...common import causal_diag, cdiv
from ...kernels.launch.tensorcore import _bwd_tiles, _tiles
from ...kernels.models.tensorcore import hbm_bytes, model_backward, model_forward
from ...kernels.tensorcore.geometry import BWD_LABEL, bwd_geometry, geometry

__all__ = ["sass_config", "model_options", "sass_shape", "launch_order", "edge_tile", "bwd_sass_config",
           "bwd_model_options", "bwd_sass_shape", "bwd_launch_order", "bwd_edge_tile", "model_forward",
           "model_backward", "hbm_bytes", "BWD_LABEL"]


def sass_config(d, causal, storage="float16", Br=None, Bc=None, warps=None, arch=80) -> dict:
    """The forward kernel's configuration at head dim ``d`` (default tiles unless given)."""
    t = _tiles(storage, d, Br, Bc, warps, arch)
    return dict(Br=t["Br"], Bc=t["Bc"], d=d, warps=t["warps"], causal=bool(causal), storage=storage, arch=arch)



def model_options(config) -> dict:
    return {k: config[k] for k in ("Br", "Bc", "warps", "storage", "arch")}



def sass_shape(config) -> dict:
    """Per warp and K/V tile: the HMMAs of ``S = Q_i K_jᵀ`` (``MT·NB·KD``) and of ``P V_j`` (``MT·ND·KV``; sm_75:
    twice each, two m16n8k8 per k-step); the 32-bit words a thread copies per tile (K_j, V_j: 4 per cp.async
    chunk), in the prologue (Q_i) and the epilogue (O_i's halves, L)."""
    g = geometry(config["storage"], config["d"], config["Br"], config["Bc"], config["warps"], config["arch"])
    twice = 2 if config["arch"] == 75 else 1
    chunk_words = 4                                   # a 16-byte chunk
    per = lambda rows: cdiv(rows * (g["Dp"] // g["E"]), g["threads"]) * chunk_words
    if g["copy"] == "sync":
        per = lambda rows: cdiv(rows * g["Dp"], g["threads"]) * (g["itemsize"] // 4 or 1)
    return dict(phases=(twice * g["MT"] * g["NB"] * g["KD"], twice * g["MT"] * g["ND"] * g["KV"]),
                tile_loads=2 * per(config["Bc"]), prologue_loads=per(config["Br"]),
                epilogue_stores=g["MT"] * g["ND"] * 4)



def launch_order(Tr, causal):
    """The Q block each ``blockIdx.x`` computes, in launch order: heavy first when causal (as the kernel does)."""
    return list(range(Tr))[::-1] if causal else list(range(Tr))



def edge_tile(v, config, Nq, Nk) -> bool:
    """Whether the forward computes tile ``v = (i, j, rows, cols)`` (:func:`flashnb.stages.fa2.tiles_visited`) in its
    masked loop: the tile reaches past ``Nk`` or, causal, past the diagonal of the block's first row."""
    i, j = v[0], v[1]
    Br, Bc = config["Br"], config["Bc"]
    n_full = Nk // Bc
    if config["causal"]:
        n_full = min(n_full, max(0, (i * Br + causal_diag(config["causal"], Nq, Nk) + 1) // Bc))
    return j >= n_full



def bwd_sass_config(d, causal, storage="float16", Br=None, Bc=None, warps=None) -> dict:
    """The backward kernel's configuration at head dim ``d`` (default tiles unless given)."""
    t = _bwd_tiles(storage, d, Br, Bc, warps)
    return dict(Br=t["Br"], Bc=t["Bc"], d=d, warps=t["warps"], causal=bool(causal), storage=storage,
                dynamic=t["dynamic"])



def bwd_model_options(config) -> dict:
    return {k: config[k] for k in ("Br", "Bc", "warps", "storage")}



def bwd_sass_shape(config) -> dict:
    """Per warp and Q tile: the HMMAs of dQ_i's parts (the one phase that may stay a loop: listed first), then of
    Sᵀ, dPᵀ (``NQ·KD`` each) and of dV_j, dK_j (``ND·KQ`` each); the words a thread copies per tile (Q_i, dO_i: 4
    per chunk; L_i, D_i), in the prologue (K_j, V_j) and the epilogue (dK_j, dV_j)."""
    g = bwd_geometry(config["storage"], config["d"], config["Br"], config["Bc"], config["warps"])
    chunks = lambda rows: cdiv(rows * (g["Dp"] // g["E"]), g["threads"]) * 4
    dq = g["IPW"] * g["KK"] * g["NDQ"]
    return dict(phases=(dq, g["NQ"] * g["KD"], g["NQ"] * g["KD"], g["ND"] * g["KQ"], g["ND"] * g["KQ"]),
                tile_loads=2 * chunks(config["Br"]) + 2, prologue_loads=2 * chunks(config["Bc"]),
                epilogue_stores=2 * g["ND"] * 4)



def bwd_launch_order(Tc, causal):
    """The K/V block each ``blockIdx.x`` computes: block ``j`` as ``j`` (causal: the first blocks, which see the
    most Q tiles, go first already)."""
    return list(range(Tc))



def bwd_edge_tile(v, config, Nq, Nk) -> bool:
    """Whether the backward computes tile ``v = (j, i, rows, cols)`` in its masked loop (it crosses the diagonal)."""
    if not config["causal"]:
        return False
    j, i = v[0], v[1]
    diag = causal_diag(config["causal"], Nq, Nk)
    return i * config["Br"] + diag < j * config["Bc"] + config["Bc"] - 1

