# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 05 · FlashAttention-2, forward: three changes, each counted
#
# FlashAttention-1 (notebook 03) already keeps $S$ and $P$ on chip. It still reaches only 25–40 % of an A100's
# theoretical maximum FLOPs/s, and the FlashAttention-2 paper makes **three changes** and gets about 2× the
# speed of FA1 (both figures: Dao 2023, *FlashAttention-2*, Abstract and Section 1; the changes are its
# Sections 3.1, 3.2 and 3.3):
#
# 1. **fewer non-matmul operations**: keep $\tilde O_i$ *unscaled* and divide by $\ell_i$ once, at the end
#    (delayed rescaling); store one statistic $L_i = m_i + \log \ell_i$ instead of $m$ and $\ell$;
# 2. **parallelism over the sequence**: the loop over query blocks becomes the grid, so thread blocks =
#    $T_r \times$ batch·heads instead of batch·heads;
# 3. **split-Q instead of split-K** inside a thread block: each warp owns its own query rows, so warps never
#    exchange partial results through shared memory.
#
# Each change gets a number below, *counted* or *modelled* without a GPU: non-matmul operations per tile
# (counted in NumPy), busy SMs (from the grid each algorithm launches), and shared-memory traffic (counted on
# the simulator). Their effect on speed is measured only where a GPU is present (the last section).
#
# FA2 **Algorithm 1** (one thread block per $(i, \text{batch·head})$):
#
# | line | |
# |---|---|
# | 4 | load $Q_i$ to SRAM (once) |
# | 5 | $\tilde O_i = 0$, $\ell_i = 0$, $m_i = -\infty$ (registers) |
# | 6–7 | for each $j$: load $K_j, V_j$ to SRAM |
# | 8 | $S_{ij} = Q_i K_j^\top$ |
# | 9 | $m_{new} = \max(m_i, \mathrm{rowmax}\,S_{ij})$, $\tilde P_{ij} = e^{S_{ij} - m_{new}}$, $\ell_i = e^{m_i - m_{new}}\ell_i + \mathrm{rowsum}\,\tilde P_{ij}$ |
# | 10 | $\tilde O_i = \mathrm{diag}(e^{m_i - m_{new}})\,\tilde O_i + \tilde P_{ij} V_j$ |
# | 12–14 | $O_i = \mathrm{diag}(\ell_i)^{-1}\tilde O_i$, $L_i = m_i + \log \ell_i$; write $O_i$, $L_i$ |

# %%
import os
import time

import matplotlib.pyplot as plt
import numpy as np

os.environ["FLASHNB_DEVICE"] = "sim"  # counting traffic needs the simulator; GPU timings run in a process of their own
import flashnb
from flashnb import reference
from flashnb.instruments import roofline, traffic
from flashnb.notebook import savefig, show_source
from flashnb.stages import fa1, fa2, fa2_steps, naive

T0 = time.perf_counter()
print("kernels run on the Numba CUDA simulator; GPU timings:",
      "on this machine's GPU, in a separate process" if flashnb.instruments.bench.gpu_available() else "none (no GPU here)")
rng = np.random.default_rng(5)

# %% [markdown]
# ## The ladder: Algorithm 1, then three kernels
#
# The kernel this notebook ends with does three things at once: it runs Algorithm 1, it splits a block's query
# rows over warps (split-Q), and it gives every lane a small register tile of $S$ and $\tilde O$ whose entries
# travel between lanes by shuffles. We add them one at a time; every step is a real kernel from the package,
# checked against the float64 reference and counted on the simulator:
#
# | step | code | what it adds |
# |---|---|---|
# | 0 | `fa2_steps.fa2_forward_numpy` | Algorithm 1 in NumPy, each block tagged with its line |
# | (a) | `fa2_steps.make_rows_forward`, `impl="fa2-rows"` | one CUDA thread per query row: delayed rescaling and $L$, nothing else |
# | (b) | `fa2_steps.make_splitq_forward`, `impl="fa2-splitq"` | the block's rows split over warps, $Q_i$ in shared memory |
# | (c) | `fa2.make_forward`, `impl="fa2"` | register micro-tiles, $\tilde P$ passed by shuffles |
#
# ### Step 0 · Algorithm 1 in NumPy

# %%
show_source(fa2_steps.fa2_forward_numpy)
q, k, v = (rng.standard_normal((n, 16)) for n in (40, 56, 56))
for causal in (False, True):
    O_np, L_np = fa2_steps.fa2_forward_numpy(q, k, v, Br=16, Bc=16, causal=causal)
    o_ref, lse_ref = reference.attention_forward(q, k, v, causal=causal)
    err = max(np.abs(O_np - o_ref).max(), np.abs(L_np - lse_ref).max())
    print(f"causal={causal}: NumPy Algorithm 1 vs the float64 reference, max error {err:.1e}")
    assert err < 1e-12                    # both float64: only the order of the sums differs

# %% [markdown]
# ### Line 10 as printed and as computed
#
# The paper prints line 10 as $\tilde O_i^{(j)} = \mathrm{diag}(e^{m_i^{(j-1)} - m_i^{(j)}})^{-1}\,
# \tilde O_i^{(j-1)} + \tilde P_i^{(j)} V_j$. The $^{-1}$ is a typo (Dao-AILab/flash-attention issue #991):
# $\tilde O_i^{(j-1)}$ was accumulated with weights $e^{S - m^{(j-1)}}$, and moving it to the new max means
# *multiplying* by $e^{m^{(j-1)} - m^{(j)}} \le 1$ — what line 9 does to $\ell$, what the transcription above
# computes, and what every kernel below computes. The printed inverse multiplies by $e^{m^{(j)} - m^{(j-1)}} \ge 1$
# instead; the two agree only while the row max does not change. Both rules on one query block:

