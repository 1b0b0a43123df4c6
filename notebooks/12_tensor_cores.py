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
# # 12 · Tensor cores: FlashAttention-2 where its argument lives
#
# FA2's Section 3.1 opens with a number: an A100 does 312 TFLOP/s of FP16 matrix multiplication on its tensor
# cores and 19.5 TFLOP/s of everything else. Every non-matmul FLOP -- an exponential, a max, a rescale -- costs
# as much as 16 matmul FLOPs, so FA2 cuts them (delayed rescaling, the row statistics kept per row, `exp2`).
# Stages 1-6 of this course ran the matmuls on the FP32 cores, where that argument has nothing to bite on: the
# softmax was noise beside the FFMAs. This notebook moves the matmuls onto the tensor cores, from Numba, and
# models -- from the machine code, without a GPU -- how the same softmax becomes a real cost.
#
# Numba's CUDA API has no tensor-core instructions. It does let an `@intrinsic` emit LLVM inline assembly, and
# PTX has the instructions: `mma.sync` (a warp multiplies 16×8×16 tiles), `ldmatrix` (a warp loads 8×8 tiles
# of 16-bit elements from shared memory straight into the fragment layout) and `cp.async` (a copy from global to
# shared memory that does not pass through registers, and finishes later). `flashnb.kernels.tensorcore.mma` wraps them, and
# `flashnb.sim.tensorcore` gives each one a **twin** on the simulator, so everything here runs on a laptop.
#
# The lesson is `flashnb/stages/tensor_cores.py`: FA2's Algorithm 1 on tensor cores, float16, dense and causal, in
# factories of one screen each, and it is what this notebook shows. What a user runs on tensor cores is the product
# kernel (`impl="fa2-tc"`, the default for half inputs on a GPU): the same instructions, with bfloat16, TF32, the
# backward, grouped K/V heads, dropout and attention modifiers.

# %%
import inspect
import os
import time
import warnings

import matplotlib.pyplot as plt
import numpy as np

os.environ["FLASHNB_DEVICE"] = "sim"  # counting needs the simulator; GPU timings run in a process of their own
import flashnb
from flashnb import registry, sim
from flashnb.instruments import bench, sass, sass_model
from flashnb.instruments.roofline import GPUS
from flashnb.instruments.sass_inputs import fa2_tc
from flashnb.kernels.tensorcore import mma
from flashnb.notebook import savefig, show_source
from flashnb.sim import tensorcore as tc
from flashnb.stages import fa2_fast, tensor_cores

T0 = time.perf_counter()
print("kernels run on the Numba CUDA simulator; GPU timings:",
      "on this machine's GPU, in a separate process" if bench.gpu_available() else "none (no GPU here)")

# %% [markdown]
# ## An instruction Numba does not have
#
# On a GPU, `mma.mma_m16n8k16_f16` is an `@intrinsic` whose code generation is one line of PTX; its operands are
# 32-bit registers (two halves packed in each), its result four float32 accumulators returned as a tuple. Here is
# how it is made (the GPU half of `flashnb/kernels/tensorcore/mma.py`, which the simulator does not execute):

# %%
src = inspect.getsource(mma).splitlines()
start = next(i for i, line in enumerate(src) if line.strip().startswith("def _mma("))
print("\n".join(line[4:] for line in src[start:start + 24]))

# %% [markdown]
# ptxas turns it into one SASS instruction. `flashnb sass` (notebook 08) now has rows for tensor-core work:
# `hmma`, `ldsm` (ldmatrix) and `ldgsts` (cp.async). The GPU check's kernel for this intrinsic, for sm_80:

# %%
s = sass.sass("mma_check.mma", config={"shape": "m16n8k16.f16"}, cc=(8, 0))
print("\n".join(str(i) for i in s.instructions if i.category in ("hmma", "ldg", "stg")))

# %% [markdown]
# ## Fragments: which lane holds which element
#
# A warp's 32 lanes each hold a piece of every operand. The PTX ISA gives the layout as formulas of
# `groupID = lane // 4` and `threadID_in_group = lane % 4`; the twin keeps them as tables
# (`tensorcore.LAYOUTS`: for every lane, register and half, the row and column of the matrix). Drawn from those
# tables, for `mma.m16n8k16`: the number in each cell is the lane holding that element.

