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
# # 10 · Attention modifiers: from the fixed causal mask to `score_mod` and `mask_mod`
#
# Every kernel so far knows exactly one variant of attention: dense, or causal (`causal=True` is a
# compile-time flag), or a block mask (notebook 07). Models use many more: a **sliding window**, **ALiBi**
# position biases, **tanh soft-capping** of the scores (Gemma 2), **document masks** for packed sequences,
# **prefix-LM** masks. PyTorch's FlexAttention showed how to get them all without writing a kernel per
# variant: the user writes two tiny functions,
#
# $$S'_{ij} = \texttt{score\_mod}(S_{ij}, b, h, i, j), \qquad
# \texttt{mask\_mod}(b, h, i, j) \in \{\text{True}, \text{False}\},$$
#
# and the library compiles them *into* the FlashAttention kernel, and derives a block mask from
# `mask_mod` so that tiles it masks entirely are never loaded. flashnb's kernel factories already bake
# compile-time choices into kernels (tile sizes, `causal`, `sparse`), so a numba device function is one more
# such choice. This notebook shows the few lines that change, how `mask_mod` becomes a block mask, checks a
# gallery against the float64 reference, and counts what a modifier costs.

# %%
import math
import os
import re
import time

import matplotlib.pyplot as plt
import numpy as np
from numba import float32  # numba's types only (numba.cuda is imported by flashnb, after the line below)

os.environ["FLASHNB_DEVICE"] = "sim"  # counting traffic needs the simulator
import flashnb
from flashnb import flex, reference
from flashnb.instruments import roofline, traffic
from flashnb.kernels import flash, policies
from flashnb.notebook import savefig, show_source

T0 = time.perf_counter()
rng = np.random.default_rng(10)

# %% [markdown]
# ## The change to the kernels: one call per element, compiled only when asked for
#
# Modifiers are a feature of the product kernel (`flashnb.kernels.simt` with `flashnb.kernels.policies`, `impl="flash"`, the default), not of
# the lessons: stage 4's kernels of notebooks 05-07 stay dense and causal. The product kernel's factories take
# `score_mod=None, mask_mod=None` (and `H`, the number of query heads, so that `b = z // H`, `h = z % H` from
# `z = blockIdx.y`) and hand them to a small *policy*, `policies.modifiers`, which returns three device
# functions the loop calls at fixed places. With both `None` they are the identity (and all-allowed), which
# numba inlines into nothing: the kernel is the plain one. The lines of the two factories that call them:

# %%
show_source(flash.make_forward, grep="score(")
show_source(flash.make_forward, grep="allowed_bits")
show_source(flash.make_backward, grep="score(")

# %% [markdown]
# The policy: `score` applies `score_mod` to the *scaled* score of every element in range; `allowed_bits`, only
# on a **partial** tile (block-mask entry `PARTIAL`), asks `mask_mod` about each of a lane's elements once per
# tile and packs the answers into one 64-bit mask, so the unrolled tile code holds one bit test per element; a
# masked element then gets a `-inf` score, exactly like a causal one. Everything else of FA2 Alg. 1 (online
# softmax, delayed rescaling) is untouched. `grad` is the backward's (next section).

# %%
show_source(policies.modifiers)

# %% [markdown]
# ### The backward needs the derivative — derived from the modifier's own source
#
# The backward rebuilds $P = \exp(S' - L)$ from the *modified* score and needs
# $\partial \mathcal{L}/\partial S = \partial \mathcal{L}/\partial S' \cdot \partial S'/\partial S$: the chain
# rule through `score_mod` (FA2 Alg. 2 line 14 becomes $dS = P \circ (dP - D) \cdot \partial S'/\partial S$).
# numba has no automatic differentiation, and a finite difference would cost two more modifier calls per
# element and about half of float32's digits. So flashnb **differentiates the source**
# (`flashnb.flex_grad`): it reads the modifier's Python syntax tree and writes a second Python function,
# forward mode — every local that depends on `score` gets a tangent `d_x` (`d_score = 1`), each statement
# `x = e` is preceded by `d_x = D(e)` with the textbook rules ($D(uv) = D(u)\,v + u\,D(v)$,
# $D(\tanh u) = (1 - \tanh^2 u)\,D(u)$, ...), an `if` or a conditional expression differentiates the branch
# it takes, and everything that depends only on `b, h, q_idx, kv_idx` (a captured bias `bias[h, kv_idx]`) is a
# constant with no tangent. numba then compiles that function into the backward kernel like any modifier.
# `flex.derivative_source` shows what it wrote:

# %%
print(flex.derivative_source(flex.softcap(5.0)))

BIAS = rng.standard_normal((2, 64)).astype(np.float32)   # a per-head bias by key position (captured)


def capped_bias(score, b, h, q_idx, kv_idx):               # no derivative written
    s = float32(5) * float32(math.tanh(score / float32(5)))
    if kv_idx > q_idx:
        s = s * float32(0.5)
    return s + BIAS[h, kv_idx]


print(flex.derivative_source(capped_bias))

# %% [markdown]
# The supported subset is what modifiers are made of: arithmetic, comparisons, `if`/`else` and conditional
# expressions, `math.exp/log/tanh/sqrt`, `abs`, `min`/`max`, `float32(...)` casts and captured arrays indexed
# by the four indices. Anything else that the derivative would have to go through — a loop, a call of another
# function, `//`, indexing by the score — is refused with a `NotDifferentiable` naming the construct and its
# line, before any launch. The derivative is float32 code and is compiled for a GPU and checked for `.f64`
# exactly like the modifier (next section). A hand-written derivative still **overrides** the derived one:
# pass `score_mod_grad` (same arguments) or attach it as `score_mod.grad`. The gallery's modifiers carry
# theirs (ALiBi: 1; soft-capping: $1 - \tanh^2(s/c)$), and they now serve as checks of the derived ones — here
# on random points (the tests also check `alibi`, and train modifiers without a derivative on the product
# kernel against the float64 reference; the backward below does it for `capped_bias`):

# %%
sc = flex.softcap(5.0)
derived = flex.derivative(sc)
pts = [(np.float32(s), 0, int(h), int(i), int(j)) for s, h, i, j in
       zip(rng.uniform(-20, 20, 1000), rng.integers(0, 2, 1000), rng.integers(0, 64, 1000), rng.integers(0, 64, 1000))]
worst = max(abs(float(derived(*p)) - float(sc.grad(*p))) for p in pts)
print(f"softcap(5): max |derived - hand-written| over {len(pts)} random points = {worst:.1e} (float32 rounding)")


def halving(score, b, h, q_idx, kv_idx):                  # a loop: outside the subset
    while score > float32(1):
        score = score * float32(0.5)
    return score


try:
    flex.derivative(halving)
except flex.NotDifferentiable as err:
    print("NotDifferentiable:", re.sub(r" of \S+, is", " of this cell, is", str(err))[:170], "...")

# %% [markdown]
# `mask_mod` needs nothing: a masked element has $P = 0$ and no gradient. In the kernel the derivative is the
# policy's `grad`, called where the backward forms `dS`:

# %%
show_source(flash.make_backward, grep="grad(s")

# %% [markdown]
# ## A modifier must compile for a GPU — checked before any launch
#
# On the simulator any Python runs, so a modifier that a GPU would refuse (an unsupported call) or run in
# float64 (a Python float literal: `score * 0.5`) would pass silently here. flashnb compiles each modifier
# *alone* for sm_80 first (`numba.cuda.compile_ptx(fn, (float32, int32, int32, int32, int32), device=True)`,
# in a child process on the simulator, once per function), refuses `.f64` in its PTX or a wrong result type,
# and names the modifier in the error. One trap is numba's type promotion: **int32 × float32 is float64**, so
# `float32(0.1) * (kv_idx - q_idx)` computes in double precision.