# %%
def line10_rules(Q, K, V, Bc):
    """One query block through Algorithm 1, line 10 as the code computes it and as the paper prints it."""
    tau = 1 / np.sqrt(Q.shape[1])
    out = {}
    for rule in ("computed", "printed"):
        O, l, m = np.zeros((len(Q), V.shape[1])), np.zeros(len(Q)), np.full(len(Q), -np.inf)
        for j0 in range(0, len(K), Bc):
            S = tau * Q @ K[j0:j0 + Bc].T                          # line 8
            m_new = np.maximum(m, S.max(axis=1))                   # line 9
            P = np.exp(S - m_new[:, None])
            alpha = np.exp(m - m_new)                              # e^(m_old - m_new) <= 1 (0 on the first tile)
            l = alpha * l + P.sum(axis=1)
            if j0 == 0:                                            # O~ = 0 so far: both rules give P~ V_1
                O = P @ V[j0:j0 + Bc]
            else:                                                  # line 10
                O = (alpha if rule == "computed" else 1 / alpha)[:, None] * O + P @ V[j0:j0 + Bc]
            m = m_new
        out[rule] = O / l[:, None]                                 # line 12
    return out


q, k, v = (rng.standard_normal((n, 16)) for n in (16, 64, 64))
o_ref = reference.attention_forward(q, k, v)[0]
errs = {rule: np.abs(o - o_ref).max() for rule, o in line10_rules(q, k, v, Bc=16).items()}
print(f"max |O - reference|: line 10 as computed {errs['computed']:.1e}, as printed {errs['printed']:.1e}")
assert errs["computed"] < 1e-12 and errs["printed"] > 1e-2

# %% [markdown]
# ### Step (a) · one thread per query row
#
# The smallest kernel that is FlashAttention-2: grid $(T_r, \text{batch·heads})$ and one thread per row of
# the block. All threads of a block load $K_j, V_j$ into shared memory together (`common.load_rows`,
# consecutive threads read consecutive addresses), then each thread walks the tile for its own row: its row
# of $Q_i$ and of $\tilde O_i$ are thread-private arrays, $m$ and $\ell$ are scalars. $\tilde O$ is multiplied
# by $e^{m - m_{new}}$ per tile and divided by $\ell$ once at the end (delayed rescaling), and the only
# statistic written is $L = m + \log \ell$. Nothing else: no thread or warp ever reads another's row.

# %%
show_source(fa2_steps.make_rows_forward)

# %% [markdown]
# Checked against the reference (ragged lengths, $N_q \ne N_k$, causal or not; `check_step` also compares the
# counted traffic with the step's model), then counted on one problem that every step below also runs
# (one head, $N = 128$, $d = 16$, $B_r = 64$, $B_c = 16$, 2 warps where a kernel has warps; no causal mask and
# no ragged tile, so every kernel does exactly $2N^2 d$ FMAs: $N^2 d$ for $S = QK^\top$ and $N^2 d$ for
# $\tilde P V$):

# %%
LADDER = dict(BH=1, N=128, d=16, Br=64, Bc=16, warps=2)
ladder = {}                                       # step -> its counted launch on the LADDER problem


def check_step(step, impl, model, **tiles):
    """Check `impl` against the reference (Nq = 40, Nk = 56, d = 16, causal and not) and its model, then count
    it on the LADDER problem; print shared reads, writes and FMAs per shared read."""
    q, k, v = (rng.standard_normal((1, n, 16)) for n in (40, 56, 56))
    err = 0.0
    for causal in (False, True):
        with traffic.count() as t:
            o, lse = flashnb.attention_forward(q, k, v, causal=causal, impl=impl, **tiles)
        o_ref, lse_ref = reference.attention_forward(q, k, v, causal=causal)
        # float32 kernel vs float64 reference, d = 16, 56 keys: rounding stays far below 1e-5
        np.testing.assert_allclose(o, o_ref, atol=1e-5)
        np.testing.assert_allclose(lse, lse_ref, atol=1e-5)
        assert t.summary() == model(1, 40, 56, 16, causal=causal, **tiles)
        err = max(err, np.abs(o - o_ref).max(), np.abs(lse - lse_ref).max())
    BH, N, d = LADDER["BH"], LADDER["N"], LADDER["d"]
    opts = {key: LADDER[key] for key in tiles}
    q, k, v = (rng.standard_normal((BH, N, d)) for _ in range(3))
    with traffic.count() as t:
        flashnb.attention_forward(q, k, v, impl=impl, **opts)
    assert t.summary() == model(BH, N, N, d, **opts)
    ladder[step] = t
    s = t.summary()[0]
    fmas = 2 * BH * N * N * d
    print(f"step {step} ({impl}, {tiles}): max error {err:.1e}, counted traffic == model; on the ladder problem {opts}: "
          f"shared reads {s['shared_reads']:,}, shared writes {s['shared_writes']:,}, "
          f"FMAs per shared read {fmas / s['shared_reads']:.2f}")


check_step("(a)", "fa2-rows", fa2_steps.model_rows_forward, Br=16, Bc=16)
assert 2 * 128 * 128 * 16 == ladder["(a)"].summary()[0]["shared_reads"]   # one shared read per FMA

# %% [markdown]
# One shared read per FMA: $S$ reads one element of $K_j$ per multiply-add (the $Q$ row is thread-private) and
# $\tilde P V$ one of $V_j$. All 32 lanes of a warp read the *same* $K_j$ element at the same time, a
# broadcast. The price is $2d$ thread-private floats per thread (its rows of $Q$ and $\tilde O$), indexed in
# loops the compiler keeps rolled: they live in local memory, not registers (stack bytes in the resources
# section below).
#
# ### Step (b) · split-Q: each warp owns its rows
#
# The same algorithm with the FA2 paper's work split (its Section 3.3): the block's $B_r$ rows are split over
# `warps` warps, warp $w$ owning $B_r/\text{warps}$ consecutive rows and each lane $R = B_r/(32\cdot
# \text{warps})$ of them (one after another). $Q_i$ is loaded into shared memory once per block, as Algorithm 1
# line 4 says (stored transposed, so the 32 lanes, which own consecutive rows, read consecutive addresses).
# $K_j, V_j$ are read by every warp; no warp ever reads a result of another warp, so the only barriers are the
# two around each $K_j, V_j$ load.

# %%
show_source(fa2_steps.make_splitq_forward)
check_step("(b)", "fa2-splitq", fa2_steps.model_splitq_forward, Br=32, Bc=16, warps=1)
assert 3 * 128 * 128 * 16 == ladder["(b)"].summary()[0]["shared_reads"]   # 2 reads per S FMA, 1 per PV FMA

