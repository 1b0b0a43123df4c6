"""Exercises of notebook 04 (FlashAttention-1's backward: recompute instead of remember)."""

from __future__ import annotations

import math

import numpy as np

from . import Wrong, close, exercise, require


def _tiles(d, M):
    from ..stages import fa1

    t = fa1.tiles(d, M=M, check_fit=False)
    return t["Br"], t["Bc"]


def _total(model) -> int:
    """Global elements read + written (atomics count once) over the launches of a model."""
    return sum(sum(x["reads"].values()) + sum(x["writes"].values()) + sum(x.get("atomics", {}).values())
               for x in model)


def _per_array(model) -> dict:
    """{("reads" | "writes", array): elements} summed over the launches of a model (shared counts ignored)."""
    out: dict = {}
    for launch in model:
        for kind in ("reads", "writes"):
            for name, n in launch.get(kind, {}).items():
                if n:
                    out[(kind, name)] = out.get((kind, name), 0) + int(n)
    return out


def _compare_models(yours, truth, where):
    try:
        mine = _per_array(yours)
    except (TypeError, AttributeError, KeyError):
        raise Wrong("your function must return a list of launch dicts with 'reads' and 'writes' "
                    "({array: elements}), like fa1.model_backward") from None
    for key in sorted(set(mine) | set(truth)):
        a, b = mine.get(key, 0), truth.get(key, 0)
        if a != b:
            raise Wrong(f"{key[0]} of {key[1]} at {where}: yours are too {'many' if a > b else 'few'}")


# --------------------------------------------------------------------------- 04.1


def _model_with_D(BH, Nq, Nk, d, M):
    """FA1's backward with D = rowsum(dO ∘ O) computed once by a kernel of its own (the truth for 04.1)."""
    from ..stages import fa1

    truth = _per_array(fa1.model_backward(BH, Nq, Nk, d, M=M, check_fit=False))
    Tc = math.ceil(Nk / _tiles(d, M)[1])
    truth[("reads", "O")] -= BH * Tc * Nq * d            # O_i no longer read at every outer step ...
    truth[("reads", "D")] = BH * Tc * Nq                 # ... D_i is, one number per row
    truth[("reads", "O")] += BH * Nq * d                 # the D kernel reads O and dO once
    truth[("reads", "dO")] += BH * Nq * d
    truth[("writes", "D")] = BH * Nq
    return {k: v for k, v in truth.items() if v}


_SIZES_04 = [(1, 64, 64, 16, 1024), (2, 100, 48, 32, 4096), (1, 256, 256, 64, 4096)]


@exercise("04.1", "D once, not Tc times", level=2, minutes=20,
          hint="""Start from fa1.model_backward(BH, Nq, Nk, d, M=M) (a list of launch dicts) and edit it: the main
          launch no longer reads O (Tc·Nq·d per head) but reads D_i with every L_i (Tc·Nq); add a launch that
          reads O and dO once (Nq·d each) and writes D (Nq). Tc = ceil(Nk / fa1.tiles(d, M=M)["Bc"]).""",
          explain="""D_i = dO_i · O_i needs O only through a dot product per row. Computed in a kernel of its own
          (FA2's preprocessing, Alg. 2 line 4), it costs one pass over O and dO (2·Nq·d reads, Nq writes); the
          backward then reads D_i (one number per row) instead of O_i (d numbers per row) at each of its Tc
          outer steps: Tc·Nq·d reads of O disappear, Tc·Nq reads of D appear. O drops out of the main loop
          entirely -- the backward needs O only for D.""")
def check_04_1(model):
    """model(BH, Nq, Nk, d, M): the launches of FA1's backward with D precomputed (like fa1.model_backward)."""
    require(callable(model), "model must be a function (BH, Nq, Nk, d, M) -> list of launch dicts")
    for BH, Nq, Nk, d, M in _SIZES_04:
        _compare_models(model(BH, Nq, Nk, d, M), _model_with_D(BH, Nq, Nk, d, M),
                        f"(BH, Nq, Nk, d, M) = {(BH, Nq, Nk, d, M)}")


@check_04_1.solves
def _():
    from flashnb import common
    from flashnb.stages import fa1

    def model_backward_with_D(BH, Nq, Nk, d, M):
        launches = fa1.model_backward(BH, Nq, Nk, d, M=M, check_fit=False)
        Tc = common.cdiv(Nk, fa1.tiles(d, M=M, check_fit=False)["Bc"])
        main = launches[1]
        main["reads"].pop("O")                           # O_i is not needed in the loop any more ...
        main["reads"]["D"] = BH * Tc * Nq                # ... D_i is read with L_i at every outer step
        pre = dict(launch="D = rowsum(dO∘O)", reads={"O": BH * Nq * d, "dO": BH * Nq * d},
                   writes={"D": BH * Nq}, atomics={})
        return [pre] + launches

    return dict(model=model_backward_with_D)