# %%
def rel_bias(score, b, h, q_idx, kv_idx):             # float32 throughout: accepted
    return score - float32(0.1) * float32(q_idx - kv_idx)


def rel_bias_f64(score, b, h, q_idx, kv_idx):         # int32 · float32 -> float64: refused
    return score - float32(0.1) * (q_idx - kv_idx)


def half_score(score, b, h, q_idx, kv_idx):           # a Python float literal: refused
    return score * 0.5


GALLERY = {"causal": (None, flex.causal()),
           "sliding window (16)": (None, flex.sliding_window(16)),
           "ALiBi + causal": (flex.alibi(2), flex.causal()),
           "softcap (5)": (flex.softcap(5.0), None),
           "document": (None, flex.document(np.repeat(np.arange(4), [12, 20, 8, 24]))),
           "prefix-LM (24)": (None, flex.prefix_lm(24))}
pairs = [(rel_bias, "score_mod"), (rel_bias_f64, "score_mod"), (half_score, "score_mod"),
         (capped_bias, "score_mod"), (flex.derivative(capped_bias), "score_mod_grad")]
for sm, mm in GALLERY.values():
    pairs += ([(sm, "score_mod"), (sm.grad, "score_mod_grad")] if sm else []) + ([(mm, "mask_mod")] if mm else [])
flex.check_many(pairs, strict=False)                  # one compile batch for everything in this notebook
for fn in (rel_bias, rel_bias_f64, half_score):
    try:
        flex.check_modifiers(score_mod=fn)
        print(f"{fn.__name__}: compiles for a GPU, float32 only")
    except flex.ModifierError as err:
        print(f"{fn.__name__}: ModifierError: {str(err)[:210]}...")

# %% [markdown]
# ## How `mask_mod` becomes a block mask
#
# `flex.create_block_mask(mask_mod, B, H, Nq, Nk, Br=, Bc=)` evaluates `mask_mod` on the host for every
# element (vectorised through NumPy broadcasting when the function allows it, else element by element) and
# classifies each $B_r \times B_c$ tile, extending notebook 07's block mask from two states to three:
#
# * **empty** — no element allowed: the tile is skipped, $K_j, V_j$ never loaded (notebook 07's `M = 0`);
# * **full** — every element allowed: computed with no per-element work at all;
# * **partial** — `mask_mod` is called for each element of the tile.
#
# The mask keeps its `mask_mod`, so when the backward runs at smaller tiles it is recomputed exactly there.

