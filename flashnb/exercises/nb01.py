"""Exercises of notebook 01 (standard attention: three kernels, S and P through HBM)."""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32  # noqa: F401  (module globals: the simulator swaps `cuda` in a kernel's globals only)

from . import close, exercise, require


def _qkv(Nq, Nk, d, seed=1):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((1, Nq, d)), rng.standard_normal((1, Nk, d)), rng.standard_normal((1, Nk, d))


@functools.lru_cache(maxsize=None)
def _counted_forward(N, d, tile):
    """Counted traffic of the naive forward (one head, Nq = Nk = N) with the matmuls' tile ``tile``."""
    from .. import api
    from ..instruments import traffic

    q, k, v = _qkv(N, N, d)
    with traffic.count() as t:
        api.attention_forward(q, k, v, impl="naive", tile=tile)
    return t.summary()


def _reads(summary):
    return sum(sum(launch["reads"].values()) for launch in summary)


@exercise("01.1", "what a smaller matmul tile re-reads", level=1, minutes=10,
          hint="""naive.matmul_model(BH, rows, cols, inner, T) is the count of one matmul launch: A is read once per
          column tile of C (⌈cols/T⌉ times), B once per row tile (⌈rows/T⌉ times). Predict with T = 8, then check
          yourself: flashnb.attention_forward(q, k, v, impl="naive", tile=8) under traffic.count(), and
          naive.model_forward(1, 32, 32, 16, tile=8).""",
          explain="""Halving T doubles the number of output tiles along each side, so each operand of each matmul
          is re-read twice as often: A reads scale with ⌈cols/T⌉, B reads with ⌈rows/T⌉ -- factor 2 for Q and K in
          S = scale·QKᵀ and for P and V in O = PV (d = 16 is now two column tiles of O). The softmax's three reads
          of S and every write are unchanged. Shared-memory *reads* do not change: each output element still
          reads 2 values from SRAM per inner index (2·rows·cols·inner in all); what grows is the shared *writes*
          (one per global read). Small tiles are cheap on SRAM and expensive on HBM.""")
def check_01_1(reads_T8, operand_factor, shared_reads_factor):
    """reads_T8: global element reads of the whole naive forward (one head, N = 32, d = 16) with tile 8;
    operand_factor: by what factor the matmuls' operand reads change from T = 16 to T = 8;
    shared_reads_factor: by what factor the matmuls' shared-memory reads change."""
    t16, t8 = _counted_forward(32, 16, 16), _counted_forward(32, 16, 8)
    close(reads_T8, _reads(t8), what="reads_T8")
    mm = [i for i, launch in enumerate(t16) if set(launch["reads"]) == {"A", "B"}]   # the two matmul launches
    factors = {t8[i]["reads"][a] / t16[i]["reads"][a] for i in mm for a in ("A", "B")}
    require(len(factors) == 1, "internal: the operands' factors differ")   # pragma: no cover
    close(operand_factor, factors.pop(), rel=1e-9, what="operand_factor")
    close(shared_reads_factor, sum(t8[i]["shared_reads"] for i in mm) / sum(t16[i]["shared_reads"] for i in mm),
          rel=1e-9, what="shared_reads_factor")
    return f"{_reads(t16)} → {_reads(t8)} global reads; shared writes ×" \
           f"{sum(t8[i]['shared_writes'] for i in mm) / sum(t16[i]['shared_writes'] for i in mm):g}"


@check_01_1.solves
def _():
    from flashnb.stages import naive

    def matmul_reads(T):
        f = naive.model_forward(1, 32, 32, 16, tile=T)
        return sum(sum(launch["reads"].values()) for launch in f)

    s16 = naive.matmul_model(1, 32, 32, 16, T=16)          # S = scale·QKᵀ: (32 x 16) · (16 x 32)
    s8 = naive.matmul_model(1, 32, 32, 16, T=8)
    return dict(reads_T8=matmul_reads(8), operand_factor=s8["a_reads"] / s16["a_reads"],
                shared_reads_factor=s8["shared_reads"] / s16["shared_reads"])


@check_01_1.fails
def _():
    return dict(reads_T8=7168, operand_factor=2, shared_reads_factor=1)     # the T = 16 count: nothing changed


@check_01_1.fails
def _():
    return dict(reads_T8=11264, operand_factor=4, shared_reads_factor=8)    # "T² threads" / "T³ reads" thinking


# --------------------------------------------------------------------------- 01.2