# %% [markdown]
# Now $S$ reads $Q_i$ *and* $K_j$ from shared memory for every FMA: 2/3 FMA per shared read, less than step (a).
# This is the inner loop FA1's split-K kernel has too; the experiment in "Change 3" below compares the two.
#
# ### Step (c) · register micro-tiles: the kernel of `flashnb.stages.fa2`
#
# The thread block has `32·warps` threads. A warp's 32 lanes form a $4 \times 8$ grid (`LR × LC`). Lane
# $(l_r, l_c)$ of warp $w$ owns query rows $w\,B_r/\text{warps} + l_r + 4a$ ($a < T_M$), key columns
# $l_c + 8b$ of the score tile ($b < T_N$) and head-dim columns $l_c + 8e$ of $\tilde O$: small register
# tiles. The 8 lanes of one row group share a row of $S$: the row max is a 3-step `shfl_xor` butterfly
# (`group_max`, printed after the kernel; `group_sum` is the same with a sum) and $\tilde P V$ fetches each
# $\tilde P_{ij}$ from its owner lane with `shfl_sync`. The tiles are loaded by `common.load_rows_T` (transposed)
# and `common.load_rows`: consecutive threads read consecutive addresses, and rows past $N$ are zero.
#
# Lines 8-10 for one K/V tile are the device function `fa2_tile`, what a lane does on its micro-tile (with the
# file's line numbers; `show_source(fa2.make_forward)` prints the whole factory):

# %%
show_source(fa2.make_forward, region="fa2_tile")
show_source(fa2.group_max)

# %% [markdown]
# Around it, the kernel: $Q_i$ loaded once (line 4), then line 6's loop -- how many K/V tiles the block visits
# (causal: none entirely above the diagonal), the barrier before $K_j, V_j$ are overwritten, the loads (line 7),
# `fa2_tile` -- and lines 12-14, where each row's $\ell_i$ is summed across its row group once, at the end:

# %%
show_source(fa2.make_forward, region="tile-count")
show_source(fa2.make_forward, region="kv-barrier")
show_source(fa2.make_forward, region="kv-load")
show_source(fa2.make_forward, region="epilogue")

# %% [markdown]
# Checked and counted like steps (a) and (b). Each lane now holds a $T_M \times T_N$ tile of $S$ and reads
# $T_M$ values of $Q_i$ and $T_N$ of $K_j$ per $k$ for $T_M T_N$ FMAs; each $V_j$ element it reads feeds $T_M$
# FMAs ($\tilde P$ arrives by shuffle, not from shared memory):

# %%
check_step("(c)", "fa2", fa2.model_forward, Br=16, Bc=16, warps=1)
r = fa2.fmas_per_shared_read(LADDER["Br"], LADDER["Bc"], LADDER["d"], LADDER["warps"])
assert 2 * 128 * 128 * 16 / ladder["(c)"].summary()[0]["shared_reads"] == r["tile"]
print(f"fa2.fmas_per_shared_read at the ladder tiles: S {r['qk']:.2f}, PV {r['pv']:.1f}, tile {r['tile']:.2f}")

# %% [markdown]
# ## Change 1 · delayed rescaling: non-matmul operations per tile
#
# FA1 (Alg. 1 line 12) rescales $O_i$ by $\mathrm{diag}(\ell_{new})^{-1}$ on every tile; FA2 multiplies
# $\tilde O_i$ by $e^{m_i - m_{new}}$ only and divides once at the end. Below, both update rules run in NumPy
# with every non-matmul operation on $O$ and on the statistics *counted* as it happens; both must give
# the same $O$.

# %%
def run_rule(S_tiles, V_tiles, rule):
    """Online softmax over tiles with FA1's or FA2's output update; returns O and the count of
    non-matmul element operations (multiplies, divides, adds outside the matmuls, exps, max/compare)."""
    Br, d = S_tiles[0].shape[0], V_tiles[0].shape[1]
    O, l, m = np.zeros((Br, d)), np.zeros(Br), np.full(Br, -np.inf)
    ops = []
    for S, V in zip(S_tiles, V_tiles):
        n = 0
        mt = S.max(1)
        n += S.size                                   # row max
        mn = np.maximum(m, mt)
        n += Br
        P = np.exp(S - mn[:, None])
        n += 2 * S.size                               # subtract, exp
        PV = P @ V                                    # matmul: not counted
        if rule == "fa1":                             # l~ = rowsum(P~) with m~ ; O = diag(l_new)^-1 (...)
            ln = np.exp(m - mn) * l + P.sum(1)
            n += S.size + 3 * Br
            O = (l * np.exp(m - mn))[:, None] * O / ln[:, None] + PV / ln[:, None]
            n += 2 * Br + 4 * O.size                  # weights; 2 multiplies/divides, 1 divide, 1 add per element
        else:                                         # FA2: O~ = diag(e^(m - m_new)) O~ + P~ V
            a = np.exp(m - mn)
            l = a * l + P.sum(1)
            n += 2 * Br + S.size + 2 * Br
            O = a[:, None] * O + PV
            n += O.size                               # 1 multiply per element (the add fuses into the matmul)
        if rule == "fa1":
            l = ln
        m = mn
        ops.append(n)
    if rule == "fa2":
        O = O / l[:, None]                            # once, at the end
        ops.append(O.size + Br)
    return O, ops


Br_, Bc_, d_, Tc_ = 64, 64, 64, 8
S_tiles = [rng.standard_normal((Br_, Bc_)) for _ in range(Tc_)]
V_tiles = [rng.standard_normal((Bc_, d_)) for _ in range(Tc_)]
O1, ops1 = run_rule(S_tiles, V_tiles, "fa1")
O2, ops2 = run_rule(S_tiles, V_tiles, "fa2")
assert np.allclose(O1, O2)
print("same O:", np.allclose(O1, O2))
print(f"non-matmul ops per tile (Br = Bc = d = 64): FA1 {ops1[0]}, FA2 {ops2[0]} "
      f"(+ {ops2[-1]} once at the end)")
print(f"on O alone: FA1 {4 * Br_ * d_} per tile, FA2 {Br_ * d_} per tile -- over {Tc_} tiles "
      f"FA1 {sum(ops1)} vs FA2 {sum(ops2)} in total ({sum(ops1) / sum(ops2):.2f}x)")
