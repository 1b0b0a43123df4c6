"""Exercises of notebook 06 (FlashAttention-2's backward: recompute, column blocks, dQ by atomics)."""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32  # module globals: the simulator swaps `cuda` in a kernel's globals only

from . import Wrong, close, exercise, require, require_gpu_ready, require_kernel, require_traffic


def _total(model) -> int:
    return sum(sum(x["reads"].values()) + sum(x["writes"].values()) + sum(x.get("atomics", {}).values())
               for x in model)


# --------------------------------------------------------------------------- 06.1


def _extra_traffic(Nq, Nk, d, Br, Bc):
    """Buffer design minus atomic design, from fa2.model_backward (non-causal, one head, atomics count once)."""
    from ..stages import fa2

    model = fa2.model_backward(1, Nq, Nk, d, Br=Br, Bc=Bc, warps=1)
    atomic = _total(model)
    pre, main = model
    partials = main["atomics"]["dQ"]                 # each atomic add becomes a plain store into the buffer
    buffered = (atomic - pre["writes"]["dQ"]         # no dQ = 0 needed: the reduction writes dQ
                + partials                           # the reduction reads every partial ...
                + Nq * d)                            # ... and writes dQ once
    return buffered - atomic


@exercise("06.1", "dQ without atomics: a buffer per column block", level=2, minutes=20,
          hint="""Start from fa2.model_backward(1, Nq, Nk, d, Br=Br, Bc=Bc, warps=1) (non-causal). In the buffer design
          every column block stores its partial dQ_i (the atomics become plain stores, same count), the
          preprocessing no longer zeroes dQ, and a reduction kernel reads the Tc partials of every row and writes
          dQ once. What is left of the difference?""",
          explain="""The atomics (Tc·Nq·d, one per partial) become Tc·Nq·d plain stores into a (Tc, Nq, d) buffer; the
          reduction then reads all of them back and writes Nq·d, while the dQ = 0 initialisation (Nq·d) goes away:
          Tc·Nq·d more element accesses, about a third more for the whole backward at N = 4096 (Q and dO are read
          Tc·Nq·d each as well). The buffer itself holds Tc copies of dQ -- 128 at N = 4096, Bc = 32 -- so it is
          worth it only when a deterministic dQ (the same bits every run, independent of the order the atomics
          land in) matters more than memory and a third more traffic.""")
def check_06_1(extra_traffic, fraction):
    """extra_traffic(Nq, Nk, d, Br, Bc): element accesses the buffer design adds to the atomic one (non-causal,
    one head); fraction: that extra over the atomic design's total at Nq = Nk = 4096, d = 64, Br = Bc = 32."""
    require(callable(extra_traffic), "extra_traffic must be a function (Nq, Nk, d, Br, Bc) -> a number")
    for Nq, Nk, d, Br, Bc in [(64, 64, 16, 16, 16), (100, 40, 32, 16, 8), (4096, 4096, 64, 32, 32)]:
        close(extra_traffic(Nq, Nk, d, Br, Bc), _extra_traffic(Nq, Nk, d, Br, Bc),
              what=f"extra_traffic({Nq}, {Nk}, {d}, {Br}, {Bc})")
    from ..stages import fa2

    atomic = _total(fa2.model_backward(1, 4096, 4096, 64, Br=32, Bc=32, warps=1))
    close(fraction, _extra_traffic(4096, 4096, 64, 32, 32) / atomic, rel=0.01, what="fraction")


@check_06_1.solves
def _():
    from flashnb import common
    from flashnb.stages import fa2

    def extra_traffic(Nq, Nk, d, Br, Bc):
        Tc = common.cdiv(Nk, Bc)
        stores = Tc * Nq * d            # instead of as many atomic adds: no difference
        reduction = Tc * Nq * d + Nq * d
        no_init = -Nq * d               # the preprocessing no longer zeroes dQ
        return stores - Tc * Nq * d + reduction + no_init

    def total(model):
        return sum(sum(x["reads"].values()) + sum(x["writes"].values()) + sum(x["atomics"].values()) for x in model)

    atomic = total(fa2.model_backward(1, 4096, 4096, 64, Br=32, Bc=32, warps=1))
    return dict(extra_traffic=extra_traffic, fraction=extra_traffic(4096, 4096, 64, 32, 32) / atomic)