# %%
def lane_map(layout, shape):
    rows, cols = layout
    grid = np.full(shape, -1)
    regs = np.full(shape, -1)
    for lane in range(32):
        for r in range(rows.shape[1]):
            for h in range(rows.shape[2]):
                grid[rows[lane, r, h], cols[lane, r, h]] = lane
                regs[rows[lane, r, h], cols[lane, r, h]] = r
    return grid, regs


fig, axes = plt.subplots(1, 3, figsize=(15, 5.2), gridspec_kw=dict(width_ratios=[16, 8, 8]))
for ax, (key, shape, title) in zip(axes, [(("m16n8k16", "a"), (16, 16), "A (16 × 16, row-major): 4 registers"),
                                         (("m16n8k16", "b"), (16, 8), "B (16 × 8): 2 registers"),
                                         (("c", "c"), (16, 8), "C / D (16 × 8, float32): 4 registers")]):
    grid, regs = lane_map(tc.LAYOUTS[key], shape)
    ax.imshow(regs, cmap="Pastel1", vmin=0, vmax=8)
    for (r, c), lane in np.ndenumerate(grid):
        ax.text(c, r, str(lane), ha="center", va="center", fontsize=7)
    ax.set_title(title)
    ax.set_xlabel("column (k for A, n for B and C)")
    ax.set_ylabel("row (m for A and C, k for B)")
fig.suptitle("mma.m16n8k16 fragments: the lane holding each element (colour: its register)")
savefig(fig, "12_fragments")
plt.show()

# %% [markdown]
# One `mma` through the twin, on plain matrices: the 32 lanes' registers are built from A, B, C with the table,
# the twin runs (a warp collective: the lanes hand it their registers, NumPy multiplies, each lane gets its D
# back), and D -- read back with the table -- equals NumPy's `A @ B + C`. (The tests do this with the PTX ISA's
# formulas written out independently, and check that a wrong layout fails; `scripts/gpu_check.py` compares the
# twin with the real instruction on the first GPU it gets.)

# %%
rng = np.random.default_rng(12)
A = rng.standard_normal((16, 16)).astype(np.float16).astype(np.float64)
B = rng.standard_normal((16, 8)).astype(np.float16).astype(np.float64)
C = rng.standard_normal((16, 8)).astype(np.float32)
a = tc.encode(tc.fragments(A, tc.LAYOUTS[("m16n8k16", "a")]), "f16")
b = tc.encode(tc.fragments(B, tc.LAYOUTS[("m16n8k16", "b")]), "f16")
c = tc.fragments(C, tc.LAYOUTS[("c", "c")])[..., 0]
D = flashnb.common.to_device(np.full((32, 4), np.nan, np.float32))
from flashnb.kernels.tensorcore import check as mma_check  # noqa: E402

mma_check.make_mma("m16n8k16.f16")[1, 32](a, b, c, D)
d = tc.matrices(D.copy_to_host()[..., None].astype(np.float64), tc.LAYOUTS[("c", "c")], (16, 8))
print(f"max |D - (A @ B + C)| = {np.abs(d - (A @ B + C)).max():.2e}   (float32 rounding of sums of size ~5)")

# %% [markdown]
# ### The same accumulators are the next matmul's operand
#
# In FA2's forward, `S = Q_i K_jᵀ` comes out in the C layout: lane `(g, t)` holds scores of rows `g, g + 8`,
# keys `2t, 2t + 1` of each 8-key tile. The A operand of `P V_j` wants rows `g, g + 8`, keys `2t, 2t + 1` and
# `2t + 8, 2t + 9` of a 16-key step -- exactly the C registers of two neighbouring 8-key tiles, packed in pairs.
# So `P~` never leaves the registers (rounded to the input dtype on the way, as FlashAttention does). The
# lesson's packing, region `p-fragment` of its tile function (`flashnb/stages/tensor_cores.py`):

