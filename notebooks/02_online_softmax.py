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
# # 02 · Online softmax: fewer passes, exact merges, and the one-pass attention row
#
# Notebook 01 ended with a softmax kernel that reads every row of $S$ **three** times. Softmax does only a
# few FLOPs per element, so it is memory-bound: its time is the time to move its bytes, and the number of
# passes over memory *is* its cost. (Per row, every variant below does $O(n)$ work; what changes is how many
# times each element crosses between HBM and the chip.)
#
# This notebook goes from the textbook formula to the idea FlashAttention stands on:
#
# 1. **unsafe** softmax, $y_i = e^{x_i} / \sum_k e^{x_k}$ — and where it overflows;
# 2. **safe** softmax in three passes (max, sum, normalise);
# 3. **online** softmax in two passes (Milakov & Gimelshein, 2018): the max and the normaliser in one pass;
# 4. the **merge** $[m, d] \oplus [m', d']$ that lets threads, and thread blocks, combine partial results exactly;
# 5. the **one-pass attention row**: the online softmax fused with the weighted sum of $V$ — first key by key,
#    then tile by tile: the computation at the heart of FlashAttention, in the loop order FlashAttention-2 uses.
#
# Every kernel runs on flashnb's simulator here (a whole grid in lockstep as NumPy vectors), and its memory
# accesses are **counted** by `flashnb.instruments.traffic` and compared with an analytic model.

# %%
import os
import time
import warnings

import matplotlib.pyplot as plt
import numpy as np

os.environ["FLASHNB_DEVICE"] = "sim"  # counting traffic needs the simulator; GPU timings run in a process of their own
import flashnb
from flashnb import reference
from flashnb.instruments import traffic
from flashnb.notebook import savefig, show_source
from flashnb.stages import softmax as S

T0 = time.perf_counter()
rng = np.random.default_rng(2)
print("kernels run on the Numba CUDA simulator; GPU timings:",
      "on this machine's GPU, in a separate process" if flashnb.instruments.bench.gpu_available() else "none (no GPU here)")

# %% [markdown]
# ## 1 · Unsafe softmax overflows
#
# $e^x$ grows fast. The largest float32 is about $3.4\times10^{38}$, so $e^x$ is `inf` as soon as
# $x > \ln(3.4\times 10^{38})$; in float16 the largest value is 65504, so the limit is $\ln 65504$:

# %%
print(f"float32: e^x overflows for x > {S.FLOAT32_EXP_OVERFLOW:.2f}")
print(f"float16: e^x overflows for x > {S.FLOAT16_EXP_OVERFLOW:.2f}")
with np.errstate(over="ignore"):
    for x in (11.0, 11.1, 12.0):
        print(f"  float16  e^{x:<5} = {np.exp(np.float16(x))}")
    for x in (88.0, 88.7, 88.8):
        print(f"  float32  e^{x:<5} = {np.exp(np.float32(x))}")

# %% [markdown]
# Attention scores reach such values easily (a dot product of two 64-dim vectors with entries around 3).
# Once a numerator is `inf` the row becomes `inf / inf = NaN`. The unsafe kernel shows it — on the simulator
# as on a GPU for inputs between 88.72 and 709.78:
#
# *Simulator caveat.* Inside a simulated kernel `math.exp` is Python's: it computes in float64, so
# $e^{100}$ is finite there and only the cast `float32(...)` turns it into `inf` (the same answer a GPU's
# `expf` gives). Above 709.78 Python's `math.exp` raises `OverflowError` where a GPU returns `inf`, so
# `softmax(..., method="unsafe")` refuses such inputs on the simulator rather than report an artefact.

# %%
x_big = np.array([[100.0, 101.0, 99.0, 102.0]], dtype=np.float32)
with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)     # the float32 cast overflows: that is the point
    print("unsafe:", S.softmax(x_big, "unsafe", threads=4))