@check_06_1.fails
def _():
    return dict(extra_traffic=lambda Nq, Nk, d, Br, Bc: Nq * d, fraction=0.0)   # only the reduction's writes


# --------------------------------------------------------------------------- 06.2


@functools.lru_cache(maxsize=None)
def _counted_dS(Nq, Nk, d, Br, Bc):
    """(dSs reads, dSs writes, all shared reads) of fa2's main backward launch, and the tiles it visited."""
    from .. import api
    from ..instruments import traffic
    from ..stages import fa2

    rng = np.random.default_rng(62)
    q, do = (rng.standard_normal((1, Nq, d)) for _ in range(2))
    k, v = (rng.standard_normal((1, Nk, d)) for _ in range(2))
    o, lse = api.attention_forward(q, k, v, impl="fa2", Br=Br, Bc=Bc, warps=1)
    with traffic.count() as t:
        api.attention_backward(q, k, v, o, lse, do, impl="fa2", Br=Br, Bc=Bc, warps=1)
    main = next(lt for lt in t.launches if lt.label == "FA2 backward")
    n = len(fa2.tiles_visited(Nq, Nk, Br, Bc, False, "backward"))
    return main.shared_reads["dSs"], main.shared_writes["dSs"], sum(main.shared_reads.values()), n


@exercise("06.2", "the price of staging dS in shared memory", level=2, minutes=20,
          hint="""Run flashnb.attention_backward(..., impl="fa2", Br=16, Bc=16, warps=1) at Nq = 16, Nk = 32, d = 8 in
          `with traffic.count() as t:`; the launch labelled "FA2 backward" has per-array counts in
          lt.shared_reads / lt.shared_writes (dS is staged in "dSs"). Divide by the tiles it visits
          (fa2.tiles_visited(..., "backward")), then read fa2_bwd_tile and line 15 (show_source(fa2.make_backward,
          region="dq-update")) for the formula.""",
          explain="""Each visited tile writes dS once, Br·Bc elements (every thread its TM × TN micro-tile), and
          reads it Br·d·Bc times: line 15 forms each of the Br·d elements of dQ_i += dS K_j from a column of Bc
          values of dS. That is as many shared reads as dQ's FMAs, one per FMA (K_j comes from shared memory
          too) -- the same Br·Bc·d as the S or dP product, but without register reuse: about a quarter of all the
          kernel's shared reads at Nq = 16, Nk = 32, d = 8. The dK_j, dV_j updates, by contrast, stay in registers:
          P and dS reach them by shuffles, and only dO_i, Q_i are read from shared memory, each value feeding
          TM FMAs.""")
def check_06_2(dS_per_tile, dS_share):
    """dS_per_tile(Br, Bc, d): (reads, writes) of the shared dS buffer per visited tile; dS_share: the fraction of
    the main backward launch's shared reads that read dS, at Nq = 16, Nk = 32, d = 8, Br = Bc = 16, warps = 1."""
    require(callable(dS_per_tile), "dS_per_tile must be a function (Br, Bc, d) -> (reads, writes)")
    for Nq, Nk, d, Br, Bc in [(16, 32, 8, 16, 16), (16, 16, 8, 8, 16)]:
        reads, writes, _, n = _counted_dS(Nq, Nk, d, Br, Bc)
        try:
            r, w = dS_per_tile(Br, Bc, d)
        except (TypeError, ValueError):
            raise Wrong("dS_per_tile must return a pair (reads, writes)") from None
        close(r, reads / n, what=f"reads of dS_per_tile({Br}, {Bc}, {d})")
        close(w, writes / n, what=f"writes of dS_per_tile({Br}, {Bc}, {d})")
    reads, _, total, _ = _counted_dS(16, 32, 8, 16, 16)
    close(dS_share, reads / total, abs=0.01, what="dS_share")


