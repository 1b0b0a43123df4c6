"""Exercises of notebook 05 (FlashAttention-2's forward: three changes, each counted)."""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32  # module globals: the simulator swaps `cuda` in a kernel's globals only

from . import Wrong, close, exercise, require, require_gpu_ready, require_kernel, require_traffic


def _lane_grid(Br, Bc, d, warps, LR, LC):
    """Per-thread micro-tile of fa2's forward for a warp laid out as LR x LC lanes."""
    TM, TN, DN = Br // (warps * LR), Bc // LC, math.ceil(d / LC)
    return TM, TN, DN


def _fmas_per_read(Br, Bc, d, warps, LR, LC):
    TM, TN, DN = _lane_grid(Br, Bc, d, warps, LR, LC)
    return (d * TM * TN + Bc * DN * TM) / (d * (TM + TN) + Bc * DN)


def _shuffles_per_tile(Br, Bc, d, warps, LR, LC):
    """Shuffles one thread makes per K/V tile: log2(LC) per row for the row max, one per P~ entry it uses."""
    TM, TN, _ = _lane_grid(Br, Bc, d, warps, LR, LC)
    return TM * int(math.log2(LC)) + TN * LC * TM


def _shared_reads(Nq, Nk, Br, Bc, d, warps, LR, LC):
    """Shared-memory element reads of the forward (dense, one head): per thread and tile d·(TM+TN) + Bc·DN."""
    TM, TN, DN = _lane_grid(Br, Bc, d, warps, LR, LC)
    tiles = math.ceil(Nq / Br) * math.ceil(Nk / Bc)
    return tiles * 32 * warps * (d * (TM + TN) + Bc * DN)


# --------------------------------------------------------------------------- 05.1


@exercise("05.1", "an 8 x 4 lane grid instead of 4 x 8", level=3, minutes=30,
          hint="""fa2.make_forward takes its lane grid from the module constants LR, LC through
          g = geometry(Br, Bc, d, warps), the kernel's region lane-grid. In a variant, replace that line by local
          constants and the micro-tile they give: registry.variant(fa2.make_forward, regions={"lane-grid": "LR, LC =
          8, 4\\ng = dict(TM=..., TN=..., DN=..., Dp=..., threads=32 * warps)"}) -- the nested kernels then see the
          local LR, LC. Count with traffic.count() inside `with registry.using(fa2.make_forward, variant):`. For the
          numbers, redo fa2.fmas_per_shared_read's formula and count the shfl calls in fa2_tile per K/V tile.""",
          explain="""With 8 row lanes × 4 column lanes each thread owns TM = Br/(8·warps) rows (half as many) and
          TN = Bc/4, DN = d/4 columns (twice as many). The S product still costs d·TM·TN FMAs per d·(TM + TN) reads
          (TM·TN/(TM+TN) falls from 2 to 1.6 at Br = 64, Bc = 32, warps = 4), but P·V gets only TM = 2 FMAs per
          read of V_j instead of 4: the whole tile drops from 2.67 to 1.78 FMAs per shared read, and the counter sees
          the extra reads of K_j and V_j. Shuffles per tile fall from TM·(log2 8 + Bc) = 140 to TM·(log2 4 + Bc) = 68
          per thread (half the rows, a 2-step instead of a 3-step butterfly). Shuffles are cheaper than shared
          reads, which is why the kernel spends them: the 4 × 8 grid is the better trade.""")