# %%
N, B = 64, 16
fig, axes = plt.subplots(2, len(GALLERY), figsize=(15, 5.2))
states = {}
for col, (name, (sm, mm)) in enumerate(GALLERY.items()):
    if mm is None:                                  # a score_mod alone: every element allowed
        elem, st = np.ones((N, N), bool), np.ones((N // B, N // B), np.uint8)
    else:
        elem = flex.mask_array(mm, 1, 1, N, N)[0, 0]
        st = flex.create_block_mask(mm, 1, 1, N, N, Br=B, Bc=B).states[0, 0]
    states[name] = st
    axes[0, col].imshow(elem, cmap="Greys", vmin=0, vmax=1)
    axes[0, col].set_title(name, fontsize=9)
    axes[1, col].imshow(st, cmap=plt.matplotlib.colors.ListedColormap(["white", "black", "tab:orange"]),
                        vmin=0, vmax=2)
    axes[1, col].set_title(f"{(st == 0).mean():.0%} empty, {(st == 2).mean():.0%} partial", fontsize=8)
    for ax in axes[:, col]:
        ax.set_xticks([])
        ax.set_yticks([])
axes[0, 0].set_ylabel(f"elements ({N}x{N})")
axes[1, 0].set_ylabel(f"tiles {B}x{B}: empty / full / partial")
savefig(fig, "10_gallery_masks")
plt.show()

# %% [markdown]
# Top: the elements each query (row) may attend to. Bottom: the tiles — white empty (skipped), black full,
# orange partial. A mask made of straight lines (causal, windows) is mostly empty or full, with partial tiles
# only along its edges; the document mask has partial tiles where documents meet inside a tile.
#
# ## The gallery against the float64 reference
#
# Each modifier's NumPy twin (`.numpy`, or a user modifier evaluated by `flex.numpy_modifier`) is applied to
# the float64 reference (`reference.attention_forward(..., mask=, score_mod=)`); a user's modifier the
# project has never seen (`rel_bias` above) goes through the same path.

# %%
Nq = Nk = 64
TILES = dict(Br=16, Bc=16, warps=1)
q, k, v, do = (rng.standard_normal((1, 2, n, 16)) for n in (Nq, Nk, Nk, Nq))
cases = dict(GALLERY, **{"user rel_bias + window": (rel_bias, flex.sliding_window(24))})
flex.check_many([(cases["user rel_bias + window"][1], "mask_mod")], strict=False)
for name, (sm, mm) in cases.items():
    o, lse = flashnb.attention_forward(q, k, v, impl="flash", score_mod=sm, mask_mod=mm, **TILES)
    mask = None if mm is None else flex.mask_array(mm, 1, 2, Nq, Nk)
    o_ref, lse_ref = reference.attention_forward(q, k, v, mask=mask,
                                                 score_mod=None if sm is None else flex.numpy_modifier(sm))
    err = np.abs(o - o_ref).max()
    print(f"{name:24s} max|o - ref| = {err:.1e}")
    assert err < 2e-5        # float32 sums of <= 64 O(1) terms, one rounding per modifier: ~1e-6
name, (sm, mm) = "softcap (5)", (flex.softcap(5.0), flex.document(np.repeat(np.arange(4), [12, 20, 8, 24])))
o, lse = flashnb.attention_forward(q, k, v, impl="flash", score_mod=sm, mask_mod=mm, **TILES)
grads = flashnb.attention_backward(q, k, v, o, lse, do, impl="flash", score_mod=sm, mask_mod=mm, **TILES)
refs = reference.attention_backward(q, k, v, do, mask=flex.mask_array(mm, 1, 2, Nq, Nk), score_mod=sm.numpy,
                                    score_mod_grad=sm.grad.numpy)
print("backward, softcap + document: max|grad - ref| =",
      f"{max(np.abs(g - r).max() for g, r in zip(grads, refs)):.1e}")


def capped_bias_np(x, b, h, i, j):            # capped_bias in float64 NumPy, for the reference ...
    s = 5 * np.tanh(x / 5)
    return np.where(j > i, 0.5 * s, s) + BIAS.astype(np.float64)[h, j]


def capped_bias_grad_np(x, b, h, i, j):       # ... and its derivative, by hand
    d = 1 - np.tanh(x / 5) ** 2
    return np.where(j > i, 0.5 * d, d)


o, lse = flashnb.attention_forward(q, k, v, score_mod=capped_bias, **TILES)        # impl="flash", the default
grads = flashnb.attention_backward(q, k, v, o, lse, do, score_mod=capped_bias, **TILES)   # derived derivative
refs = reference.attention_backward(q, k, v, do, score_mod=capped_bias_np, score_mod_grad=capped_bias_grad_np)
err = max(np.abs(g - r).max() for g, r in zip(grads, refs))
print(f"backward, capped_bias (derived derivative, impl 'flash'): max|grad - ref| = {err:.1e}")
assert err < 1e-4        # as the tests: four chained float32 products of sums over <= 64 terms, atomics for dQ

# %% [markdown]
# ## What a modifier costs: counted traffic, then the model at scale
#
# A modifier adds no global memory traffic: its per-element work is arithmetic, and captured arrays (document
# ids, ALiBi slopes) are constants of the compiled kernel (constant memory on a GPU). What changes is the set
# of tiles visited — the empty ones are skipped — so the counted traffic equals `flash.model_forward` with the
# block mask of `mask_mod`, and falls with its density. Counted on the simulator (one head, $N = 64$):

# %%
qd, kd, vd = (flashnb.common.to_device(rng.standard_normal((1, 64, 8))) for _ in range(3))
for w in (8, 24, 64):
    mm = flex.sliding_window(w)
    flex.check_many([(mm, "mask_mod")], strict=False)
    bm = flex.create_block_mask(mm, 1, 1, 64, 64, Br=16, Bc=16)
    with traffic.count() as t:
        flash.forward(qd, kd, vd, scale=0.35, mask_mod=mm, block_mask=bm, **TILES)
    model = flash.model_forward(1, 64, 64, 8, block_mask=bm, **TILES)
    assert t.summary() == model
    print(f"window {w:2d}: tiles visited {bm.density:.3f}, K+V reads {model[0]['reads']['K'] * 2:5d} elements "
          f"(counted == model)")

# %% [markdown]
# At scale (batch·heads 16, $N = 4096$, $d = 64$, the product kernel's default tiles), the same model for each gallery mask,
# against dense attention, with a roofline time on the H100 preset — **modelled, not measured**. FLOPs count
# the visited tiles; the per-element `mask_mod` calls on partial tiles are extra integer work the roofline
# does not see, so the partial fraction is printed beside it (it is what a GPU measurement would add).

# %%
BHs, Ns, ds = 16, 4096, 64
tt = flash.mask_tiles(ds)      # the tiles a mask_mod's block mask is built at
big = {"dense": None, "causal": flex.causal(), "sliding window 512": flex.sliding_window(512),
       "document (8 docs)": flex.document(np.repeat(np.arange(8), Ns // 8)), "prefix-LM 1024": flex.prefix_lm(1024)}


def nbytes(model):
    return sum(n * (1 if a == "M" else 4) for launch in model for kind in ("reads", "writes", "atomics")
               for a, n in launch[kind].items())


rows = []
for name, mm in big.items():
    bm = None if mm is None else flex.create_block_mask(mm, 1, 1, Ns, Ns, Br=tt["Br"], Bc=tt["Bc"])
    model = flash.model_forward(BHs, Ns, Ns, ds, block_mask=bm)
    dens = 1.0 if bm is None else bm.density
    partial = 0.0 if bm is None else float(bm.partial.mean())
    tm = roofline.modelled_time(roofline.flops_forward(1, BHs, Ns, Ns, ds) * dens, nbytes(model), "H100 SXM")
    rows.append((name, dens, partial, nbytes(model), tm.seconds))
    print(f"{name:20s} tiles visited {dens:6.3f} (partial {partial:5.3f}): {nbytes(model) / 1e6:7.1f} MB, "
          f"modelled {tm.seconds * 1e3:6.3f} ms ({tm.bound}-bound)")

# %%
fig, ax = plt.subplots(figsize=(7, 3.2))
names = [r[0] for r in rows]
ax.bar(np.arange(len(rows)) - 0.2, [r[3] / rows[0][3] for r in rows], 0.4, label="HBM traffic / dense")
ax.bar(np.arange(len(rows)) + 0.2, [r[4] / rows[0][4] for r in rows], 0.4, label="modelled time / dense")
ax.set_xticks(np.arange(len(rows)), names, fontsize=8)
ax.set_ylabel("relative to dense")
ax.set_title(f"product kernel forward, BH={BHs}, N={Ns}, d={ds} (model; H100 preset, not measured)", fontsize=9)
ax.legend(fontsize=8)
savefig(fig, "10_cost_vs_dense")
plt.show()

# %% [markdown]
# The sliding window and the document mask visit a small fraction of the tiles, and their modelled traffic
# and time fall with it; causal halves both (it is exactly `causal=True`'s tile set); a `score_mod` alone
# (soft-capping, ALiBi) changes neither — it is pure arithmetic on scores the kernel computes anyway.
#
# ## Grouped-query attention: K and V shared by several query heads
#
# With $H_{kv} < H_q$ heads of K and V ($H_q$ a multiple), query head $h$ uses K/V head $h // (H_q/H_{kv})$.
# The forward reads K/V head `z // G`; the backward's grid runs over the K/V heads and each thread block
# loops over its group's query heads, loading $K_j, V_j$ once and summing $dK_j, dV_j$ over the group on chip
# (no reduction kernel, no atomics). Counted backward traffic of K and V ($N = 32$, $d = 8$, four query heads):

# %%
qg, dog = (rng.standard_normal((1, 4, 32, 8)) for _ in range(2))
for Hkv in (4, 2, 1):
    kg, vg = (rng.standard_normal((1, Hkv, 32, 8)) for _ in range(2))
    o, lse = flashnb.attention_forward(qg, kg, vg, impl="flash", **TILES)
    with traffic.count() as t:
        grads = flashnb.attention_backward(qg, kg, vg, o, lse, dog, impl="flash", **TILES)
    main = t.summary()[1]
    assert t.summary() == flash.model_backward(4, 32, 32, 8, group=4 // Hkv, **TILES)
    err = max(np.abs(g - r).max() for g, r in zip(grads, reference.attention_backward(qg, kg, vg, dog)))
    print(f"H_kv = {Hkv}: K+V read {main['reads']['K'] + main['reads']['V']:5d}, dK+dV written "
          f"{main['writes']['dK'] + main['writes']['dV']:5d} elements; Q read {main['reads']['Q']}; "
          f"max|grad - ref| {err:.1e}")

# %% [markdown]
# K/V reads and dK/dV writes fall by the group size $G$; Q, dO and the dQ atomics stay (every query head
# still does its work). The forward's *counted* K/V reads do not change: each query head's thread blocks
# stream their K/V tiles as before, and what sharing saves there is the K/V tensors' size (and, on a GPU,
# DRAM traffic when the group's blocks find the same tiles in L2) — which an element counter does not see.
#
# ## Exercises
#
# Each exercise has a check: fill in the `...` and run its cell (`...` means "not attempted yet"). Stuck?
# `exercises.hint("10.1")` gives a hint and `exercises.answer("10.1")` the worked answer -- try first.
# Levels: ★ a few lines, ★★ a small model or experiment, ★★★ a real change to a kernel.

# %%
from flashnb import exercises  # noqa: E402

# %% [markdown]
# **10.1 · Attention sinks** (★, ~10 min) StreamingLLM keeps the first few tokens visible to every query next to a
# sliding window. Write `sinks_mask(b, h, q_idx, kv_idx)`: causal, and a key is allowed when it is one of the
# first 4 positions or one of the last 16 (the query's own included). Then look at its block mask
# (`flex.create_block_mask(sinks_mask, 1, 1, 512, 512, Br=64, Bc=32)`): which tiles are partial?

# %%
sinks_mask = ...   # def sinks_mask(b, h, q_idx, kv_idx): ...
passed = exercises.check("10.1", sinks_mask=sinks_mask)

# %% [markdown]
# **10.2 · The derivative** (★★, ~15 min) A modifier soft-caps the score and adds a per-head temperature term:
# `3·tanh(score/3) + temps[h]·score` with `temps = exercises.nb10.TEMPS` (captured). Write `score_grad`, the
# derivative the backward needs, in float32, by hand (flashnb would derive it; a hand-written derivative is what
# checks a derived one).

# %%
score_grad = ...   # def score_grad(score, b, h, q_idx, kv_idx): ...
passed = exercises.check("10.2", score_grad=score_grad)

# %%
print(f"notebook ran in {time.perf_counter() - T0:.1f} s")
