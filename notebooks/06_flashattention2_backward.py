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
# # 06 · FlashAttention-2, backward: recompute, column blocks, dQ by atomics
#
# The backward pass needs $dQ, dK, dV$ from $Q, K, V, O, dO$ and the saved $L = m + \log \ell$. Like FA1 it
# never stores $S$ or $P$: it recomputes them tile by tile. FA2 **Algorithm 2**:
#
# | line | |
# |---|---|
# | 4 | (separate kernel) $D = \mathrm{rowsum}(dO \circ O)$ |
# | 5 | one thread block per K/V column block $j$ (and batch·head) |
# | 6–7 | load $K_j, V_j$ to SRAM; $dK_j = dV_j = 0$ on chip |
# | 8–9 | for each query block $i$: load $Q_i, dO_i, L_i, D_i$ |
# | 10–11 | $S_{ij} = \tau\,Q_i K_j^\top$, $P_{ij} = \exp(S_{ij} - L_i)$ (already normalised: no $m$, no $\ell$) |
# | 12 | $dV_j \mathrel{+}= P_{ij}^\top dO_i$ |
# | 13–14 | $dP_{ij} = dO_i V_j^\top$, $dS_{ij} = P_{ij} \circ (dP_{ij} - D_i)$ |
# | 15 | $dQ_i \mathrel{+}= \tau\, dS_{ij} K_j$ — **atomic adds in HBM** |
# | 16 | $dK_j \mathrel{+}= \tau\, dS_{ij}^\top Q_i$ |
# | 18 | write $dK_j, dV_j$ once |

# %%
import os
import time

import matplotlib.pyplot as plt
import numpy as np

os.environ["FLASHNB_DEVICE"] = "sim"  # counting traffic needs the simulator; GPU timings run in a process of their own
import flashnb
from flashnb import common, reference
from flashnb.instruments import roofline, traffic
from flashnb.notebook import savefig, show_source
from flashnb.stages import fa1, fa2, fa2_steps, naive

T0 = time.perf_counter()
print("kernels run on the Numba CUDA simulator; GPU timings:",
      "on this machine's GPU, in a separate process" if flashnb.instruments.bench.gpu_available() else "none (no GPU here)")
rng = np.random.default_rng(6)

# %% [markdown]
# ## Algorithm 2 in NumPy, line by line
#
# Before any kernel: the algorithm transcribed into float64 NumPy with its loops, every block tagged with
# the paper's line (`fa2_steps.fa2_backward_numpy`; the forward's Algorithm 1 is in notebook 05). The softmax
# scale $\tau$ is written out where the paper leaves it implicit ($S = \tau QK^\top$, so $dQ$ and $dK$ carry a
# factor $\tau$), and with the causal mask the query blocks entirely above the diagonal are skipped.

# %%
show_source(fa2_steps.fa2_backward_numpy)
q, k, v, do = (rng.standard_normal((n, 16)) for n in (40, 56, 56, 40))
for causal in (False, True):
    o, lse = reference.attention_forward(q, k, v, causal=causal)
    grads = fa2_steps.fa2_backward_numpy(q, k, v, o, do, lse, Br=16, Bc=16, causal=causal)
    err = max(np.abs(g - r).max() for g, r in zip(grads, reference.attention_backward(q, k, v, do, causal=causal)))
    print(f"causal={causal}: NumPy Algorithm 2 vs the float64 reference, max error over dQ, dK, dV {err:.1e}")
    assert err < 1e-12                    # both float64: only the order of the sums differs

# %% [markdown]
# ## Line 4: the preprocessing kernel $D = \mathrm{rowsum}(dO \circ O)$
#
# $D_i = \sum_j P_{ij}\, dP_{ij}$ is needed by every column block. Since $dP = dO\,V^\top$ and $O = P V$,
# $\sum_j P_{ij} dP_{ij} = \sum_j P_{ij} \sum_c dO_{ic} V_{jc} = \sum_c dO_{ic} O_{ic}$: a dot product of two
# rows we already have, computed once per row by its own small kernel (one warp per row, lanes over $d$,
# reduced with `shfl_down_sync`). The same kernel zeroes the dQ accumulator.