@check_06_2.solves
def _():
    import numpy as np

    import flashnb
    from flashnb.instruments import traffic
    from flashnb.stages import fa2

    def dS_per_tile(Br, Bc, d):
        return Br * d * Bc, Br * Bc       # line 15 reads a column of Bc per dQ element; each thread stores its dS

    rng = np.random.default_rng(0)
    q, do = (rng.standard_normal((1, 16, 8)) for _ in range(2))
    k, v = (rng.standard_normal((1, 32, 8)) for _ in range(2))
    o, lse = flashnb.attention_forward(q, k, v, impl="fa2", Br=16, Bc=16, warps=1)
    with traffic.count() as t:
        flashnb.attention_backward(q, k, v, o, lse, do, impl="fa2", Br=16, Bc=16, warps=1)
    main = next(lt for lt in t.launches if lt.label == "FA2 backward")
    assert main.shared_reads["dSs"] == len(fa2.tiles_visited(16, 32, 16, 16, False, "backward")) * dS_per_tile(
        16, 16, 8)[0]
    return dict(dS_per_tile=dS_per_tile, dS_share=main.shared_reads["dSs"] / sum(main.shared_reads.values()))


@check_06_2.fails
def _():
    return dict(dS_per_tile=lambda Br, Bc, d: (Br * Bc, Br * Bc), dS_share=0.01)   # one read per element


# --------------------------------------------------------------------------- 06.3


@exercise("06.3", "P = exp(S - L) for a row with no key", level=1, minutes=10,
          hint="""Try np.exp(np.where(allowed, S, -np.inf) - L[:, None]) on a row whose L is -inf: what is
          -inf - (-inf)? The kernel tests `Lr != NEG_INF` (and the mask) before it calls exp.""",
          explain="""L_i = m_i + log l_i already holds both statistics: exp(S_ij - L_i) = exp(S_ij - m_i) / l_i, the
          softmax itself, so the backward needs neither m nor l. A row with no allowed key (causal with Nq > Nk,
          or a block-sparse row whose blocks are all zero, or the padding rows of the last tile) has L = -inf, and
          S - L is +inf for an allowed-looking entry or -inf - (-inf) = NaN for a masked one: one NaN in P spreads
          through dS into dK, dV and dQ of other rows. The kernel sets P = 0 whenever L = -inf (or the key is
          masked or past Nk) without calling exp, which is the right answer: such a row contributes nothing.""")
def check_06_3(p_from_L):
    """p_from_L(S, L, allowed): P from scaled scores S (Nq, Nk), the row log-sum-exps L (Nq,) and the boolean
    mask allowed (Nq, Nk), with P = 0 where not allowed and for rows with L = -inf."""
    from .. import reference

    require(callable(p_from_L), "p_from_L must be a function (S, L, allowed) -> P")
    rng = np.random.default_rng(63)
    for Nq, Nk in [(12, 8), (6, 6)]:
        q, k = rng.standard_normal((Nq, 4)), rng.standard_normal((Nk, 4))
        S = q @ k.T / 2.0
        allowed = np.arange(Nk)[None, :] <= np.arange(Nq)[:, None] + (Nk - Nq)      # causal, bottom-right
        _, L = reference.attention_forward(q, k, np.zeros((Nk, 1)), causal=True)
        E = np.where(allowed, np.exp(S - S.max(1, keepdims=True)), 0.0)
        truth = E / np.where(E.sum(1, keepdims=True) > 0, E.sum(1, keepdims=True), 1.0)
        with np.errstate(all="ignore"):
            P = np.asarray(p_from_L(S.copy(), L.copy(), allowed.copy()), dtype=np.float64)
        require(P.shape == truth.shape, f"P must have shape {truth.shape}, got {P.shape}")
        bad = ~np.isclose(P, truth, atol=1e-12, rtol=1e-9)
        require(not np.isnan(P).any(), f"P has NaN in rows {sorted(set(np.nonzero(np.isnan(P))[0].tolist()))} "
                f"(Nq = {Nq}, Nk = {Nk})")
        require(not bad.any(), f"P is wrong in rows {sorted(set(np.nonzero(bad)[0].tolist()))} "
                f"(Nq = {Nq}, Nk = {Nk})")


