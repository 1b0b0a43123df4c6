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
# # 00 · Why attention is limited by memory traffic
#
# FlashAttention is not a new way to compute attention: it computes exactly the same numbers, but moves far
# fewer bytes between the GPU's large, slow memory (**HBM**) and its small, fast one (on-chip **SRAM**).
# Standard attention writes two $N \times N$ matrices, the scores $S$ and the probabilities $P$, to HBM and
# reads them back; each of their elements takes part in only a handful of arithmetic operations, so the GPU
# spends its time waiting for memory, not computing. The **roofline** makes that precise: a kernel that does
# fewer FLOPs per HBM byte than the GPU's *ridge point* is memory-bound. FlashAttention fuses the three steps
# into one kernel that keeps tiles of $S$ and $P$ in SRAM and never stores them, so the same FLOPs come with
# far fewer bytes. This notebook puts numbers on that:
#
# 1. the GPU memory hierarchy: how much faster and how much smaller SRAM is than HBM;
# 2. the roofline, and the arithmetic intensity of each step of attention, standard and fused;
# 3. how flashnb **counts** that traffic on the simulator, and what the count is *not*.
#
# Three kinds of number appear in flashnb, and each is always labelled: **counted** (element accesses observed
# on the simulator), **modelled** (a roofline estimate from FLOPs, bytes and a datasheet) and **measured**
# (only on a GPU). The instruments later notebooks use now and then (the memory profiler, the resource report
# and occupancy, warp operations, the sanitizer, and measuring on a GPU) are in the **Appendix** at the end,
# before the exercises.

# %%
import os

# Importing flashnb chooses GPU or simulator, once per process, before numba.cuda is imported. The notebooks
# count traffic, which only the simulator can do, so they ask for it; GPU timings run in a separate process.
os.environ["FLASHNB_DEVICE"] = "sim"
import flashnb

MODE = flashnb.MODE

import time

import matplotlib.pyplot as plt
import numpy as np
from numba import cuda, float32

from flashnb import instruments as fi
from flashnb.instruments import bench, roofline, traffic
from flashnb.notebook import savefig
from flashnb.registry import KERNELS
from flashnb.stages import fa2, naive

T0 = time.perf_counter()
print("kernels run on:", "the Numba CUDA simulator" if flashnb.is_simulator() else "a GPU", f"(flashnb.MODE = {MODE!r});",
      "GPU timings:", "on this machine's GPU, in a separate process" if bench.gpu_available() else "none (no GPU here)")

# %% [markdown]
# ## 1 · The memory hierarchy
#
# A GPU has (at least) two memories that matter for attention:
#
# * **HBM** (high-bandwidth memory, "global memory" in CUDA): tens of gigabytes, off the chip. Every input
#   ($Q, K, V$) starts there and every output ($O$) must end there.
# * **SRAM** on each streaming multiprocessor (SM): the shared memory / L1 array, a couple of hundred
#   kilobytes per SM. In CUDA, `cuda.shared.array` allocates a tile of it that the threads of one block share.
#
# The FlashAttention paper gives these numbers for an A100; the cell below derives the two ratios that
# matter — how much faster SRAM is, and how much smaller.

# %%
A100_PAPER = dict(hbm_bytes=(40e9, 80e9), hbm_bandwidth=(1.5e12, 2.0e12),
                  sram_per_sm=192 * 1024, sms=108, sram_bandwidth=19e12)   # FA1 paper, Section 2.1
sram_total = A100_PAPER["sram_per_sm"] * A100_PAPER["sms"]
print(f"HBM : {A100_PAPER['hbm_bytes'][0] / 1e9:.0f}-{A100_PAPER['hbm_bytes'][1] / 1e9:.0f} GB at "
      f"{A100_PAPER['hbm_bandwidth'][0] / 1e12:.1f}-{A100_PAPER['hbm_bandwidth'][1] / 1e12:.1f} TB/s")
print(f"SRAM: {A100_PAPER['sram_per_sm'] // 1024} KB x {A100_PAPER['sms']} SMs = {sram_total / 2**20:.1f} MiB "
      f"at ~{A100_PAPER['sram_bandwidth'] / 1e12:.0f} TB/s")
