# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 08 · From readable to fast: what the machine code costs
#
# Stage 4's FA2 forward (notebook 05) is the algorithm of the FA2 paper, written to be read. Its HBM traffic is
# what the paper promises; its *speed* is another matter. On a GPU the FP32 units can do one fused multiply-add
# (FFMA) per lane per clock -- **if** every clock the scheduler has an FFMA to issue. Every other instruction
# (a loop counter, an address, a shared-memory load, a shuffle) takes an issue slot an FFMA could have had. So
# the question of this notebook is: **what fraction of the instructions a kernel issues are FFMAs, and what
# stands in the way of the rest?**
#
# We answer it without a GPU, with three tools that run on a laptop:
#
# * `flashnb.instruments.sass` -- the kernel's machine code (SASS) from ptxas and nvdisasm, sorted into FFMA, other FP32,
#   shared loads (with their width), shuffles, integer/address work, local memory;
# * `flashnb.sim.profile` -- the simulator's memory profiler: bank conflicts and sectors per request;
# * `flashnb.instruments.sass_model` -- a **modelled** time from the SASS counts: each instruction charged to the pipe of an
#   SM that runs it (issue, FP32, MUFU, shared), blocks scheduled onto the SMs. A model, not a measurement:
#   it assumes the warps hide every latency, so it is an upper bound on speed.
#
# Then we take the stage-4 kernel apart one change at a time, and see what each does to the code.

# %%
import os
import time

import matplotlib.pyplot as plt
import numpy as np

os.environ["FLASHNB_DEVICE"] = "sim"  # counting needs the simulator; GPU timings run in a process of their own
import flashnb
from flashnb import instruments as fi
from flashnb.instruments import bench, sass, sass_model
from flashnb.notebook import savefig, show_source
from flashnb.stages import fa2, fa2_fast
from flashnb.stages import fa2_fast_steps as steps

T0 = time.perf_counter()
print("kernels run on the Numba CUDA simulator; GPU timings:",
      "on this machine's GPU, in a separate process" if bench.gpu_available() else "none (no GPU here)")
GPU = "H100 SXM"

# %% [markdown]
# ## The audit: stage 4's SASS
#
# `sass.sass(kernel, config=...)` compiles a registered kernel for sm_90 and disassembles it. Loops are found
# from backward branches; the **hot loop** is the innermost loop with the most FFMAs. We compile stage 4's
# forward and stage 6's (`flashnb.stages.fa2_fast`) at their default tiles, d = 64 (and stage 6 at d = 128), in one batch.

# %%
configs = {("fa2", 64): fa2.sass_config(64, False), ("fa2_fast", 64): fa2_fast.sass_config(64, False),
           ("fa2_fast", 128): fa2_fast.sass_config(128, False)}
kernel_of = {"fa2": "fa2.forward", "fa2_fast": "fa2_fast.forward"}
compiled = dict(zip(configs, sass.sass_many([(kernel_of[m], c) for (m, _), c in configs.items()])))
print(compiled[("fa2", 64)].table())

# %% [markdown]
# The whole kernel is thousands of instructions, most of them run once per thread block. What runs per K/V tile
# is the loop body, and within it the two inner loops of FA2 Alg. 1: line 8 ($S = Q_i K_j^\top$) and line 10
# ($\tilde O \mathrel{+}= \tilde P V_j$). The table puts stage 4 and stage 6 side by side:

# %%
rows = []
for (m, d), s in compiled.items():
    hot = s.hot_loop
    r = s.resources
    rows.append(dict(kernel=m, d=d, hot_loop=len(hot), ffma_pct=round(100 * s.fma_fraction(hot), 1),
                     lds_bits=s.load_widths(hot), int_ops=s.mix(hot)["int"], local=s.mix()["ldl"] + s.mix()["stl"],
                     registers=r.registers, shared_KiB=round((r.shared_bytes + r.dynamic_shared_bytes) / 1024, 1),
                     blocks_per_SM=r.occupancy(32 * configs[(m, d)]["warps"]).blocks_per_sm))