# %%
show_source(fa2.make_preprocess)
q, k, v, do = (rng.standard_normal((1, n, 16)) for n in (24, 24, 24, 24))
o, lse = reference.attention_forward(q, k, v)
P = np.exp(q @ k.transpose(0, 2, 1) / 4.0 - lse[..., None])
gap = np.abs((do * o).sum(-1) - (P * (do @ v.transpose(0, 2, 1))).sum(-1)).max()
print("max |rowsum(dO∘O) - rowsum(P∘dP)| =", gap)
assert gap < 1e-12                                # an identity: float64 rounding only

# %% [markdown]
# ## The ladder, backward
#
# Notebook 05 climbed from Algorithm 1 to the forward kernel one idea at a time. The backward has the same
# ladder (`flashnb.stages.fa2_steps`), each step a real kernel checked against the float64 reference and counted
# against its own model. Line 5 puts one thread block on each K/V column block, so the rows a block owns are
# *key* rows, and every block adds into $dQ$.
#
# | step | kernel | what it changes |
# |---|---|---|
# | 0 | `fa2_steps.fa2_backward_numpy` | Algorithm 2 in NumPy (above) |
# | (a) | `fa2_steps.make_rows_backward`, `impl="fa2-rows"` | one CUDA thread per key row; every thread adds its own terms of $dQ$ with atomics |
# | (b) | `fa2_steps.make_splitq_backward`, `impl="fa2-splitq"` | the key rows split over warps, $dS_{ij}$ through shared memory: one atomic per element of $dQ_i$ and tile |
# | (c) | `fa2.make_backward`, `impl="fa2"` | register micro-tiles, padded transposed tiles, $P$ and $dS$ passed between lanes by shuffles |
#
# ### Step (a) · one thread per key row
#
# Grid $(T_c, \text{batch·heads})$, one thread per key row $j$ of the block. The thread's rows of $K_j$ and
# $V_j$ and its accumulators $dK_j$, $dV_j$ are thread-private arrays, read from and written to HBM once. The query
# tile $Q_i, dO_i$ and its statistics $L_i, D_i$ are loaded into shared memory by all threads together, and
# each thread walks the tile's rows: $S$ and $dP$ for its key (lines 10, 13), $P = \exp(S - L)$ (line 11),
# $dS$ (line 14), its own rows of $dV_j$ and $dK_j$ (lines 12, 16). Line 15 is where this step is naive: every
# thread adds its own term $\tau\,dS_{rj}\,k_j$ into $dQ_r$ with `cuda.atomic.add`, $d$ atomics per query row it
# sees.

# %%
show_source(fa2_steps.make_rows_backward)

# %% [markdown]
# Checked against the reference ($N_q = 40$, $N_k = 56$, $d = 16$, causal and not, counted traffic against the
# step's model), then counted on one problem that every step below runs too: one head, $N = 128$, $d = 16$, the
# same tiles $B_r = 16$, $B_c = 64$ (two warps) for all three steps, no mask, so every step visits the same tiles.

# %%
BWD_LADDER = dict(BH=1, N=128, d=16, Br=16, Bc=64, warps=2)
bwd_ladder = {}                                   # step -> the counted main launch on the BWD_LADDER problem