@check_04_1.fails
def _():
    from flashnb.stages import fa1

    def d_still_per_tile(BH, Nq, Nk, d, M):             # the D kernel added, but O still read in the loop
        pre = dict(reads={"O": BH * Nq * d, "dO": BH * Nq * d}, writes={"D": BH * Nq})
        return [pre] + fa1.model_backward(BH, Nq, Nk, d, M=M, check_fit=False)

    return dict(model=d_still_per_tile)


# --------------------------------------------------------------------------- 04.2


def _paper(N, d, M):
    Tc = math.ceil(N / _tiles(d, M)[1])
    return 4 * N * d + 5 * Tc * N * d + 2 * Tc * N


@exercise("04.2", "the checkpoint's size: l and m instead of L", level=1, minutes=10,
          hint="""Total the global reads and writes of fa1.model_backward(1, N, N, d, M=M) (one head); storing l and
          m instead of L means the backward reads one more vector of N numbers at each of its Tc outer steps.
          Then subtract the paper's 4Nd + 5·Tc·N·d + 2·Tc·N (Tc = ceil(N / fa1.tiles(d, M=M)["Bc"])).""",
          explain="""The backward reads L_i at every outer step: Tc·N reads. Reading l_i and m_i instead doubles that
          term, 2·Tc·N, which is the paper's. What is left between the model and the paper is N·d: the dQ = 0
          initialisation (Alg. 4 line 5), which the paper's count of the main loop leaves out. Either way the
          statistics are a small term: 2·Tc·N against 5·Tc·N·d.""")
def check_04_2(model_lm, gap):
    """model_lm(N, d, M): global elements of FA1's backward (one head, Nq = Nk = N) storing l and m instead of L;
    gap(N, d, M): model_lm minus the paper's 4Nd + 5TcNd + 2TcN."""
    from ..stages import fa1

    require(callable(model_lm) and callable(gap), "model_lm and gap must be functions (N, d, M) -> a number")
    for N, d, M in [(64, 16, 1024), (200, 32, 4096), (4096, 64, 4096), (1000, 128, 16384)]:
        Tc = math.ceil(N / _tiles(d, M)[1])
        truth = _total(fa1.model_backward(1, N, N, d, M=M, check_fit=False)) + Tc * N
        close(model_lm(N, d, M), truth, what=f"model_lm({N}, {d}, {M})")
        close(gap(N, d, M), truth - _paper(N, d, M), what=f"gap({N}, {d}, {M})")


@check_04_2.solves
def _():
    from flashnb import common
    from flashnb.stages import fa1

    def total(model):
        return sum(sum(x["reads"].values()) + sum(x["writes"].values()) for x in model)

    def model_lm(N, d, M):
        Tc = common.cdiv(N, fa1.tiles(d, M=M, check_fit=False)["Bc"])
        return total(fa1.model_backward(1, N, N, d, M=M, check_fit=False)) + Tc * N   # m next to l (was L)

    def gap(N, d, M):
        Tc = common.cdiv(N, fa1.tiles(d, M=M, check_fit=False)["Bc"])
        return model_lm(N, d, M) - (4 * N * d + 5 * Tc * N * d + 2 * Tc * N)          # = N·d: dQ = 0

    return dict(model_lm=model_lm, gap=gap)


@check_04_2.fails
def _():
    from flashnb import common
    from flashnb.stages import fa1

    def model_lm(N, d, M):                                # l and m counted on top of L: one vector too many
        Tc = common.cdiv(N, fa1.tiles(d, M=M, check_fit=False)["Bc"])
        return _total(fa1.model_backward(1, N, N, d, M=M, check_fit=False)) + 2 * Tc * N

    return dict(model_lm=model_lm, gap=lambda N, d, M: 0)


# --------------------------------------------------------------------------- 04.3


def _swapped(N, d, M):
    Br, _ = _tiles(d, M)
    Tr = math.ceil(N / Br)
    return (2 * N * d                        # dK = dV = 0
            + 3 * N * d + N                  # Q_i, O_i, dO_i, L_i once
            + Tr * 4 * N * d                 # K_j, V_j, dK_j, dV_j read at every outer step
            + Tr * 2 * N * d                 # dK_j, dV_j written at every outer step
            + N * d)                         # dQ_i written once