print("safe:  ", S.softmax(x_big, "safe", threads=4))
print("online:", S.softmax(x_big, "online", threads=4))
print("float64 reference:", np.round(np.exp(x_big - x_big.max()) / np.exp(x_big - x_big.max()).sum(), 6))

# %% [markdown]
# ## 2 · Safe softmax: three passes
#
# Since $e^{x_i - m} / \sum_k e^{x_k - m} = e^{x_i}/\sum_k e^{x_k}$ for any $m$, choose $m = \max_k x_k$:
# every exponent is then $\le 0$, every term in $(0, 1]$, and the sum is between 1 and $n$. The price is a
# third pass:
#
# | pass | computes | global accesses per element |
# |---|---|---|
# | 1 | $m = \max_k x_k$ | 1 read |
# | 2 | $d = \sum_k e^{x_k - m}$ | 1 read |
# | 3 | $y_i = e^{x_i - m} / d$ | 1 read + 1 write |
#
# Pass 2 cannot start before pass 1 has seen the *whole* row, because every term needs the final $m$.
#
# ## 3 · The online normaliser: max and sum in one pass
#
# Fix the dependency on the final maximum. After the first $j$ elements keep two numbers:
#
# $$m_j = \max_{k \le j} x_k, \qquad d_j = \sum_{k \le j} e^{x_k - m_j}$$
#
# — the sum shifted by the maximum *seen so far*. When $x_{j+1}$ arrives the maximum may grow to
# $m_{j+1} = \max(m_j, x_{j+1})$, and every old term must be re-shifted. Since
# $e^{x_k - m_{j+1}} = e^{x_k - m_j}\, e^{m_j - m_{j+1}}$, that is one multiplication for the whole old sum:
#
# $$d_{j+1} = \sum_{k \le j} e^{x_k - m_{j+1}} + e^{x_{j+1} - m_{j+1}}
#          = \underbrace{d_j \, e^{m_j - m_{j+1}}}_{\text{old sum, re-shifted}} + e^{x_{j+1} - m_{j+1}}.$$
#
# Both exponents are $\le 0$ (nothing overflows) and when the maximum does not change the factor is 1. At the
# end $m_n = m$ and $d_n = \sum_k e^{x_k - m}$ — exactly what the safe algorithm's first two passes compute —
# so only the normalising pass remains: **two passes, 3 accesses per element instead of 4.**
#
# A small row, step by step (float64 on the host), shows $m_j$, the rescaling factor and $d_j$
# (always $1 \le d_j \le j$):

# %%
x_demo = np.array([1.0, 3.0, 2.0, 6.0, 5.0, 6.0])
m_j, d_j = -np.inf, 0.0
print(f"{'j':>2} {'x_j':>5} {'m_j':>5} {'e^(m_(j-1)-m_j)':>16} {'d_j':>9}")
for j, xj in enumerate(x_demo, 1):
    m_new = max(m_j, xj)
    factor = np.exp(m_j - m_new)
    d_j = d_j * factor + np.exp(xj - m_new)
    m_j = m_new
    print(f"{j:>2} {xj:5.1f} {m_j:5.1f} {factor:16.4f} {d_j:9.4f}")
print(f"safe softmax's normaliser sum e^(x - max) = {np.exp(x_demo - x_demo.max()).sum():.4f}")

# %% [markdown]
# ## 4 · The merge operator
#
# The recurrence is a special case of something more useful. A *state* $[m, d]$ summarises any set of
# elements: their maximum and their sum shifted by it. (The letter $d$ for that sum is Milakov & Gimelshein's;
# the FlashAttention papers, notebooks 03 onward and the start page's notation sheet call the same normaliser
# $\ell$, and keep $d$ for the head dimension: $[m, d]$ here is $[m, \ell]$ there.) Two states of disjoint sets
# combine exactly:
#
# $$[m, d] \oplus [m', d'] = \bigl[\, M,\; d\, e^{m - M} + d'\, e^{m' - M} \,\bigr], \qquad M = \max(m, m').$$
#
# The online step is $[m_j, d_j] \oplus [x_{j+1}, 1]$ (a single element is the state $[x, 1]$), and the empty
# set is $[-\infty, 0]$. $\oplus$ is **associative** and commutative (both sides equal the state of the
# union), so partial states can be combined in *any* grouping: each thread scans a strided part of the row,
# then the threads merge their states pairwise in a tree, and separate thread blocks can each summarise a
# chunk of a row and merge afterwards. The device function, and the tree in shared memory that uses it:

# %%
show_source(S.merge_state)
show_source(S.block_reduce_state)

# %% [markdown]
# The whole online kernel: pass 1 folds each thread's elements into its state, the block merges the states,
# pass 2 normalises. (A row of only $-\infty$ — fully masked — keeps the state $[-\infty, 0]$ and gives zeros,
# the convention of `flashnb.reference`.)

# %%
show_source(S.make_softmax_online)

# %% [markdown]
# **Two blocks.** Split one row in two halves, let one thread block summarise each (`online_partials`
# launches one block per chunk) and merge the two states on the host:

# %%
x_row = (3 * rng.standard_normal((1, 64))).astype(np.float32)
M2, D2 = S.online_partials(x_row, 2, threads=16)
(m_a, d_a), (m_b, d_b) = (M2[0, 0], D2[0, 0]), (M2[0, 1], D2[0, 1])
m_ab, d_ab = S.merge((m_a, d_a), (m_b, d_b))
x64 = x_row[0].astype(np.float64)
print(f"block A: [m, d] = [{m_a:.4f}, {d_a:.4f}]    block B: [m, d] = [{m_b:.4f}, {d_b:.4f}]")
print(f"A ⊕ B  : [m, d] = [{m_ab:.4f}, {d_ab:.4f}]")
print(f"whole row (float64): [{x64.max():.4f}, {np.exp(x64 - x64.max()).sum():.4f}]")

# %% [markdown]
# **A tree of threads.** Inside a block of 8 threads, thread $t$ first scans elements $t, t+8, t+16, \dots$;
# then 4, 2, 1 threads merge pairs (what `block_reduce_state` does, with a barrier between levels). The figure
# shows each level's states for a row of 32 elements, and that grouping the same states differently (a left
# fold) gives the same result:

# %%
x_tree = (2 * rng.standard_normal(32)).astype(np.float64)
TPB = 8
level = [(x_tree[t::TPB].max(), np.exp(x_tree[t::TPB] - x_tree[t::TPB].max()).sum()) for t in range(TPB)]
levels = [level]
while len(level) > 1:
    half = len(level) // 2
    level = [S.merge(level[t], level[t + half]) for t in range(half)]   # thread t merges with t + half
    levels.append(level)
left = levels[0][0]
for s in levels[0][1:]:
    left = S.merge(left, s)
print(f"tree: [{levels[-1][0][0]:.6f}, {levels[-1][0][1]:.6f}]   left fold: [{left[0]:.6f}, {left[1]:.6f}]")

fig, ax = plt.subplots(figsize=(9, 3.2))
for depth, lev in enumerate(levels):
    for t, (m, d) in enumerate(lev):
        xpos = (t + 0.5) * TPB / len(lev)
        ax.text(xpos, -depth, f"t{t}\n[{m:.2f}, {d:.2f}]", ha="center", va="center", fontsize=7,
                bbox=dict(boxstyle="round", fc="#dde8f5" if depth else "#f5e6d3"))
        if depth:
            for child in (t, t + len(lev)):
                cx = (child + 0.5) * TPB / len(levels[depth - 1])
                ax.plot([xpos, cx], [-depth + 0.25, -depth + 0.75], color="grey", lw=0.8)
ax.set_xlim(0, TPB)
ax.set_ylim(-len(levels) + 0.4, 0.6)
ax.axis("off")
ax.set_title("[m, d] ⊕ tree over 8 threads (top: each thread's strided scan; bottom: the row's state)")
savefig(fig, "02_merge_tree")
plt.show()