# %%
show_source(tensor_cores.make_tile, region="p-fragment")

# %% [markdown]
# ## One K/V tile: lines 8-10 of FA2's Algorithm 1, a warp at a time
#
# `make_tile` is Algorithm 1's inner loop body for one warp's 16 query rows. Line 8, `S_ij = Q_i K_jᵀ`, is
# `d / 16` k-steps of MMAs; the online softmax (lines 9-10) works on the accumulators where they are -- a row of
# `S_ij` lives in the four lanes of a quad, so `rowmax` is two `shfl_xor` -- in base 2, one `exp2` a score:

# %%
show_source(tensor_cores.make_tile, region="online-softmax")

# %% [markdown]
# The lesson against the float64 reference, and beside the product kernel, on a causal float16 problem
# (`tensor_cores.attention` takes NumPy arrays; FlashAttention's own rule for half inputs is to be within twice
# the error of the same attention computed in float16 by PyTorch):

# %%
rng16 = np.random.default_rng(3)
qh, kh, vh = (rng16.standard_normal((2, n, 64)).astype(np.float16) for n in (96, 112, 112))
o_lesson, lse_lesson = tensor_cores.attention(qh, kh, vh, causal=True)
o_ref, lse_ref = flashnb.reference.attention_forward(*(a.astype(np.float64) for a in (qh, kh, vh)), causal=True)
o_product = flashnb.attention(qh, kh, vh, causal=True, impl="fa2-tc")
print(f"lesson : max |O - O_ref| = {np.abs(o_lesson.astype(np.float64) - o_ref).max():.1e}, "
      f"max |L - L_ref| = {np.abs(lse_lesson - lse_ref).max():.1e}")
print(f"product: max |O - O_ref| = {np.abs(o_product.astype(np.float64) - o_ref).max():.1e}  (float16 outputs: "
      f"half an ulp of values ~1 is 2.4e-4)")

# %% [markdown]
# ## ldmatrix, and why the shared tiles are swizzled
#
# `ldmatrix.x4` loads four 8×8 matrices of halves: lanes `8j .. 8j+7` give the addresses of matrix `j`'s rows,
# and every lane receives its fragment. Shared memory serves it in 8-row phases: one wavefront per matrix *if*
# its 8 rows of 16 bytes fall in different banks. A tile row of d = 64 halves is 128 bytes -- one full turn of the
# 32 four-byte banks -- so stored plainly, the 8 rows of a matrix all start in bank 0: 8 wavefronts for 1.
# The lesson (as fa2-tc) stores chunk `c` of row `r` at chunk `c ^ (r mod 8)` (rows of fewer than 8 chunks: the
# rows that share a 128-byte line of banks take different chunks):

# %%
show_source(tensor_cores.swizzled_layout)

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 4))
for ax, (name, f) in zip(axes, [("plain: chunk c at c", lambda r, ch: ch),
                                ("swizzled: chunk c at c ^ (r mod 8)", lambda r, ch: ch ^ (r % 8))]):
    placed = np.array([[f(r, ch) for ch in range(8)] for r in range(8)])
    ax.imshow(placed == placed[:, :1], cmap="Reds", vmin=0, vmax=1.5)       # where logical chunk 0 went
    for (r, ch), p in np.ndenumerate(placed):
        ax.text(p, r, f"{ch}", ha="center", va="center")
    ax.set_title(name)
    ax.set_xlabel("physical chunk (banks 4·chunk .. 4·chunk+3)")
    ax.set_ylabel("row of the 8×8 matrix")
fig.suptitle("d = 64 halves: where the logical chunks of 8 rows land (red: logical chunk 0, what one matrix reads)")
savefig(fig, "12_swizzle")
plt.show()

# %% [markdown]
# The profiler counts ldmatrix's wavefronts by those 8-row phases. The kernel with the swizzle, and the same kernel
# with its region `layout` changed to the plain layout (`registry.variant`: a changed copy of the factory,
# registered nowhere), on a float16 problem with d = 64:

# %%
show_source(tensor_cores.make_forward, region="layout")
plain = registry.variant(tensor_cores.make_forward, region="layout", replace=("swizzled_layout", "plain_layout"))
prng = np.random.default_rng(7)
q16, k16, v16 = (prng.standard_normal((1, 64, 64)).astype(np.float16) for _ in range(3))
conflicts = {}
for name, factory in (("swizzled", tensor_cores.make_forward), ("plain", plain)):
    with registry.using(tensor_cores.make_forward, factory), sim.profile() as prof:
        tensor_cores.attention(q16, k16, v16, Br=32, Bc=32, warps=2)
    ld = prof.total(memory="shared", op="ld")
    conflicts[name] = ld["bank_conflicts"]
    print(f"{name:>9}: shared loads {ld['requests']:,} requests, {ld['cost']:,} wavefronts "
          f"(ideal {ld['ideal']:,}), {ld['bank_conflicts']:,} bank conflicts")

# %% [markdown]
# ## cp.async: the next tile is already on its way
#
# `cp.async` copies 16 bytes from global to shared memory without a register in between, and the copy is not
# finished when the instruction is: `cp.async.commit_group` closes a group of copies, `cp.async.wait_group n`
# waits until at most `n` groups are still in flight. The lesson (as fa2-tc) double-buffers K_j and V_j: while
# tile j is being computed, tile j + 1 is already flying into the other buffer (its copies: `tile_copy`, one
# 16-byte `cp.async` a chunk):

# %%
show_source(tensor_cores.make_forward, region="kv-load")

# %% [markdown]
# On the simulator a copy lands when its thread reaches a `wait_group` that covers it -- not before. So the two
# classic mistakes are caught by the sanitizer (notebook 00, appendix A.4): forget the wait and a warp reads shared memory that
# nothing has written yet (**initcheck**); forget the barrier after it and a warp reads what *another* warp's
# copy wrote, unordered (**racecheck**).

# %%
mistakes = {                                   # edits of the kernel's region kv-load (the loads of K_j, V_j)
    "no wait": ("mma.cp_async_wait_group(1)", "pass"),
    "no barrier": ("cuda.syncthreads()", "pass"),
}
q8, k8, v8 = (prng.standard_normal((1, 40, 16)).astype(np.float16) for _ in range(3))
for name, change in mistakes.items():
    broken = registry.variant(tensor_cores.make_forward, region="kv-load", replace=change)
    # (the broken kernels multiply shared memory nothing wrote -- NaN on the simulator: NumPy would warn)
    with registry.using(tensor_cores.make_forward, broken), sim.sanitize(raise_on_error=False) as report, \
            warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        tensor_cores.attention(q8, k8, v8, Br=32, Bc=16, warps=2)
    tools = sorted({f.tool for f in report.findings})
    print(f"{name:>10}: {len(report.findings)} finding(s) from {tools}; first: {report.findings[0].message[:150]}...")

# %% [markdown]
# ## FA2's non-matmul argument, in flashnb's own SASS
#
# Now the question of this notebook. Per K/V tile, what do the softmax's instructions cost beside the matmuls --
# on stage 6's FP32 cores and on stage 7's tensor cores? The SASS time model (notebook 08) counts each
# instruction of a tile on its pipe; the matmul's pipe is FP32 for stage 6 (its FFMAs) and the tensor pipe for
# stage 7 (its HMMAs, at the whitepapers' 1,024 FP16 multiply-adds per SM per clock on an A100, 2,048 on an
# H100); the softmax's are MUFU (16 exponentials per SM per clock) and FP32 (max, rescaling, sums). Both at their
# default tiles, d = 64, for sm_80 -- stage 7 here is the product kernel (fa2-tc, what users run), whose tile has
# the lesson's instructions:

# %%
def tile_cycles(kernel, module, config, gpu):
    """Per warp and K/V tile: cycles of one SM for the matmuls and for the rest of the FP32 and MUFU work."""
    s = sass.sass(kernel, config=config, cc=(8, 0))
    shape = module.sass_shape(config)
    c = sass_model.count(s, sass_model.KernelShape(**shape))
    rate = sass_model.pipe_rates(gpu)
    p = c.tile.pipes
    if c.work == "hmma":
        matmul = p["tensor"] / rate["tensor"]
        softmax_fp32 = p["fp32"] / rate["fp32"]
    else:
        matmul = sum(shape["phases"]) / rate["fp32"]                 # the matmuls' FFMAs
        softmax_fp32 = (p["fp32"] - sum(shape["phases"])) / rate["fp32"]
    return dict(matmul=matmul, exp=p["mufu"] / rate["mufu"], other_fp32=softmax_fp32, issue=p["issue"] / 4,
                mufu=p["mufu"])


cfg6 = fa2_fast.sass_config(64, False)
cfg7 = fa2_tc.sass_config(64, False)
cost = {(stage, gpu): tile_cycles(kernel, module, cfg, gpu)
        for stage, kernel, module, cfg in (("stage 6 (FP32 cores)", "fa2_fast.forward", fa2_fast, cfg6),
                                           ("stage 7 (tensor cores)", "fa2_tc.forward", fa2_tc, cfg7))
        for gpu in ("A100 80GB SXM", "H100 SXM")}
for key, c in cost.items():
    print(f"{key[0]:<23} {key[1]:<14} matmul {c['matmul']:7.1f}  exp {c['exp']:6.1f}  other FP32 "
          f"{c['other_fp32']:6.1f} cycles per warp-tile;  exp / matmul = {c['exp'] / c['matmul']:.0%}")

# %%
fig, ax = plt.subplots(figsize=(9, 4.5))
labels = [f"{st}\n{gpu.split()[0]}" for st, gpu in cost]
for i, part in enumerate(("matmul", "exp", "other_fp32")):
    ax.bar(np.arange(len(cost)) + 0.27 * (i - 1), [c[part] for c in cost.values()], width=0.27,
           label={"matmul": "matmuls (FFMA or HMMA pipe)", "exp": "exponentials (MUFU pipe)",
                  "other_fp32": "max, rescaling, sums (FP32 pipe)"}[part])
ax.set_xticks(range(len(cost)), labels)
ax.set_ylabel("SM cycles per warp and K/V tile (modelled)")
ax.set_title("FA2 forward, d = 64: the softmax beside the matmuls (SASS time model, not a measurement)")
ax.legend()
savefig(fig, "12_nonmatmul")
plt.show()

# %% [markdown]
# On the FP32 cores the exponentials are a few percent of the matmuls' time: the FA2 paper's tricks would save
# little. On the tensor cores the matmuls shrink by an order of magnitude while the softmax does not, and on an
# H100 -- twice the tensor throughput per SM of an A100, the same 16 exponentials per clock -- the MUFU pipe
# needs as long as both matmuls. That is the bottleneck FlashAttention-3 then attacks (overlapping the softmax of
# one tile with the matmuls of the next). Exercise 12.3 derives the ratio by hand.

# %% [markdown]
# ## What the model says about the whole kernel
#
# The same model over the whole launch (N = 4096, the FA2 paper's batch 4 × 32 heads of d = 64; HBM charged for
# every byte of the traffic model, K/V re-reads included), as a share of the dense FP16 peak. It is a model, and
# an optimistic one: it charges the instructions to the pipes and the bytes to HBM, but no latency, stalls or
# launch overhead. For scale, the FA2 paper *measured* its own CUDA kernels at 50-73 % of the A100's theoretical
# peak (Dao 2023, Abstract): read the modelled share below as a ceiling, not as what this kernel would reach.

# %%
for gpu in ("A100 80GB SXM", "H100 SXM"):
    t = sass_model.forward_time("fa2_tc.forward", 128, 4096, 4096, 64, gpu=gpu, storage="float16")
    print(f"{gpu:<14}: fa2-tc forward {t.tflops:6.1f} TFLOP/s = {t.fraction_of_peak(peak='tensor_fp16'):.0%} of "
          f"{GPUS[gpu].tensor_fp16_dense / 1e12:.0f} (bound: {t.bound})")