bw_ratio = (A100_PAPER["sram_bandwidth"] / A100_PAPER["hbm_bandwidth"][1],
            A100_PAPER["sram_bandwidth"] / A100_PAPER["hbm_bandwidth"][0])
size_ratio = (A100_PAPER["hbm_bytes"][0] / sram_total, A100_PAPER["hbm_bytes"][1] / sram_total)
print(f"SRAM is {bw_ratio[0]:.1f}-{bw_ratio[1]:.1f}x faster and {size_ratio[0]:,.0f}-{size_ratio[1]:,.0f}x smaller")

# %% [markdown]
# SRAM is about an order of magnitude faster but thousands of times smaller. An algorithm that keeps its
# working set in SRAM and touches HBM only for inputs and outputs wins — *if* its working set can be cut into
# tiles that fit. That is the whole idea of FlashAttention.
#
# flashnb's models use datasheet presets (`flashnb.instruments.roofline.GPUS`; the module docstring cites each source).
# The compute roof of notebooks 01 to 11 is the **FP32 CUDA-core** peak: their kernels multiply on the FP32
# units. The tensor-core peak, many times higher, is the roof of a kernel that runs its matmuls on the tensor
# cores, as notebook 12's does (numba has no tensor-core API; notebook 12 emits the PTX instructions itself).

# %%
print(f"{'GPU':<14} {'SMs':>4} {'DRAM TB/s':>9} {'FP32 TF/s':>10} {'tensor TF/s':>12} {'smem/SM KiB':>12} "
      f"{'ridge FLOP/B':>13}")
for g in roofline.GPUS.values():
    print(f"{g.name:<14} {g.sm_count:>4} {g.hbm_bandwidth / 1e12:>9.2f} {g.fp32_peak / 1e12:>10.1f} "
          f"{g.tensor_fp16_dense / 1e12:>12.1f} {g.smem_per_sm // 1024:>12} {g.ridge_intensity:>13.1f}")

# %% [markdown]
# The DRAM column is HBM on the data-centre GPUs; the T4 has GDDR6 (off-chip DRAM all the same: this notebook's
# "HBM" is the GPU's off-chip memory). The last column is the **ridge point**: peak FLOP/s divided by DRAM bytes/s. A kernel that does fewer FLOPs
# per HBM byte than that cannot keep the arithmetic units busy — its time is set by bandwidth. It is
# **memory-bound**. Above the ridge it is **compute-bound**.
#
# ## 2 · The roofline, and the arithmetic intensity of attention
#
# `flashnb.instruments.roofline.modelled_time(flops, bytes, gpu)` is the roofline model,
# $t = \max(\text{FLOPs}/\text{peak},\ \text{bytes}/\text{bandwidth})$: a lower bound, always labelled
# *modelled*. Standard attention (notebook 01) runs in three steps; `naive.model_forward` gives the exact
# element reads and writes of flashnb's kernels for each step, and FLOPs follow from the shapes: $2 N^2 d$ per
# matrix product, and (a convention, stated here) 5 FLOPs per element for the softmax (max, subtract, exp, add,
# multiply). For comparison, the last row is FlashAttention-2's single fused kernel (`fa2.model_forward`),
# doing the same arithmetic.

# %%
B, H, N, d = 64, 16, 1024, 64      # GPT-2 medium, as in the FA1 paper's Figure 2
BH = B * H
SOFTMAX_FLOPS_PER_ELEMENT = 5
mm_flops = 2 * BH * N * N * d
step_flops = {"S = scale·QKᵀ": mm_flops, "P = softmax(S)": SOFTMAX_FLOPS_PER_ELEMENT * BH * N * N,
              "O = PV": mm_flops}


def launch_bytes(m):
    return 4 * (sum(m["reads"].values()) + sum(m["writes"].values()) + sum(m["atomics"].values()))


steps = [(m["launch"], step_flops[m["launch"]], launch_bytes(m)) for m in naive.model_forward(BH, N, N, d)]
steps.append(("FA2 forward (fused)", sum(step_flops.values()),
              sum(launch_bytes(m) for m in fa2.model_forward(BH, N, N, d))))
a100, h100 = roofline.GPUS["A100 80GB SXM"], roofline.GPUS["H100 SXM"]
print(f"B={B}, H={H}, N={N}, d={d}; ridge: {a100.name} {a100.ridge_intensity:.1f}, "
      f"{h100.name} {h100.ridge_intensity:.1f} FLOP/B")