# %% [markdown]
# ## 5 · All variants against float64, on adversarial rows
#
# Rows longer than the block (each thread loops), a row of length 1, values of $\pm 10^4$, masked ($-\infty$)
# entries and a fully masked row. `reduce="warp"` uses warp shuffles (`cuda.shfl_xor_sync`, a butterfly
# within each warp of 32 threads, no shared memory and no barrier) and then one shared-memory step across
# warps; on the simulator the shuffles come from `flashnb.sim`.

# %%
def ref_softmax(x):
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    e = np.exp(x - np.where(np.isfinite(m), m, 0.0))
    s = e.sum(axis=-1, keepdims=True)
    return e / np.where(s > 0, s, 1.0)


X = (3 * rng.standard_normal((4, 70))).astype(np.float32)
X[1] *= 3000                       # values of about ±1e4
X[2, ::4] = -np.inf                # masked entries
X[3] = -np.inf                     # a fully masked row -> zeros
for method in ("safe", "online"):
    for reduce in ("block", "warp"):
        Y = S.softmax(X, method, reduce=reduce, threads=32)
        print(f"{method:>6} {reduce:>5}: max |error| = {np.abs(Y - ref_softmax(X)).max():.1e}, "
              f"NaN: {np.isnan(Y).any()}, fully masked row sums to {Y[3].sum()}")
print("row of length 1:", S.softmax(np.array([[4.2]]), "online", threads=4))

# %%
show_source(S.warp_reduce_state)

# %% [markdown]
# ## 6 · Counted accesses per element
#
# Count every launch's global and shared element accesses on the simulator, and compare with the analytic
# model `softmax.model_softmax` (the tests assert they are equal for every variant):

# %%
rows_, n_ = 4, 256
X_count = rng.standard_normal((rows_, n_)).astype(np.float32)
counts = {}
for method in S.METHODS:
    with traffic.count() as t:
        S.softmax(X_count, method, threads=32)
    model = S.model_softmax(rows_, n_, method, threads=32)
    assert t.summary() == model, (t.summary(), model)
    counts[method] = (t.global_reads / (rows_ * n_), t.global_writes / (rows_ * n_), t.shared_reads, t.shared_writes)
passes = {"unsafe": 2, "safe": 3, "online": 2}
print(f"{'method':>7} {'passes':>6} {'reads/elem':>10} {'writes/elem':>11} {'total/elem':>10} {'shared R/W per row':>18}")
for method, (r, w, sr, sw) in counts.items():
    print(f"{method:>7} {passes[method]:>6} {r:>10.0f} {w:>11.0f} {r + w:>10.0f} {sr // rows_:>9}/{sw // rows_:<8}")

fig, ax = plt.subplots(figsize=(5, 3))
names = list(counts)
ax.bar(names, [counts[m][0] for m in names], label="reads")
ax.bar(names, [counts[m][1] for m in names], bottom=[counts[m][0] for m in names], label="writes")
ax.set_ylabel("global accesses per element (counted)")
ax.set_title("Softmax: counted HBM accesses per element")
ax.legend()
savefig(fig, "02_accesses_per_element")
plt.show()

# %% [markdown]
# The online algorithm has the unsafe one's traffic and the safe one's robustness. The shared-memory traffic of
# the reductions is per row (a few dozen accesses for 32 threads), not per element; the online tree moves two
# arrays ($m$ and $d$) instead of one, but it runs one tree instead of the safe version's two.
#
# ## 7 · Modelled speed
#
# Softmax does a handful of FLOPs per 4-byte element, far below any GPU's ridge point, so a roofline model puts
# its time at bytes / bandwidth. The model is evaluated at a size the simulator could never run
# (16384 rows of 16384 — the $S$ of a long sequence); the counts above validate the model at a small size.
# These are **modelled** times, not measurements.

# %%
R_big, n_big = 16384, 16384
flops_per_elem = {"unsafe": 5, "safe": 7, "online": 9}   # rough: max/sub/exp/add/mul per element, all passes
from flashnb.instruments import roofline