print(bench.table(rows, list(rows[0])))

# %% [markdown]
# Stage 4's hot loop (line 10) is mostly FFMA but fed by 32-bit shared loads, and it touches local memory (the
# stack): `S[a, b]` is indexed by a loop variable that did not unroll, so the array cannot live in registers.
# Stage 6's hot loop reads shared memory only with 128-bit loads and has no local memory at all.
#
# ## The steps, one change at a time
#
# Each change is easiest to see on the smallest kernel that has it. `flashnb.stages.fa2_fast_steps` holds the core of
# line 8 -- copy $Q_i$, $K_j$ (32 × d) into shared memory, then $S = Q_i K_j^\top$ on one warp with stage 4's
# register micro-tile of $8 \times 4$ per lane -- written four ways, each one change away from the one before.
# Step 1 is stage 4's way:

# %%
show_source(steps.make_qk_stage4)

# %% [markdown]
# Step 2 changes only the loop counter and the shared-memory indices to 32-bit unsigned integers. Numba's
# `range` keeps a 64-bit counter, and a *signed* index gets a negative-index fix-up (`if i < 0: i += n`, as
# Python allows `x[-1]`) before every load; an unsigned one cannot be negative:

# %%
show_source(steps.make_qk_u32, grep="uint32")

# %% [markdown]
# Step 3 changes the layout: $Q_i$ and $K_j$ stay **row-major** (each row padded by 4 floats), and a lane reads
# 4 consecutive $k$ of a row at a time, which ptxas turns into one 128-bit load (`LDS.128`). The copy from HBM
# becomes a plain row copy. Step 4 replaces the padding by a **swizzle**: chunk $c$ (4 floats) of row $r$ is
# stored at chunk $c \oplus (r \bmod 8)$, which spreads the rows a warp reads over the banks without spending
# any bytes:

# %%
show_source(steps._make_qk_rowmajor, grep="at(")

# %% [markdown]
# What each step does -- checked against NumPy (`steps.run` poisons $S$ with NaN and compares with $QK^\top$ in
# float64), profiled on the simulator (bank conflicts of the shared stores and loads), and compiled:

# %%
step_sass = sass.sass_many([(kernel, dict(d=64)) for _, kernel, _ in steps.STEPS])
step_rows = []
for (name, kernel, factory), s in zip(steps.STEPS, step_sass):
    with flashnb.sim.profile() as prof:
        S, ref = steps.run(factory, 64)
    assert not np.isnan(S).any() and np.abs(S - ref).max() < 1e-3   # float32 sums of 64 products: ~1e-5
    hot = s.hot_loop
    step_rows.append(dict(step=name, instructions=len(s.instructions), hot_loop=len(hot),
                          hot_ffma_pct=round(100 * s.fma_fraction(hot), 1), hot_int=s.mix(hot)["int"],
                          lds_bits=s.load_widths(hot),
                          store_conflicts=prof.total(memory="shared", op="st")["bank_conflicts"],
                          load_conflicts=prof.total(memory="shared", op="ld")["bank_conflicts"],
                          shared_bytes=s.resources.shared_bytes))
print(bench.table(step_rows, list(step_rows[0])))

# %% [markdown]
# Read the table row by row:
#
# * **32-bit indices** remove integer work everywhere in the kernel (the instruction count falls) and in the hot
#   loop. In this small kernel LLVM unrolled stage 4's `range(d)` loop anyway; inside stage 4's real kernel it
#   did not, and its SASS has ~56 instructions per 16 FFMAs there.
# * **128-bit loads** are the big step: each load brings 4 values of $k$, so the same $T_M + T_N$ loads feed
#   $4 T_M T_N$ FFMAs instead of $T_M T_N$ (exercise 08.1). The transposed stores of steps 1-2 were 32-way bank
#   conflicts (32 lanes storing down one column); the row copies have none.
# * **The swizzle** keeps the loads conflict-free without the padding (less shared memory), for one XOR per
#   load address -- visible as extra integer instructions in the hot loop.
#
# The full stage-6 kernel applies all of these, plus: every per-lane array indexed only by compile-time loop
# variables (so it lives in registers), the two loops that stay loops counted in `uint32`, tile copies without
# a bounds test for full tiles, and a coalesced store of $O_i$ staged through shared memory. Its line 8:

# %%
show_source(fa2_fast.make_forward, grep="LDS.128")

# %% [markdown]
# ## Memory transactions of the full kernels
#
# The simulator's profiler (notebook 00) counts, for every request, the 32-byte sectors of global memory and the
# wavefronts of shared memory. One full 32 × 32 tile at d = 32 (one thread block), stage 4 against stage 6:

# %%
rng = np.random.default_rng(8)
q, k, v = (rng.standard_normal((1, 32, 32)).astype(np.float32) for _ in range(3))
prof_rows = []
for impl, tiles in (("fa2", dict(Br=32, Bc=32, warps=2)), ("fa2-fast", dict(Br=32, Bc=32, warps=1))):
    with flashnb.sim.profile() as prof:
        flashnb.attention_forward(q, k, v, impl=impl, **tiles)
    g, st_, ld = (prof.total(memory=m, op=o) for m, o in (("global", "ld"), ("shared", "st"), ("shared", "ld")))
    prof_rows.append(dict(impl=impl, **tiles, global_ld_sectors_per_req=round(g["cost"] / g["requests"], 2),
                          ideal=round(g["ideal"] / g["requests"], 2), shared_store_conflicts=st_["bank_conflicts"],
                          shared_load_conflicts=ld["bank_conflicts"]))
print(bench.table(prof_rows, list(prof_rows[0])))

# %% [markdown]
# Both read HBM with ideal sectors (consecutive lanes, consecutive floats); stage 4's transposed stores of
# $Q_i$ and $K_j$ are bank conflicts, stage 6's padded rows have none. (`flashnb profile fa2 fa2-fast` prints
# the same per source line, forward and backward.)
#
# ## A modelled time from the SASS
#
# `sass_model.count` turns the static SASS into per-warp counts for one block's prologue, **one K/V tile** and
# the epilogue. It has to know how often each loop runs, which the SASS does not say; the kernel module says how
# many FFMAs each matmul of a tile needs, and the loops get the trip counts that make the FFMAs add up (load
# loops likewise from the words they copy). Every instruction outside the inner loops is counted once per tile,
# including the masking and partial-tile branches an interior tile never takes: an upper bound on the work.
# The per-tile counts of the two d = 64 kernels:

# %%
for m in ("fa2", "fa2_fast"):
    c = sass_model.count(compiled[(m, 64)], sass_model.KernelShape(**(fa2 if m == "fa2" else fa2_fast)
                                                                   .sass_shape(configs[(m, 64)])))
    print(f"{m:9s} per tile per warp: {c.tile.issued:6,d} instructions, {c.tile.ffma:5,d} FFMA "
          f"({100 * c.tile_ffma_fraction:.0f} %), pipes {c.tile.pipes}")

# %% [markdown]
# Each pipe of an SM takes so many warp-instructions per clock (issue 4, FP32 4 on an H100, MUFU 0.5, shared one
# 128-byte wavefront -- an `LDS.128` of 32 lanes is 4). A block needs, per pipe, its count divided by that rate;
# the slowest pipe sets how long it lasts. The blocks are then dispatched in launch order onto the SMs' slots
# (occupancy from ptxas's registers and shared memory), and HBM gets the bytes of the traffic model. At the FA2
# paper's benchmark shape (N = 4096, batch 4, hidden 2048):

# %%
HEADS = {64: 32, 128: 16}
model_rows = []
for m, d in configs:
    t = sass_model.forward_time(kernel_of[m], 4 * HEADS[d], 4096, 4096, d, gpu=GPU)
    model_rows.append(dict(kernel=m, d=d, modelled_ms=round(1e3 * t.seconds, 2), TFLOPs=round(t.tflops, 1),
                           pct_fp32_peak=round(100 * t.fraction_of_peak(), 1), bound=t.bound,
                           blocks_per_SM=t.blocks_per_sm, tile_ffma_pct=round(100 * t.tile_ffma_fraction, 1),
                           **{f"{p}_ms": round(1e3 * v, 2) for p, v in t.pipe_seconds.items()}))
