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
# # 07 · Block-sparse FlashAttention: skip the tiles a mask zeroes
#
# FlashAttention already works tile by tile. If we *know in advance* that a whole tile of the score matrix
# is masked, it need not be loaded or computed at all. The FlashAttention paper (FA1) calls this
# **block-sparse FlashAttention**: given a block mask $M \in \{0, 1\}^{T_r \times T_c}$ (one bit per
# $B_r \times B_c$ tile), **Algorithm 5 is Algorithm 2 with `if` $M_{ij} \ne 0$** around the body of the
# inner loop. The attention computed is
#
# $$S = \tau\, Q K^\top,\quad S_{kl} = -\infty \text{ where } M_{\lfloor k/B_r\rfloor \lfloor l/B_c\rfloor} = 0,
# \quad O = \mathrm{softmax}(S)\, V,$$
#
# and its HBM traffic is (FA1 Proposition 4)
#
# $$\Theta\!\left(N d + \frac{N^2 d^2}{M}\, s\right),$$
#
# $s$ the fraction of nonzero blocks ($M$ here is the SRAM size). The $N^2$ term shrinks with $s$; the
# $Nd$ term (read $Q$, write $O$) does not. This notebook builds it on stage 4's FA2 kernels, checks it,
# counts its traffic against $s$, and shows when it changes the answer: block-sparse attention is a
# **different function** from dense attention, an approximation of it.

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
from flashnb.stages import block_sparse as bs
from flashnb.stages import fa2

T0 = time.perf_counter()
print("kernels run on the Numba CUDA simulator; GPU timings:",
      "on this machine's GPU, in a separate process" if flashnb.instruments.bench.gpu_available() else "none (no GPU here)")
rng = np.random.default_rng(7)

# %% [markdown]
# ## The change to the kernel: two lines per direction
#
# There is no second kernel. `fa2.make_forward` and `fa2.make_backward` take a compile-time flag `sparse`
# and one more argument, `M` (uint8, one entry per tile, per batch·head). When `sparse` is False the
# condition is a compile-time `False` and `M` is never read (the launcher passes a 1×1×1 dummy), so the
# dense kernels do exactly what they did in notebooks 05 and 06. The lines that test it, the region
# `block-skip` of the forward and of the backward kernel:

# %%
for factory in (fa2.make_forward, fa2.make_backward):
    show_source(factory, region="block-skip")

# %% [markdown]
# The test is *block-uniform*: lane 0 of each warp reads $M_{ij}$ and hands it to the other 31 lanes with a
# shuffle, so every thread of the block tests the same value and the whole block skips the tile together,
# barriers included. In the forward (grid over query blocks $i$) the skipped tile is
# $K_j, V_j$; in the backward (grid over key blocks $j$) it is $Q_i, dO_i, L_i, D_i$ and the atomic
# $dQ_i$ update.
#
# ## Which tiles? A mask carries its tile sizes
#
# A block mask only means something together with the tile sizes it was built for. `bs.BlockMask` holds
# both; a plain boolean array is read at the *forward's* tiles. The backward of FA2 uses *smaller* default
# tiles than the forward (fewer registers per thread: see the resources section of notebook 05, or
# `flashnb inspect`, for the register counts), so the launcher maps the mask onto the
# kernel's tiles: the kernel's tiles must **divide** the mask's, each kernel tile then lies inside one mask
# block, and the mask is repeated over the tiles inside each block. Both directions then skip exactly the
# same elements.

# %%
show_source(fa2.block_tiles)

# %%
d = 16
print("fa2 default tiles, d = 16: forward", fa2.default_tiles(d), " backward", fa2.default_tiles(d, "backward"))
demo = bs.local(100, 100, 64, 32, 2)                       # a mask at the forward's tiles
for direction in ("forward", "backward"):
    t, M = fa2.block_tiles(d, direction, None, None, None, demo, 1, 100, 100)
    print(f"{direction:8s}: kernel tiles {t['Br']}x{t['Bc']}, M at those tiles:\n{M[0]}")

# %% [markdown]
# ## Patterns
#
# `flashnb.stages.block_sparse` builds the masks used in the papers, on the block grid and aligned like the
# causal mask (bottom-right): **causal** as blocks; a **local** sliding window; the **strided** and
# **fixed** factorised patterns of Sparse Transformers (Child et al. 2019), here with blocks as the unit;
# the **butterfly** pattern the FA1 paper uses for its block-sparse experiments (the diagonal block and the
# blocks whose index differs from it in one bit); and **random** blocks at a given density.