gpu = roofline.GPUS["A100 80GB SXM"]
gpu_name = gpu.name


def modelled_ms(flops, nbytes):
    return roofline.modelled_time(flops, nbytes, gpu).seconds * 1e3


times = {}
for method in S.METHODS:
    m = S.model_softmax(R_big, n_big, method, threads=256)[0]
    nbytes = 4 * (sum(m["reads"].values()) + sum(m["writes"].values()))
    times[method] = modelled_ms(flops_per_elem[method] * R_big * n_big, nbytes)
    print(f"{method:>7}: {nbytes / 1e9:5.2f} GB  modelled {times[method]:6.2f} ms on {gpu_name}")
print(f"online vs safe: modelled speed-up {times['safe'] / times['online']:.2f}x (= 4/3 accesses per element)")

# %% [markdown]
# Real speed needs a GPU. Milakov & Gimelshein measured about 1.3× for online over safe softmax on a V100
# (arXiv 1805.02867, their V100 benchmarks) — close to the 4/3 the access count predicts. On a machine with a
# GPU the cell below times the three kernels there with CUDA events (notebook 00, A.5).

# %%
from flashnb.instruments import bench  # noqa: E402

# on a GPU only, in a process of its own (this one runs the simulator); gb_per_s = modelled bytes / median time
gpu_rows = bench.on_gpu("flashnb.instruments.measure.softmax:measure_gpu", rows=4096, n=4096, threads=256)
print(bench.table(gpu_rows, ["method", "median_ms", "q1_ms", "q3_ms", "model_bytes", "gb_per_s", "gpu_name"]))

# %% [markdown]
# ## 8 · One-pass attention for a query row
#
# In attention a query row's scores are $x_j = \tau\, q \cdot k_j$ and the output is
# $o = \sum_j \frac{e^{x_j - m}}{d} V_j$. The online softmax still needs a second pass to normalise — but
# attention never needs the probabilities themselves, only their weighted sum of $V$. Keep the output
# *normalised so far*, $o_j = \sum_{k \le j} \frac{e^{x_k - m_j}}{d_j} V_k$. When key $j+1$ arrives, re-shift
# and re-normalise the old sum and add the new term:
#
# $$o_{j+1} = o_j \,\frac{d_j\, e^{m_j - m_{j+1}}}{d_{j+1}} + \frac{e^{x_{j+1} - m_{j+1}}}{d_{j+1}}\, V_{j+1}.$$
#
# After the last key $o_n$ is the attention output: **one pass over K and V**, nothing of size $n$ stored.
# One thread per query row, keys straight from global memory:

# %%
show_source(S.make_attention_rows)

# %%
Nq, Nk, d = 8, 40, 16
q = rng.standard_normal((Nq, d))
K = rng.standard_normal((Nk, d))
V = rng.standard_normal((Nk, d))
o_ref, lse_ref = reference.attention_forward(q, K, V)
for tile in (None, 8):
    o, lse = S.attention_rows(q, K, V, tile=tile, return_lse=True)
    print(f"tile={tile!s:>4}: max |o - ref| = {np.abs(o - o_ref).max():.1e}, "
          f"max |lse - ref| = {np.abs(lse - lse_ref).max():.1e}")
o_c = flashnb.attention(q, K, V, causal=True, impl="onepass")
print(f"causal, through flashnb.attention(impl='onepass'): max |o - ref| = "
      f"{np.abs(o_c - reference.attention(q, K, V, causal=True)).max():.1e}")