print(bench.table(model_rows, list(model_rows[0])))

# %%
fig, ax = plt.subplots(figsize=(7, 3.2))
labels = [f"{r['kernel']}\nd={r['d']}" for r in model_rows]
pipes = ["issue_ms", "fp32_ms", "mio_ms", "hbm_ms"]
for k, p in enumerate(pipes):
    ax.bar(np.arange(len(model_rows)) + (k - 1.5) * 0.2, [r[p] for r in model_rows], 0.2, label=p[:-3])
ax.set_xticks(range(len(model_rows)), labels)
ax.set_ylabel("modelled ms (busiest SM)")
ax.set_title(f"Where the time goes, per pipe ({GPU}, N = 4096; modelled)")
ax.legend(ncol=4, fontsize=8)
savefig(fig, "08_pipes")
plt.show()

# %% [markdown]
# The issue pipe binds stage 4: most of what it issues is not FFMA. Stage 6 at d = 64 is issue-bound too, but
# now about two thirds of what it issues is FFMA. At d = 128 it is issue-bound as well (the shared pipe close
# behind), with tiles that need more than the 48 KiB of shared memory a block may declare statically (next
# section). With the tiles that fit in 48 KiB each lane gets only three rows ($T_M = 3$): too few FFMAs per
# 128-bit load, and the shared pipe binds (exercise 08.2).
#
# ## Bigger tiles
#
# Larger micro-tiles feed more FFMAs per load, and larger $B_r$ reads $K$ and $V$ fewer times from HBM; both
# cost registers and shared memory, and so occupancy. Beyond 48 KiB a block takes *dynamic* shared memory
# (`cuda.shared.array(0, float32)`, its size given at launch), which a GPU grants only after a per-kernel
# opt-in -- up to 163 KiB on an A100, 227 KiB on an H100 (`fa2_fast.make_forward(..., dynamic=True)`, technique
# 7 of `flashnb.stages.fa2_fast`). The model makes the trade visible (d = 128; the last row is the default):

# %%
tile_configs = (dict(Br=24, Bc=32, warps=2), dict(Br=32, Bc=24, warps=1), dict(Br=32, Bc=32, warps=2),
                fa2_fast.default_tiles(128))
# one compile batch (NVVM in parallel processes); the loop below finds each kernel already compiled
sass.sass_many([("fa2_fast.forward", fa2_fast.sass_config(128, False, **cfg)) for cfg in tile_configs])
tile_rows = []
for cfg in tile_configs:
    t = sass_model.forward_time("fa2_fast.forward", 4 * HEADS[128], 4096, 4096, 128, gpu=GPU, **cfg)
    res = fi.resources_for("fa2_fast.forward", fa2_fast.sass_config(128, False, **cfg))
    tile_rows.append(dict(**cfg, TM=cfg["Br"] // (4 * cfg["warps"]), TN=cfg["Bc"] // 8, registers=res.registers,
                          shared_KiB=round((res.shared_bytes + res.dynamic_shared_bytes) / 1024, 1),
                          dynamic=res.dynamic_shared_bytes > 0, blocks_per_SM=t.blocks_per_sm,
                          warps_per_SM=t.blocks_per_sm * cfg["warps"], pct_fp32_peak=round(100 * t.fraction_of_peak(), 1),
                          bound=t.bound))
print(bench.table(tile_rows, list(tile_rows[0])))