@check_06_3.solves
def _():
    import numpy as np

    def p_from_L(S, L, allowed):
        has_key = np.isfinite(L)[:, None]
        ok = allowed & has_key                                     # the kernel's `Lr != NEG_INF and ...`
        return np.where(ok, np.exp(np.where(ok, S, 0.0) - np.where(has_key, L[:, None], 0.0)), 0.0)

    return dict(p_from_L=p_from_L)


@check_06_3.fails
def _():
    return dict(p_from_L=lambda S, L, allowed: np.exp(np.where(allowed, S, -np.inf) - L[:, None]))  # NaN rows


# --------------------------------------------------------------------------- 06.4


def _visits(Nq, Nk, B):
    from ..stages import fa2

    counts = [0] * math.ceil(Nk / B)
    for j, _, _, _ in fa2.tiles_visited(Nq, Nk, B, B, True, "backward"):
        counts[j] += 1
    return counts


@exercise("06.4", "which column blocks do the least work?", level=1, minutes=10,
          hint="""fa2.tiles_visited(Nq, Nk, 32, 32, True, "backward") lists (column block j, query block i, rows, cols):
          count the entries per j. Remember the causal mask is aligned to the bottom-right corner.""",
          explain="""Column block j holds keys j·Bc .. j·Bc + Bc - 1; only queries i >= j·Bc - (Nk - Nq) may see them.
          With Nq = Nk the first column block meets every query block and the last only the diagonal one: 8, 7, ...,
          1 -- the reverse of the forward, where the last query block does the most work. With Nq = 128 < Nk = 256
          the diagonal starts at key 128: the first five column blocks see all 4 query blocks, then 3, 2, 1. Under
          causal masking the backward's thread blocks are unbalanced from 8 tiles down to 1 -- on a GPU the last
          column blocks finish early and the first ones set the time, unless the work is rebalanced.""")
def check_06_4(visits_square, visits_wide):
    """visits_square: Q tiles each column block j visits in fa2's causal backward, Nq = Nk = 256, Br = Bc = 32;
    visits_wide: the same for Nq = 128, Nk = 256."""
    for name, yours, (Nq, Nk) in (("visits_square", visits_square, (256, 256)),
                                  ("visits_wide", visits_wide, (128, 256))):
        truth = _visits(Nq, Nk, 32)
        try:
            yours = [int(x) for x in yours]
        except (TypeError, ValueError):
            raise Wrong(f"{name} must be a list of numbers, one per column block") from None
        require(len(yours) == len(truth), f"{name} needs one number per column block ({len(truth)})")
        wrong = [j for j, (a, b) in enumerate(zip(yours, truth)) if a != b]
        require(not wrong, f"{name} is wrong for column blocks {wrong}")