for name, flops, nbytes in steps:
    ta, th = roofline.modelled_time(flops, nbytes, a100), roofline.modelled_time(flops, nbytes, h100)
    print(f"{name:<20} {flops / 1e9:7.1f} GFLOP {nbytes / 1e9:7.2f} GB  intensity {flops / nbytes:7.2f} FLOP/B  "
          f"A100: {ta.seconds * 1e3:6.2f} ms {ta.bound:<7}  H100: {th.seconds * 1e3:6.2f} ms {th.bound}  (modelled)")
naive_total = sum(roofline.modelled_time(f, b, a100).seconds for _, f, b in steps[:3])
fused = roofline.modelled_time(steps[3][1], steps[3][2], a100)
print(f"standard attention, three launches: {naive_total * 1e3:.2f} ms; fused: {fused.seconds * 1e3:.2f} ms "
      f"on {a100.name} (modelled) -> {naive_total / fused.seconds:.1f}x")

# %%
fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
for ax, g in zip(axes, (a100, h100)):
    roofline.roofline_plot(steps, g, ax=ax)
fig.suptitle(f"Attention forward steps, B={B} H={H} N={N} d={d}, float32 -- modelled, not measured")
savefig(fig, "00_roofline")
plt.show()

# %% [markdown]
# Read the plot from left to right: a point's x-coordinate is its arithmetic intensity, its height the
# FLOP/s the roofline allows at that intensity. The softmax sits far left of the ridge on both GPUs — it is
# memory-bound whatever the GPU. The two matrix products of flashnb's standard attention also fall below the
# ridge, because the $N \times N$ matrices $S$ and $P$ travel to and from HBM (and the tiled matmul re-reads
# its operands once per tile). The fused kernel reads $Q, K, V$ and writes $O$ without ever storing $S$ or $P$,
# so the same FLOPs come with far fewer bytes and its point moves right, towards or past the ridge.
# Note also that the H100's ridge is further right than the A100's: compute grew faster than bandwidth, so
# memory traffic matters *more* on newer GPUs.

# %% [markdown]
# ## 3 · Counting traffic on the simulator
#
# `flashnb.instruments.traffic.count()` watches every kernel launched inside it, on the simulator, and counts each
# element read or written in global memory, per kernel parameter, and in shared memory, per variable. Kernels
# are not modified. Here is a tiny kernel of our own — a moving average of width 3 — counted:

# %%
@cuda.jit
def moving_average3(x, y):
    i = cuda.grid(1)
    if 1 <= i < x.shape[0] - 1:
        y[i] = (x[i - 1] + x[i] + x[i + 1]) / float32(3)


