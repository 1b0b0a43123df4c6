"""Exercises of notebook 06 (FlashAttention-2's backward: recompute, column blocks, dQ by atomics)."""

from __future__ import annotations

import functools
import math

import numpy as np

from . import Wrong, close, exercise, require


def _total(model) -> int:
    return sum(sum(x["reads"].values()) + sum(x["writes"].values()) + sum(x.get("atomics", {}).values())
               for x in model)


# --------------------------------------------------------------------------- 06.1


def _extra_traffic(Nq, Nk, d, Br, Bc):
    """Buffer design minus atomic design, from fa2.model_backward (non-causal, one head, atomics count once)."""
    from .. import fa2

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
    from .. import fa2

    atomic = _total(fa2.model_backward(1, 4096, 4096, 64, Br=32, Bc=32, warps=1))
    close(fraction, _extra_traffic(4096, 4096, 64, 32, 32) / atomic, rel=0.01, what="fraction")


@check_06_1.solves
def _():
    from flashnb import common, fa2

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
    from .. import api, fa2, traffic

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
          (fa2.tiles_visited(..., "backward")), then read fa2_bwd_tile and line 15 in show_source for the formula.""",
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
    from flashnb import fa2, traffic

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
    from .. import fa2

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

    from flashnb import fa2

    def visits(Nq, Nk):
        per_j = Counter(j for j, _, _, _ in fa2.tiles_visited(Nq, Nk, 32, 32, True, "backward"))
        return [per_j[j] for j in range(Nk // 32)]

    return dict(visits_square=visits(256, 256), visits_wide=visits(128, 256))


@check_06_4.fails
def _():
    # the forward's view (the last block does the most), and top-left alignment
    return dict(visits_square=[1, 2, 3, 4, 5, 6, 7, 8], visits_wide=[4, 3, 2, 1, 0, 0, 0, 0])