def check_05_1(variant, fmas_per_read, shuffles_per_tile):
    """variant: a kernel factory like fa2.make_forward whose warps are 8 x 4 lanes (LR = 8, LC = 4);
    fmas_per_read, shuffles_per_tile: per thread, for that layout at Br = 64, Bc = 32, d = 64, warps = 4."""
    from .. import api, reference, registry
    from ..instruments import traffic
    from ..stages import fa2

    require(callable(variant), "variant must be a kernel factory (from registry.variant)")
    q, k, v = (np.random.default_rng(51 + s).standard_normal((1, 32, 16)) for s in range(3))
    try:
        with registry.using(fa2.make_forward, variant), traffic.count() as t:
            o = api.attention(q, k, v, impl="fa2", Br=16, Bc=16, warps=1)
    except Wrong:
        raise
    except Exception as e:
        raise Wrong(f"running your variant through flashnb.attention failed: {type(e).__name__}: {e}") from None
    require(np.abs(o - reference.attention(q, k, v)).max() < 1e-5,
            "your variant's output does not match the float64 reference (N = 32, d = 16, Br = Bc = 16, one warp)")
    counted = t.shared_reads
    if counted == _shared_reads(32, 32, 16, 16, 16, 1, fa2.LR, fa2.LC):
        raise Wrong("the counter sees the 4 x 8 lane grid's shared reads: your variant still uses LR = 4, LC = 8")
    require(counted == _shared_reads(32, 32, 16, 16, 16, 1, 8, 4),
            "the counted shared reads are not those of an 8 x 4 lane grid")
    close(fmas_per_read, _fmas_per_read(64, 32, 64, 4, 8, 4), rel=0.01, what="fmas_per_read")
    close(shuffles_per_tile, _shuffles_per_tile(64, 32, 64, 4, 8, 4), what="shuffles_per_tile")
    return (f"{counted} shared reads counted at N = 32 (the 4 x 8 grid: "
            f"{_shared_reads(32, 32, 16, 16, 16, 1, fa2.LR, fa2.LC)})")


@check_05_1.solves
def _():
    import math

    from flashnb import registry
    from flashnb.stages import fa2

    lanes_8x4 = registry.variant(fa2.make_forward, regions={"lane-grid": (
        "LR, LC = 8, 4   # local: the nested kernels close over these instead of fa2.LR, fa2.LC\n"
        "g = dict(TM=Br // (warps * LR), TN=Bc // LC, DN=cdiv(d, LC), Dp=cdiv(d, LC) * LC, threads=32 * warps)")})
    Br, Bc, d, warps, LR, LC = 64, 32, 64, 4, 8, 4
    TM, TN, DN = Br // (warps * LR), Bc // LC, math.ceil(d / LC)
    fmas = d * TM * TN + Bc * DN * TM                  # S = Q Kᵀ, then P~ V
    reads = d * (TM + TN) + Bc * DN
    shuffles = TM * int(math.log2(LC)) + TN * LC * TM  # row-max butterfly, then one shfl per P~ entry used
    return dict(variant=lanes_8x4, fmas_per_read=fmas / reads, shuffles_per_tile=shuffles)


@check_05_1.fails
def _():
    from flashnb import registry
    from flashnb.stages import fa2

    only_lc = registry.variant(fa2.make_forward, regions={"lane-grid": (   # LC changed, LR not: 16 lanes
        "LC = 4\ng = dict(TM=Br // (warps * LR), TN=Bc // LC, DN=cdiv(d, LC), Dp=cdiv(d, LC) * LC, "
        "threads=32 * warps)")})
    return dict(variant=only_lc, fmas_per_read=1.78, shuffles_per_tile=68)


@check_05_1.fails
def _():
    from flashnb.stages import fa2

    g = fa2.fmas_per_shared_read(64, 32, 64, 4)      # today's layout, not the new one
    return dict(variant=fa2.make_forward, fmas_per_read=g["tile"], shuffles_per_tile=140)


# --------------------------------------------------------------------------- 05.2


@exercise("05.2", "can the unnormalised O~ overflow?", level=1, minutes=10,
          hint="""O~_i = Σ_j exp(S_ij - m_i) V_j over the keys seen so far, with m_i the running maximum. How large
          can one exp(S_ij - m_i) be, and how many terms are there after Tc tiles of Bc keys?""",
          explain="""Every weight exp(S_ij - m_i) is at most 1 (m_i is the maximum of the scores seen), so
          |O~_i| ≤ (keys seen) · max|V| ≤ Bc·Tc·max|V|, reached when all scores are equal and V is constant. That is
          at most Nk·max|V| (padding keys have weight 0): with 2³¹ keys and |V| ≤ 10⁴, about 2·10¹³ -- 25 orders of
          magnitude below float32's 3.4·10³⁸. Subtracting the running max is what makes delayed rescaling safe:
          O~ grows linearly with the keys, never exponentially. (The row sum l_i has the same bound with
          max|V| = 1.)""")