def check_bwd_step(step, impl, model, **tiles):
    """Check `impl`'s backward against the reference (Nq = 40, Nk = 56, d = 16, causal and not) and its
    model, then count it on the BWD_LADDER problem; print its HBM accesses and shared accesses."""
    q, k, v, do = (rng.standard_normal((1, n, 16)) for n in (40, 56, 56, 40))
    err = 0.0
    for causal in (False, True):
        o, lse = reference.attention_forward(q, k, v, causal=causal)
        with traffic.count() as t:
            grads = flashnb.attention_backward(q, k, v, o, lse, do, causal=causal, impl=impl, **tiles)
        for g, r in zip(grads, reference.attention_backward(q, k, v, do, causal=causal)):
            np.testing.assert_allclose(g, r, atol=1e-4)   # float32 kernel vs float64, 56 keys: as tests/stages
            err = max(err, np.abs(g - r).max())
        assert t.summary() == model(1, 40, 56, 16, causal=causal, **tiles)
    BH, N, d = (BWD_LADDER[key] for key in ("BH", "N", "d"))
    opts = {key: BWD_LADDER[key] for key in tiles}
    q, k, v, do = (rng.standard_normal((BH, N, d)) for _ in range(4))
    o, lse = reference.attention_forward(q, k, v)
    with traffic.count() as t:
        flashnb.attention_backward(q, k, v, o, lse, do, impl=impl, **opts)
    assert t.summary() == model(BH, N, N, d, **opts)
    main = t.summary()[1]                             # [0] is line 4's D launch, the same for every step
    bwd_ladder[step] = main
    print(f"step {step} ({impl}, {opts}): max error {err:.1e}, counted traffic == model; on the ladder problem: "
          f"HBM reads {sum(main['reads'].values()):,}, writes {sum(main['writes'].values()):,}, "
          f"dQ atomics {main['atomics']['dQ']:,}; shared reads {main['shared_reads']:,}, "
          f"writes {main['shared_writes']:,}")


check_bwd_step("(a)", "fa2-rows", fa2_steps.model_rows_backward, Br=16, Bc=64)
assert bwd_ladder["(a)"]["atomics"]["dQ"] == 128 * 128 * 16   # N_q · N_k · d: one per (row, key, column)

# %% [markdown]
# $N_q N_k d$ atomic adds: $B_c$ times the $T_c N_q d$ that line 15 asks for, and the 32 lanes of a warp add into
# the *same* element of $dQ$ in the same instruction, so the adds to one address are applied one after another.
# Shared memory is cheap here: the thread's $k_j, v_j$ are private, so $S$ and $dP$ read one shared element per
# FMA, as the forward's step (a) did.
#
# ### Step (b) · key rows split over warps, $dS$ through shared memory
#
# The block's $B_c$ key rows are split over `warps` warps (lane $t$ of warp $w$ owns key rows $w\cdot 32R + t +
# 32a$, $R = B_c / (32 \cdot \text{warps})$), and $K_j$, $V_j$ move to shared memory (transposed: the lanes own
# consecutive keys, so they read consecutive addresses). Each lane writes its $dS_{rj}$ into a shared tile
# $dS_{ij}$; after one more barrier the whole block forms $dQ_i \mathrel{+}= \tau\, dS_{ij} K_j$, each thread a few
# elements, and adds each element once: line 15 as the paper writes it.

# %%
show_source(fa2_steps.make_splitq_backward)
check_bwd_step("(b)", "fa2-splitq", fa2_steps.model_splitq_backward, Br=16, Bc=64, warps=2)
assert bwd_ladder["(a)"]["atomics"]["dQ"] == 64 * bwd_ladder["(b)"]["atomics"]["dQ"]   # B_c times fewer

# %% [markdown]
# The atomics fall by $B_c = 64$. The price is paid in shared memory: $S$ and $dP$ now read $K_j$ and $V_j$ from
# shared memory too (two shared reads per FMA), and forming $dS_{ij} K_j$ reads a row of $dS_{ij}$ and a column of
# $K_j$ per element of $dQ_i$. HBM reads are unchanged: $K_j, V_j$ once, $Q_i, dO_i, L_i, D_i$ once per visited tile.
#
# ### Step (c) · register micro-tiles: the kernel of `flashnb.stages.fa2`
#
# The warps split the $B_c$ *key* rows of the block (lane $(l_r, l_c)$ owns key rows $l_r + 4a$ of its
# warp and query columns $l_c + 8b$ of $S^\top$), so $dK_j$ and $dV_j$ stay in registers, each row owned by
# one row group of 8 lanes. $dQ_i$ needs a sum over *all* keys of the block, so $dS$ goes through shared
# memory once per tile, as in step (b), and every thread forms some elements of $dS\,K_j$ and adds them into HBM.
# What is new is how a lane computes: a $T_M \times T_N$ micro-tile each of $S^\top$ and $dP^\top$, each from
# $T_M + T_N$ shared reads per $k$, and $P$, $dS$ passed to the lanes that need them by `shfl_sync`, not through memory.
#
# A lane's work on one Q tile is the device function `fa2_bwd_tile` (lines 10-16, with the file's line numbers;
# `show_source(fa2.make_backward)` prints the whole factory), and line 15's atomic add of $dQ_i$ is the region
# `dq-update` of the kernel's loop:

# %%
show_source(fa2.make_backward, region="fa2_bwd_tile")
show_source(fa2.make_backward, region="dq-update")
check_bwd_step("(c)", "fa2", fa2.model_backward, Br=16, Bc=64, warps=2)

# %% [markdown]
# ### The three steps side by side
#
# The same problem and the same tiles, counted on the simulator (main launch; line 4's $D$ launch is the same for
# all three). HBM reads and writes do not move from step to step: what the steps change is where line 15's sum is
# formed (atomics) and how often a multiply-add goes to shared memory.

# %%
from flashnb.sim import vector  # noqa: E402

assert not vector.notes(), vector.notes()         # every counted launch ran on the vectorised simulator
steps = list(bwd_ladder)
assert len({sum(m["reads"].values()) for m in bwd_ladder.values()}) == 1    # same HBM reads at every step
assert bwd_ladder["(b)"]["atomics"] == bwd_ladder["(c)"]["atomics"]
print(f"{'step':6s} {'HBM reads':>10s} {'HBM writes':>10s} {'dQ atomics':>10s} {'shared reads':>13s} {'shared writes':>13s}")
for step, m in bwd_ladder.items():
    print(f"{step:6s} {sum(m['reads'].values()):10,d} {sum(m['writes'].values()):10,d} {m['atomics']['dQ']:10,d} "
          f"{m['shared_reads']:13,d} {m['shared_writes']:13,d}")
fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(9, 3.2))
x = np.arange(len(steps))
for off, (label, values) in zip((-0.27, 0, 0.27), (
        ("HBM reads", [sum(m["reads"].values()) for m in bwd_ladder.values()]),
        ("HBM writes", [sum(m["writes"].values()) for m in bwd_ladder.values()]),
        ("dQ atomics", [m["atomics"]["dQ"] for m in bwd_ladder.values()]))):
    ax0.bar(x + off, values, width=0.27, label=label)
for off, (label, key) in zip((-0.2, 0.2), (("shared reads", "shared_reads"), ("shared writes", "shared_writes"))):
    ax1.bar(x + off, [m[key] for m in bwd_ladder.values()], width=0.4, label=label)
for ax, title in ((ax0, "global memory (elements)"), (ax1, "shared memory (elements)")):
    ax.set_xticks(x, [f"step {s}" for s in steps])
    ax.set_yscale("log")
    ax.set_ylim(top=ax.get_ylim()[1] * 10)          # room for the legend above the bars
    ax.set_ylabel("element accesses (log)")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left", ncol=3 if ax is ax0 else 2)
fig.suptitle(f"backward ladder, counted: one head, N = {BWD_LADDER['N']}, d = {BWD_LADDER['d']}, "
             f"Br = {BWD_LADDER['Br']}, Bc = {BWD_LADDER['Bc']}")
fig.tight_layout()
savefig(fig, "06_backward_ladder")
plt.show()

# %% [markdown]
# ## The K/V-block grid keeps the SMs busy
#
# Line 5 makes every K/V column block $j$ a thread block of its own: the grid is $T_c \times$ batch·heads.
# FA1's backward (notebook 04) runs one thread block per head, which walks all column blocks in turn. A thread
# block runs on one SM, so a grid with fewer blocks than the GPU has SMs leaves the others idle. Thread blocks
# per launch and the SMs that get one, on the H100 preset, $N = 2048$, $d = 64$, the backward's default $B_c$:

# %%
N, d = 2048, 64
Bc = fa2.default_tiles(d, "backward")["Bc"]
Tc = -(-N // Bc)
gpu = roofline.get_gpu("H100 SXM")
BHs = np.array([1, 2, 4, 8, 16, 32, 64])
busy = {"one block per head (FA1)": np.minimum(BHs, gpu.sm_count),
        f"K/V-block grid, Tc = {Tc} (FA2)": np.minimum(BHs * Tc, gpu.sm_count)}
for bh, one, grid in zip(BHs, *busy.values()):
    print(f"batch·heads = {bh:3d}: one block per head {bh:5d} blocks, {one:3d}/{gpu.sm_count} SMs busy;   "
          f"K/V-block grid {bh * Tc:5d} blocks, {grid:3d}/{gpu.sm_count} SMs busy")
assert busy[f"K/V-block grid, Tc = {Tc} (FA2)"][0] == min(Tc, gpu.sm_count) > busy["one block per head (FA1)"][0]
fig, ax = plt.subplots(figsize=(6.5, 3.4))
for label, b in busy.items():
    ax.plot(BHs, 100 * b / gpu.sm_count, marker="o", label=label)
ax.set_xscale("log", base=2)
ax.set_xlabel("batch · heads")
ax.set_ylabel(f"SMs with a thread block (%), {gpu.name}")
ax.set_title(f"backward, N = {N}, d = {d}, Bc = {Bc}")
ax.legend(fontsize=8)
savefig(fig, "06_busy_sms")
plt.show()

# %% [markdown]
# The price of this grid is line 15: the column blocks all add into the same $dQ_i$, next.
# (SMs with a block is an upper bound on the parallelism, not a speed: with the causal mask column block $j$
# visits only the query blocks at or below the diagonal, so the blocks do unequal work; exercise 4.)
#
# ## Why dQ needs atomics
#
# $dQ_i = \tau \sum_j dS_{ij} K_j$ sums over **column blocks**, and each column block is a different thread
# block, running on different SMs at the same time. Several blocks add into the same $dQ_i$: a plain
# read-modify-write would lose updates; `cuda.atomic.add` makes each addition indivisible. The price:
# the additions happen in whatever order the blocks arrive, and float32 addition is not associative, so the
# last bits of $dQ$ can differ from run to run. Below, the same sums in different orders (what different
# block schedules do on a GPU; the simulator runs blocks one after another, so it always agrees with itself):

# %%
q, k, v, do = (rng.standard_normal((1, n, 16)) for n in (32, 64, 64, 32))
o, lse = reference.attention_forward(q, k, v)
grads = [flashnb.attention_backward(q, k, v, o, lse, do, impl="fa2", Br=16, Bc=16, warps=1) for _ in range(2)]
print("two runs here, dQ bitwise equal:", np.array_equal(grads[0][0], grads[1][0]))
if flashnb.is_simulator():                 # blocks run one after another here: same order, same bits
    assert np.array_equal(grads[0][0], grads[1][0])

Tc = 4                                     # the four column blocks' contributions to dQ, as the kernel forms them
Kb = k[0].reshape(Tc, 16, 16)
dS = rng.standard_normal((32, 64)).astype(np.float32)
parts = [(0.25 * dS[:, j * 16:(j + 1) * 16] @ Kb[j]).astype(np.float32) for j in range(Tc)]
orders = [(0, 1, 2, 3), (3, 2, 1, 0), (2, 0, 3, 1), (1, 3, 0, 2)]
sums = []
for order in orders:
    acc = np.zeros((32, 16), np.float32)
    for j in order:
        acc += parts[j]                    # float32 adds, like the atomics
    sums.append(acc)
for order, s in zip(orders[1:], sums[1:]):
    diff = s.view(np.int32) - sums[0].view(np.int32)
    print(f"order {order}: {np.count_nonzero(diff)} of {diff.size} elements differ, "
          f"by at most {np.abs(diff).max()} ulp, max |Δ| = {np.abs(s - sums[0]).max():.1e}")

# %% [markdown]
# ## A gradient check
#
# Against the float64 reference, and against finite differences of $f(q,k,v) = \sum O \circ dO$ (central
# differences in float64 through the reference forward):

# %%
q, k, v, do = (rng.standard_normal((1, n, 8)) for n in (20, 28, 28, 20))
o, lse = flashnb.attention_forward(q, k, v, causal=True, impl="fa2", Br=16, Bc=16, warps=1)
dq, dk, dv = flashnb.attention_backward(q, k, v, o, lse, do, causal=True, impl="fa2", Br=16, Bc=16, warps=1)
ref = reference.attention_backward(q, k, v, do, causal=True)
for name, g, r in zip(("dq", "dk", "dv"), (dq, dk, dv), ref):
    print(f"{name}: max |fa2 - reference| = {np.abs(g - r).max():.1e}")
    np.testing.assert_allclose(g, r, atol=1e-5)   # float32 kernel vs float64, d = 8, 28 keys: far below 1e-5


def f(q_, k_, v_):
    return float((reference.attention_forward(q_, k_, v_, causal=True)[0] * do).sum())


eps = 1e-6
for name, x, g in (("q", q, dq), ("k", k, dk), ("v", v, dv)):
    for idx in [(0, 3, 1), (0, 17, 5)]:
        xp, xm = x.copy(), x.copy()
        xp[idx] += eps
        xm[idx] -= eps
        args_p = dict(q=q, k=k, v=v)
        args_m = dict(q=q, k=k, v=v)
        args_p[name], args_m[name] = xp, xm
        fd = (f(**{a + "_": b for a, b in args_p.items()}) - f(**{a + "_": b for a, b in args_m.items()})) / (2 * eps)
        print(f"d{name}{idx}: finite difference {fd:+.6f}, kernel {g[idx]:+.6f}")
        assert abs(fd - g[idx]) < 1e-4        # O(eps²) truncation + float32 kernel rounding

# %% [markdown]
# ## Traffic and memory against FA1's backward
#
# FA1's backward (notebook 04) runs one thread block per head: its outer loop is over K/V blocks, and it reads
# **and writes** $dQ_i$ (plus $Q_i, O_i, dO_i$) in HBM on every step of its inner loop. FA2 reads $Q_i, dO_i,
# L_i, D_i$ per visited tile and *adds* into $dQ$ (one atomic per element per tile); $D$ replaces FA1's
# per-tile recomputation of $\mathrm{rowsum}(dO_i \circ O_i)$ and $O$ is read only by the preprocessing.
# Counted (simulator) and modelled, same tiles (16 × 16): a small check first, then one head at $N = 1024$,
# $d = 64$, counted where the simulator takes seconds (each row says whether it was counted or is the model's;
# FA1's one thread block per head walks all its tiles one after another, so it is modelled there); the last lines list each implementation's own
# extra allocations besides its outputs, taken from its host launchers with `common.dry_run` (as notebook 04
# does for FA1): only the naive ones grow with $N^2$.

# %%
def total(model):
    return {key: sum(sum(x[key].values()) for x in model) for key in ("reads", "writes", "atomics")}


q, k, v, do = (rng.standard_normal((1, 64, 16)) for _ in range(4))
o, lse = reference.attention_forward(q, k, v)
for impl, opts in (("fa1", dict(Br=16, Bc=16)), ("fa2", dict(Br=16, Bc=16, warps=1))):
    with traffic.count() as t:
        flashnb.attention_backward(q, k, v, o, lse, do, impl=impl, **opts)
    model = (fa1.model_backward if impl == "fa1" else fa2.model_backward)(1, 64, 64, 16, **opts)
    print(f"{impl}: counted {total(t.summary())}, equals model: {t.summary() == model}")
    assert t.summary() == model

N, d = 1024, 64
specs = {"naive": ("naive", naive.model_backward, {}, False), "FA1": ("fa1", fa1.model_backward, dict(Br=16, Bc=16), False),
         "FA2": ("fa2", fa2.model_backward, dict(Br=16, Bc=16), False),
         "FA2 causal": ("fa2", fa2.model_backward, dict(Br=16, Bc=16), True)}
counted_here = ("naive", "FA2", "FA2 causal")      # one head each, on the simulator; FA1 is the model's
q, k, v, do = (rng.standard_normal((1, N, d)) for _ in range(4))
rows, how = {}, {}
for name, (impl, model, opts, causal) in specs.items():
    rows[name], how[name] = model(1, N, N, d, causal=causal, **opts), "model"
    if name in counted_here:
        o, lse = reference.attention_forward(q, k, v, causal=causal)
        with traffic.count() as t:
            flashnb.attention_backward(q, k, v, o, lse, do, causal=causal, impl=impl, **opts)
        assert t.summary() == rows[name]
        rows[name], how[name] = t.summary(), "counted"
assert not vector.notes(), vector.notes()         # every counted launch ran on the vectorised simulator
fig, ax = plt.subplots(figsize=(7, 3))
for x, (name, m) in enumerate(rows.items()):
    tot = total(m)
    bottom = 0
    for key, colour in (("reads", "C0"), ("writes", "C1"), ("atomics", "C3")):
        ax.bar(x, 4 * tot[key] / 1e6, bottom=bottom, color=colour, label=key if x == 0 else None)
        bottom += 4 * tot[key] / 1e6
    print(f"{name:10s} ({how[name]:>7}): HBM {4 * sum(tot.values()) / 1e6:7.2f} MB  {tot}")
ax.set_xticks(range(len(rows)), [f"{name}\n({how[name]})" for name in rows])
ax.set_ylabel("MB (float32), N = 1024, d = 64")
ax.set_title("backward HBM traffic, one head: reads, writes and dQ atomics")
ax.legend()
savefig(fig, "06_backward_traffic")
plt.show()


def in_n(arrays, N):
    """Total float32 elements of per-head arrays, written as a·N² + b·N (+ c·N·d)."""
    sizes = [a.size for a in arrays]
    n2, nd_, n1 = (sum(x for x in sizes if x == v) // v for v in (N * N, N * d, N))
    assert n2 * N * N + nd_ * N * d + n1 * N == sum(sizes), sizes
    terms = [f"{c}·{u}" for c, u in ((n2, "N²"), (nd_, "N·d"), (n1, "N")) if c]
    return " + ".join(terms) or "0"


S_ = common.ShapeOnly
x, xl = S_((1, N, d)), S_((1, N))
print(f"own allocations, one head, N = {N}, d = {d} (common.dry_run; outputs O, dQ, dK, dV are N·d each):")
for name, mod in (("naive", naive), ("FA1", fa1), ("FA2", fa2)):
    fwd = common.dry_run(mod.forward, x, x, x, causal=False, scale=0.125)
    bwd = common.dry_run(mod.backward, x, x, x, x, xl, x, causal=False, scale=0.125)
    extra_f = [a for a in fwd if a.shape != x.shape]            # everything besides O
    extra_b = [a for a in bwd if a.shape != x.shape]            # everything besides dQ, dK, dV
    print(f"  {name:5s} forward besides O: {in_n(extra_f, N):12s} ({sum(a.nbytes for a in extra_f) / 2**10:7.1f} KiB)"
          f"   backward besides dQ, dK, dV: {in_n(extra_b, N):8s} ({sum(a.nbytes for a in extra_b) / 2**10:7.1f} KiB)")

# %% [markdown]
# ## Exercises
#
# Each exercise has a check: fill in the `...` and run its cell (`...` means "not attempted yet"). Stuck?
# `exercises.hint("06.1")` gives a hint and `exercises.answer("06.1")` the worked answer -- try first.
# Levels: ★ a few lines, ★★ a small model or experiment, ★★★ a real change to a kernel.

# %%
from flashnb import exercises  # noqa: E402

# %% [markdown]
# **06.1 · dQ without atomics** (★★, ~20 min) Replace the atomics by a per-column-block `dQ` buffer of shape
# $(T_c, N_q, d)$ (each column block stores its partial $dQ_i$) and a reduction kernel that sums the partials
# into $dQ$. Model its traffic: write `extra_traffic(Nq, Nk, d, Br, Bc)`, the element accesses it adds to
# `fa2.model_backward`'s count (non-causal, one head, an atomic add counted as one access), and give the
# `fraction` that is of the atomic design's total at $N_q = N_k = 4096$, $d = 64$, `Br = Bc = 32`. How much memory
# does the buffer take, and when is it worth it?

# %%
extra_traffic = ...   # def extra_traffic(Nq, Nk, d, Br, Bc): ...
fraction = ...
passed = exercises.check("06.1", extra_traffic=extra_traffic, fraction=fraction)

# %% [markdown]
# **06.2 · The price of staging dS** (★★, ~20 min) The kernel stages $dS$ through shared memory (`dSs`) so all
# warps can form $dQ_i$. Count its shared reads and writes with `flashnb.instruments.traffic.count()` (per-array counts:
# `t.launches[i].shared_reads`) at $N_q = 16$, $N_k = 32$, $d = 8$, `Br=16, Bc=16, warps=1`, and turn them into
# `dS_per_tile(Br, Bc, d)` -> (reads, writes) per visited tile. What fraction `dS_share` of the main launch's
# shared reads are reads of `dSs`? Compare with how the $dK_j, dV_j$ updates get $P$ and $dS$.

# %%
dS_per_tile = ...   # def dS_per_tile(Br, Bc, d): return reads, writes
dS_share = ...
passed = exercises.check("06.2", dS_per_tile=dS_per_tile, dS_share=dS_share)

# %% [markdown]
# **06.3 · $P$ from $L$ alone** (★, ~10 min) Why does $P = \exp(S - L)$ need neither $m$ nor $\ell$? Write
# `p_from_L(S, L, allowed)` (NumPy, float64): $P$ from the scaled scores, the row log-sum-exps and the boolean mask,
# right also for rows with $L = -\infty$. The check feeds it causal rows with no key ($N_q > N_k$). What goes
# wrong for such a row with the plain formula, and how does the kernel avoid it?

# %%
p_from_L = ...   # def p_from_L(S, L, allowed): ...
passed = exercises.check("06.3", p_from_L=p_from_L)

# %% [markdown]
# **06.4 · Causal work per column block** (★, ~10 min) With the causal mask, which column blocks do the least
# work? Using `fa2.tiles_visited(..., "backward")`, list the number of query tiles each column block visits at
# `Br = Bc = 32` for $N_q = N_k = 256$ and for $N_q = 128$, $N_k = 256$.

# %%
visits_square = ...   # [tiles of column block 0, 1, ...]
visits_wide = ...
passed = exercises.check("06.4", visits_square=visits_square, visits_wide=visits_wide)

# %% [markdown]
# **06.5 · FA2's backward from a blank cell** (★★★, ~90 min) The twin of exercise 05.6, and the ladder's step (a)
# written from memory (try it without scrolling up): a `@cuda.jit` kernel
# `(Q, K, V, dO, L, D, dQ, dK, dV, scale, diag)` launched as `kernel[(ceil(Nk / 32), BH), 32]`, one thread per key
# row $j$: $k_j$, $v_j$, $dK_j$, $dV_j$ in registers, query tiles $Q_i$, $dO_i$, $L_i$, $D_i$ of $B_r$ rows staged
# in shared memory, $P$ rebuilt from $L$ (Algorithm 2, lines 6-18) and $dQ$ summed with `cuda.atomic.add` (it
# arrives zeroed; $D = \mathrm{rowsum}(dO \circ O)$ is given). Key $j$ is visible to row $i$ iff
# $j \le i + $ `diag`; skip the query tiles before the first row that sees a block's first key; $d \le 32$. The
# check grades it like exercise 05.6: float64 on five shapes, counted traffic against FA2's backward model for
# your $B_r$, the four sanitizer tools, and a compile for sm_80 and sm_90.

# %%
import math  # noqa: F401  (for your kernel: math.exp)

from numba import cuda, float32  # noqa: F401

# @cuda.jit
# def my_fa2_backward(Q, K, V, dO, L, D, dQ, dK, dV, scale, diag):
#     ...

my_fa2_backward = ...   # your kernel
my_Br = ...             # the query rows it loads per tile
passed = exercises.check("06.5", kernel=my_fa2_backward, Br=my_Br)   # prints the verdict

# %%
print(f"notebook ran in {time.perf_counter() - T0:.1f} s")