# %%
Np, Bp = 512, 32
patterns = {
    "causal": bs.causal(Np, Np, Bp, Bp),
    "local (window 3)": bs.local(Np, Np, Bp, Bp, 3),
    "strided (stride 4)": bs.strided(Np, Np, Bp, Bp, 4),
    "fixed (stride 4, c 1)": bs.fixed(Np, Np, Bp, Bp, 4, 1),
    "butterfly": bs.butterfly(Np, Np, Bp, Bp),
    "random (s = 0.25)": bs.random(Np, Np, Bp, Bp, 0.25, seed=1),
}
fig, axes = plt.subplots(1, len(patterns), figsize=(15, 2.9))
for ax, (name, bm) in zip(axes, patterns.items()):
    ax.imshow(bm.mask, cmap="Greys", vmin=0, vmax=1)
    ax.set_title(f"{name}\ns = {bm.density:.3f}", fontsize=9)
    ax.set_xticks([])
    ax.set_yticks([])
axes[0].set_ylabel(f"query block i ({Np // Bp})")
axes[0].set_xlabel("key block j")
savefig(fig, "07_patterns")
plt.show()

# %% [markdown]
# ## It computes masked attention, forward and backward
#
# Against the float64 reference with the block mask expanded to elements (`BlockMask.expand`, i.e.
# `reference.expand_block_mask`), on ragged lengths ($N_q \ne N_k$, not multiples of the tiles). Tile rows
# whose blocks are all zero have no key at all: $O = 0$, $L = -\infty$ and zero gradients, not NaN.

# %%
Nq, Nk = 45, 70
q, k, v, do = (rng.standard_normal((1, n, 8)) for n in (Nq, Nk, Nk, Nq))
checks = {"strided, causal": (bs.strided(Nq, Nk, 16, 16, 2), True),
          "random s=0.4": (bs.random(Nq, Nk, 16, 16, 0.4, seed=3), False),
          "empty block row": (bs.BlockMask(np.array([[1, 1, 0, 0, 1], [0, 0, 0, 0, 0], [0, 1, 1, 0, 1]], bool),
                                           16, 16), False)}
for name, (bm, causal) in checks.items():
    mask = bm.expand(Nq, Nk)
    o, lse = flashnb.attention_forward(q, k, v, causal=causal, impl="fa2", block_mask=bm, warps=1)
    o_ref, lse_ref = reference.attention_forward(q, k, v, causal=causal, mask=mask)
    grads = flashnb.attention_backward(q, k, v, o_ref, lse_ref, do, causal=causal, impl="fa2", block_mask=bm,
                                       warps=1)
    refs = reference.attention_backward(q, k, v, do, causal=causal, mask=mask)
    empty_rows = int(np.isneginf(lse_ref).sum())
    print(f"{name:15s} s={bm.density:.2f}: max|o - ref| {np.abs(o - o_ref).max():.1e}, "
          f"max|grad - ref| {max(np.abs(g - r).max() for g, r in zip(grads, refs)):.1e}, "
          f"rows with no key {empty_rows} (o there: {np.abs(o[np.isneginf(lse)]).max(initial=0):.0f}), "
          f"NaN: {any(np.isnan(a).any() for a in (o, *grads))}")
    # float32 kernels vs float64 reference, d = 8, ≤ 70 keys: rounding stays far below 1e-5
    np.testing.assert_allclose(o, o_ref, atol=1e-5)
    for g, r in zip(grads, refs):
        np.testing.assert_allclose(g, r, atol=1e-5)
    assert not any(np.isnan(a).any() for a in (o, *grads))
print(bm.mask.astype(int))

# %% [markdown]
# ## Counted traffic against $s$
#
# The traffic model is FA2's with *visited tiles = nonzero blocks* (and, under `causal=True`, the
# causal limit as well), plus one more array: lane 0 of every warp reads the one-byte $M_{ij}$ once per tile
# it might visit and hands it to the other 31 lanes with a shuffle. On the simulator, $N = 128$, $d = 8$, $16 \times 16$ tiles, one warp, random masks:

# %%
N, d, B = 128, 8, 16
q, k, v = (common.to_device(rng.standard_normal((1, N, d))) for _ in range(3))


def nbytes(model):
    """HBM bytes of a model: float32 arrays, except the uint8 block mask M."""
    return sum(n * (1 if name == "M" else 4) for launch in model for kind in ("reads", "writes", "atomics")
               for name, n in launch[kind].items())