def check_05_2(bound, can_overflow):
    """bound(Bc, Tc, vmax): the largest |O~_ij| possible after Tc tiles of Bc keys with |V| <= vmax;
    can_overflow: can O~ overflow float32 with at most 2**31 keys and |V| <= 1e4?"""
    require(callable(bound), "bound must be a function (Bc, Tc, vmax) -> a number")
    for Bc, Tc, vmax in [(32, 1, 1.0), (64, 128, 3.0), (16, 1000, 0.5), (128, 7, 1e4)]:
        close(bound(Bc, Tc, vmax), Bc * Tc * vmax, rel=1e-9, what=f"bound({Bc}, {Tc}, {vmax})")
    require(isinstance(can_overflow, (bool, np.bool_)), "can_overflow must be True or False")
    require(not can_overflow, "can_overflow: compare your bound at 2**31 keys and |V| = 1e4 with float32's maximum")


@check_05_2.solves
def _():
    import numpy as np

    def bound(Bc, Tc, vmax):
        return Bc * Tc * vmax        # every weight exp(S - m) <= 1, Bc·Tc of them

    return dict(bound=bound, can_overflow=bound(1, 2 ** 31, 1e4) > np.finfo(np.float32).max)


@check_05_2.fails
def _():
    return dict(bound=lambda Bc, Tc, vmax: vmax, can_overflow=False)   # as if O~ were normalised


# --------------------------------------------------------------------------- 05.3


@exercise("05.3", "the causal tile map for Nq = 300, Nk = 200", level=1, minutes=15,
          hint="""flashnb's causal mask is aligned to the bottom-right corner: query i may see key j when
          j <= i + Nk - Nq. Which rows have no key at all? For the tiles, fa2.tiles_visited(Nq, Nk, Br, Bc, causal)
          lists what the forward computes -- or count them from the rule that block i stops at the key block holding
          the diagonal of its last row.""",
          explain="""With Nq > Nk the diagonal starts below the top: row i sees keys 0 .. i - 100, so rows 0-99 see
          no key, get P = 0, O = 0 and L = -inf (the kernel guards exp and log so this is not NaN). With top-left
          alignment no row would be empty (and the last 100 rows would see every key). At Br = 64, Bc = 32 the
          forward visits 0 + 1 + 3 + 5 + 7 = 16 tiles of the 5 × 7 = 35: block 0 (rows 0-63) loads no K/V tile at
          all and writes O = 0, L = -inf straight away; block 1 computes one tile in which rows 64-99 are fully
          masked.""")
def check_05_3(rows_without_keys, tiles_computed):
    """rows_without_keys: the query rows with L = -inf (Nq = 300, Nk = 200, causal);
    tiles_computed: the (Q block, K/V block) tiles fa2's causal forward computes there at Br = 64, Bc = 32."""
    from .. import reference
    from ..stages import fa2

    try:
        yours = {int(i) for i in rows_without_keys}
    except (TypeError, ValueError):
        raise Wrong("rows_without_keys must be a collection of row indices (e.g. a set or range)") from None
    rng = np.random.default_rng(53)
    _, lse = reference.attention_forward(rng.standard_normal((300, 8)), rng.standard_normal((200, 8)),
                                         rng.standard_normal((200, 8)), causal=True)
    truth = set(np.flatnonzero(np.isneginf(lse)).tolist())
    missing, extra = truth - yours, yours - truth
    require(not missing and not extra, f"rows_without_keys: {len(missing)} row(s) missing, {len(extra)} that do "
            "have a key -- how is the causal mask aligned when Nq != Nk?")
    close(tiles_computed, len(fa2.tiles_visited(300, 200, 64, 32, True)), what="tiles_computed")