@exercise("04.3", "dQ in HBM: swap the loops?", level=2, minutes=20,
          hint="""With the outer loop over query blocks i (Tr = ceil(N / Br) of them, Br = fa1.tiles(d, M=M)["Br"]),
          Q_i, O_i, dO_i, L_i stay on chip and dQ_i is written once. What must the inner loop over key blocks j
          now read and write at every outer step? Count those as Tr·N·d each, plus a dK = dV = 0 initialisation.""",
          explain="""Swapping the loops moves the read-modify-write from dQ to dK and dV: the outer step owns Q_i and
          finishes dQ_i on chip, but every key block's dK_j, dV_j receives a contribution from every query block, so
          they must be read and written back (plus K_j, V_j read) Tr times: 6·Tr·N·d instead of 5·Tc·N·d. With
          FA1's tiles (Br = Bc = 16 at d = 64, M = 4096) that is *more* traffic, not less: one RMW array (dQ, 2
          accesses + Q, O, dO: 5 per step) is traded for two (dK, dV, 4 accesses + K, V: 6 per step). FA2 keeps the
          K/V-outer order and makes the dQ update an atomic add instead (notebook 06); the Q-outer order with
          atomics on dK, dV would need two atomic arrays.""")
def check_04_3(swapped_total, rmw_arrays):
    """swapped_total(N, d, M): global elements of the loop-swapped backward (one head, Nq = Nk = N, as the
    notebook states the assumptions); rmw_arrays: the arrays it must read-modify-write in HBM."""
    require(callable(swapped_total), "swapped_total must be a function (N, d, M) -> a number")
    for N, d, M in [(64, 16, 1024), (256, 64, 4096), (4096, 64, 4096), (1000, 32, 16384)]:
        close(swapped_total(N, d, M), _swapped(N, d, M), what=f"swapped_total({N}, {d}, {M})")
    require(isinstance(rmw_arrays, (set, frozenset, list, tuple)), "rmw_arrays must be a set of array names")
    require(set(rmw_arrays) == {"dK", "dV"}, "rmw_arrays is not right: which gradients now receive a contribution "
            "from every outer step?")


@check_04_3.solves
def _():
    from flashnb import common
    from flashnb.stages import fa1

    def swapped_total(N, d, M):
        Tr = common.cdiv(N, fa1.tiles(d, M=M, check_fit=False)["Br"])
        init = 2 * N * d                      # dK = dV = 0
        once = 3 * N * d + N + N * d          # Q, O, dO, L read once; dQ written once
        per_outer = 4 * N * d + 2 * N * d     # K, V, dK, dV read; dK, dV written -- at each of the Tr steps
        return init + once + Tr * per_outer

    return dict(swapped_total=swapped_total, rmw_arrays={"dK", "dV"})


@check_04_3.fails
def _():
    from flashnb import common
    from flashnb.stages import fa1

    def swapped_total(N, d, M):                           # forgot that dK, dV must be read back before the add
        Tr = common.cdiv(N, fa1.tiles(d, M=M, check_fit=False)["Br"])
        return 2 * N * d + 4 * N * d + N + Tr * 4 * N * d

    return dict(swapped_total=swapped_total, rmw_arrays={"dQ"})


# --------------------------------------------------------------------------- 04.4


def _fa1_memory_fp16(B, H, N, d) -> float:
    """FA1's forward + backward peak bytes at fp16, from its own allocations (as notebook 04's table)."""
    from .. import common
    from ..stages import fa1

    S = common.ShapeOnly
    x = S((B * H, N, d))
    fwd = common.dry_run(fa1.forward, x, x, x, causal=False, scale=0.125)
    bwd = common.dry_run(fa1.backward, x, x, x, x, S((B * H, N)), x, causal=False, scale=0.125)
    kept = x.nbytes + S((B * H, N)).nbytes
    return (4 * x.nbytes + max(sum(a.nbytes for a in fwd), kept + sum(a.nbytes for a in bwd))) / 2


@exercise("04.4", "the dropout mask FA1 does not store", level=1, minutes=10,
          hint="""The memory table is batch 16, 8 heads, d = 64. One boolean per (query, key) pair and head, one byte
          per boolean (NumPy's bool). Compare with FA1's own fp16 bytes at N = 16K: memory(fa1, 16, 8, 16384, 64) / 2
          in the notebook's memory() function.""",
          explain="""16 · 8 · 16384² one-byte booleans are 32 GiB -- about 16 times FA1's whole forward + backward
          (about 2 GiB in fp16 at 16K): storing the mask would bring back exactly the N² memory that recomputation
          removed. Packing 8 booleans per byte still leaves 4 GiB. Algorithm 4 keeps only the RNG state (a few
          bytes) and regenerates the mask tile by tile in the backward.""")