densities = [0.125, 0.25, 0.5, 1.0]
counted = []
for s in densities:
    bm = bs.random(N, N, B, B, s, seed=0)
    with traffic.count() as t:
        fa2.forward(q, k, v, scale=0.35, Br=B, Bc=B, warps=1, block_mask=bm)
    model = fa2.model_forward(1, N, N, d, Br=B, Bc=B, warps=1, block_mask=bm)
    assert t.summary() == model
    counted.append(t.global_read_bytes + t.global_write_bytes)
    print(f"s = {s:5.3f}: counted {counted[-1]:7,d} B == model {nbytes(model):7,d} B   "
          f"(K+V {4 * (model[0]['reads']['K'] + model[0]['reads']['V']):6,d} B, "
          f"Q+O+L {4 * (model[0]['reads']['Q'] + model[0]['writes']['O'] + model[0]['writes']['L']):5,d} B, "
          f"M {model[0]['reads']['M']:5,d} B)")

# %% [markdown]
# Every number equals the model exactly (the `assert`). The $K, V$ bytes are $2 \cdot s\, T_r T_c B_c d \cdot 4$:
# proportional to $s$. What remains at $s \to 0$ is the $Nd$ term, $Q$ read and $O$ (and $L$) written once, and
# the small mask term, $T_r T_c \cdot \text{warps}$ bytes: it does not shrink with $s$ either.
#
# ## At scale: the $Nd$ term that never goes away, and modelled time
#
# The same (exact) model for batch·heads $= 16$, $N = 4096$, $d = 64$ at fa2's default tiles, and
# a roofline time on an H100 preset, **modelled, not measured**. FLOPs scale with $s$ too (only the
# computed tiles do work).

# %%
BH, N, d = 16, 4096, 64
t = fa2.default_tiles(d)
Tr, Tc = N // t["Br"], N // t["Bc"]
ss = [1 / Tc, 1 / 64, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0]
rows = []
for s in ss:
    bm = bs.random(N, N, t["Br"], t["Bc"], s, seed=0)
    fwd, bwd = fa2.model_forward(BH, N, N, d, block_mask=bm), fa2.model_backward(BH, N, N, d, block_mask=bm)
    nd = 4 * BH * (2 * N * d + N)                              # Q read, O and L written
    flops_f = roofline.flops_forward(1, BH, N, N, d) * bm.density
    tf = roofline.modelled_time(flops_f, nbytes(fwd), "H100 SXM")
    tb = roofline.modelled_time(2.5 * flops_f, nbytes(bwd), "H100 SXM")
    rows.append((bm.density, nbytes(fwd), nd, tf.seconds, tb.seconds, tf.bound))
    empty = int((~bm.mask.any(-1)).sum())                        # block rows the random mask left empty
    print(f"s = {bm.density:7.4f} ({bm.mask.sum() / Tr:.2f} blocks per block row, {empty:3d}/{Tr} rows empty): forward {nbytes(fwd) / 1e6:8.1f} MB (Nd term {nd / nbytes(fwd):5.1%}), "
          f"backward {nbytes(bwd) / 1e6:8.1f} MB; modelled fwd {tf.seconds * 1e3:6.3f} ms ({tf.bound}-bound), "
          f"bwd {tb.seconds * 1e3:6.3f} ms")
dense_bytes = nbytes(fa2.model_forward(BH, N, N, d))
print(f"dense fa2 forward (no mask): {dense_bytes / 1e6:.1f} MB")

# %%
s_arr, fb, ndb, tf_, tb_ = (np.array([r[i] for r in rows]) for i in range(5))
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.6))
ax1.plot(s_arr, fb / 1e6, "o-", label="forward HBM traffic (model; equal to the counts above)")
ax1.axhline(ndb[0] / 1e6, color="gray", ls="--", label="Nd term: Q read, O, L written")
ax1.set_xscale("log")
ax1.set_yscale("log")
ax1.set_xlabel("fraction of nonzero blocks s")
ax1.set_ylabel("MB")
ax1.set_title(f"BH={BH}, N={N}, d={d}, tiles {t['Br']}x{t['Bc']}")
ax1.legend(fontsize=8)
ax2.plot(s_arr, tf_ * 1e3, "o-", label="forward")
ax2.plot(s_arr, tb_ * 1e3, "s-", label="backward")
ax2.set_xscale("log")
ax2.set_yscale("log")
ax2.set_xlabel("fraction of nonzero blocks s")
ax2.set_ylabel("ms (modelled)")
ax2.set_title("modelled roofline time, H100 SXM preset (not measured)")
ax2.legend(fontsize=8)
savefig(fig, "07_traffic_vs_s")
plt.show()