print("stage 6 (fa2-fast) on the same model: at most the FP32 peak,", GPUS["H100 SXM"].fp32_peak / 1e12, "TFLOP/s")

# %% [markdown]
# `benchmarks/stage7_goals.md` (`python scripts/stage7_goals.py`) has the backward, d = 128, registers and
# spills, and bank conflicts. On a GPU, `measure.tensor_cores.measure_gpu` times fa2-tc beside stage 6:

# %%
rows = bench.on_gpu("flashnb.instruments.measure.tensor_cores:measure_gpu", BH=64, N=4096, d=128, repeats=10)
if rows:
    for r in rows:
        print(f"{r['impl']:>8} {r['storage']} {r['direction']:<8}: {r['median_ms']:.2f} ms, {r['tflops']:.1f} TFLOP/s")

# %% [markdown]
# ## In your own code
#
# On a GPU of sm_80 or newer, `flashnb.attention` and `flashnb.pytorch.attention` run this kernel by default for
# float16 and bfloat16 inputs (`impl="auto"`), with its features: causal masks, grouped K/V heads, dropout,
# attention modifiers and block masks (notebook 10). Before its first launch the default checks, once, that the
# GPU's instructions use the fragment layouts the twins assume (every intrinsic on random fragments); a GPU that
# disagrees keeps the product kernel. On the simulator the default is the product kernel, and `impl="fa2-tc"`
# asks for this one by name. `flashnb.kernels.auto.last_choice` says what ran and why:

# %%
from flashnb import flex
from flashnb.kernels import auto

qm, km, vm = (prng.standard_normal((1, 2, 48, 16)).astype(np.float16) for _ in range(3))
mods = dict(score_mod=flex.alibi(2), mask_mod=flex.sliding_window(16))
o_default = flashnb.attention(qm, km, vm, **mods)
print("default:", auto.last_choice["impl"], "--", auto.last_choice["reason"])
o_tc = flashnb.attention(qm, km, vm, impl="fa2-tc", **mods)
print(f"fa2-tc with ALiBi and a sliding window: max |fa2-tc - default| = "
      f"{np.abs(o_tc.astype(np.float32) - o_default.astype(np.float32)).max():.1e} (float16 outputs)")

# %% [markdown]
# ## Exercises
#
# Each exercise has a check: fill in the `...` and run its cell (`...` means "not attempted yet"). Stuck?
# `exercises.hint("12.1")` gives a hint and `exercises.answer("12.1")` the worked answer -- try first.

# %%
from flashnb import exercises  # noqa: E402

# %% [markdown]
# **12.1 · Who holds A[r][c]** (★, ~15 min) Write `owner(r, c)`: the `(lane, register, half)` holding element
# `(r, c)` of the 16×16 A operand of `mma.m16n8k16`. The figure above is the answer drawn; the check asks for all
# 256 elements.

# %%
owner = ...   # def owner(r, c): ... return (lane, register, half)
passed = exercises.check("12.1", owner=owner)

# %% [markdown]
# **12.2 · A swizzle without conflicts** (★★, ~20 min) Write `swizzle(r, c)`: where logical chunk `c` (0..7) of
# row `r` of a 64-half-wide tile is stored, so that every 8-row ldmatrix phase takes one wavefront and no two chunks
# of a row collide.

# %%
swizzle = ...   # def swizzle(r, c): ... return physical chunk
passed = exercises.check("12.2", swizzle=swizzle)

# %% [markdown]
# **12.3 · Exponentials per matmul** (★★, ~20 min) Write `exp_over_matmul(d, rate)`: a tile's exponential time over
# its two matmuls' time for head dim `d` and a matmul pipe of `rate` multiply-adds per SM per clock (MUFU: 16 per
# clock). Evaluate it for stage 6 on an A100 (64 FP32 lanes) and stage 7 on an A100 and an H100.

# %%
exp_over_matmul = ...   # def exp_over_matmul(d, rate): ...
passed = exercises.check("12.3", exp_over_matmul=exp_over_matmul)

# %%
print(f"notebook ran in {time.perf_counter() - T0:.1f} s")
