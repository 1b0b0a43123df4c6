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
# # 01 · Standard attention, and why it is slow
#
# Attention for one head is three steps (FlashAttention-1 paper, **Algorithm 0**):
#
# 1. $S = \tau\, Q K^\top$ — load $Q, K$ from HBM, write $S$ ($N_q \times N_k$) to HBM;
# 2. $P = \mathrm{softmax}(S)$ row by row — read $S$, write $P$ ($N_q \times N_k$);
# 3. $O = P V$ — read $P, V$, write $O$.
#
# Here $Q \in \mathbb{R}^{N_q\times d}$, $K, V \in \mathbb{R}^{N_k\times d}$ and $\tau = 1/\sqrt d$.
# The FLOPs are those of two matrix products, about $4 N_q N_k d$. The *memory traffic* is the problem:
# the two $N_q\times N_k$ intermediates go out to HBM and come back, so traffic grows like $N^2$ while each
# element of $S$ and $P$ is used for only a handful of arithmetic operations.
#
# **Compute-bound or memory-bound?** A kernel is memory-bound when the time to move its bytes,
# bytes / bandwidth, exceeds the time to do its FLOPs, FLOPs / peak. The ratio FLOPs/byte a GPU can sustain
# is its *ridge point*. Softmax does a few FLOPs per 4-byte element it reads and writes — far below the ridge
# of any GPU — so steps 2 (and the HBM round trips of $S$ and $P$) are memory-bound.
#
# HBM is large and slow, the on-chip SRAM (`cuda.shared.array` in CUDA) small and fast -- notebook 00 has the
# numbers. Every stage of flashnb is about which data lives where.
#
# This notebook builds Algorithm 0 as separate kernels, checks them, **counts** their HBM traffic on the
# Numba CUDA simulator and compares the count with an analytic model.

# %%
import os
import time

import matplotlib.pyplot as plt
import numpy as np

os.environ["FLASHNB_DEVICE"] = "sim"  # counting traffic needs the simulator; GPU timings run in a process of their own
import flashnb
from flashnb import reference
from flashnb.instruments import traffic
from flashnb.notebook import savefig, show_source
from flashnb.stages import naive

T0 = time.perf_counter()
print("kernels run on the Numba CUDA simulator; GPU timings:",
      "on this machine's GPU, in a separate process" if flashnb.instruments.bench.gpu_available() else "none (no GPU here)")

# %% [markdown]
# ## The kernels
#
# Step 1 (and every product in the backward) is one tiled matrix-multiply kernel. Its tile size `T`, the
# transposes and the causal flag are compile-time constants baked in by a *kernel factory*: the same
# source, compiled once per configuration. Each thread block computes a `T x T` tile of the output; at each
# step of the inner dimension it copies a `T x T` tile of each operand into shared memory (`As`, `Bs`), waits
# at a barrier, and multiplies out of SRAM.

# %%
show_source(naive.make_matmul)

# %% [markdown]
# The tile loads are shared mechanics (`flashnb/common.py`), reused by every stage: a bounded load that
# zero-fills outside the matrix, so lengths need not be multiples of `T`.

# %%
show_source(flashnb.common.load_tile)

# %% [markdown]
# Step 2 is the *safe* softmax: subtract the row maximum before exponentiating (otherwise $e^{s}$ overflows
# float32 for $s > 88.7$). It takes **three passes over each row of $S$**: max, sum, normalise — each pass a
# read from HBM. Notebook 02 shows how to do this in fewer passes; FlashAttention needs that trick.
# The kernel also stores the log-sum-exp $L_i = m_i + \log \ell_i$ of each row: the backward uses it.

# %%
show_source(naive.make_softmax_rows)

# %% [markdown]
# And the host side: three launches, three $N_q \times N_k$ or $N \times d$ arrays written to HBM.

# %%
show_source(naive.forward)

# %% [markdown]
# ## Correctness
#
# Against the float64 NumPy reference (`flashnb.reference`), with lengths that are not multiples of the tile
# and a causal mask aligned to the bottom-right corner ($N_q \ne N_k$).

# %%
rng = np.random.default_rng(0)
B, H, Nq, Nk, d = 1, 2, 37, 45, 16
q, k, v = (rng.standard_normal((B, H, n, d)) for n in (Nq, Nk, Nk))
for causal in (False, True):
    o, lse = flashnb.attention_forward(q, k, v, causal=causal, impl="naive")
    o_ref, lse_ref = reference.attention_forward(q, k, v, causal=causal)
    print(f"causal={causal!s:5}  max |O - O_ref| = {np.abs(o - o_ref).max():.1e}   "
          f"max |L - L_ref| = {np.abs(lse - lse_ref).max():.1e}")