@check_05_3.solves
def _():
    from flashnb.stages import fa2

    Nq, Nk = 300, 200
    rows = {i for i in range(Nq) if i + Nk - Nq < 0}      # bottom-right: key j allowed when j <= i + Nk - Nq
    return dict(rows_without_keys=rows, tiles_computed=len(fa2.tiles_visited(Nq, Nk, 64, 32, True)))


@check_05_3.fails
def _():
    return dict(rows_without_keys=set(), tiles_computed=16)          # top-left alignment


@check_05_3.fails
def _():
    return dict(rows_without_keys=range(100), tiles_computed=17)     # off by one: a tile for block 0 too


# --------------------------------------------------------------------------- 05.4


@functools.lru_cache(maxsize=None)
def _largest_br(N=4096, d=64):
    from ..stages import fa1, fa2

    def total(model):
        return sum(sum(x["reads"].values()) + sum(x["writes"].values()) for x in model)

    f1 = total(fa1.model_forward(1, N, N, d))
    return max(Br for Br in range(4, 129, 4)
               if f1 < total(fa2.model_forward(1, N, N, d, Br=Br, Bc=32, warps=1)))


@exercise("05.4", "when does FA1 move fewer bytes than FA2?", level=2, minutes=15,
          hint="""Total the reads and writes of fa1.model_forward(1, 4096, 4096, 64) (its default M) and of
          fa2.model_forward(1, 4096, 4096, 64, Br=Br, Bc=32, warps=1) for Br = 4, 8, 12, ... (a multiple of 4 with
          one warp). Which term of each grows with the number of tiles?""",
          explain="""FA1 (K/V outer) reads Q_i and reads and writes O_i at each of its Tc = N/16 outer steps: about
          3·Tc·N·d. FA2 (Q outer) reads Q and writes O once but reads K_j and V_j for each of its Tr = N/Br query
          blocks: about 2·Tr·N·d. FA1 moves less when 2N/Br > 3N/16, i.e. Br < 10.7: Br ≤ 8. FA2's default
          Br = 64 moves about 6 times less than FA1's default, because its re-read term is two arrays, read only,
          per query block of 64 rows, where FA1 re-reads and re-writes O per key block of 16.""")
def check_05_4(largest_Br):
    """largest_Br: the largest Br (multiple of 4; FA2 with Bc = 32, one warp) at which FA1's default forward moves
    fewer HBM elements than FA2's forward, N = 4096, d = 64."""
    close(largest_Br, _largest_br(), what="largest_Br")


@check_05_4.solves
def _():
    from flashnb.stages import fa1, fa2

    def total(model):
        return sum(sum(x["reads"].values()) + sum(x["writes"].values()) for x in model)

    fa1_elements = total(fa1.model_forward(1, 4096, 4096, 64))
    fa2_elements = {Br: total(fa2.model_forward(1, 4096, 4096, 64, Br=Br, Bc=32, warps=1)) for Br in range(4, 129, 4)}
    return dict(largest_Br=max(Br for Br, n in fa2_elements.items() if fa1_elements < n))


@check_05_4.fails
def _():
    return dict(largest_Br=16)      # FA1's own Br: the tiles are not comparable one to one


# --------------------------------------------------------------------------- 05.5


@exercise("05.5", "the race a missing barrier makes", level=2, minutes=15,
          hint="""That barrier is the kernel's region kv-barrier (show_source(fa2.make_forward, region="kv-barrier")):
          no_barrier = registry.variant(fa2.make_forward, regions={"kv-barrier": "pass"}); then `with
          registry.using(fa2.make_forward, no_barrier), sim.sanitize(raise_on_error=False) as report:` run
          flashnb.attention(q, k, v, impl="fa2", Br=16, Bc=16, warps=2) on (1, 48, 8) inputs, and look at
          report.by_tool("racecheck").""",
          explain="""Without that barrier a fast warp starts loading K_j, V_j of the next tile while a slow warp still
          reads the previous tile: racecheck reports read/write races on the shared tiles KsT and Vs, between the
          tile loads (common.load_rows_T, load_rows) and the reads in fa2_tile. Whether the simulator's output is
          still right depends on the order in which it happens to run threads; a GPU runs warps concurrently, so a
          right answer on the simulator is no evidence.""")