print("matmul FLOPs per tile:", 4 * Br_ * Bc_ * d_)
a100 = roofline.get_gpu("A100 80GB SXM")
print(f"A100 (FA2 paper, Section 3.1): FP16 tensor-core matmul {a100.tensor_fp16_dense / 1e12:.1f} TFLOP/s vs "
      f"FP32 non-matmul {a100.fp32_peak / 1e12:.1f} TFLOP/s: a non-matmul FLOP costs "
      f"{a100.tensor_fp16_dense / a100.fp32_peak:.0f} matmul FLOPs there")

# %% [markdown]
# The last printed ratio is the FA2 paper's argument (Section 3.1): on an A100 matmuls run on tensor cores
# and everything else on the much slower FP32 units, so each non-matmul FLOP saved is worth many matmul
# FLOPs. flashnb's kernels do **both** on FP32 CUDA cores (FMAs, no tensor cores), so that weighting does not
# apply here: what delayed rescaling gains in flashnb is just the op-count ratio counted above (the
# "in total" line), a small part of the work next to the matmul FLOPs.
#
# ## Change 2 · parallelism over the sequence: thread blocks and busy SMs
#
# FA1's grid is batch·heads (one block walks the whole sequence); FA2's is $T_r$ × batch·heads. With long
# sequences and few heads per GPU, FA1 leaves most SMs idle.