# %% [markdown]
# Errors of order $10^{-7}$: float32 rounding, nothing else.
#
# ## Counting HBM traffic
#
# On the simulator, `flashnb.instruments.traffic.count()` watches every element each kernel reads or writes, per array
# (named by the kernel's parameter), and every shared-memory access. It is a *program-level* count — what
# the kernel asks for, element by element. A real GPU moves whole 32-byte sectors and may serve re-reads from
# its L2 cache, so DRAM bytes measured by Nsight Compute can be lower (notebook 00 discusses this).

# %%
BH, N, d = 1, 48, 16
q3, k3, v3 = (rng.standard_normal((BH, N, d)) for _ in range(3))
with traffic.count() as t:
    flashnb.attention_forward(q3, k3, v3, impl="naive")
print(t)

# %% [markdown]
# The analytic model (`naive.model_forward`) predicts every one of those numbers from the shapes alone.
# The tiled matmul reads each element of its left operand once per *column tile* of the output, and each
# element of its right operand once per *row tile*: $S = QK^\top$ reads $Q$ $\lceil N_k/T\rceil$ times.
# Softmax reads $S$ three times (three passes) and writes $P$ once.

# %%
model = naive.model_forward(BH, N, N, d)
assert t.summary() == model, "counted traffic differs from the model"
for launch_model in model:
    print(f"{launch_model['launch']:<16} reads {launch_model['reads']}  writes {launch_model['writes']}")

# %% [markdown]
# ### Traffic as $N$ grows
#
# The FA1 paper's Theorem 2: standard attention needs $\Theta(Nd + N^2)$ HBM accesses — Algorithm 0 as
# written reads and writes $4N^2 + 4Nd$ elements (Q, K, V read once; S written, read; P written, read;
# O written). We count the real kernels, launch by launch, for small $N$ on the simulator, check every
# count against the model, and then use the validated model for larger $N$.

# %%
d = 16
Ns_counted = [8, 16, 32, 48, 64]
counted = {}   # launch label -> bytes per N
for n in Ns_counted:
    x = rng.standard_normal((1, n, d))
    with traffic.count() as t:
        flashnb.attention_forward(x, x, x, impl="naive")
    assert t.summary() == naive.model_forward(1, n, n, d)
    for launch in t.launches:
        counted.setdefault(launch.label, []).append(launch.read_bytes + launch.write_bytes)


def model_bytes_per_launch(n, d):
    return {m["launch"]: 4 * (sum(m["reads"].values()) + sum(m["writes"].values()))
            for m in naive.model_forward(1, n, n, d)}


Ns = np.array([8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096])
per_launch = [model_bytes_per_launch(n, d) for n in Ns]
fig, ax = plt.subplots(figsize=(7, 4.5))
for label, points in counted.items():
    line, = ax.loglog(Ns, [m[label] for m in per_launch], "-", label=f"{label}: model")
    ax.loglog(Ns_counted, points, "o", color=line.get_color(), label=f"{label}: counted")
ax.loglog(Ns, [sum(m.values()) for m in per_launch], "k-", lw=2, label="total: model")
ax.loglog(Ns, [4 * (4 * n * n + 4 * n * d) for n in Ns], "k:", label=r"Alg. 0 as written: $4N^2 + 4Nd$ elements")
ax.set_xlabel("sequence length N (Nq = Nk, d = 16, one head)")
ax.set_ylabel("global memory traffic (bytes)")
ax.set_title("Standard attention forward: HBM traffic per kernel")
ax.legend(fontsize="small")
savefig(fig, "01_naive_traffic_vs_N")
plt.show()
n = 4096
print(f"N = {n}, d = {d}: model {sum(model_bytes_per_launch(n, d).values()) / 1e6:.0f} MB, "
      f"Alg. 0 as written {4 * (4 * n * n + 4 * n * d) / 1e6:.0f} MB")