@check_06_4.solves
def _():
    from collections import Counter

    from flashnb.stages import fa2

    def visits(Nq, Nk):
        per_j = Counter(j for j, _, _, _ in fa2.tiles_visited(Nq, Nk, 32, 32, True, "backward"))
        return [per_j[j] for j in range(Nk // 32)]

    return dict(visits_square=visits(256, 256), visits_wide=visits(128, 256))


@check_06_4.fails
def _():
    # the forward's view (the last block does the most), and top-left alignment
    return dict(visits_square=[1, 2, 3, 4, 5, 6, 7, 8], visits_wide=[4, 3, 2, 1, 0, 0, 0, 0])


# --------------------------------------------------------------------------- 06.5: FA2's backward from a blank cell

#: The launch signature of a 06.5 kernel: Q, K, V, dO (BH, N, d), L, D (BH, Nq), dQ, dK, dV, scale, diag.
SIG_06_5 = ("void(float32[:, :, ::1], float32[:, :, ::1], float32[:, :, ::1], float32[:, :, ::1], float32[:, ::1], "
            "float32[:, ::1], float32[:, :, ::1], float32[:, :, ::1], float32[:, :, ::1], float32, int32)")
BC_06_5 = 32          # key rows per block: one thread each, one warp
#: (BH, Nq, Nk, d, diag), as in exercise 05.6: dense, bottom-right causal both ways round, top-left.
CASES_06_5 = ((2, 40, 56, 16, 56), (1, 64, 40, 32, 40), (2, 40, 56, 16, 16), (1, 48, 20, 16, -28),
              (1, 33, 70, 32, 0))


def _backward64(q, k, v, do, scale, diag):
    """float64 gradients of attention with key j visible to row i iff j <= i + diag, and the forward's L and
    D = rowsum(dO ∘ O) the kernel is given (rows that see no key: L = -inf, no gradient)."""
    q, k, v, do = (a.astype(np.float64) for a in (q, k, v, do))
    s = scale * np.einsum("zid,zjd->zij", q, k)
    i, j = np.arange(q.shape[1])[:, None], np.arange(k.shape[1])[None, :]
    vis = j <= i + diag
    s = np.where(vis, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    seen = np.isfinite(m)
    e = np.where(vis, np.exp(s - np.where(seen, m, 0.0)), 0.0)
    l = e.sum(axis=-1, keepdims=True)
    P = e / np.where(seen, l, 1.0)
    o = P @ v
    L = np.where(seen[..., 0], m[..., 0] + np.log(np.where(seen[..., 0], l[..., 0], 1.0)), -np.inf)
    D = (do * o).sum(-1)
    dv = np.einsum("zij,zid->zjd", P, do)
    dP = do @ np.swapaxes(v, -1, -2)
    dS = P * (dP - D[..., None])
    return L, D, scale * dS @ k, scale * np.einsum("zij,zid->zjd", dS, q), dv


def _model_06_5(BH, Nq, Nk, d, diag, Br):
    """Element reads and writes of FA2's backward, one thread per key row: K, V read once, dK, dV written once;
    Q, dO (and L, D) read once per key block for every query tile from the first that holds a row seeing one
    of the block's keys (tiles before it are skipped)."""
    qd = st = 0
    for c0 in range(0, Nk, BC_06_5):
        first = c0 - diag                                 # the first query row that sees key c0
        t0 = max(first, 0) // Br if first < Nq else -(-Nq // Br)
        rows = sum(min(Br, Nq - t * Br) for t in range(t0, -(-Nq // Br)))
        qd, st = qd + rows * d, st + rows
    return dict(reads=dict(K=BH * Nk * d, V=BH * Nk * d, Q=BH * qd, dO=BH * qd, L=BH * st, D=BH * st),
                writes=dict(dK=BH * Nk * d, dV=BH * Nk * d))


@exercise("06.5", "FA2's backward from a blank cell, one thread per key row", level=3, minutes=90,
          signatures={"kernel": SIG_06_5},
          hint="""Block (kb, z) owns key rows j = kb·32 + threadIdx.x of batch·head z: keep k_j, v_j and the
          accumulators dK_j, dV_j in cuda.local.array(32, float32). Loop over query tiles of Br rows (Br = 32:
          thread t loads row t of Q_i and dO_i, and L_i, D_i, into shared memory; syncthreads before overwriting
          and after loading). For each query row r of the tile that sees key j (j <= r + diag): p = exp(scale·q_r·k_j
          - L_r) (FA2 Alg. 2 line 11), dV_j += p·dO_r (line 12), dp = dO_r·v_j (line 13), ds = p·(dp - D_r)
          (line 14), dK_j += scale·ds·q_r (line 16) and dQ_r += scale·ds·k_j with cuda.atomic.add on dQ (line 15:
          every key block adds to the same rows). Start at the first tile holding a row that sees the block's first
          key (c0 - diag), write dK_j, dV_j once at the end. dQ arrives zeroed.""",
          explain="""This is the backward ladder's one-thread-per-key-row step: K_j, V_j stay in registers for the
          whole kernel and are read from HBM once, while Q_i, dO_i (and the statistics L_i, D_i that the forward and
          a rowsum leave) stream through shared memory once per key block -- Tc = ceil(Nk/32) times in all. P is
          rebuilt from L (never stored: FA2's recompute), and dQ, which every key block contributes to, is summed
          with atomics. The check's traffic model counts Q, dO, L, D per key block from its first useful query
          tile, so a kernel that does not skip the tiles before the diagonal, or reloads a tile, reads more.""")
def check_06_5(kernel, Br):
    """kernel: a cuda.jit kernel (Q, K, V, dO, L, D, dQ, dK, dV, scale, diag) launched as
    kernel[(ceil(Nk / 32), BH), 32] that adds to the zeroed dQ and writes dK, dV: the gradients of attention
    with key j visible to row i iff j <= i + diag, given the forward's L and D = rowsum(dO ∘ O), for d <= 32;
    Br: the query rows it loads per tile.  Checked like a course assignment: float64 on five shapes, counted
    traffic against FA2's backward model for your Br, the four sanitizer tools, and a compile for sm_80 and
    sm_90."""
    from .. import common
    from ..instruments import traffic

    require_kernel(kernel, "Q, K, V, dO, L, D, dQ, dK, dV, scale, diag")
    require(isinstance(Br, int) and not isinstance(Br, bool) and 1 <= Br <= 128,
            "Br must be the int number of query rows your kernel loads per tile (1..128)")
    rng = np.random.default_rng(65)

    def launch(BH, Nq, Nk, d, diag):
        q, do = (rng.standard_normal((BH, Nq, d)).astype(np.float32) for _ in range(2))
        k, v = (rng.standard_normal((BH, Nk, d)).astype(np.float32) for _ in range(2))
        scale = np.float32(d ** -0.5)
        L, D, dq, dk, dv = _backward64(q, k, v, do, scale, diag)
        dQ = common.to_device(np.zeros((BH, Nq, d), np.float32))              # the atomics' accumulator
        dK = common.to_device(np.full((BH, Nk, d), np.nan, np.float32))       # poisoned: every element written
        dV = common.to_device(np.full((BH, Nk, d), np.nan, np.float32))
        args = (*(common.to_device(a) for a in (q, k, v, do, L.astype(np.float32), D.astype(np.float32))),
                dQ, dK, dV, scale, np.int32(diag))
        return (dq, dk, dv), args, (dQ, dK, dV)

    for BH, Nq, Nk, d, diag in CASES_06_5:
        what = f"BH = {BH}, Nq = {Nq}, Nk = {Nk}, d = {d}, diag = {diag}"
        want, args, outs = launch(BH, Nq, Nk, d, diag)
        try:
            with traffic.count() as t:
                kernel[(-(-Nk // BC_06_5), BH), BC_06_5](*args)
        except Exception as e:
            raise Wrong(f"your kernel failed at {what}: {type(e).__name__}: {e}") from None
        for name, out, ref in zip(("dQ", "dK", "dV"), outs, want):
            got = out.copy_to_host()
            bad = sorted(set(np.argwhere(np.isnan(got))[:, 1].tolist()))
            require(not bad, f"at {what}, {name} rows {bad[:6]} were never written (still NaN)")
            # float32 against float64: chained sums of at most 70 O(1) products (tests/stages/test_fa2.py: 1e-4)
            err = float(np.abs(got - ref).max())
            require(err <= 1e-4 * (1 + np.abs(ref).max()), f"at {what}, {name} is off the float64 reference by "
                    f"{err:.2e}: check p = exp(scale·s - L), ds = p·(dp - D) and the mask j <= i + diag")
        require_traffic(t.launches[-1], _model_06_5(BH, Nq, Nk, d, diag, Br), what, _why_06_5)
    BH, Nq, Nk, d, diag = CASES_06_5[2]
    _, args, _ = launch(BH, Nq, Nk, d, diag)
    require_gpu_ready(kernel, lambda: kernel[(-(-Nk // BC_06_5), BH), BC_06_5](*args), SIG_06_5,
                      "a missing syncthreads? a read past Nq?")
    return (f"float64 on {len(CASES_06_5)} shapes, traffic equal to FA2's backward model (Q read "
            f"{_model_06_5(*CASES_06_5[2], Br)['reads']['Q']} times at {CASES_06_5[2][1]} x {CASES_06_5[2][2]}, "
            "causal), race-free, compiles for sm_80 and sm_90")


def _why_06_5(kind, name, n, want):
    if name in ("K", "V"):
        return "read each of K, V once, into registers"
    if kind == "writes":
        return "write dK_j, dV_j once, at the end"
    return ("load each query tile once per key block, from the first tile holding a row that sees the block's "
            "first key" if n > want else "every query tile from the first useful one must be loaded (is Br what "
            "your kernel loads?)")


def _fa2_key_rows_kernel(skip=True, first_barrier=True, delta=True):
    """The worked solution of 06.5, and (with an argument off) the three wrong answers the tests try."""
    from flashnb.common import NEG_INF, ZERO

    Br = 32

    @cuda.jit
    def fa2_backward_key_rows(Q, K, V, dO, L, D, dQ, dK, dV, scale, diag):
        Q_i = cuda.shared.array((32, 32), float32)                # SRAM: one query tile of Br = 32 rows, d <= 32
        dO_i = cuda.shared.array((32, 32), float32)
        L_i = cuda.shared.array(32, float32)
        D_i = cuda.shared.array(32, float32)
        k_j = cuda.local.array(32, float32)                      # registers: this thread's key row
        v_j = cuda.local.array(32, float32)
        dK_j = cuda.local.array(32, float32)
        dV_j = cuda.local.array(32, float32)
        z = cuda.blockIdx.y
        t = cuda.threadIdx.x
        c0 = cuda.blockIdx.x * 32
        j = c0 + t
        Nq, Nk, d = Q.shape[1], K.shape[1], Q.shape[2]
        for x in range(d):                                       # FA2 Alg. 2 lines 6-7: K_j, V_j once; dK = dV = 0
            k_j[x] = K[z, j, x] if j < Nk else ZERO
            v_j[x] = V[z, j, x] if j < Nk else ZERO
            dK_j[x] = ZERO
            dV_j[x] = ZERO
        first = c0 - diag                                        # the first query row that sees key c0
        i_first = 0
        if skip:
            i_first = first // Br if first > 0 else 0
        for it in range(i_first, (Nq + Br - 1) // Br):           # line 8
            i0 = it * Br
            if first_barrier:
                cuda.syncthreads()                               # every thread is done with the last tile
            if i0 + t < Nq:                                      # line 9: Q_i, dO_i, L_i, D_i -> SRAM
                for x in range(d):
                    Q_i[t, x] = Q[z, i0 + t, x]
                    dO_i[t, x] = dO[z, i0 + t, x]
                L_i[t] = L[z, i0 + t]
                D_i[t] = D[z, i0 + t]
            cuda.syncthreads()
            if j < Nk:
                for r in range(min(Br, Nq - i0)):
                    if j <= i0 + r + diag and L_i[r] != NEG_INF:
                        s = ZERO
                        dp = ZERO
                        for x in range(d):                       # lines 10, 13: S_ij, dP_ij
                            s += Q_i[r, x] * k_j[x]
                            dp += dO_i[r, x] * v_j[x]
                        p = float32(math.exp(scale * s - L_i[r]))   # line 11: P = exp(S - L)
                        ds = p * (dp - D_i[r]) if delta else p * dp  # line 14: dS = P ∘ (dP - D)
                        for x in range(d):
                            dV_j[x] += p * dO_i[r, x]            # line 12
                            dK_j[x] += scale * ds * Q_i[r, x]    # line 16
                            cuda.atomic.add(dQ, (z, i0 + r, x), scale * ds * k_j[x])   # line 15
        if j < Nk:                                               # lines 17-18: dK_j, dV_j -> HBM, once
            for x in range(d):
                dK[z, j, x] = dK_j[x]
                dV[z, j, x] = dV_j[x]

    return fa2_backward_key_rows


@check_06_5.solves
def _():
    return dict(kernel=_fa2_key_rows_kernel(), Br=32)


@check_06_5.fails
def _():
    return dict(kernel=_fa2_key_rows_kernel(skip=False), Br=32)      # every query tile: too many Q, dO reads


@check_06_5.fails
def _():
    return dict(kernel=_fa2_key_rows_kernel(delta=False), Br=32)     # dS without D: wrong dQ and dK


@check_06_5.fails
def _():
    return dict(kernel=_fa2_key_rows_kernel(first_barrier=False), Br=32)   # a tile overwritten while read