@exercise("01.2", "a two-pass softmax in the naive forward", level=2, minutes=20,
          hint="""Replace passes 1 and 2 of naive.make_softmax_rows by one online pass (notebook 02, §3): per element
          s, m_new = max(m, s); l = l·e^(m - m_new) + e^(s - m_new) (skip the update while m_new is -inf); m = m_new.
          The lines of passes 1 and 2 are the kernel's region max-and-sum (show_source(naive.make_softmax_rows,
          region="max-and-sum")): registry.variant(naive.make_softmax_rows, regions={"max-and-sum": new}) replaces
          them by your lines `new`; run it with `with registry.using(naive.make_softmax_rows, variant):`. The saving:
          one read of S fewer per element.""",
          explain="""The online normaliser computes the maximum and the shifted sum in the same pass, so the softmax
          reads S twice (one pass for [m, l], one to normalise) instead of three times: 4·N_q·N_k bytes saved per
          head, 4 MiB at N = 1024. That is only about 5 % of this forward's traffic at d = 64: the 16-wide tiled
          matmuls re-read Q, K, P and V ⌈N/16⌉ times each, and P is still written and read once. The softmax is
          worth fixing, but the N² intermediates (and the tile re-reads) are the real bill -- FlashAttention
          removes them.""")
def check_01_2(variant, saving_bytes):
    """variant: a kernel factory replacing naive.make_softmax_rows (same arguments) whose kernel reads S
    twice; saving_bytes: the float32 bytes this saves in the forward of one head at N = 1024, d = 64."""
    from .. import api, reference, registry
    from ..instruments import traffic
    from ..stages import naive

    require(callable(variant), "variant must be a kernel factory (what registry.variant returns)")
    Nq, Nk = 20, 12                           # causal, Nq > Nk: the first 8 rows see no key, the others 1..12
    q, k, v = _qkv(Nq, Nk, 8, seed=Nq)
    with registry.using(naive.make_softmax_rows, variant), traffic.count() as t:
        o, lse = api.attention_forward(q, k, v, causal=True, impl="naive")
    o_ref, lse_ref = reference.attention_forward(q, k, v, causal=True)
    # float32 softmax of <= 12 keys and an O(1) weighted sum: well within 1e-5
    require(np.allclose(o, o_ref, atol=1e-5) and np.allclose(lse, lse_ref, atol=1e-5),
            f"wrong output (Nq={Nq}, Nk={Nk}, causal) -- look at fully masked rows and at rows whose maximum "
            "changes as you go")
    s_reads = next(x for x in t.summary() if x["launch"] == "P = softmax(S)")["reads"].get("S", 0)
    require(s_reads == 2 * Nq * Nk, f"the softmax reads S {s_reads / (Nq * Nk):g} times per element; a two-pass "
            "softmax reads it twice")
    close(saving_bytes, 4 * 1024 * 1024, rel=1e-6, what="saving_bytes")
    model = naive.model_forward(1, 1024, 1024, 64)
    total = 4 * sum(sum(x["reads"].values()) + sum(x["writes"].values()) for x in model)
    return f"that is {saving_bytes / total:.1%} of the forward's {total / 2**20:.0f} MiB"


@check_01_2.solves
def _():
    from flashnb import registry
    from flashnb.stages import naive

    online = """
m = NEG_INF
l = float32(0.0)
for j in range(n):                       # pass 1: [m, l] = [m, l] ⊕ [s, 1], the online normaliser
    s = S[z, i, j]
    m_new = max(m, s)
    if m_new != NEG_INF:
        l = l * float32(math.exp(m - m_new)) + float32(math.exp(s - m_new))
    m = m_new
m_safe = m if m != NEG_INF else float32(0.0)
"""
    two_pass = registry.variant(naive.make_softmax_rows, regions={"max-and-sum": online})
    return dict(variant=two_pass, saving_bytes=4 * 1024 * 1024)      # one float32 read of S per element fewer


@check_01_2.fails
def _():
    from flashnb.stages import naive

    return dict(variant=naive.make_softmax_rows, saving_bytes=4 * 1024 * 1024)   # still three passes


@check_01_2.fails
def _():
    sol = check_01_2.solution()
    return dict(variant=sol["variant"], saving_bytes=8 * 1024 * 1024)   # counts a write that does not go away


# --------------------------------------------------------------------------- 01.3


def _sectors(offsets):
    from ..sim.memprofile import request_cost

    return request_cost("global", [(4 * o, 4) for o in offsets])[0]


@exercise("01.3", "one thread per row: what a warp's request costs", level=1, minutes=10,
          hint="""In softmax_rows lane l of a warp handles row i0 + l, and at step j all 32 lanes read S[z, i0 + l, j]:
          element offsets l·N_k + j. Which 32-byte sectors do those 32 float32 addresses fall into? You can also
          profile: `with flashnb.sim.profile() as prof:` run the naive forward, then
          prof.select(launch="P = softmax(S)", array="S").""",
          explain="""With one thread per row the lanes of a warp read addresses N_k floats apart: for N_k >= 8 every
          lane hits its own 32-byte sector, so one request moves 32 sectors (1024 bytes) to deliver 128 useful
          bytes -- 8x the ideal. If a block (or a warp) handled one row, lane l would read S[i, j0 + l]: 32
          consecutive floats, 4 sectors. The *element* count does not change -- each element of S is still read
          three times and P written once -- only how the accesses group into sectors, which the traffic counter
          (a program-level count) does not see and the memory profiler does.""")