# %%
N = 2048
BHs = np.array([1, 2, 4, 8, 16, 32, 64, 128])
fig, ax = plt.subplots(figsize=(6.5, 3.6))
for name in ("A100 80GB SXM", "H100 SXM"):
    sms = roofline.get_gpu(name).sm_count
    for impl, blocks in (("FA1", BHs), ("FA2", BHs * -(-N // fa2.default_tiles(64)["Br"]))):
        busy = np.minimum(blocks, sms) / sms
        ax.plot(BHs, 100 * busy, marker="o", label=f"{impl}, {name} ({sms} SMs)")
ax.set_xscale("log", base=2)
ax.set_xlabel("batch · heads")
ax.set_ylabel("SMs with a thread block (%)")
ax.set_title(f"N = {N}, d = 64 (FA2 Br = {fa2.default_tiles(64)['Br']})")
ax.legend(fontsize=7)
savefig(fig, "05_busy_sms")
plt.show()
Tr = -(-N // fa2.default_tiles(64)["Br"])       # FA2's query blocks per head
h100 = roofline.get_gpu("H100 SXM").sm_count
for bh in (1, 8, 32):
    print(f"batch·heads = {bh}: FA1 {bh} blocks, FA2 {bh} x Tr = {bh * Tr} blocks; "
          f"H100 SMs busy FA1 {min(bh, h100)}/{h100}, FA2 {min(bh * Tr, h100)}/{h100}")

# %% [markdown]
# ## Change 3 · split-K vs split-Q: shared-memory traffic and FMAs per shared read
#
# FA1 splits the key tile over its warps (split-K): every warp writes a partial $\tilde P V$, $m$, $\ell$ to
# shared memory, the block synchronises and merges them. FA2 splits the query rows (split-Q): no partial
# results. FA2's kernel also tiles registers, which is a second, separate change; the ladder keeps them apart.
# FA1 (split-K), step (b) (split-Q, no register tiles) and step (c) (split-Q with register tiles) run the
# ladder problem with the same $B_r$, $B_c$, $d$ and warps (step (a), one thread per row, for comparison),
# and the counted shared-memory accesses are sorted by the array they touch: the $Q$, $K$, $V$ tiles (their
# loads and the inner loops' reads), FA1's split-K merge (every warp's partial $m$, $\ell$, $\tilde P V$ and
# the merge weights: `m_w`, `l_w`, `O_w`, `a_i`) and FA1's staging of $O_i, \ell_i, m_i$ (its loop order reads
# them from HBM into shared memory for every $(i, j)$).

# %%
BH, N, d = LADDER["BH"], LADDER["N"], LADDER["d"]
tiles, W = dict(Br=LADDER["Br"], Bc=LADDER["Bc"]), LADDER["warps"]
q, k, v = (rng.standard_normal((BH, N, d)) for _ in range(3))
with traffic.count() as t:
    flashnb.attention_forward(q, k, v, impl="fa1", **tiles, warps=W)
assert t.summary() == fa1.model_forward(BH, N, N, d, **tiles, warps=W)
runs = {"FA1\nsplit-K": t, "(a) rows": ladder["(a)"], "(b) split-Q": ladder["(b)"], "(c) split-Q\n+ reg. tiles": ladder["(c)"]}
MERGE = {"m_w", "l_w", "O_w", "a_i"}
STAGING = {"O_i", "l_i", "m_i"}
fmas = 2 * BH * N * N * d
split = {}                                        # name -> {category: (reads, writes)}
for name, counted in runs.items():
    cats = {"Q, K, V tiles": [0, 0], "split-K merge": [0, 0], "O, l, m staging": [0, 0]}
    for array, e in counted.totals_by_array().items():
        if e["kind"] == "shared":
            a = array.split(":", 1)[1]
            cat = "split-K merge" if a in MERGE else "O, l, m staging" if a in STAGING else "Q, K, V tiles"
            cats[cat][0] += e["reads"]
            cats[cat][1] += e["writes"]
    split[name] = cats
    reads = sum(r for r, _ in cats.values())
    assert reads == sum(x["shared_reads"] for x in counted.summary())
    print(f"{name.replace(chr(10), ' '):26s} FMAs per shared read {fmas / reads:4.2f}   " + "   ".join(
        f"{c}: {r:,} reads, {w:,} writes" for c, (r, w) in cats.items() if r or w))

fa1_qkv, b_qkv, c_qkv = (split[n]["Q, K, V tiles"][0] for n in ("FA1\nsplit-K", "(b) split-Q", "(c) split-Q\n+ reg. tiles"))
fa1_reads = sum(r for r, _ in split["FA1\nsplit-K"].values())
assert fa1_qkv == b_qkv                           # split-Q leaves the inner loops' reads exactly as they were
assert 3 * fmas == 2 * b_qkv                      # (b), like FA1: 2 reads per FMA of S, 1 per FMA of P~V
assert c_qkv < b_qkv                              # register tiles cut them
print(f"split-Q alone (FA1 -> (b)): Q, K, V tile reads unchanged ({fa1_qkv:,} = {b_qkv:,}); gone: the merge "
      f"({sum(split['FA1' + chr(10) + 'split-K']['split-K merge']):,} accesses) and the staging "
      f"({sum(split['FA1' + chr(10) + 'split-K']['O, l, m staging']):,}); FMAs per shared read "
      f"{fmas / fa1_reads:.2f} -> {fmas / b_qkv:.2f}")
print(f"register tiles alone ((b) -> (c)): Q, K, V tile reads {b_qkv:,} -> {c_qkv:,} ({b_qkv / c_qkv:.1f}x fewer); "
      f"FMAs per shared read {fmas / b_qkv:.2f} -> {fmas / c_qkv:.2f}")

fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
names = list(split)
axes[0].bar(names, [fmas / sum(r for r, _ in split[n].values()) for n in names], color=["C3", "C7", "C0", "C2"])
axes[0].set_ylabel("FMAs per shared-memory read")
axes[0].set_title(f"counted: N = {N}, d = {d}, Br = {tiles['Br']}, Bc = {tiles['Bc']}, {W} warps")
bottom = np.zeros(len(names))
for cat, colour in (("Q, K, V tiles", "C0"), ("split-K merge", "C3"), ("O, l, m staging", "C1")):
    height = np.array([sum(split[n][cat]) / fmas for n in names])
    axes[1].bar(names, height, bottom=bottom, color=colour, label=cat)
    bottom += height
axes[1].set_ylabel("shared accesses (reads + writes) per FMA")
axes[1].legend(fontsize=8)
savefig(fig, "05_split_q_vs_register_tiles")
plt.show()

# %% [markdown]
# Read the two steps apart. **Split-Q** (FA1 → (b)) leaves the inner loops exactly as they were, two shared
# reads per FMA of $S$ and one per FMA of $\tilde P V$, and removes the warps' exchange of partial results
# through shared memory (and the barriers around it). **Register tiling** ((b) → (c)) is what changes the
# FMAs per shared read: each value read from shared memory feeds $T_M$ or $T_N$ FMAs. Step (a)'s one read per
# FMA comes from keeping a whole $Q$ row per thread, which does not scale with $d$ (stack bytes in the resources
# section below).
#
# Do the two effects hold at the tile sizes the kernels actually use? The inner loops' FMAs per shared read
# follow from the tiles alone: without register tiles (FA1's loops, and step (b)'s) a score of $S$ reads a row
# of $Q_i$ and one of $K_j$ ($2d$ reads for $d$ FMAs) and $\tilde P V$ one element of $V_j$ per FMA, whatever
# the tiles; with them (`fa2.fmas_per_shared_read`) the ratio grows with the register tile $T_M \times T_N$:

# %%
def inner_loop_fmas_per_shared_read_without_register_tiles(Br, Bc, d):
    """FA1's inner loops (the `3·Br·Bc·d` term of fa1.model_forward's shared reads) and step (b)'s: a score of
    S = Q_i K_jᵀ reads a row of Q_i and one of K_j (2d elements) for d FMAs; P̃V reads d elements of V_j per
    score for d FMAs."""
    qk_fmas, qk_reads = Br * Bc * d, Br * Bc * 2 * d
    pv_fmas, pv_reads = Br * Bc * d, Br * Bc * d
    return dict(qk=qk_fmas / qk_reads, pv=pv_fmas / pv_reads)


r0 = inner_loop_fmas_per_shared_read_without_register_tiles(LADDER["Br"], LADDER["Bc"], LADDER["d"])
r1 = fa2.fmas_per_shared_read(LADDER["Br"], LADDER["Bc"], LADDER["d"], LADDER["warps"])
assert np.isclose(fmas / b_qkv, 1 / (1 / (2 * r0["qk"]) + 1 / (2 * r0["pv"])))   # the counted (b) above
assert np.isclose(fmas / c_qkv, r1["tile"])                                       # the counted (c) above
for d_ in (32, 64, 128):
    t = fa2.default_tiles(d_)
    r = fa2.fmas_per_shared_read(t["Br"], t["Bc"], d_, t["warps"])
    r0 = inner_loop_fmas_per_shared_read_without_register_tiles(t["Br"], t["Bc"], d_)
    print(f"d={d_}, FA2 default tiles {t}: inner-loop FMAs per shared read without register tiles (FA1, step (b)): "
          f"S {r0['qk']:.2f}, PV {r0['pv']:.2f};  with them (step (c), fa2): S {r['qk']:.2f}, PV {r['pv']:.1f}, "
          f"tile {r['tile']:.2f}")

# %% [markdown]
# ### The warp layout
#
# Which warp and which lane own which element of the score tile, at the default tiles for $d = 64$ (printed
# below, with the register tile $T_M \times T_N$ each lane holds). The register tile is strided by `LR` rows
# and `LC` columns so that neighbouring lanes read neighbouring shared-memory addresses.

# %%
def owner(Br, Bc, warps):
    g = fa2.geometry(Br, Bc, 8, warps)
    warp = np.zeros((Br, Bc), int)
    lane = np.zeros((Br, Bc), int)
    for w in range(warps):
        for lr in range(fa2.LR):
            for lc in range(fa2.LC):
                for a in range(g["TM"]):
                    for b in range(g["TN"]):
                        r, c = w * g["TM"] * fa2.LR + lr + fa2.LR * a, lc + fa2.LC * b
                        warp[r, c], lane[r, c] = w, lr * fa2.LC + lc
    return warp, lane


tw = fa2.default_tiles(64)
gw = fa2.geometry(tw["Br"], tw["Bc"], 64, tw["warps"])
print(f"default tiles, d = 64: {tw}; register tile per lane TM x TN = {gw['TM']} x {gw['TN']}, "
      f"strided by LR = {fa2.LR} rows, LC = {fa2.LC} columns")
warp, lane = owner(tw["Br"], tw["Bc"], tw["warps"])
rows_w = tw["Br"] // tw["warps"]                 # query rows per warp
fig, axes = plt.subplots(1, 2, figsize=(10, 5.2), gridspec_kw=dict(width_ratios=[1, 1.3]))
axes[0].imshow(warp, cmap="tab10", vmin=0, vmax=9, aspect="auto")
axes[0].set_title(f"S tile {tw['Br']} x {tw['Bc']}: warp that owns each score")
axes[0].set_xlabel("key column j")
axes[0].set_ylabel("query row i")
for w in range(tw["warps"]):                     # the colours' legend: each band is one warp's rows
    axes[0].text(tw["Bc"] / 2, w * rows_w + rows_w / 2, f"warp {w}", ha="center", va="center", color="white")
sub = lane[:rows_w, :tw["Bc"]]
axes[1].imshow(sub % fa2.LC, cmap="Pastel1", aspect="auto")
for (r, c), value in np.ndenumerate(sub):
    axes[1].text(c, r, str(value), ha="center", va="center", fontsize=5.5)
axes[1].set_title(f"warp 0 (rows 0-{rows_w - 1}): lane id\n(colour = lane column lc)")
axes[1].set_xlabel("key column j")
fig.suptitle(f"who computes which score: FA2's default tiles at d = 64 ({tw['warps']} warps, split-Q)")
fig.tight_layout()
savefig(fig, "05_warp_layout")
plt.show()

# %% [markdown]
# ### Bank conflicts of the transposed tiles
#
# The memory profiler of notebook 00 (Appendix A.1) groups each warp's accesses into requests and counts the
# shared-memory wavefronts each needs. Run on FA2's forward and on FA1's (notebook 03), it finds the line of each
# that wastes the most: FA2 stores its $Q_i$ and $K_j$ tiles *transposed* (the lanes of a warp write words
# $k \cdot B_r + r$ for consecutive $k$: one bank for every lane), and FA1 gives each lane a row of $Q_i$ to read
# (stride $d$). The tables name the line of each; stage 6 (notebook 08) lays its tiles out without conflicts.

# %%
from flashnb import sim  # noqa: E402

qp, kp, vp = (rng.standard_normal((1, 64, 32)) for _ in range(3))
for impl in ("fa2", "fa1"):
    with sim.profile() as prof:
        flashnb.attention_forward(qp, kp, vp, impl=impl)
    print(f"{impl}: the lines that waste the most")
    print(prof.table(prof.worst(2)))
    assert prof.worst(1)[0].per_request == 32

# %% [markdown]
# ## Causal: skip the blocks above the diagonal
#
# Only tiles with at least one allowed (query, key) pair are visited; only those crossing the diagonal
# are masked element by element.

# %%
def tile_map(Nq, Nk, Br, Bc):
    diag = Nk - Nq
    Tr, Tc = -(-Nq // Br), -(-Nk // Bc)
    state = np.zeros((Tr, Tc), int)          # 0 skipped, 1 visited unmasked, 2 visited and masked
    for i, j, _, _ in fa2.tiles_visited(Nq, Nk, Br, Bc, True):
        crossing = (j + 1) * Bc > Nk or (j + 1) * Bc - 1 > i * Br + diag
        state[i, j] = 2 if crossing else 1
    return state


fig, axes = plt.subplots(1, 2, figsize=(9, 4))
for ax, (Nq, Nk) in zip(axes, ((256, 256), (128, 256))):
    st = tile_map(Nq, Nk, 32, 32)
    ax.imshow(st, cmap="Greys", vmin=0, vmax=2)
    ax.set_title(f"Nq={Nq}, Nk={Nk}: {np.count_nonzero(st)}/{st.size} visited, {np.sum(st == 2)} masked")
    ax.set_xlabel("K/V tile j")
    ax.set_ylabel("Q tile i")
savefig(fig, "05_causal_tiles")
plt.show()
full = len(fa2.tiles_visited(256, 256, 32, 32, False))
half = len(fa2.tiles_visited(256, 256, 32, 32, True))
print(f"N = 256, 32 x 32 tiles: causal visits {half} of {full} tiles ({half / full:.0%})")

q, k, v = (rng.standard_normal((1, 64, 16)) for _ in range(3))
for causal in (False, True):
    with traffic.count() as t:
        flashnb.attention_forward(q, k, v, causal=causal, impl="fa2", Br=16, Bc=16, warps=1)
    s = t.summary()[0]
    print(f"counted, N = 64, causal={causal}: K reads {s['reads']['K']}, shared reads {s['shared_reads']}")

# %% [markdown]
# ## Traffic beside stages 1 and 3 (notebooks 01 and 03)
#
# HBM traffic (element accesses, from the models that the tests check exactly against counts), one head,
# $N = 256$, $d = 32$. With the same tiles, FA2 moves less than FA1: for every K/V tile FA1 re-reads $Q_i$,
# reads $O_i$ and writes it back ($3 T_c N d$, the model's $Q$ and $O$ counts printed below; $\ell_i$, $m_i$
# add only $4 T_c N$), FA2 re-reads only $K, V$ per query block ($2 T_r N d$). With each implementation's default tiles the ordering depends on the tile sizes: a larger
# $B_r$ makes FA2's $T_r$ smaller, a larger $B_c$ makes FA1's $T_c$ smaller.

# %%
def total(model):
    return sum(sum(x[key].values()) for x in model for key in ("reads", "writes", "atomics"))


def shared(model):
    return sum(x["shared_reads"] + x["shared_writes"] for x in model)


N, d = 256, 32
rows = {
    "naive (stage 1)": naive.model_forward(1, N, N, d),
    "FA1 32x32": fa1.model_forward(1, N, N, d, Br=32, Bc=32),
    "FA2 32x32": fa2.model_forward(1, N, N, d, Br=32, Bc=32, warps=2),
    f"FA1 default {fa1.tiles(d)['Br']}x{fa1.tiles(d)['Bc']}": fa1.model_forward(1, N, N, d),
    f"FA2 default {fa2.default_tiles(d)['Br']}x{fa2.default_tiles(d)['Bc']}": fa2.model_forward(1, N, N, d),
}
for name, m in rows.items():
    print(f"{name:22s} HBM elements {total(m):9d}   shared elements {shared(m):10d}")
m1 = next(x for x in rows["FA1 32x32"] if x["launch"] == "FA1 forward")
Tc1 = -(-N // 32)
print(f"FA1 32x32: Q reads {m1['reads']['Q']} + O reads {m1['reads']['O']} + O writes {m1['writes']['O']} "
      f"= {m1['reads']['Q'] + m1['reads']['O'] + m1['writes']['O']}, 3·Tc·N·d = {3 * Tc1 * N * d}")
m2 = rows["FA2 32x32"][0]
print(f"FA2 32x32: K + V reads {m2['reads']['K'] + m2['reads']['V']}, 2·Tr·N·d = {2 * -(-N // 32) * N * d}")
fig, ax = plt.subplots(figsize=(7, 3))
ax.barh(list(rows), [4 * total(m) / 1e6 for m in rows.values()])
ax.set_xlabel("HBM traffic (MB, float32), N = 256, d = 32, one head")
ax.set_title("forward HBM traffic: stage 1, FA1 and FA2 (model, equal to the counts)")
savefig(fig, "05_traffic_stages")
plt.show()

# %% [markdown]
# ## Resources: registers and occupancy, FA1, the ladder's steps, FA2
#
# Compiled for sm_80 with NVVM and `ptxas` (no GPU needed), default tiles at $d = 64$. *Stack* is thread-private
# memory the compiler could not keep in registers (local memory, cached in L1): steps (a) and (b) keep a
# whole row of $\tilde O$ (and step (a) of $Q$) per thread, the micro-tiled kernel only $T_M \times d/8$ of $\tilde O$.

# %%
from flashnb import instruments as finspect  # noqa: E402

t1, t2 = fa1.tiles(64), fa2.default_tiles(64)
ta, tb = fa2_steps.rows_tiles(64), fa2_steps.splitq_tiles(64)
jobs = [("fa1.forward", dict(Br=t1["Br"], Bc=t1["Bc"], d=64, W=t1["warps"], causal=False), (8, 0)),
        ("fa2_steps.rows", dict(**ta, d=64, causal=False), (8, 0)),
        ("fa2_steps.splitq", dict(**tb, d=64, causal=False), (8, 0)),
        ("fa2.forward", dict(**t2, d=64, causal=False), (8, 0))]
for (name, cfg, cc), res in zip(jobs, finspect.resources_many(jobs)):
    if res.registers is None:
        print(name, "could not be compiled here:", res.error)
        continue
    occ = finspect.occupancy(res.registers, res.shared_bytes, flashnb.registry.KERNELS[name].threads_for(cfg), cc)
    print(f"{name} {cfg}: {res.registers} registers, {res.shared_bytes} B shared, stack {res.stack_bytes} B, "
          f"spills {res.spill_bytes} B, "
          f"{occ.warps_per_sm} warps/SM ({occ.occupancy:.0%}, limited by {occ.limiter})")

# %% [markdown]
# ## Modelled speed, and measured TFLOP/s on a GPU
#
# The FA2 paper's benchmark (its Section 4.1) sweeps the sequence length from 512 to 16k with the batch chosen
# so that every run holds 16k tokens, hidden dimension 2048 and $d = 64$ (32 heads), on an A100 80GB. The same
# sweep here, forward, no causal mask: HBM traffic per head is **counted** on the simulator where that takes
# seconds (the sizes marked "counted" below, each count equal to the model) and taken from the model elsewhere,
# then multiplied by batch·heads. FA1 is modelled at every $N$: its one thread block per head walks all
# $T_r T_c$ tiles one after another, so its simulated time grows with the number of tiles. A roofline estimate
# ($\max$(FLOPs / FP32 peak, bytes / HBM bandwidth)) turns bytes into time, scaled by the fraction of SMs that
# have a thread block (change 2). That scaling assumes each busy SM gets only its share of the bandwidth as well
# as of the FLOPs: a grid with few busy SMs can draw more than its share of HBM, so for such grids the model is
# pessimistic. flashnb's kernels use FP32 FMAs, not tensor cores, so the compute roof is the
# FP32 peak. Read the FA1 / FA2 ratios below as a model of these two kernels, not of the papers': the FA2 paper
# *measured* its kernel at about 2× FlashAttention-1 (Dao 2023, Abstract), while the model gives more at long $N$,
# where it charges this FA1 for the tiles its one thread block per head walks one after another.

# %%
from flashnb.sim import vector  # noqa: E402

d, hidden, tokens = 64, 2048, 16 * 1024         # FA2 paper, Section 4.1: 32 heads of d = 64, 16k tokens per run
H = hidden // d
sweep_N = [512, 1024, 2048, 4096, 8192, 16384]
count_N = {"naive": (512, 1024), "FA2": (512, 1024, 2048, 4096)}   # counted per head; everything else modelled
impls = {"naive": ("naive", naive.model_forward), "FA1": ("fa1", fa1.model_forward), "FA2": ("fa2", fa2.model_forward)}
gpu = roofline.get_gpu("A100 80GB SXM")
Br2 = fa2.default_tiles(d)["Br"]
print(f"{'N':>6} {'batch':>6} {'B·H':>5} | " + " | ".join(f"{name + ' GB':>9} {'one head':>8} {'ms':>6}" for name in impls))
for N in sweep_N:
    batch = tokens // N
    BH = batch * H
    flops = roofline.flops_forward(batch, H, N, N, d)
    cells = []
    for name, (impl, model) in impls.items():
        el, how = total(model(1, N, N, d)), "model"
        if N in count_N.get(name, ()):
            q, k, v = (rng.standard_normal((1, N, d)) for _ in range(3))
            with traffic.count() as t:
                flashnb.attention_forward(q, k, v, impl=impl)
            assert t.summary() == model(1, N, N, d)
            el, how = total(t.summary()), "counted"
        assert BH * el == total(model(BH, N, N, d))           # every head moves the same
        blocks = {"naive": None, "FA1": BH, "FA2": BH * -(-N // Br2)}[name]
        busy = 1.0 if blocks is None else min(blocks, gpu.sm_count) / gpu.sm_count
        mt = roofline.modelled_time(flops, 4 * BH * el, gpu)
        cells.append(f"{4 * BH * el / 1e9:9.2f} {how:>8} {mt.seconds / busy * 1e3:6.2f}")
    print(f"{N:>6} {batch:>6} {BH:>5} | " + " | ".join(cells))
assert not vector.notes(), vector.notes()      # every counted launch ran on the vectorised simulator
print(f"GB: float32, all batch·heads; one head: counted on the simulator or the model's; "
      f"ms: roofline on {gpu.name} / fraction of its {gpu.sm_count} SMs with a block (model)")

# %%
BH, N, d = 16, 2048, 64
# measured TFLOP/s: on a GPU only, in a process of its own (this one runs the simulator)
from flashnb.instruments import bench  # noqa: E402

gpu_rows = bench.on_gpu("flashnb.instruments.bench:measure_impls", impls=["fa1", "fa2"], BH=BH, N=N, d=d)
print(bench.table(gpu_rows, ["impl", "direction", "median_ms", "q1_ms", "q3_ms", "tflops", "pct_fp32_peak", "gpu_name"]))


# %% [markdown]
# ## Exercises
#
# Each exercise has a check: fill in the `...` and run its cell (`...` means "not attempted yet"). Stuck?
# `exercises.hint("05.1")` gives a hint and `exercises.answer("05.1")` the worked answer -- try first.
# Levels: ★ a few lines, ★★ a small model or experiment, ★★★ a real change to a kernel.

# %%
from flashnb import exercises, registry, sim  # noqa: F401  (registry: exercises 05.1 and 05.5; sim: 05.5)

# %% [markdown]
# **05.1 · An 8 × 4 lane grid** (★★★, ~30 min) Give the kernel warps of `LR = 8` row lanes × `LC = 4` column
# lanes instead of 4 × 8. Do not edit `fa2.LC`: the factory picks its lane grid in its region `lane-grid`
# (`show_source(fa2.make_forward, region="lane-grid")`); make a copy of the factory with new lines there,
# `registry.variant(fa2.make_forward, regions={"lane-grid": new_lines})`, and
# run it through the library's launcher with `with registry.using(fa2.make_forward, variant):`. The check runs
# it at $N = 32$, $d = 16$, `Br=16, Bc=16, warps=1` against the reference and counts its shared reads. Then, per
# thread, at `Br=64, Bc=32, d=64, warps=4`: how many FMAs per shared read (as `fa2.fmas_per_shared_read(...)["tile"]`
# reports for today's layout), and how many shuffles per K/V tile?

# %%
variant = ...             # registry.variant(fa2.make_forward, regions={"lane-grid": ...})
fmas_per_read = ...
shuffles_per_tile = ...
passed = exercises.check("05.1", variant=variant, fmas_per_read=fmas_per_read, shuffles_per_tile=shuffles_per_tile)

# %% [markdown]
# **05.2 · Can $\tilde O$ overflow?** (★, ~10 min) Delayed rescaling keeps $\tilde O$ unnormalised. Write
# `bound(Bc, Tc, vmax)`: the largest $|\tilde O_{ij}|$ can get after $T_c$ tiles of $B_c$ keys with $|V| \le$ `vmax`.
# Can $\tilde O$ overflow float32 with at most $2^{31}$ keys and $|V| \le 10^4$?

# %%
bound = ...          # def bound(Bc, Tc, vmax): ...
can_overflow = ...   # True or False
passed = exercises.check("05.2", bound=bound, can_overflow=can_overflow)

# %% [markdown]
# **05.3 · The causal tile map for $N_q = 300$, $N_k = 200$** (★, ~15 min) Draw it (as in the causal section) and
# predict which query rows get $L = -\infty$, and how many tiles FA2's causal forward computes at
# `Br=64, Bc=32`.

# %%
rows_without_keys = ...   # a set (or range) of row indices
tiles_computed = ...
passed = exercises.check("05.3", rows_without_keys=rows_without_keys, tiles_computed=tiles_computed)

# %% [markdown]
# **05.4 · When does FA1 move fewer bytes?** (★★, ~15 min) Using `fa1.model_forward` and `fa2.model_forward`,
# find the largest `Br` (a multiple of 4; FA2 with `Bc=32, warps=1`) at which FA1's default configuration moves
# fewer HBM elements than FA2 at $N = 4096$, $d = 64$ — and explain why.

# %%
largest_Br = ...
passed = exercises.check("05.4", largest_Br=largest_Br)

# %% [markdown]
# **05.5 · The race a missing barrier makes** (★★, ~15 min) Make a variant of `fa2.make_forward` without the
# `cuda.syncthreads()` marked "every warp is done with K_{j-1}, V_{j-1}", the kernel's region `kv-barrier`
# (`show_source(fa2.make_forward, region="kv-barrier")`) -- `registry.variant(fa2.make_forward,
# regions={"kv-barrier": new_lines})` edits a copy of the factory without touching the library -- and run it through
# the library's launcher (`with registry.using(fa2.make_forward, variant):`) under `sim.sanitize()`, with two
# warps and several key tiles (`Br=16, Bc=16, warps=2`, $N = 48$). Which shared arrays does racecheck report,
# and at which lines? Does the output still match the reference on the simulator, and why is that no evidence
# about a GPU?

# %%
race_arrays = ...   # a set of shared-array names
passed = exercises.check("05.5", race_arrays=race_arrays)

# %% [markdown]
# **05.6 · FA2's forward from a blank cell** (★★★, ~90 min) Write the forward yourself, at the ladder's
# one-thread-per-row level: a `@cuda.jit` kernel `(Q, K, V, O, L, scale, diag)` launched as
# `kernel[(ceil(Nq / 32), BH), 32]`, one thread per query row $i$ of batch·head `blockIdx.y`, K/V tiles of $B_c$
# rows staged in shared memory, $m_i$, $\ell_i$ and $\tilde O_i$ in registers (Algorithm 1, lines 4-13). Key $j$ is
# visible to row $i$ iff $j \le i + $ `diag` (the check passes `diag = Nk` for no mask, `Nk - Nq` for
# bottom-right causal, `0` for top-left); a row that sees no key writes $O_i = 0$, $L_i = -\infty$; skip the tiles
# after a block's last visible key; $d \le 32$. The check grades it as the course kit does: float64 on five
# shapes, counted traffic against FA2's model for your $B_c$, the four sanitizer tools, and a compile for sm_80
# and sm_90 -- and says what is wrong. `exercises.hint("05.6")` gives the outline.

# %%
import math  # noqa: F401  (for your kernel: math.exp, math.log)

from numba import cuda, float32  # noqa: F401

# @cuda.jit
# def my_fa2_forward(Q, K, V, O, L, scale, diag):
#     ...

my_fa2_forward = ...   # your kernel
my_Bc = ...            # the K/V rows it loads per tile
passed = exercises.check("05.6", kernel=my_fa2_forward, Bc=my_Bc)   # prints the verdict

# %%
print(f"notebook ran in {time.perf_counter() - T0:.1f} s")