# %% [markdown]
# **Tile by tile.** The key-by-key kernel reads every key and value once *per query row*. Let a block of
# $B_r$ query rows share each tile of $B_c$ keys and values through shared memory, and apply the same update
# per tile instead of per key: with the tile's $\tilde m = \max S$, $\tilde P = e^{S - \tilde m}$,
# $\tilde\ell = \sum \tilde P$,
#
# $$m_\text{new} = \max(m, \tilde m),\quad \ell_\text{new} = e^{m - m_\text{new}} \ell + e^{\tilde m - m_\text{new}} \tilde\ell,\quad
# o \leftarrow \frac{\ell\, e^{m - m_\text{new}}\, o + e^{\tilde m - m_\text{new}}\, \tilde P V_j}{\ell_\text{new}}.$$
#
# That is the merge $\oplus$ of the running state with the tile's state, carried along with $o$ — the update of
# FlashAttention-1's Algorithm 1, lines 9–12, for one block of query rows. The *loop order* here is
# FlashAttention-2's, though: each query row stays put and walks over the key tiles (FA2 Alg. 1, lines 6–10).
# FlashAttention-1 (notebook 03) turns it inside out -- key tiles outside, query blocks inside, with the running
# $O, \ell, m$ parked in HBM between visits -- and FlashAttention-2 (notebook 05) turns it back, for reasons
# notebook 05 measures:

# %%
show_source(S.make_attention_tiles)

# %% [markdown]
# Counted global reads of K and V, key by key versus tiles of 8 (the model `model_forward` agrees):

# %%
qd, Kd, Vd = (flashnb.common.to_device(a[None]) for a in (q, K, V))
for tile in (None, 8):
    with traffic.count() as t:
        S.forward(qd, Kd, Vd, causal=False, scale=1 / np.sqrt(d), tile=tile)
    assert t.summary() == S.model_forward(1, Nq, Nk, d, tile=tile)
    s = t.summary()[0]
    print(f"tile={tile!s:>4}: K reads {s['reads']['K']:>5}  V reads {s['reads']['V']:>5}  "
          f"(= {s['reads']['K'] // (Nk * d)} × Nk·d)  shared R/W {s['shared_reads']}/{s['shared_writes']}")

# %% [markdown]
# K and V are now read once per *block* of query rows ($T_r = \lceil N_q / B_r \rceil$ times) instead of once
# per row, and nothing of size $N_q \times N_k$ ever reaches HBM. Notebook 03 builds **FlashAttention-1** from
# this update: it swaps the loops (K/V tiles outside, so each $K_j, V_j$ is loaded once), keeps $O$, $\ell$, $m$
# in HBM between the K/V tiles (FA1 Alg. 1), chooses $B_r, B_c$ from the SRAM size, and adds the backward pass;
# notebook 05's FlashAttention-2 returns to the loop order of this kernel.

# %%
print(f"notebook ran in {time.perf_counter() - T0:.1f} s")

# %% [markdown]
# ## Exercises
#
# Each exercise has a check: fill in the `...` and run its cell (`...` means "not attempted yet"). Stuck?
# `exercises.hint("02.1")` gives a hint and `exercises.answer("02.1")` the worked answer -- try first.
# Levels: ★ a few lines, ★★ a small kernel or experiment, ★★★ a real change to a kernel.
# To change a library kernel, edit a copy. The lines worth changing are marked in the kernels as named regions
# (`# region tile-update` ... `# endregion tile-update`; `show_source(factory, region=name)` prints one):
# `registry.variant(factory, regions={name: new_lines})` replaces a region's lines, `registry.variant(factory,
# region=name, replace=(old_text, new_text))` one piece of text inside it. Run the copy through the library with
# `with registry.using(factory, variant):`.

# %%
import math  # noqa: E402,F401  (for the kernels you write below)

from numba import cuda, float32  # noqa: E402,F401

from flashnb import exercises, registry  # noqa: E402,F401
from flashnb.common import NEG_INF, ONE, ZERO  # noqa: E402,F401
from flashnb.stages.softmax import block_reduce_state, merge_state  # noqa: E402,F401

# %% [markdown]
# **02.1 · The merge is associative** (★, ~15 min) Write `merge(a, b)` for states `a = (m_a, d_a)`,
# `b = (m_b, d_b)` (floats, on the host). Show on paper that $([a]\oplus[b])\oplus[c]$ and
# $[a]\oplus([b]\oplus[c])$ both equal the state of the union of the three sets; the check tests exactly that on
# random states (some with values of $\pm 10^4$) and the empty state $[-\infty, 0]$. Why does associativity let
# the block reduce states in a tree?