def check_04_4(mask_bytes, times_fa1):
    """mask_bytes: bytes of one-byte booleans for an N x N mask per head at N = 16384 (batch 16, 8 heads);
    times_fa1: mask_bytes divided by FA1's forward + backward memory there (fp16 bytes, as the table)."""
    truth = 16 * 8 * 16384 ** 2
    close(mask_bytes, truth, rel=1e-3, what="mask_bytes")
    close(times_fa1, truth / _fa1_memory_fp16(16, 8, 16384, 64), rel=0.02, what="times_fa1")


@check_04_4.solves
def _():
    from flashnb import common
    from flashnb.stages import fa1

    B, H, N, d = 16, 8, 16384, 64
    mask_bytes = B * H * N * N * np.dtype(bool).itemsize
    S = common.ShapeOnly
    x = S((B * H, N, d))
    fwd = common.dry_run(fa1.forward, x, x, x, causal=False, scale=0.125)
    bwd = common.dry_run(fa1.backward, x, x, x, x, S((B * H, N)), x, causal=False, scale=0.125)
    kept = x.nbytes + S((B * H, N)).nbytes
    fa1_fp16 = (4 * x.nbytes + max(sum(a.nbytes for a in fwd), kept + sum(a.nbytes for a in bwd))) / 2
    return dict(mask_bytes=mask_bytes, times_fa1=mask_bytes / fa1_fp16)


@check_04_4.fails
def _():
    return dict(mask_bytes=16 * 8 * 16384 ** 2 / 8, times_fa1=8.0)     # bits, not bytes


# --------------------------------------------------------------------------- 04.5


@exercise("04.5", "finite differences in float32", level=2, minutes=20,
          hint="""Put q ± ε·u for several ε (10⁻¹ … 10⁻⁶) into the leading axis of one batch and run
          flashnb.attention_forward(..., impl="fa1") once; φ = sum(O ∘ dO) per batch entry, in float64 on the host.
          Compare (φ₊ - φ₋)/2ε with the float64 reference's <dq, u>. Where is the error smallest?""",
          explain="""The central difference has truncation error ~ ε²·|φ'''|/6 and rounding error ~ u·|φ|/ε, where u is
          the precision φ is computed in: float32, u = 2⁻²⁴ ≈ 6·10⁻⁸. Their sum is smallest near ε ~ u^(1/3) ≈ 4·10⁻³
          (for O(1) inputs), where the error is ~ u^(2/3) ≈ 10⁻⁵ relative -- much worse than float64's 10⁻¹⁰. The
          notebook's ε = 10⁻⁵ is right for the float64 reference (u^(1/3) ≈ 6·10⁻⁶) and far too small for a float32
          forward: there rounding error dominates, ~ 6·10⁻⁸/10⁻⁵ ≈ 0.6 % of φ's size.""")
def check_04_5(eps_best):
    """eps_best: the step ε at which a central difference of a float32 φ is most accurate (order of magnitude)."""
    try:
        e = float(eps_best)
    except (TypeError, ValueError):
        raise Wrong(f"eps_best must be a number, got {eps_best!r}") from None
    require(e > 0 and math.isfinite(e), "eps_best must be a positive number")
    close(math.log10(e), math.log10(2.0 ** (-24 / 3)), abs=0.75, what="log10(eps_best)")


@check_04_5.solves
def _():
    import flashnb
    from flashnb import reference

    rng = np.random.default_rng(45)
    q, k, v, do = (rng.standard_normal((8, 4)) for _ in range(4))
    u = rng.standard_normal(q.shape)
    eps = 10.0 ** -np.arange(1, 7)                               # 10⁻¹ ... 10⁻⁶
    qs = np.stack([q + s * e * u for e in eps for s in (1, -1)])  # all 12 forwards in one launch
    rep = lambda x: np.broadcast_to(x, qs.shape)                  # noqa: E731
    o, _ = flashnb.attention_forward(qs, rep(k), rep(v), causal=True, impl="fa1", Br=8, Bc=4, warps=1)
    phi = (o.astype(np.float64) * do).sum(axis=(1, 2)).reshape(len(eps), 2)
    fd = (phi[:, 0] - phi[:, 1]) / (2 * eps)
    exact = np.sum(reference.attention_backward(q, k, v, do, causal=True)[0] * u)
    return dict(eps_best=eps[np.argmin(np.abs(fd - exact))])


@check_04_5.fails
def _():
    return dict(eps_best=1e-5)     # the float64 step of the notebook's check