# %% [markdown]
# The default tiles look best *in the model*: eight key columns per lane ($T_N = 8$) halve the loads per FFMA of
# line 8, and $B_r = 64$ halves the K/V re-reads. The model assumes every latency is hidden: with a handful of
# warps per SM (warps_per_SM column) a real GPU may stall on shared-memory and FFMA latency instead. That is the
# limit of a model without a GPU; the measurement cell at the end settles it on a machine that has one.
#
# ## Register prefetch: latency the model cannot see
#
# Everything so far counts instructions. A load from HBM also takes time to *arrive*: hundreds of cycles, during
# which a warp that needs the value waits. FA2's tile loop loads $K_j$ and then at once waits for it (store to
# shared memory, barrier). **Register prefetch** issues the loads of $K_{j+1}$ *before* computing tile $j$ and
# stores them only after, so they arrive while the FFMAs run. Step 5 (`fa2_fast_steps.make_stream`) streams three
# K tiles through one shared buffer, both ways:

# %%
show_source(steps.make_stream, grep="prefetch")

# %% [markdown]
# Both compute the same $S$ with nearly the same instructions, so the SASS time model gives them the same time.
# What differs is *where* each load's result is first used: `steps.load_to_use` counts, in the SASS of the tile
# loop, the instructions issued between each global load and the first instruction that reads its register.

# %%
stream_sass = sass.sass_many([("fa2_fast_steps.stream", dict(d=32, prefetch=p)) for p in (False, True)])
for p, s in zip((False, True), stream_sass):
    S, ref = steps.run_stream(p)
    assert not np.isnan(S).any() and np.abs(S - ref).max() < 1e-3
    dist = steps.load_to_use(s)
    print(f"prefetch={p!s:5}: {len(dist)} loads per tile, {min(dist)}-{max(dist)} instructions from load to use, "
          f"{s.resources.registers} registers, hot loop {100 * s.fma_fraction(s.hot_loop):.0f} % FFMA")

# %% [markdown]
# Without prefetch the compiler already batches the tile's loads ahead of their stores, but each result is
# needed within a few dozen instructions; with prefetch a whole tile of FFMAs separates them. The price is the
# registers that hold the next tile -- here $d$ = 32 per thread. The fast kernels do not prefetch: at the register counts
# of their rows in the table above they have none to spare, and they hide latency with several warps per SM instead (GPUs
# from sm_80 on also have `cp.async`, a copy from HBM to shared memory that needs no registers, which numba
# does not expose). Whether latency, not issue, limits them is a question for a GPU: the cell at the end.
#
# ## Heavy first
#
# With a causal mask, Q block $i$ visits about $i + 1$ K/V tiles: the blocks are unequal. A GPU hands blocks to
# SMs in launch order. Stage 4 launches the lightest first, so the heaviest start last and the launch ends with
# a few SMs busy and the rest idle. Stage 6 runs block `blockIdx.x` as Q block $T_r - 1 -$ `blockIdx.x`, through
# the small policy every causal loop of the product kernels calls too (`flashnb.kernels.policies.tiles`):

# %%
from flashnb.kernels.policies import tiles as tile_ranges  # noqa: E402

show_source(fa2_fast.make_forward, grep="heavy_first(")
show_source(tile_ranges.heavy_first)

# %% [markdown]
# The model schedules the same blocks in both orders (same per-tile counts, only the order changes):

# %%
s64 = compiled[("fa2_fast", 64)]
cfg = configs[("fa2_fast", 64)]
counts = sass_model.count(s64, sass_model.KernelShape(**fa2_fast.sass_shape(cfg)))
occ = s64.resources.occupancy(32 * cfg["warps"]).blocks_per_sm
order_rows = []
N = 4096
per_i = {}
for i, _, _, _ in fa2.tiles_visited(N, N, cfg["Br"], cfg["Bc"], True):
    per_i[i] = per_i.get(i, 0) + 1