def check_05_5(race_arrays):
    """race_arrays: the set of shared arrays racecheck reports for the FA2 forward without that barrier."""
    require(isinstance(race_arrays, (set, frozenset, list, tuple)), "race_arrays must be a set of array names")
    from .. import api, registry, sim
    from ..stages import fa2

    variant = registry.variant(fa2.make_forward, regions={"kv-barrier": "pass"})
    q, k, v = (np.random.default_rng(s).standard_normal((1, 48, 8)) for s in range(3))
    with registry.using(fa2.make_forward, variant), sim.sanitize(tools="racecheck", raise_on_error=False) as rep:
        api.attention(q, k, v, impl="fa2", Br=16, Bc=16, warps=2)
    truth = {f.message.split(" race on shared ")[1].split("[")[0] for f in rep.findings}
    missing, extra = truth - set(race_arrays), set(race_arrays) - truth
    require(not missing and not extra, f"{len(missing)} array(s) missing, {len(extra)} that racecheck does not "
            "report; run it and read the report")


@check_05_5.solves
def _():
    import numpy as np

    from flashnb import api, registry, sim
    from flashnb.stages import fa2

    no_barrier = registry.variant(fa2.make_forward, regions={"kv-barrier": "pass"})
    q, k, v = (np.random.default_rng(s).standard_normal((1, 48, 8)) for s in range(3))
    with registry.using(fa2.make_forward, no_barrier), sim.sanitize(raise_on_error=False) as report:
        api.attention(q, k, v, impl="fa2", Br=16, Bc=16, warps=2)
    races = report.by_tool("racecheck")
    return dict(race_arrays={f.message.split(" race on shared ")[1].split("[")[0] for f in races})


@check_05_5.fails
def _():
    return dict(race_arrays={"QsT"})


# --------------------------------------------------------------------------- 05.6: FA2's forward from a blank cell

#: The launch signature of a 05.6 kernel: Q, K, V, O (BH, N, d), L (BH, Nq), scale, diag.
SIG_05_6 = ("void(float32[:, :, ::1], float32[:, :, ::1], float32[:, :, ::1], float32[:, :, ::1], "
            "float32[:, ::1], float32, int32)")
BR_05_6 = 32          # query rows per block: one thread each, one warp
#: (BH, Nq, Nk, d, diag): dense (diag = Nk: every key visible), causal bottom-right (diag = Nk - Nq) with Nq < Nk
#: and with Nq > Nk (rows that see no key), top-left (diag = 0), partial tiles everywhere.
CASES_05_6 = ((2, 40, 56, 16, 56), (1, 64, 40, 32, 40), (2, 40, 56, 16, 16), (1, 48, 20, 16, -28),
              (1, 33, 70, 32, 0))