# %% [markdown]
# Traffic falls linearly with $s$ until the $Nd$ term dominates: at the smallest density, $s = 1/T_c$, there
# are as many nonzero blocks as block rows, i.e. one block per block row *on average* (`bs.random` places
# them at random, so some block rows get several and others none: the printed count of empty rows), and
# the $Nd$ term is most of what is left, so no mask makes the forward cheaper than reading $Q$ and writing
# $O$ once. Above the smallest densities fa2's FP32 FMAs are the roof (the printed bound), and the modelled
# time is simply $\propto s$. The FA1 paper's claim for block-sparse FlashAttention is this IO complexity,
# $\Theta(Nd + N^2 d^2 s / M)$ (Dao et al. 2022, *FlashAttention*, Section 3.3, Proposition 4); how much
# faster that makes it on a real GPU is a measurement, and this notebook makes none without one.
#
# On a machine with a GPU this cell times the forward at four densities (notebook 00, A.5).

# %%
from flashnb.instruments import bench  # noqa: E402

# on a GPU only, in a process of its own (this one runs the simulator): bs.measure_gpu's source is below
gpu_rows = bench.on_gpu("flashnb.instruments.measure.block_sparse:measure_gpu", BH=BH, N=N, d=d, densities=[1.0, 0.5, 0.25, 0.125])
print(bench.table(gpu_rows, ["density", "median_ms", "q1_ms", "q3_ms", "tflops", "pct_fp32_peak", "gpu_name"]))
show_source(bs.measure_gpu)

# %% [markdown]
# ## When block sparsity changes the answer
#
# A block mask is not an optimisation of dense attention: it **removes keys**, and the output changes by
# however much softmax mass those keys carried. The float64 reference is enough to see it ($N = 512$,
# $d = 64$, causal, local windows of growing width). Two inputs: i.i.d. random $q, k$ (attention spread
# over all keys), and $q, k$ dominated by a shared smooth positional signal, so that each query's scores
# peak on nearby keys (the situation local patterns are designed for).