n = 256
x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
y = np.zeros(n, np.float32)
with traffic.count() as t:
    moving_average3[n // 64, 64](x, y)
print(t)
assert np.allclose(y[1:-1], (x[:-2] + x[1:-1] + x[2:]) / 3)
reads, writes = t.summary()[0]["reads"]["x"], t.summary()[0]["writes"]["y"]
assert (reads, writes) == (3 * (n - 2), n - 2)
print(f"x: {reads} element reads of {n} distinct elements ({reads / n:.2f} reads per element); "
      f"y: {writes} writes")

# %% [markdown]
# The count says each element of `x` is read about three times — because three threads ask for it. That is a
# **program-level count of element accesses**: what the kernel asks for, not what DRAM delivers. On a real GPU
# the second and third reads of an element almost certainly hit in the L1 or L2 cache, and the DRAM traffic is
# close to one read per element. So measured DRAM bytes can be **lower** than the count wherever a cache
# catches re-reads.
#
# They can also be **higher**: DRAM is read in 32-byte *sectors*, and the lanes of a warp whose addresses
# are scattered make it fetch many sectors for a few useful floats (Appendix A.1 counts them). flashnb's counts
# are therefore best read as "how many times does the *algorithm* touch each array" -- exactly the quantity of
# the FlashAttention papers' IO-complexity theorems.
#
# The counter works the same on flashnb's own kernels, and each stage has an analytic model in the same
# format that the tests check for exact equality. FlashAttention-2's forward at a small size:

# %%
rng = np.random.default_rng(1)
BHs, Ns, ds = 1, 128, 16
q, k, v = (rng.standard_normal((BHs, Ns, ds)) for _ in range(3))
with traffic.count() as t:
    o, lse = flashnb.attention_forward(q, k, v, impl="fa2")
print(t)
assert t.summary() == fa2.model_forward(BHs, Ns, Ns, ds)
per = {a: n_ / (BHs * Ns * ds) for a, n_ in t.summary()[0]["reads"].items()}
row_blocks = t.launches[0].grid[0]
print("reads per element:", {a: round(r, 2) for a, r in per.items()}, f"with {row_blocks} blocks of query rows"
      " -- counted == fa2.model_forward")

# %% [markdown]
# $Q$ is read once; $K$ and $V$ once per block of query rows (one thread block each, printed above). The
# shared-memory counts are the tile loads and the many cheap SRAM reads the arithmetic runs on.
#
# That is the whole idea in one count: standard attention (notebook 01) reads and writes $\Theta(N^2)$ elements
# of $S$ and $P$; FlashAttention reads $Q$, $K$, $V$ a few times and writes $O$ once, and nothing of size
# $N \times N$ ever reaches HBM. Notebooks 01 to 07 build that, stage by stage, and count each step; 11 adds what
# training and inference need. The electives go further: 08 (speed from the machine code), 09 (PyTorch), 10
# (attention modifiers), 12 (tensor cores) and 13 (many GPUs); [the start page](../docs/start.md) maps the path.

# %% [markdown]
# ## Appendix · The toolkit
#
# The sections below are reference material: the instruments flashnb uses beyond the traffic counter, shown on
# small kernels of this notebook and on stage 1's matrix product (notebook 01). Later notebooks point back to
# them and use them on FlashAttention's kernels; exercises 00.3 to 00.5 use them.
#
# ### A.1 · Sectors and bank conflicts: the memory profiler
#
# DRAM is read in 32-byte *sectors*; the 32 lanes of a warp execute a load together (one *request*), and the
# hardware serves it with as few sectors as the lanes' addresses allow (*coalescing*). The element counter
# knows nothing of this; `flashnb.sim.profile()` does. It groups the accesses of each warp into requests -- the
# k-th access of a source line by the lanes of one warp -- and counts the distinct sectors each request
# touches, under Nsight Compute's metric names. Three copies of one row of 32 floats, with the same element
# count:

# %%
from flashnb import sim


@cuda.jit
def copy_patterns(A, out):
    lane = cuda.threadIdx.x
    out[0, lane] = A[0, lane]      # lanes read consecutive floats: 128 bytes, 4 sectors
    out[1, lane] = A[lane, 0]      # lanes read down a column: rows are 256 bytes apart, a sector each
    out[2, lane] = A[0, 0]         # every lane reads the same float: one sector, broadcast


A = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
out3 = np.zeros((3, 32), np.float32)
with sim.profile() as prof:
    copy_patterns[1, 32](A, out3)
print(prof.table(prof.select(array="A")))
assert [s.per_request for s in prof.select(array="A")] == [4, 32, 1]
assert np.array_equal(out3, np.stack([A[0, :32], A[:32, 0], np.full(32, A[0, 0])]))
print({k: v for k, v in prof.metrics()["copy_patterns"].items() if "global_op_ld" in k})

# %% [markdown]
# Same element count, eight times the sectors for the column (32 per request against the ideal 4): measured
# DRAM bytes can exceed the count wherever a warp's lanes are scattered. Shared memory has its own version of
# this: 32 *banks* of 4-byte words, word $w$ in bank $w \bmod 32$; a request costs as many *wavefronts* as the
# most distinct words any one bank must deliver (lanes reading the same word share it). The profiler counts
# those too: lanes that read down a column of a row-major tile whose width is a multiple of 32 all hit one bank.
# Notebooks 03 and 05 profile FlashAttention's own tiles this way, once their kernels are taught.

# %% [markdown]
# `flashnb profile` prints this for every implementation of attention. These are still program-level counts (the compiler
# may keep a value in a register instead of reloading it) with no cache modelling: `flashnb.sim.memprofile`
# lists how they differ from what Nsight Compute measures. Read the traffic counter as "how many times does the
# *algorithm* touch each array" and the profiler as "how well would a GPU's memory system serve those touches".
#
# ### A.2 · The resource report: registers, shared memory, occupancy
#
# Counting tells us about the algorithm; whether a kernel can keep an SM busy depends on what each thread and
# block *costs*. `flashnb.instruments` compiles a kernel to PTX for a real architecture (NVVM) and runs `ptxas -v`
# on it — no GPU needed; in simulator mode the compile runs in a child process — then derives the
# **occupancy**: how many blocks (and warps) one SM can hold at once, and which resource limits it. Here,
# stage 1's tiled matrix product `naive.matmul` (notebook 01; one configuration) for sm_80 (A100) and sm_90
# (H100/H200):

# %%
t_inspect = time.perf_counter()
jobs = [(name, KERNELS[name].configs[i], cc) for name, i in (("naive.matmul", 0),) for cc in ((8, 0), (9, 0))]
resources = fi.resources_many(jobs)
t_inspect = time.perf_counter() - t_inspect
MATMUL_THREADS = naive.TILE * naive.TILE      # naive's launcher: a T x T block per output tile
for (name, config, cc), r in zip(jobs, resources):
    threads = r.threads if r.threads is not None else MATMUL_THREADS
    occ = r.occupancy(threads)
    print(f"{r.name:<12} {config}")
    print(f"    sm_{r.cc[0]}{r.cc[1]}  {r.registers:>3} regs/thread  {r.shared_bytes:>6} B smem  "
          f"{r.spill_bytes} B spills  {threads:>3} thr -> {occ.blocks_per_sm:>2} blocks = {occ.warps_per_sm:>2} "
          f"warps/SM ({occ.occupancy:.0%}), limited by {occ.limiter}  {occ.limits}")
print(f"(compiled in {t_inspect:.1f} s)")
for cc, lim in fi.SM_LIMITS.items():
    print(f"sm_{cc[0]}{cc[1]} per-SM limits: {lim.regs_per_sm:,} registers, {lim.max_warps_per_sm} warps, "
          f"{lim.max_blocks_per_sm} blocks, {lim.smem_per_sm // 1024} KiB shared; registers allocated per warp "
          f"in units of {lim.reg_alloc_unit}")

# %% [markdown]
# How to read a row: an SM has a fixed register file and a cap on resident warps and blocks (the per-SM limits
# printed last). A thread that needs $r$ registers costs a warp $32r$ of them (rounded up to the allocation
# unit), so the register file holds
# fewer warps as $r$ grows. `limits` shows how many blocks each resource alone would allow; the smallest wins
# and is named the limiter. `naive.matmul` is small and cheap: a few registers per thread, one tile of each
# operand in shared memory. FlashAttention-2's kernels (notebook 05) keep tiles of $S$ and $O$ in registers, so
# there registers limit how many blocks fit. Low occupancy is not automatically bad (FlashAttention-2 runs at low
# occupancy on purpose, using registers as the fastest memory), but it means fewer warps are available to hide
# memory latency.
#
# The same rule over every register count, at 128 threads per block (`flashnb.instruments.occupancy` is pure
# arithmetic, so this needs no compiler):

# %%
regs = np.arange(16, 256)
fig, ax = plt.subplots(figsize=(7, 4))
for cc in ((8, 0), (9, 0)):
    ax.step(regs, [fi.occupancy(int(r), 0, 128, cc).warps_per_sm for r in regs], where="post",
            label=f"sm_{cc[0]}{cc[1]}, 128 threads/block, no shared memory")
for r in resources:      # naive.matmul at its own block size (the curves are for 128 threads)
    ax.plot([r.registers], [r.occupancy(MATMUL_THREADS).warps_per_sm], "o",
            label=f"naive.matmul on sm_{r.cc[0]}{r.cc[1]}, {MATMUL_THREADS} threads/block")
ax.set_xlabel("registers per thread")
ax.set_ylabel("resident warps per SM")
ax.set_title("Occupancy vs registers (from published per-SM limits)")
ax.legend(fontsize="small")
savefig(fig, "00_occupancy_vs_registers")
plt.show()

# %% [markdown]
# ### A.3 · Warp operations on the simulator
#
# A **warp** is 32 threads that execute together; lanes of a warp can exchange registers directly with
# *shuffles*, without shared memory or a barrier. FlashAttention-2 uses them for row maxima and sums. The stock
# Numba simulator lacks these intrinsics; `flashnb.sim` adds them with CUDA's semantics, so the same kernel runs
# here and compiles for a GPU. A small tour, with two warps of 32 lanes:
#
# * `shfl_down_sync(mask, v, k)` — lane $i$ gets lane $i+k$'s value: halving $k$ from 16 leaves the warp's sum
#   in lane 0;
# * `shfl_xor_sync(mask, v, k)` — lane $i$ gets lane $i \oplus k$'s value: the "butterfly" leaves the sum in
#   *every* lane;
# * `shfl_sync(mask, v, src)` — a broadcast of lane `src`'s value;
# * `ballot_sync(mask, pred)` — a 32-bit mask with bit $i$ set when lane $i$'s predicate holds.

# %%
FULL = 0xFFFFFFFF


@cuda.jit
def warp_tour(x, down, butterfly, bcast, ballot):
    tid = cuda.threadIdx.x
    v = x[tid]
    s = v
    offset = 16
    while offset > 0:                       # tree reduction towards lane 0
        s += cuda.shfl_down_sync(FULL, s, offset)
        offset //= 2
    down[tid] = s
    b = v
    offset = 1
    while offset < 32:                      # butterfly: every lane ends with the sum
        b += cuda.shfl_xor_sync(FULL, b, offset)
        offset *= 2
    butterfly[tid] = b
    bcast[tid] = cuda.shfl_sync(FULL, v, 5)              # everyone reads lane 5
    ballot[tid] = cuda.ballot_sync(FULL, v > float32(0))  # bit i: lane i saw a positive value


xs = np.random.default_rng(2).standard_normal(64).astype(np.float32)
down, butterfly, bcast = (np.zeros(64, np.float32) for _ in range(3))
ballot = np.zeros(64, np.int32)
warp_tour[1, 64](xs, down, butterfly, bcast, ballot)

warps = xs.reshape(2, 32)
sums = warps.astype(np.float64).sum(axis=1)
bits = ((warps > 0).astype(np.int64) << np.arange(32)).sum(axis=1)
expected_ballot = bits.astype(np.uint32).view(np.int32)     # numba types ballot_sync's result as int32
assert np.allclose(down[[0, 32]], sums, atol=1e-5)
assert np.allclose(butterfly.reshape(2, 32), sums[:, None], atol=1e-5)
assert np.array_equal(bcast.reshape(2, 32), np.repeat(warps[:, 5:6], 32, axis=1))
assert np.array_equal(ballot.reshape(2, 32), np.repeat(expected_ballot[:, None], 32, axis=1))
print("warp sums (numpy)       :", sums)
print("shfl_down_sync, lane 0  :", down[[0, 32]])
print("shfl_xor_sync, all lanes:", np.unique(butterfly.reshape(2, 32), axis=1).ravel())
print("ballot of v > 0         :", [f"{int(b) & 0xFFFFFFFF:#010x}" for b in ballot[[0, 32]]],
      "= numpy", [f"{int(b):#010x}" for b in bits])

# %% [markdown]
# Lane 0 of the `shfl_down_sync` reduction holds the sum; the other lanes hold partial sums that mean little.
# A lane whose source $i+k$ lies past lane 31 gets its *own* value back (CUDA's rule), so lane 31 adds itself
# at each of the five steps and ends with $2^5 = 32$ times its value — checked here:

# %%
assert np.allclose(down[[31, 63]], 32 * xs[[31, 63]], rtol=1e-6)
print("lane 31 after shfl_down:", down[[31, 63]], "= 32 x", xs[[31, 63]])

# %% [markdown]
# The butterfly gives every lane the total, which is what a row-wise softmax wants: every lane then knows the row
# max or row sum. The simulator also turns a shuffle that a GPU would hang on (a full-mask shuffle that some
# lane never reaches) into an error instead of a hang. flashnb's kernels use exactly these calls: the online
# softmax of notebook 02 reduces its rows with them, and FlashAttention-2 (notebook 05) its row maxima and sums.

# %% [markdown]
# ### A.4 · The bugs the simulator hides, and the sanitizer that finds them
#
# Threads of a block that share a tile must wait at `cuda.syncthreads()` between writing it and reading what
# *other* threads wrote. Leave the barrier out and a GPU may read stale values; the simulator, which runs the
# threads of a block in turn, often happens to read the right ones and the mistake goes unseen. It hides
# three more: NumPy quietly *wraps* a negative index (`x[-1]` is the last element; on a GPU it is whatever lies
# before the array), the simulator's shared arrays start as whatever the previous block left there (an
# uninitialised read looks plausible), and a `syncthreads()` that only some threads reach is undefined
# behaviour in CUDA. `flashnb.sim.sanitize()` is compute-sanitizer's four tools on the simulator: **memcheck**,
# **racecheck**, **initcheck** and **synccheck**. Here each thread writes its slot and reads its neighbour's:

# %%
@cuda.jit
def rotate(x, out, barrier):
    sh = cuda.shared.array(64, float32)
    t = cuda.threadIdx.x
    sh[t] = x[t]
    if barrier:
        cuda.syncthreads()
    out[t] = sh[(t + 1) % cuda.blockDim.x]


x64, out64 = np.arange(64, dtype=np.float32), np.zeros(64, np.float32)
for barrier in (False, True):
    with sim.sanitize(raise_on_error=False) as report:
        rotate[1, 64](x64, out64, barrier)
    print(f"barrier={barrier}: output right: {np.array_equal(out64, np.roll(x64, -1))};", report)
    assert bool(report) != barrier

# %% [markdown]
# Without the barrier, whether the output comes out right depends on the order the threads happen to run in
# (the line above says what it was this time), on the simulator as on a GPU; racecheck reports the race either
# way and names the two lines (in a notebook, a cell's "file" is a number), and initcheck adds the reads that ran
# before the write they needed. And an off-by-one that NumPy would have wrapped:

# %%
@cuda.jit
def shift_right(x, out):
    t = cuda.threadIdx.x
    out[t] = x[t - 1]          # thread 0 reads x[-1]


with sim.sanitize(raise_on_error=False) as report:
    shift_right[1, 32](x64, out64)
print(report)
assert report.findings[0].tool == "memcheck"

# %% [markdown]
# Every flashnb kernel, forward and backward, passes all four tools in the tests
# (`tests/sim/test_sim_sanitizer.py`), with tiles small enough that every loop reloads its shared tiles;
# `flashnb sanitize my_script.py` runs a script of your own under them.
#
# ### A.5 · What a GPU adds
#
# Everything above is counted or modelled. The simulator runs the kernels' Python on a CPU, so its
# wall-clock time says nothing about GPU speed, and flashnb refuses to present it as such:

# %%
try:
    bench.time_call(lambda: flashnb.attention_forward(q, k, v, impl="fa2"))
except bench.SimulatorTimingError as exc:
    print("SimulatorTimingError:", exc)

# %% [markdown]
# On a machine with a GPU:
#
# * `flashnb.instruments.bench.time_call(fn, flops=...)` times `fn` with **CUDA events** — JIT compilation in untimed
#   warm-up calls, then the median of repeats with the spread — and reports TFLOP/s and the percentage of that
#   device's own FP32 peak (SMs × FP32 lanes × 2 × clock, read from the device);
# * `flashnb bench` sweeps $N$ and $d$ for every implementation and writes a CSV with provenance (GPU name,
#   driver, versions, date). On the simulator the same sweep writes only *modelled* rows;
# * `scripts/gpu_check.py` checks correctness at realistic sizes, runs the sweep and, where Nsight Compute
#   (`ncu`) is installed, reads **DRAM bytes** per kernel (`dram__bytes_read.sum`, `dram__bytes_write.sum`) and
#   sets them beside the counted/modelled bytes — the place to see the cache and sector effects of section 3
#   and A.1;
# * inside a notebook (a simulator process, so it can count), `bench.on_gpu("flashnb.<module>:<function>", ...)`
#   runs a measurement in a separate Python process on the GPU when the machine has one, and returns its rows.
#
# Most notebooks have such a cell near their end. Without a GPU it measures nothing, invents nothing, and
# prints one line naming the measurement it would have made; the numbers around it are then counted on the
# simulator or modelled, as labelled. (A process's mode is fixed when `numba.cuda` is first imported, and only
# the simulator can count element accesses: that is why the notebooks run on the simulator and measure in a
# child process.)

# %%
gpu_rows = bench.on_gpu("flashnb.instruments.bench:measure_impls", impls=["naive", "fa2"], BH=16, N=1024, d=64)
print(bench.table(gpu_rows, ["impl", "direction", "median_ms", "q1_ms", "q3_ms", "tflops", "pct_fp32_peak", "gpu_name"]))

# %% [markdown]
# What the sweep writes here, without a GPU — the modelled bytes and time of the standard and fused forward
# at a larger size:

# %%
Bb, Hb, Nb, db = 2, 8, 4096, 64
flops = roofline.flops_forward(Bb, Hb, Nb, Nb, db)
for impl in ("naive", "fa2"):
    nbytes = bench.modelled_bytes(impl, Bb, Hb, Nb, db, causal=False)
    print(f"{impl:<6} {nbytes / 1e9:6.2f} GB  {roofline.modelled_time(flops, nbytes, h100)}")

# %%
runtime_s = time.perf_counter() - T0
print(f"notebook ran in {runtime_s:.1f} s (simulator wall time: says nothing about GPU speed)")

# %% [markdown]
# ## Exercises
#
# Each exercise has a check: fill in the `...` and run its cell (`...` means "not attempted yet"). Stuck?
# `exercises.hint("00.1")` gives a hint and `exercises.answer("00.1")` the worked answer -- try first.
# Levels: ★ a few lines, ★★ a small kernel or experiment, ★★★ a real change to a kernel.

# %%
from flashnb import exercises

# %% [markdown]
# **00.1 · When does FA2's forward become compute-bound?** (★, ~10 min) Using the presets, find the smallest
# sequence length $N$ (a multiple of 64, $d = 64$, one head) at which the FA2 forward's modelled time on an H100
# is compute-bound, and the same on an A100 (80 GB). Why do they differ?

# %%
N_h100 = ...
N_a100 = ...
passed = exercises.check("00.1", N_h100=N_h100, N_a100=N_a100)

# %% [markdown]
# **00.2 · A moving average through shared memory** (★★, ~20 min) Rewrite `moving_average3` so each block
# first copies its slice of `x` (plus one element on each side) into a `cuda.shared.array`, then averages from
# shared memory. The check runs it as `kernel[n // 64, 64](x, y)` under the sanitizer and counts it: how do the
# global reads per element change, and where did the other reads go?

# %%
moving_average3_shared = ...   # your @cuda.jit kernel (x, y)
passed = exercises.check("00.2", kernel=moving_average3_shared)

# %% [markdown]
# **00.3 · Strided reads** (★, ~10 min) Add lines to `copy_patterns` that read `A[0, 2 * lane]` and
# `A[0, 8 * lane]` (make `A` wide enough) and profile them. How many sectors does a request touch at stride 2
# and at stride 8? From which stride on does the strided read get no worse, and why?

# %%
sectors_stride2 = ...
sectors_stride8 = ...
worst_from_stride = ...
passed = exercises.check("00.3", sectors_stride2=sectors_stride2, sectors_stride8=sectors_stride8,
                worst_from_stride=worst_from_stride)

# %% [markdown]
# **00.4 · Registers to spare** (★★, ~15 min) With `flashnb.instruments.occupancy` and the resource report of
# Appendix A.2, find how many registers per thread `naive.matmul` (the configuration A.2 prints, at its
# `MATMUL_THREADS` threads per block) could use on sm_90 and still keep its current number of resident blocks per
# SM.

# %%
max_registers = ...
passed = exercises.check("00.4", max_registers=max_registers)

# %% [markdown]
# **00.5 · A warp scan** (★★, ~20 min) Write a warp *inclusive scan* with `shfl_up_sync`: in each warp, lane $i$
# ends with the sum of lanes $0..i$. The check launches it as `kernel[1, 64](x, out)` and compares each warp with
# `np.cumsum`. What must a lane do when `lane - offset` is negative?

# %%
warp_scan = ...   # your @cuda.jit kernel (x, out)
passed = exercises.check("00.5", kernel=warp_scan)