# %% [markdown]
# Every kernel's traffic grows like $N^2$. Ours is *above* the $4N^2 + 4Nd$ of Algorithm 0 as written: the
# softmax reads S three times (one read per pass), and a tiled matmul with $T\times T$ tiles reads its
# operands $\lceil N/T \rceil$ times, so $S = QK^\top$ costs $2N^2d/T$ reads on top of writing $S$. The
# paper's count assumes each input is read once — true only if an operand stays on chip (or in cache)
# while it is reused. Either way, the $N^2$ intermediates are what FlashAttention removes.

# %% [markdown]
# ## Memory footprint of S and P
#
# Beyond traffic, the intermediates must *fit*: $S$ and $P$ are $B \cdot H \cdot N^2$ floats each. For the
# GPT-2 medium setting of the FA1 paper's Figure 2 (batch 64, 16 heads):

# %%
for n in (1024, 2048, 4096, 8192, 16384):
    elems = 64 * 16 * n * n
    print(f"N = {n:>5}:  S and P together = {2 * elems * 4 / 2**30:8.1f} GiB in float32,"
          f" {2 * elems * 2 / 2**30:8.1f} GiB in float16")

# %% [markdown]
# At $N = 4096$, in float32, that is more than the 80 GB of an A100 holds — before counting the backward's
# $dP$ and $dS$.
#
# ## Modelled speed
#
# Without a GPU we can still say how fast this *would* be if each kernel ran at the roofline: its time is at
# least $\max(\text{FLOPs}/\text{peak}, \text{bytes}/\text{bandwidth})$. This is a **model**, a lower bound
# from counted bytes and FLOPs, not a measurement. The bytes are counted at the shape below: one head runs on
# the simulator (each launch equal to its model), and every head of the batch moves the same. These kernels
# multiply on the FP32 CUDA cores, so their compute ceiling is the FP32 CUDA-core peak (the tensor cores'
# is notebook 12's).

# %%
from flashnb.instruments import roofline  # noqa: E402

gpu = roofline.GPUS["A100 80GB SXM"]
from flashnb.sim import vector  # noqa: E402

BH, N, d = 16 * 64, 1024, 64
x = rng.standard_normal((1, N, d))
with traffic.count() as t:                        # one head
    flashnb.attention_forward(x, x, x, impl="naive")
assert t.summary() == naive.model_forward(1, N, N, d)
assert not vector.notes(), vector.notes()         # it ran on the vectorised simulator
rows = []
for m, m_bh in zip(t.summary(), naive.model_forward(BH, N, N, d)):
    nbytes = 4 * BH * (sum(m["reads"].values()) + sum(m["writes"].values()))      # counted, times batch·heads
    assert nbytes == 4 * (sum(m_bh["reads"].values()) + sum(m_bh["writes"].values()))
    flops = {"S = scale·QKᵀ": 2 * BH * N * N * d, "O = PV": 2 * BH * N * N * d}.get(m["launch"], 5 * BH * N * N)
    rows.append((m["launch"], flops, nbytes, roofline.modelled_time(flops, nbytes, gpu)))
for name, flops, nbytes, mt in rows:
    print(f"{name:<16} {flops / 1e9:8.1f} GFLOP {nbytes / 1e9:8.2f} GB  intensity {flops / nbytes:6.2f} FLOP/B"
          f"  modelled {mt.seconds * 1e3:7.2f} ms ({mt.bound}-bound)")
print(f"total modelled forward time on {gpu.name}: {sum(r[3].seconds for r in rows) * 1e3:.1f} ms (model, not a measurement)")
print(f"{gpu.name} FP32 ridge point: {gpu.ridge_intensity:.1f} FLOP/B")
fig, ax = plt.subplots(figsize=(7, 4.5))
roofline.roofline_plot([(name, flops, nbytes) for name, flops, nbytes, _ in rows], gpu, ax=ax)
savefig(fig, "01_naive_roofline")
plt.show()

# %% [markdown]
# (The softmax's FLOPs are counted here as ~5 per element: max, subtract, exp, add, multiply.)
#
# Compare each intensity printed above with the GPU's FP32 ridge point (printed below): a kernel left of
# the ridge is memory-bound. An element of $S$ costs $2d$ FLOPs to compute and 4 bytes to write, but our
# $T = 16$ tiles also re-read $Q$ and $K$ once per tile, which pulls even the matrix products down. The
# softmax, at a fraction of a FLOP per byte, is memory-bound on every GPU.
#
# **Measured, on a GPU.** The cell below times the forward and backward with CUDA events (JIT warm-up
# excluded, median of repeats and its spread) in a separate process when this machine has a GPU; notebook 00's
# appendix (A.5) explains how, and why the simulator's wall-clock time is never reported as GPU speed.