# %%
N, d, B = 512, 64, 32
pos = np.arange(N)[:, None] / N
freqs = np.arange(1, d // 2 + 1)[None, :]
smooth = np.concatenate([np.sin(2 * np.pi * 6 * pos * freqs / d), np.cos(2 * np.pi * 6 * pos * freqs / d)], 1)
inputs = {"i.i.d. random q, k": [rng.standard_normal((N, d)) for _ in range(3)],
          "positional q, k": [1.5 * smooth + 0.3 * rng.standard_normal((N, d)),
                              1.5 * smooth + 0.3 * rng.standard_normal((N, d)), rng.standard_normal((N, d))]}
windows = [1, 2, 4, 8, 12]                                     # 16 blocks would be all of them: exact
fig, ax = plt.subplots(figsize=(6, 3.4))
for name, (qx, kx, vx) in inputs.items():
    o_dense, _ = reference.attention_forward(qx, kx, vx, causal=True)
    P = np.tril(np.exp(qx @ kx.T / np.sqrt(d) - (qx @ kx.T / np.sqrt(d)).max(1, keepdims=True)))
    P /= P.sum(1, keepdims=True)
    errs = []
    for w in windows:
        bm = bs.local(N, N, B, B, w)
        o_sparse, _ = reference.attention_forward(qx, kx, vx, causal=True, mask=bm.expand(N, N))
        rel = np.linalg.norm(o_sparse - o_dense) / np.linalg.norm(o_dense)
        lost = (P * ~bm.expand(N, N)).sum(1).mean()
        errs.append(rel)
        print(f"{name:18s} window {w:2d} blocks (s = {bm.density:.3f}): relative error {rel:.2e}, "
              f"mean softmax mass dropped {lost:.2e}")
    ax.plot([bs.local(N, N, B, B, w).density for w in windows], errs, "o-", label=name)
ax.set_xlabel("fraction of nonzero blocks s (local window)")
ax.set_ylabel("||O_sparse - O_dense|| / ||O_dense||")
ax.set_yscale("log")
ax.legend(fontsize=8)
savefig(fig, "07_error_vs_dense")
plt.show()

# %% [markdown]
# The error tracks the softmax mass the mask drops. With diffuse attention (i.i.d. inputs) a local window
# throws away most of it and the output is a different function; with attention concentrated near the
# diagonal the same window is a close approximation. Block-sparse FlashAttention is exact for the
# *masked* attention it is asked for (checked above); whether that is close to dense attention depends on
# the data — and in models trained with a sparse pattern (Sparse Transformers, the FA1 paper's long-range
# experiments) the pattern is part of the model, not an approximation of it.
#
# One special case is exact: the `causal` pattern with `causal=True` gives causal attention and visits
# exactly the tiles that fa2's own causal skipping visits.

# %%
m = bs.causal(200, 200, 32, 32).mask
same = set(zip(*np.nonzero(m))) == {(i, j) for i, j, _, _ in fa2.tiles_visited(200, 200, 32, 32, True)}
print("causal pattern == fa2's causal tile set:", same, f"(s = {m.mean():.3f})")
assert same

# %% [markdown]
# ## Exercises
#
# Each exercise has a check: fill in the `...` and run its cell (`...` means "not attempted yet"). Stuck?
# `exercises.hint("07.1")` gives a hint and `exercises.answer("07.1")` the worked answer -- try first.
# Levels: ★ a few lines, ★★ a small model or experiment, ★★★ a real change to a kernel.

# %%
from flashnb import exercises  # noqa: E402

# %% [markdown]
# **07.1 · The mask term** (★★, ~20 min) The kernel reads $M_{ij}$ once per *possible* tile, so the mask term is
# $\propto T_r T_c$, not $s$. Write `mask_reads_now(mask, warps)`: the reads of the block mask per head in the
# non-causal forward (`mask`: a boolean $(T_r, T_c)$ array at the kernel's tiles) — the check compares it with the
# traffic counter — and `mask_reads_csr(mask, warps)`: the same if the mask were stored as CSR (`row_ptr` of
# $T_r + 1$ entries, `col_idx` of the nonzero blocks; each warp reads `row_ptr[i]`, `row_ptr[i+1]` and one index per
# nonzero block of its row). Which one is $\propto s$?

# %%
mask_reads_now = ...   # def mask_reads_now(mask, warps): ...
mask_reads_csr = ...   # def mask_reads_csr(mask, warps): ...
passed = exercises.check("07.1", mask_reads_now=mask_reads_now, mask_reads_csr=mask_reads_csr)

# %% [markdown]
# **07.2 · Query blocks with nothing to do** (★, ~15 min) Query blocks with no nonzero block still read $Q_i$ and
# write $O_i = 0$, $L_i = -\infty$. If the forward skipped them entirely, who would then write $O$ and $L$? Write
# `q_reads_saved(mask, Br, Nq, d)`: the global elements (one head, non-causal) that skipping saves, and give
# `local_saved` for `bs.local(1024, 1024, 64, 64, 2).mask` at $d = 64$. How much of the $Nd$ term is that?

# %%
q_reads_saved = ...   # def q_reads_saved(mask, Br, Nq, d): ...
local_saved = ...
passed = exercises.check("07.2", q_reads_saved=q_reads_saved, local_saved=local_saved)

# %% [markdown]
# **07.3 · Whose tiles?** (★, ~10 min) Build a mask at $128 \times 128$ tiles ($N = 256$) and run it at $d = 64$:
# which tiles `(Br, Bc)` does each direction use (`fa2.block_tiles`)? Does the forward accept `Br=48` with that
# mask? Why must the kernel's tiles divide the mask's, and what would go wrong otherwise?

# %%
forward_tiles = ...    # (Br, Bc)
backward_tiles = ...   # (Br, Bc)
Br48_raises = ...      # True or False
passed = exercises.check("07.3", forward_tiles=forward_tiles, backward_tiles=backward_tiles, Br48_raises=Br48_raises)

# %% [markdown]
# **07.4 · Butterfly vs local** (★★, ~15 min) For `bs.butterfly` at $N = 4096$ with $64 \times 64$ blocks, compute
# $s$; find the non-causal `bs.local` window with the closest density, and the ratio of their modelled forward
# traffic ($d = 64$, one head). Which would you expect to approximate dense attention better on the "positional"
# input above, and why?

# %%
s_butterfly = ...
window = ...
traffic_ratio = ...    # butterfly / local
passed = exercises.check("07.4", s_butterfly=s_butterfly, window=window, traffic_ratio=traffic_ratio)

# %%
print(f"notebook ran in {time.perf_counter() - T0:.1f} s")