Tr = len(per_i)
for BH in (4, 12, 24, 128):
    kw = dict(warps=cfg["warps"], blocks_per_sm=occ, hbm_bytes=0.0,
              flops=flashnb.instruments.roofline.flops_forward(1, BH, N, N, 64, True), gpu=GPU)
    light = sass_model.modelled_time(counts, tiles_per_block=[per_i[i] for _ in range(BH) for i in range(Tr)], **kw)
    heavy = sass_model.modelled_time(counts, tiles_per_block=[per_i[i] for _ in range(BH)
                                                              for i in reversed(range(Tr))], **kw)
    order_rows.append(dict(N=N, BH=BH, blocks=BH * Tr, slots=occ * flashnb.instruments.roofline.get_gpu(GPU).sm_count, light_first_ms=round(1e3 * light.seconds, 3),
                           heavy_first_ms=round(1e3 * heavy.seconds, 3),
                           gain_pct=round(100 * (light.seconds / heavy.seconds - 1), 1)))
print(bench.table(order_rows, list(order_rows[0])))

# %% [markdown]
# The order matters only when there are more blocks than slots: with fewer, every block starts at once and the
# launch lasts as long as the heaviest; with many waves, the tail is a small part of the launch. It pays most
# between the two (a couple of waves), and even there the model gives a few per cent at this shape -- heavy-first
# is cheap to do, not a big win. (Exercise 08.3 builds the scheduler and shows a case where it is larger.)
#
# ## On a GPU
#
# Everything above is counted or modelled. On a machine with a GPU, the cell below times stage 4's and stage
# 6's forward with CUDA events (in a separate process: this notebook's kernels run on the simulator) and reports
# the fraction of the device's FP32 peak. Here it measures nothing and says so.

# %%
gpu_rows = bench.on_gpu("flashnb.instruments.bench:measure_impls", impls=["fa2", "fa2-fast"], BH=64, N=4096, d=64)
print(bench.table(gpu_rows, ["impl", "direction", "median_ms", "q1_ms", "q3_ms", "tflops", "pct_fp32_peak",
                             "gpu_name"]))

# %% [markdown]
# ## Exercises
#
# Each exercise has a check: fill in the `...` and run its cell (`...` means "not attempted yet"). Stuck?
# `exercises.hint("08.1")` gives a hint and `exercises.answer("08.1")` the worked answer -- try first.
# Levels: ★ a few lines, ★★ a small model or experiment, ★★★ a real change to a kernel.

# %%
from flashnb import exercises  # noqa: E402

# %% [markdown]
# **08.1 · FFMAs per shared load** (★, ~10 min) Write `fmas_per_load(TM, TN, vec)`: the FFMAs of line 8 per shared
# load for a $T_M \times T_N$ micro-tile when each load brings `vec` floats. Compare with the step table above:
# how many FFMAs must one `LDS.128` feed to keep the FP32 pipe busy, if the shared pipe delivers one wavefront per
# clock and the FP32 pipe takes 4 warp-FFMAs?

# %%
fmas_per_load = ...   # def fmas_per_load(TM, TN, vec): ...
passed = exercises.check("08.1", fmas_per_load=fmas_per_load)

# %% [markdown]
# **08.2 · Which pipe binds** (★★, ~20 min) Write `bound(pipes, ffma, fp32_lanes)`: given one tile's demand on each
# pipe (`{"issue", "fp32", "mufu", "mio"}`), its FFMAs and the FP32 lanes per SM, return the binding pipe and the
# fraction of the FP32 peak the tile can reach. The check compares with `flashnb.instruments.sass_model`. Try it on the
# per-tile counts printed above.

# %%
bound = ...   # def bound(pipes, ffma, fp32_lanes): ... return (pipe, fraction)
passed = exercises.check("08.2", bound=bound)

# %% [markdown]
# **08.3 · Heavy first** (★★, ~20 min) Write `makespan(durations, slots)`: when the last block ends if blocks
# of these durations go, in order, each to the slot that frees first. Then `light_over_heavy`: the makespan of
# causal blocks of 1, 2, ..., 64 tile-times on 16 slots, light first, over heavy first.

# %%
makespan = ...          # def makespan(durations, slots): ...
light_over_heavy = ...
passed = exercises.check("08.3", makespan=makespan, light_over_heavy=light_over_heavy)

# %%
print(f"notebook ran in {time.perf_counter() - T0:.1f} s")