# %%
merge = ...   # def merge(a, b): ... return m, d
passed = exercises.check("02.1", merge=merge)

# %% [markdown]
# **02.2 · An online softmax that also stores the log-sum-exp** (★★, ~20 min) Write a kernel `(X, Y, L)`,
# launched as `kernel[rows, 32]`, that computes the online softmax of each row (two passes over $X$) and also
# writes $L = m + \ln d$ per row (start from `show_source(S.make_softmax_online)`). Write its traffic model: how
# many global accesses per element is that for one row of $n = 4096$? The check runs your kernel under the
# sanitizer, against float64, and counts it.

# %%
softmax_lse = ...            # your @cuda.jit kernel (X, Y, L)
accesses_per_element = ...
passed = exercises.check("02.2", kernel=softmax_lse, accesses_per_element=accesses_per_element)

# %% [markdown]
# **02.3 · The second half of a split-row softmax** (★★★, ~30 min) `online_partials` computes the state
# $[m, d]$ of each chunk of a row, one block per chunk. Write the second kernel `(X, M, D, Y)`, launched as
# `kernel[(chunks, rows), 32]`: block $(c, row)$ merges the chunk states of its row and normalises the elements
# of chunk $c$ ($C = \lceil n / \text{chunks} \rceil$ elements, as `online_partials` splits them). Count both
# launches: what does splitting a row over blocks cost, and when is it worth it?

# %%
normalise_chunks = ...       # your @cuda.jit kernel (X, M, D, Y)
passed = exercises.check("02.3", kernel=normalise_chunks)

# %% [markdown]
# **02.4 · Warp totals, reduced by warp 0** (★★, ~20 min) In `warp_reduce_sum` every thread reads all $T/32$
# warp totals from shared memory. How many shared reads is one call with $T = 256$ threads? Then write a block
# sum `(X, out)`, launched as `kernel[rows, 256]` with `out[row] = X[row, 0:256].sum()`, in which only warp 0 reads
# the warp totals and reduces them with shuffles. The check runs it under the sanitizer and counts its shared reads.

# %%
shared_reads_now = ...
block_sum = ...              # your @cuda.jit kernel (X, out)
passed = exercises.check("02.4", kernel=block_sum, shared_reads_now=shared_reads_now)

# %% [markdown]
# **02.5 · Causal: skip the work, not just the load** (★★★, ~30 min) With `causal=True`, `make_attention_tiles`
# already stops loading key tiles past the block's last row, but every row still scores the tiles that are fully
# masked *for that row*. Make a variant that skips the score and $\tilde P V$ work of those tiles per row (mind
# the bottom-right alignment, $N_q \ne N_k$). The check runs it through `flashnb.attention(..., causal=True,
# impl="onepass", tile=8)` against the reference and counts it. Which counts of `model_forward` change?

# %%
skip_masked = ...            # registry.variant(S.make_attention_tiles, region="tile-update", replace=(old, new))
changed = ...                # a set of model fields: "reads", "writes", "shared_reads", "shared_writes"
passed = exercises.check("02.5", variant=skip_masked, changed=changed)

# %% [markdown]
# **02.6 · Keep $o$ unnormalised, divide once** (★★, ~20 min) The key-by-key update divides by $d_{j+1}$ for every
# key. Make a variant of `make_attention_rows` that keeps $o$ unnormalised (scale by $e^{m_j - m_{j+1}}$ only) and
# divides once after the last key -- FlashAttention-2 does this. How many divisions per query row does it save
# at $N_k = 1024$, $d = 64$?

# %%
unnormalised = ...           # registry.variant(S.make_attention_rows, regions={"o-update": ..., "write-o": ...})
divisions_saved = ...
passed = exercises.check("02.6", variant=unnormalised, divisions_saved=divisions_saved)