# %%
from flashnb.instruments import bench  # noqa: E402

gpu_rows = bench.on_gpu("flashnb.instruments.bench:measure_impls", impls=["naive"], BH=16, N=1024, d=64, directions=["fwd", "bwd"])
print(bench.table(gpu_rows, ["impl", "direction", "median_ms", "q1_ms", "q3_ms", "tflops", "pct_fp32_peak", "gpu_name"]))

# %%
print(f"notebook ran in {time.perf_counter() - T0:.1f} s")

# %% [markdown]
# ## Exercises
#
# Each exercise has a check: fill in the `...` and run its cell (`...` means "not attempted yet"). Stuck?
# `exercises.hint("01.1")` gives a hint and `exercises.answer("01.1")` the worked answer -- try first.
# Levels: ★ a few lines, ★★ a small kernel or experiment, ★★★ a real change to a kernel.
# To change a library kernel, edit a copy. The lines worth changing are marked in the kernels as named regions
# (`# region max-and-sum` ... `# endregion max-and-sum`; `show_source(factory, region=name)` prints one):
# `registry.variant(factory, regions={name: new_lines})` replaces a region's lines, `registry.variant(factory,
# region=name, replace=(old_text, new_text))` one piece of text inside it. Run the copy through the library with
# `with registry.using(factory, variant):`.

# %%
from flashnb import exercises, registry  # noqa: F401,E402  (registry: for exercise 01.2)

# %% [markdown]
# **01.1 · What a smaller matmul tile re-reads** (★, ~10 min) The matmuls' tile is an option:
# `flashnb.attention_forward(q, k, v, impl="naive", tile=8)`, and `naive.matmul_model(BH, rows, cols, inner, T)`
# is the model of one matmul launch. *Before running*, predict from the model: for one head, $N = 32$, $d = 16$,
# how many global element reads does the whole forward make with $T = 8$? By what factor do the matmuls'
# operand reads change from $T = 16$, and by what factor their shared-memory reads? Then count to check yourself.

# %%
reads_T8 = ...
operand_factor = ...
shared_reads_factor = ...
passed = exercises.check("01.1", reads_T8=reads_T8, operand_factor=operand_factor, shared_reads_factor=shared_reads_factor)

# %% [markdown]
# **01.2 · A two-pass softmax in the naive forward** (★★, ~20 min) Make a variant of `naive.make_softmax_rows`
# whose passes 1 and 2 are one online pass (notebook 02 shows how), so the kernel reads $S$ twice. The check runs
# it through `naive.forward` (with `registry.using`) against the float64 reference -- fully masked rows
# included -- and counts its reads of $S$. How many bytes does it save for one head at $N = 1024$, $d = 64$, and
# what fraction of the forward's traffic is that?

# %%
two_pass = ...       # registry.variant(naive.make_softmax_rows, regions={"max-and-sum": new_lines})
saving_bytes = ...
passed = exercises.check("01.2", variant=two_pass, saving_bytes=saving_bytes)

# %% [markdown]
# **01.3 · One thread per row** (★, ~10 min) In `softmax_rows` neighbouring threads read addresses $N_k$ floats
# apart. For $N_k = 64$: how many 32-byte sectors does one warp's request for $S$ touch? How many if the 32 lanes
# read 32 consecutive elements of one row (one block per row)? Would the traffic *count* change?
# (`flashnb.sim.profile()` measures the first; notebook 00's appendix, A.1, explains sectors.)

# %%
sectors_per_request = ...
sectors_row_per_block = ...
count_changes = ...   # True or False
passed = exercises.check("01.3", sectors_per_request=sectors_per_request, sectors_row_per_block=sectors_row_per_block,
                count_changes=count_changes)

# %% [markdown]
# **01.4 · What storing P would save** (★★, ~15 min) `naive.backward` rebuilds $P = e^{S - L}$ from the saved
# log-sum-exp instead of keeping $P$ from the forward. Count its traffic with `traffic.count()` and compare with
# `naive.model_backward`: which launches would a backward that stored $P$ skip (their labels, as the traffic table
# prints them), and what share of the backward's element accesses are they at $N = 1024$, $d = 64$? What does
# storing $P$ cost instead?

# %%
skipped = ...          # a set of launch labels
saved_fraction = ...
passed = exercises.check("01.4", skipped=skipped, saved_fraction=saved_fraction)