def _attention64(q, k, v, scale, diag):
    """float64 attention with key j visible to row i iff j <= i + diag; a row that sees no key: o = 0, L = -inf."""
    q, k, v = (a.astype(np.float64) for a in (q, k, v))
    s = scale * np.einsum("zid,zjd->zij", q, k)
    i, j = np.arange(q.shape[1])[:, None], np.arange(k.shape[1])[None, :]
    s = np.where(j <= i + diag, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    seen = np.isfinite(m)
    e = np.exp(s - np.where(seen, m, 0.0))
    l = e.sum(axis=-1, keepdims=True)
    o = np.where(seen, np.einsum("zij,zjd->zid", e, v) / np.where(seen, l, 1.0), 0.0)
    lse = np.where(seen[..., 0], m[..., 0] + np.log(np.where(seen[..., 0], l[..., 0], 1.0)), -np.inf)
    return o, lse


def _model_05_6(BH, Nq, Nk, d, diag, Bc):
    """Element reads and writes of FA2's forward, one thread per query row: Q once, K_j and V_j once per query
    block for every tile holding a visible key (tiles after the block's last visible key are skipped), O and L
    written once."""
    kv = 0
    for r0 in range(0, Nq, BR_05_6):
        last = min(r0 + BR_05_6, Nq) - 1 + diag          # the block's last visible key
        tiles = 0 if last < 0 else min(-(-Nk // Bc), last // Bc + 1)
        kv += sum(min(Bc, Nk - t * Bc) for t in range(tiles)) * d
    return dict(reads=dict(Q=BH * Nq * d, K=BH * kv, V=BH * kv), writes=dict(O=BH * Nq * d, L=BH * Nq))


@exercise("05.6", "FA2's forward from a blank cell, one thread per query row", level=3, minutes=90,
          signatures={"kernel": SIG_05_6},
          hint="""Block (qb, z) owns query rows i = qb·32 + threadIdx.x of batch·head z; keep q_i and the
          unnormalised o_i in cuda.local.array(D, float32) (D a constant >= d, e.g. 32), m_i = -inf, l_i = 0.
          Loop over K/V tiles of Bc rows (Bc = 32: thread t loads row t of K_j and V_j into cuda.shared.array
          tiles): syncthreads before overwriting a tile and after loading it. Per tile (FA2 Alg. 1 lines 8-10):
          scores s_c = scale·q_i·k_c for the visible keys (j <= i + diag), m_new = max(m_i, max_c s_c),
          p_c = exp(s_c - m_new), l_i = e^(m_i - m_new)·l_i + Σ p_c, o_i = e^(m_i - m_new)·o_i + Σ p_c v_c. After
          the last tile: O = o_i / l_i, L = m_i + log(l_i); a row that saw no key writes O = 0, L = -inf. Skip the
          tiles after the block's last visible key (min(qb·32 + 32, Nq) - 1 + diag). Guard every load and store
          with i < Nq and j < Nk, use float32(...) for every constant.""",
          explain="""This is fa2_steps.make_rows_forward (the ladder's one-thread-per-row step, impl="fa2-rows") written
          out: the block's 32 threads share each K_j, V_j tile through shared memory, so K and V are read from HBM once
          per query block -- Tr = ceil(Nq/32) times in all -- while each thread keeps its row's statistics and output in
          registers and rescales o_i once per tile (delayed normalisation: one division per row, at the end). The
          check's traffic model counts exactly that: Q, O, L once, and the K/V tiles of every query block up to its last
          visible key; reading a tile more than once, or a K/V tile entirely above the diagonal, shows up as extra
          reads. The barrier before a tile's overwrite is the one most often forgotten: without it a fast thread loads
          tile j+1 while a slow one still reads tile j (racecheck reports it).""")
def check_05_6(kernel, Bc):
    """kernel: a cuda.jit kernel (Q, K, V, O, L, scale, diag) launched as kernel[(ceil(Nq / 32), BH), 32] that
    writes O = softmax(scale·Q Kᵀ, key j visible to row i iff j <= i + diag) V and L = its log-sum-exp (-inf, and
    O = 0, for a row that sees no key), for d <= 32; Bc: the K/V tile rows it loads at a time (its traffic depends
    on it).  Checked like a course assignment: float64 on five shapes (Nq != Nk, dense, both causal alignments,
    rows with no key), counted traffic against FA2's model, the four sanitizer tools, and a compile for sm_80 and
    sm_90 (no float64, no spills, shared memory within 48 KiB)."""
    from .. import common
    from ..instruments import traffic

    require_kernel(kernel, "Q, K, V, O, L, scale, diag")
    require(isinstance(Bc, int) and not isinstance(Bc, bool) and 1 <= Bc <= 128,
            "Bc must be the int number of K/V rows your kernel loads per tile (1..128)")
    rng = np.random.default_rng(55)

    def launch(BH, Nq, Nk, d, diag):
        q, k, v = (rng.standard_normal((BH, n, d)).astype(np.float32) for n in (Nq, Nk, Nk))
        scale = np.float32(d ** -0.5)
        O = common.to_device(np.full((BH, Nq, d), np.nan, np.float32))      # poisoned: every element is written
        L = common.to_device(np.full((BH, Nq), np.nan, np.float32))
        args = (common.to_device(q), common.to_device(k), common.to_device(v), O, L, scale, np.int32(diag))
        return (q, k, v, scale), args, O, L

    for BH, Nq, Nk, d, diag in CASES_05_6:
        what = f"BH = {BH}, Nq = {Nq}, Nk = {Nk}, d = {d}, diag = {diag}"
        (q, k, v, scale), args, O, L = launch(BH, Nq, Nk, d, diag)
        try:
            with traffic.count() as t:
                kernel[(-(-Nq // BR_05_6), BH), BR_05_6](*args)
        except Exception as e:
            raise Wrong(f"your kernel failed at {what}: {type(e).__name__}: {e}") from None
        o, lse = O.copy_to_host(), L.copy_to_host()
        o_ref, lse_ref = _attention64(q, k, v, scale, diag)
        unwritten = sorted(set(np.argwhere(np.isnan(o))[:, 1].tolist())
                           | set(np.argwhere(np.isnan(lse))[:, 1].tolist()))
        require(not unwritten, f"at {what}, some of O or L was never written (still NaN): rows {unwritten[:6]}"
                + (" ..." if len(unwritten) > 6 else ""))
        empty = ~np.isfinite(lse_ref)
        require(np.array_equal(lse[empty], lse_ref[empty]) and not np.abs(o[empty]).any(),
                f"at {what}, rows that see no key must write O = 0 and L = -inf")
        # float32 against float64: sums of at most 70 O(1) products, as tests/stages/test_fa2.py bounds them (2e-5)
        err_o = float(np.abs(o - o_ref).max())
        err_l = float(np.abs(lse[~empty] - lse_ref[~empty]).max()) if (~empty).any() else 0.0
        require(err_o <= 2e-5 * (1 + np.abs(o_ref).max()), f"at {what}, O is off the float64 reference by "
                f"{err_o:.2e}: check the rescaling e^(m_old - m_new) of l_i and o_i, and the mask j <= i + diag")
        require(err_l <= 2e-5 * (1 + np.abs(lse_ref[~empty]).max()), f"at {what}, L is off by {err_l:.2e}: "
                "L = m_i + log(l_i)")
        require_traffic(t.launches[-1], _model_05_6(BH, Nq, Nk, d, diag, Bc), what, _why_05_6)
    BH, Nq, Nk, d, diag = CASES_05_6[2]
    _, args, _, _ = launch(BH, Nq, Nk, d, diag)
    require_gpu_ready(kernel, lambda: kernel[(-(-Nq // BR_05_6), BH), BR_05_6](*args), SIG_05_6,
                      "a missing syncthreads? a read past Nk?")
    return (f"float64 on {len(CASES_05_6)} shapes, traffic equal to FA2's model (K read "
            f"{_model_05_6(*CASES_05_6[2], Bc)['reads']['K']} times at {CASES_05_6[2][1]} x {CASES_05_6[2][2]}, "
            "causal), race-free, compiles for sm_80 and sm_90")


def _why_05_6(kind, name, n, want):
    if name in ("K", "V"):
        return ("load each K/V tile once per block, and skip the tiles after the block's last visible key" if n > want
                else "every tile holding a visible key must be loaded (is Bc what your kernel loads?)")
    return {"Q": "read q_i once into registers", "O": "write each row of O once", "L": "write L once per row"}[name]


def _fa2_rows_kernel(skip=True, first_barrier=True, rescale=True, f64=False):
    """The worked solution of 05.6, and (with an argument off, or ``f64``) the wrong answers the tests try."""
    from flashnb.common import NEG_INF, ONE, ZERO

    Bc = 32
    unit = 1.0 if f64 else ONE            # a Python float in a kernel is float64: the PTX guard refuses it

    @cuda.jit
    def fa2_forward_rows(Q, K, V, O, L, scale, diag):
        K_j = cuda.shared.array((32, 32), float32)               # SRAM: one K/V tile of Bc = 32 rows, d <= 32
        V_j = cuda.shared.array((32, 32), float32)
        q_i = cuda.local.array(32, float32)                      # registers: this thread's row
        o_i = cuda.local.array(32, float32)
        S = cuda.local.array(32, float32)
        z = cuda.blockIdx.y
        t = cuda.threadIdx.x
        r0 = cuda.blockIdx.x * 32
        i = r0 + t
        Nq, Nk, d = Q.shape[1], K.shape[1], Q.shape[2]
        for x in range(d):                                       # FA2 Alg. 1 line 4: Q_i, once
            q_i[x] = Q[z, i, x] if i < Nq else ZERO
            o_i[x] = ZERO                                        # line 5: O~ = 0, l = 0, m = -inf
        m_i = NEG_INF
        l_i = ZERO
        n_tiles = (Nk + Bc - 1) // Bc
        last = min(r0 + 32, Nq) - 1 + diag                       # the block's last visible key
        if skip:
            n_tiles = min(n_tiles, last // Bc + 1) if last >= 0 else 0
        for jt in range(n_tiles):                                # line 6
            j0 = jt * Bc
            if first_barrier:
                cuda.syncthreads()                               # every thread is done with the last tile
            if j0 + t < Nk:                                      # line 7: K_j, V_j -> SRAM
                for x in range(d):
                    K_j[t, x] = K[z, j0 + t, x]
                    V_j[t, x] = V[z, j0 + t, x]
            cuda.syncthreads()
            if i < Nq:
                m_new = m_i                                      # line 8: S = Q_i K_jᵀ, m_new = max(m, rowmax S)
                for c in range(min(Bc, Nk - j0)):
                    s = NEG_INF
                    if j0 + c <= i + diag:
                        s = ZERO
                        for x in range(d):
                            s += q_i[x] * K_j[c, x]
                        s *= scale * unit
                    S[c] = s
                    m_new = max(m_new, s)
                if m_new != NEG_INF:                             # lines 9-10: P~, l, O~ rescaled once per tile
                    alpha = float32(math.exp(m_i - m_new)) if rescale else ONE
                    l_i *= alpha
                    for x in range(d):
                        o_i[x] *= alpha
                    for c in range(min(Bc, Nk - j0)):
                        p = float32(math.exp(S[c] - m_new))
                        l_i += p
                        for x in range(d):
                            o_i[x] += p * V_j[c, x]
                    m_i = m_new
        if i < Nq:                                               # lines 12-13: O = O~ / l, L = m + log l
            for x in range(d):
                O[z, i, x] = o_i[x] / l_i if l_i > ZERO else ZERO
            L[z, i] = m_i + float32(math.log(l_i)) if l_i > ZERO else NEG_INF

    return fa2_forward_rows


@check_05_6.solves
def _():
    return dict(kernel=_fa2_rows_kernel(), Bc=32)


@check_05_6.fails
def _():
    return dict(kernel=_fa2_rows_kernel(skip=False), Bc=32)       # every tile loaded: too many K/V reads


@check_05_6.fails
def _():
    return dict(kernel=_fa2_rows_kernel(rescale=False), Bc=32)    # l_i and o_i never rescaled: wrong O and L


@check_05_6.fails
def _():
    return dict(kernel=_fa2_rows_kernel(first_barrier=False), Bc=32)   # a tile overwritten while read: a race


@check_05_6.fails
def _():
    return dict(kernel=_fa2_rows_kernel(f64=True), Bc=32)            # right numbers, float64 arithmetic