def check_01_3(sectors_per_request, sectors_row_per_block, count_changes):
    """For N_k = 64: sectors one warp request of softmax_rows' S reads touches today; the same if the warp's
    lanes read 32 consecutive elements of one row; and whether the traffic *count* would change (True/False)."""
    Nk = 64
    close(sectors_per_request, _sectors([lane * Nk for lane in range(32)]), what="sectors_per_request")
    close(sectors_row_per_block, _sectors(list(range(32))), what="sectors_row_per_block")
    require(isinstance(count_changes, (bool, np.bool_)), "count_changes must be True or False")
    require(not count_changes, "count_changes: the traffic counter counts elements, not sectors -- how many "
            "times is each element of S read in either layout?")


@check_01_3.solves
def _():
    import numpy as np

    Nk = 64
    one_thread_per_row = 4 * (np.arange(32) * Nk)          # byte offsets of lane l: row i0 + l, same column
    one_row_per_warp = 4 * np.arange(32)                   # lane l: column j0 + l of one row
    return dict(sectors_per_request=len(np.unique(one_thread_per_row // 32)),
                sectors_row_per_block=len(np.unique(one_row_per_warp // 32)), count_changes=False)


@check_01_3.fails
def _():
    return dict(sectors_per_request=4, sectors_row_per_block=4, count_changes=False)


@check_01_3.fails
def _():
    return dict(sectors_per_request=32, sectors_row_per_block=4, count_changes=True)


# --------------------------------------------------------------------------- 01.4

_RECOMPUTE = ("S = scale·QKᵀ", "P = exp(S - L)")     # the launches that rebuild P from Q, K and L


@exercise("01.4", "what storing P would save in the backward", level=2, minutes=15,
          hint="""Run flashnb.attention_backward(q, k, v, o, lse, do, impl="naive") under traffic.count() and print
          it: which launches only exist to rebuild P? Copy their labels. For the fraction use
          naive.model_backward(1, 1024, 1024, 64) and sum reads + writes per launch.""",
          explain="""naive.backward starts with two launches that recompute what the forward already had: S = scale·QKᵀ
          (a full tiled matmul) and P = exp(S - L) (read S, write P). An implementation that kept P from the
          forward would skip both and start at dV = PᵀdO -- at the price of an N_q x N_k matrix held in HBM from
          the forward to the backward (for long sequences, more memory than the GPU has; see §"Memory
          footprint"). At N = 1024, d = 64 the two launches are about a fifth of the backward's accesses.
          FlashAttention recomputes too, but tile by tile on chip, so the recomputation costs FLOPs, not HBM
          traffic.""")
def check_01_4(skipped, saved_fraction):
    """skipped: the labels of the naive.backward launches a backward with a stored P would not run;
    saved_fraction: their share of the backward's global element accesses (one head, N = 1024, d = 64)."""
    from ..stages import naive

    model = naive.model_backward(1, 1024, 1024, 64)
    labels = [m["launch"] for m in model]
    require(isinstance(skipped, (set, frozenset, list, tuple)), "skipped must be a set of launch labels")
    given = {str(s).strip() for s in skipped}
    unknown = sorted(given - set(labels))
    require(not unknown, f"not launches of naive.backward: {unknown} (copy the labels from the traffic table)")
    missing, extra = set(_RECOMPUTE) - given, given - set(_RECOMPUTE)
    require(not missing and not extra, f"{len(missing)} launch(es) missing, {len(extra)} that a stored P does not "
            "remove: which launches only produce S or P?")

    def accesses(m):
        return sum(m["reads"].values()) + sum(m["writes"].values())

    truth = sum(accesses(m) for m in model if m["launch"] in _RECOMPUTE) / sum(accesses(m) for m in model)
    close(saved_fraction, truth, rel=0.01, what="saved_fraction")


@check_01_4.solves
def _():
    from flashnb.stages import naive

    model = naive.model_backward(1, 1024, 1024, 64)
    total = {m["launch"]: sum(m["reads"].values()) + sum(m["writes"].values()) for m in model}
    skipped = {"S = scale·QKᵀ", "P = exp(S - L)"}
    return dict(skipped=skipped, saved_fraction=sum(total[s] for s in skipped) / sum(total.values()))


@check_01_4.fails
def _():
    return dict(skipped={"P = exp(S - L)"}, saved_fraction=0.05)     # forgets that S is recomputed too

