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
# # 03 · FlashAttention-1, forward: tiles, an online softmax across tiles, and what crosses HBM
#
# Notebook 01 wrote $S = QK^\top$ and $P = \mathrm{softmax}(S)$ to HBM and read them back: $\Theta(N^2)$ element
# transfers per head. Notebook 02 showed that a softmax row can be built **incrementally**: keep a running
# maximum $m$ and a running sum $\ell$, and rescale what you have when a bigger score arrives.
#
# FlashAttention-1 (Dao et al., 2022, *Algorithm 1*) puts the two together:
#
# * cut $Q$ into row blocks $Q_i$ of $B_r$ rows and $K, V$ into column blocks $K_j, V_j$ of $B_c$ rows;
# * **outer loop over $j$**: load $K_j, V_j$ into on-chip SRAM (shared memory) once;
# * **inner loop over $i$**: load $Q_i$ and the running $O_i, \ell_i, m_i$ from HBM, compute the tile
#   $S_{ij} = Q_i K_j^\top$ *on chip*, merge it into $O_i, \ell_i, m_i$ with the online-softmax rule, and write
#   $O_i, \ell_i, m_i$ back to HBM.
#
# $S$ and $P$ never exist in HBM. The price is that $Q$ and $O$ cross HBM once **per key block**: $T_c = \lceil N/B_c\rceil$
# times. That is the $\Theta(N^2 d^2 / M)$ of the paper's Theorem 2. FlashAttention-2 (notebook 05) swaps the
# loops, so $Q_i$ is read and $O_i$ written only once -- but then $K$ and $V$ cross HBM once per *query* block,
# $T_r$ times, and the bound is the same $\Theta(N^2 d^2 / M)$ (Proposition 3 of the FA1 paper: no exact
# algorithm does asymptotically better for every $M$). What FA2 removes is the constant in front: the round
# trips of $O_i, \ell_i, m_i$. This notebook builds, counts and models exactly that kernel
# (`flashnb/stages/fa1.py`, `impl="fa1"`), on the Numba CUDA simulator.

# %%
import inspect
import os
import re
import time

import matplotlib.pyplot as plt
import numpy as np

os.environ["FLASHNB_DEVICE"] = "sim"  # counting traffic needs the simulator; GPU timings run in a process of their own
import flashnb
from flashnb import common, reference
from flashnb.instruments import roofline, traffic
from flashnb.notebook import savefig, show_source
from flashnb.stages import fa1, naive

T0 = time.perf_counter()
rng = np.random.default_rng(3)
print("kernels run on the Numba CUDA simulator; GPU timings:",
      "on this machine's GPU, in a separate process" if flashnb.instruments.bench.gpu_available() else "none (no GPU here)")

# %% [markdown]
# ## 1 · Block sizes from the SRAM budget
#
# Algorithm 1, line 1: with an SRAM of $M$ elements, $B_c = \lceil M/4d \rceil$ and $B_r = \min(\lceil M/4d\rceil, d)$.
# The "4" is for the four tiles that must sit on chip at once: $Q_i$, $K_j$, $V_j$ and $O_i$ (each about
# $B\cdot d$ elements). `fa1.tiles` applies the formula (rounding $B_c$ up to a multiple of the warp count,
# see §3) and checks that **everything** the kernels declare fits in 48 KiB of static shared memory:

# %%
print(f"default budget M = {fa1.DEFAULT_M} float32 elements ({fa1.DEFAULT_M * 4 // 1024} KiB), "
      f"warps per block W = {fa1.WARPS}")
print(f"{'d':>4} {'Br':>4} {'Bc':>5} {'4·Bc·d (paper)':>15} {'fwd holds':>10} {'bwd holds':>10} {'fwd/paper':>10}")
for d in (1, 16, 32, 64, 96, 128):
    t = fa1.tiles(d)
    paper = 4 * t["Bc"] * d
    fwd = t["shared_bytes_forward"] // 4
    bwd = t["shared_bytes_backward"] // 4
    print(f"{d:>4} {t['Br']:>4} {t['Bc']:>5} {paper:>15} {fwd:>10} {bwd:>10} {fwd / paper:>10.2f}")
fits = [d for d in range(1, flashnb.api.MAX_HEAD_DIM + 1)
        if max(fa1.tiles(d)["shared_bytes_forward"], fa1.tiles(d)["shared_bytes_backward"]) <= 48 * 1024]
print(f"head dims whose default tiles fit in 48 KiB: {fits[0]}..{fits[-1]} ({len(fits)} of 128)")

# %% [markdown]
# **Why the formula holds only up to a constant.** The paper's $M$ counts the four $B\times d$ tiles and nothing
# else. A real kernel also holds
#
# * the split-K partials (§3): each of the $W$ warps keeps its own partial $\tilde P V_j$ for all $B_r$ rows,
#   $W \cdot B_r \cdot d$ more elements, plus $2W B_r$ partial maxima and sums;
# * the statistics $\ell_i, m_i$ and the merge weights;
# * in the backward, $dK_j, dV_j, dO_i, dQ_i$ and the $B_r\times B_c$ tiles $P$ and $dS$: about twice the forward.
#
# The table shows the ratio: the forward holds a small multiple of what the formula budgets, the backward
# more. So the budget $M$ that the formula is fed must be a *fraction* of the shared memory (here 16 KiB of
# the 48 KiB static limit); the asymptotics $\Theta(N^2 d^2/M)$ are unchanged because the ratio is a constant
# (it depends on $W$, not on $N$). And the 48 KiB is itself a choice: a GPU offers 163 KiB (A100) or 227 KiB
# (H100) of *dynamic* shared memory per block, which would allow larger tiles (exercise 03.5: what 160 KiB buys).

# %% [markdown]
# ## 2 · Algorithm 1, line by line
#
# One inner step merges the tile $(i, j)$ into the running row statistics. In the paper's notation, with
# $\tau = 1/\sqrt d$:
#
# | line | update |
# |---|---|
# | 9  | $S_{ij} = \tau\, Q_i K_j^\top$ (masked to $-\infty$ where not allowed) |
# | 10 | $\tilde m_{ij} = \mathrm{rowmax}(S_{ij})$, $\tilde P_{ij} = \exp(S_{ij} - \tilde m_{ij})$, $\tilde\ell_{ij} = \mathrm{rowsum}(\tilde P_{ij})$ |
# | 11 | $m_i^{new} = \max(m_i, \tilde m_{ij})$, $\ell_i^{new} = e^{m_i - m_i^{new}}\ell_i + e^{\tilde m_{ij}-m_i^{new}}\tilde\ell_{ij}$ |
# | 12 | $O_i \leftarrow \mathrm{diag}(\ell_i^{new})^{-1}\left(\mathrm{diag}(\ell_i)\, e^{m_i-m_i^{new}} O_i + e^{\tilde m_{ij}-m_i^{new}}\tilde P_{ij} V_j\right)$ |
# | 13 | $\ell_i \leftarrow \ell_i^{new}$, $m_i \leftarrow m_i^{new}$ |
#
# $O_i$ stays **normalised** after every step (line 12 divides by $\ell^{new}$ and multiplies the old $O_i$ back by
# $\ell_i$): that is why it can be written to HBM and read back at the next $j$. Here is the algorithm as a
# NumPy transcription, loops and all (`fa1.fa1_forward_numpy`, tagged with the paper's line numbers), run
# against the float64 reference:

# %%
show_source(fa1.fa1_forward_numpy)

# %%
q, k, v = rng.standard_normal((3, 40, 16))
O_np, l_np, m_np = fa1.fa1_forward_numpy(q, k, v, Br=16, Bc=16, causal=True)
o_ref, lse_ref = reference.attention_forward(q, k, v, causal=True)
err_O, err_L = np.abs(O_np - o_ref).max(), np.abs(m_np + np.log(l_np) - lse_ref).max()
print(f"NumPy Algorithm 1 vs reference (float64): max |ΔO| = {err_O:.1e}, max |(m + log l) - L| = {err_L:.1e}")
assert err_O < 1e-12 and err_L < 1e-12      # float64, same sums in another order: a few ulps of O(1) values

# %% [markdown]
# The kernel does the same, with one thread block per (batch, head) and `W` warps. Every line of the paper's
# algorithm is tagged `# line N` in the source; here it is region by region, straight from the package, with the
# file's line numbers (`show_source(fa1.make_forward)` prints the whole factory). First the loop nest, lines 5–8:
# $K_j, V_j$ go to shared memory once per outer step, and for **every** inner step $Q_i$ and the running
# $O_i, \ell_i, m_i$ come back from HBM:

# %%
show_source(fa1.make_forward, region="loop-nest")

# %% [markdown]
# Line 9 and the first half of line 10: the scores of one row against this warp's `Bw` keys of $K_j$ (the warps
# split the tile's keys, *split-K*), masked past $N_k$ and above the causal diagonal, and their maximum $\tilde m$:

# %%
show_source(fa1.make_forward, region="scores")

# %% [markdown]
# Line 11, after the warps' partial maxima and sums are merged: the new statistics, and the two weights of line
# 12 (the old $O_i$'s, and each warp's partial $\tilde P V_j$'s), so that line 12 is one multiply-add per element:

# %%
show_source(fa1.make_forward, region="statistics")

# %% [markdown]
# Line 12 applies them, and lines 12–13 write $O_i, \ell_i, m_i$ back to HBM, at the end of every inner step. That
# round trip of the output through HBM, $T_c$ times per row, is the traffic FlashAttention-2 removes (notebook 05):

# %%
show_source(fa1.make_forward, region="o-update")
show_source(fa1.make_forward, region="write-back")

# %% [markdown]
# The map from the paper's lines to the kernel's source lines, extracted from those tags:

# %%
src, first = inspect.getsourcelines(inspect.unwrap(fa1.make_forward))
for n, text in enumerate(src):
    tag = re.search(r"#.*?\b(lines? \d+(?:-\d+)?)", text)
    if tag:
        code = text.split("#")[0].strip() or src[n + 1].split("#")[0].strip()   # a comment line tags the next
        print(f"fa1.py:{first + n:<4} {tag.group(1):<9} {code}")

# %% [markdown]
# Run it: the kernel's O and statistics against the float64 reference and the NumPy transcription (with
# $B_r = B_c = 16$ there are $T_c = 3$ key blocks, so every row is merged across three tiles, the last one ragged):

# %%
qd, kd, vd = (common.to_device(a[None]) for a in (q, k, v))
O_k, l_k, m_k, used = fa1.forward_stats(qd, kd, vd, causal=True, scale=1 / np.sqrt(16), Br=16, Bc=16)
print("tiles used:", {key: used[key] for key in ("Br", "Bc", "warps")})
errs = dict(O=np.abs(O_k.copy_to_host()[0] - o_ref).max(), l=np.abs(l_k.copy_to_host()[0] - l_np).max(),
            m=np.abs(m_k.copy_to_host()[0] - m_np).max())
print("kernel vs reference:  max |ΔO| =", errs["O"])
print("kernel vs NumPy Alg1: max |Δl| =", errs["l"], " max |Δm| =", errs["m"])
o_api, lse_api = flashnb.attention_forward(q, k, v, causal=True, impl="fa1", Br=16, Bc=16)
errs["lse"] = np.abs(lse_api - lse_ref).max()
print("public API (o, lse = m + log l): max |Δlse| =", errs["lse"])
# float32 kernel: a few roundings per tile merge on O(1) values (l is a sum of <= 40 terms <= 1)
assert max(errs.values()) < 1e-4, errs

# %% [markdown]
# ## 3 · Split-K: the warps divide the key tile
#
# Inside a block, FA1 gives each of its $W = 4$ warps a quarter of $K_j, V_j$ ("split-K"): warp $w$ scores
# its $B_c/W$ keys against **all** $B_r$ query rows and produces a partial row max $m_w$, a partial sum $\ell_w$
# and a partial $\tilde P V_j$. The partials are combined through shared memory with the same merge rule
# as across tiles:
# $\tilde m_{ij} = \max_w m_w$, $\tilde\ell_{ij} = \sum_w e^{m_w - \tilde m_{ij}}\ell_w$,
# $\tilde P_{ij}V_j = \sum_w e^{m_w-\tilde m_{ij}} (\tilde P V)_w$. Every warp writes $B_r\cdot d$ partial outputs to
# shared memory and the merge reads them all back: the shared-memory traffic that the FA2 paper blames
# for FA1's speed. The model counts it exactly (`shared_reads` / `shared_writes`). Splitting over more warps
# adds merge traffic: the writes grow with $W$, while the reads, dominated by the tiles' own loads, barely move:

# %%
for W in (1, 2, 4, 8):
    launch = fa1.model_forward(1, 1024, 1024, 64, Br=16, Bc=128, warps=W, check_fit=False)[1]
    print(f"W = {W}: forward shared reads {launch['shared_reads']:>12,}  writes {launch['shared_writes']:>10,}"
          f"   (N = 1024, d = 64, Br = 16, Bc = 128)")

# %% [markdown]
# ## 4 · The tile schedule: which tile when, and what moves
#
# The outer loop walks the key blocks $j$, the inner loop the query blocks $i$: the $S$ matrix is visited
# **column of tiles by column of tiles**. At each step the kernel reads $Q_i, O_i, \ell_i, m_i$ from HBM
# (plus $K_j, V_j$ at the first step of a column) and writes $O_i, \ell_i, m_i$ back. The numbers below are
# the model's, per step, for $N = 64$, $d = 16$, $B_r = 16$, $B_c = 32$:

# %%
N_s, d_s, Br_s, Bc_s = 64, 16, 16, 32
Tr_s, Tc_s = common.cdiv(N_s, Br_s), common.cdiv(N_s, Bc_s)
steps = []
for j in range(Tc_s):
    for i in range(Tr_s):
        rows = min(Br_s, N_s - i * Br_s)
        kv = 2 * min(Bc_s, N_s - j * Bc_s) * d_s if i == 0 else 0
        steps.append(dict(i=i, j=j, kv=kv, reads=2 * rows * d_s + 2 * rows, writes=rows * d_s + 2 * rows))
print(f"{'step':>4} {'(i,j)':>6} {'K_j,V_j in':>11} {'Q_i,O_i,l_i,m_i in':>19} {'O_i,l_i,m_i out':>16}")
for s, st in enumerate(steps):
    print(f"{s:>4} {str((st['i'], st['j'])):>6} {st['kv']:>11} {st['reads']:>19} {st['writes']:>16}")
total = sum(st["kv"] + st["reads"] + st["writes"] for st in steps)
main = fa1.model_forward(1, N_s, N_s, d_s, Br=Br_s, Bc=Bc_s)[1]
print("sum over steps:", total, " = model's main launch:", sum(main["reads"].values()) + sum(main["writes"].values()))

# %%
fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw=dict(width_ratios=[1, 1.6]))
for s, st in enumerate(steps):
    ax0.add_patch(plt.Rectangle((st["j"], st["i"]), 1, 1, facecolor=plt.cm.viridis(s / len(steps)),
                                edgecolor="white", lw=2))
    ax0.text(st["j"] + 0.5, st["i"] + 0.5, str(s), ha="center", va="center", color="white", fontsize=12)
ax0.set_xlim(0, Tc_s)
ax0.set_ylim(Tr_s, 0)
ax0.set_xticks(np.arange(Tc_s) + 0.5, [f"K,V block j={j}" for j in range(Tc_s)])
ax0.set_yticks(np.arange(Tr_s) + 0.5, [f"Q block i={i}" for i in range(Tr_s)])
ax0.set_title("visit order of the S tiles (never stored)")
x = np.arange(len(steps))
ax1.bar(x, [st["kv"] for st in steps], color="tab:green", label="K_j, V_j  HBM→SRAM")
ax1.bar(x, [st["reads"] for st in steps], bottom=[st["kv"] for st in steps], color="tab:blue",
        label="Q_i, O_i, l_i, m_i  HBM→SRAM")
ax1.bar(x, [-st["writes"] for st in steps], color="tab:red", label="O_i, l_i, m_i  SRAM→HBM")
ax1.axhline(0, color="k", lw=0.8)
ax1.set_xticks(x, [f"{s}\n({st['i']},{st['j']})" for s, st in enumerate(steps)])
ax1.set_xlabel("step (i, j)")
ax1.set_ylabel("elements moved (reads up, writes down)")
ax1.set_title(f"HBM traffic per step, N={N_s}, d={d_s}, Br={Br_s}, Bc={Bc_s}")
ax1.legend(fontsize=8, loc="upper right")
fig.tight_layout()
savefig(fig, "03_fa1_tile_schedule")
plt.show()

# %% [markdown]
# ## 5 · Counted global traffic against standard attention as N grows
#
# The traffic counter (`flashnb.instruments.traffic`) counts every element each launch reads and writes. Below both
# implementations run on the simulator at the $N$ printed ($d = 16$, budget $M = 1024$, so $B_r = B_c = 16$),
# and each count is checked against its analytic model; the longer sequences of the figure are the model's.
# Per head, the FA1 main kernel moves $2Nd + 3T_c Nd + 4T_c N$ elements (counted from Algorithm 1 as written: $K, V$ once; $Q_i, O_i, \ell_i, m_i$
# read and $O_i, \ell_i, m_i$ written at each of the $T_c$ outer steps), plus $Nd + 2N$
# for initialising $O, \ell, m$ and $3N$ for the final $L = m + \log \ell$. With $T_c = \lceil 4dN/M\rceil$ the
# leading term is $3 T_c N d \approx 12 N^2 d^2 / M$: $\Theta(N^2 d^2 / M)$.

# %%
def total(model):
    return sum(sum(x["reads"].values()) + sum(x["writes"].values()) for x in model)


d_c, M_c = 16, 1024
counted = {}
for N in (16, 32, 64, 128, 256):
    q, k, v = (common.to_device(rng.standard_normal((1, N, d_c))) for _ in range(3))
    with traffic.count() as t:
        fa1.forward(q, k, v, causal=False, scale=0.25, M=M_c)
    assert t.summary() == fa1.model_forward(1, N, N, d_c, M=M_c)
    with traffic.count() as t2:
        naive.forward(q, k, v, causal=False, scale=0.25)
    assert t2.summary() == naive.model_forward(1, N, N, d_c)
    counted[N] = (total(t.summary()), total(t2.summary()))
    print(f"N = {N:>3}: counted FA1 {counted[N][0]:>9,}  naive {counted[N][1]:>9,}   (both == model)")

# %%
Ns = 2 ** np.arange(4, 15)
fa1_model = [total(fa1.model_forward(1, int(N), int(N), d_c, M=M_c)) for N in Ns]
naive_model = [total(naive.model_forward(1, int(N), int(N), d_c)) for N in Ns]
theta = [12 * N**2 * d_c**2 / M_c for N in Ns]
fig, ax = plt.subplots(figsize=(6.5, 4.2))
ax.loglog(Ns, naive_model, "-", color="tab:gray", label="standard (flashnb naive), model")
ax.loglog(Ns, fa1_model, "-", color="tab:blue", label=f"FA1, model (M = {M_c})")
ax.loglog(Ns, theta, ":", color="tab:blue", label=r"$12 N^2 d^2 / M$")
ax.loglog(list(counted), [c[0] for c in counted.values()], "o", color="tab:blue", label="FA1, counted")
ax.loglog(list(counted), [c[1] for c in counted.values()], "s", color="tab:gray", label="naive, counted")
ax.set_xlabel("sequence length N")
ax.set_ylabel("global elements read + written (one head)")
ax.set_title(f"forward, d = {d_c}")
ax.legend(fontsize=8)
savefig(fig, "03_fa1_traffic_vs_N")
plt.show()
print(f"at N = {Ns[-1]}: naive / FA1 = {naive_model[-1] / fa1_model[-1]:.1f}x fewer elements for FA1")

# %% [markdown]
# Both grow as $N^2$ — FA1 is not linear in HBM traffic, only in memory (notebook 04) — but FA1's constant is
# $12 d^2/M$ instead of a handful of full $N\times N$ passes, and it shrinks as the SRAM grows. (The naive
# curve is flashnb's own count: its tiled matmuls re-read $Q$ and $K$ once per 16-wide output tile, which a
# library GEMM with bigger tiles would not. Algorithm 0 as written -- read $Q, K$, write $S$, read $S$, write $P$,
# read $P, V$, write $O$ -- moves $4N^2 + 4Nd$; §6 uses both as "standard attention".)

# %% [markdown]
# ## 6 · At d = 64, when does FA1 move fewer bytes than standard attention?
#
# At $d = 16$ above, FA1 wins. At $d = 64$ -- GPT-2's head dimension -- the answer depends on the tiles. Two
# settings of Algorithm 1 line 1 ($B_c = \lceil M/4d\rceil$, $B_r = \min(\lceil M/4d\rceil, d)$):
#
# * **the library's tiles**: $M$ = `fa1.DEFAULT_M` float32 elements. That is a third of the 48 KiB of static
#   shared memory a block may declare, because the kernel holds more than the formula's four tiles (§1's table);
# * **the paper's tiles**: $M$ = the A100's on-chip SRAM. The FA1 paper's background section (§2.1) gives
#   192 KB of SRAM per SM on the A100; the paper ran fp16 (2 bytes per element), so $M$ = 192 · 1024 / 2
#   elements. That is the whole SRAM of an SM (L1 and shared memory together), an upper bound on what one
#   kernel gets -- the formula's $M$ as the paper states it, not a tile any kernel here can hold
#   (`check_fit=False`).
#
# Standard attention, twice: Algorithm 0 as written ($4N^2 + 4Nd$, what the paper's "standard" can at best
# move), and flashnb's naive kernels (`naive.model_forward`, counted in §5). All counts are per head, forward
# only, and converted to bytes at 4 bytes per element (float32, what flashnb computes in). The dtype scales
# every curve alike, so the crossings do not depend on it.

# %%
d_x = 64
M_lib = fa1.DEFAULT_M                       # float32 elements the library feeds the formula
M_paper = 192 * 1024 // 2                   # A100: 192 KB SRAM per SM, in fp16 (2-byte) elements
tiles_x = {"library": fa1.tiles(d_x), "paper": fa1.tiles(d_x, M=M_paper, check_fit=False)}
for name, t in tiles_x.items():
    print(f"{name:>7} tiles: M = {t['M']:>6,} elements -> Br = {t['Br']:>3}, Bc = {t['Bc']:>3};"
          f" at N = 4096, Tc = {common.cdiv(4096, t['Bc'])}")
print(f"library M in float32 bytes: {M_lib * 4 // 1024} KiB of the {fa1.SHARED_LIMIT_BYTES // 1024} KiB static limit")

Nx = np.arange(1, 2 ** 16 + 1)              # every N up to 64K: the model is a formula, so it is cheap
Nx_plot = 2 ** np.arange(3, 17)
std_alg0 = 4 * Nx**2 + 4 * Nx * d_x


def fa1_bytes(N, t):
    return 4 * total(fa1.model_forward(1, int(N), int(N), d_x, Br=t["Br"], Bc=t["Bc"], check_fit=False))


fa1_x = {name: np.array([fa1_bytes(N, t) for N in Nx]) for name, t in tiles_x.items()}
naive_x = np.array([4 * total(naive.model_forward(1, int(N), int(N), d_x)) for N in Nx])
alg0_x = 4 * std_alg0


def crossing(fa, std):
    """Smallest N from which FA1 moves fewer bytes than `std` for every larger N scanned (None: never)."""
    above = np.flatnonzero(fa >= std)
    if len(above) == 0:
        return int(Nx[0])
    return None if above[-1] == len(Nx) - 1 else int(Nx[above[-1] + 1])


cross = {}
for name in tiles_x:
    cross[name, "Alg. 0"] = crossing(fa1_x[name], alg0_x)
    cross[name, "naive"] = crossing(fa1_x[name], naive_x)
    ratio = fa1_x[name][-1] / alg0_x[-1]
    print(f"FA1 with the {name:>7} tiles: below Algorithm 0 from N = {cross[name, 'Alg. 0'] or f'- (never, N <= {Nx[-1]})'};"
          f" below flashnb's naive from N = {cross[name, 'naive']};"
          f" at N = {Nx[-1]}: FA1 / Alg. 0 = {ratio:.3f}")

# %% [markdown]
# **Why.** Count the leading terms. FA1's main loop moves $(3d + 4)\,T_c N \approx (3d+4)\,N^2/B_c$ elements: $Q_i$ and
# $O_i$ are read and $O_i$ written ($3d$ per row), and $\ell_i, m_i$ read and written (4 per row), once for every
# key block, $T_c = \lceil N/B_c\rceil$ times. Algorithm 0 moves $4N^2$. So FA1 wins for long sequences only when
# $(3d+4)/B_c < 4$, i.e. $B_c > (3d+4)/4$, and since $B_c \approx M/4d$ that is $M \gtrsim 3d^2$: the
# $\Theta(N^2 d^2/M)$ of Theorem 2 with its constant written out. A small SRAM means a small $B_c$, a large $T_c$,
# and $Q, O, \ell, m$ crossing HBM $T_c$ times. The asymptotic ratios and the block size where FA1 starts to win:

# %%
lead = {name: (3 * d_x + 4) / (4 * t["Bc"]) for name, t in tiles_x.items()}
for name, t in tiles_x.items():
    print(f"{name:>7} tiles: (3d + 4) / (4 Bc) = {3 * d_x + 4} / {4 * t['Bc']} = {lead[name]:.3f}")
# the smallest Bc (any integer: warps=1 lifts split-K's multiple-of-W rule) with FA1 below Alg. 0 at N = 64K
N_big = int(Nx[-1])
Bc_star = next(Bc for Bc in range(1, 257)
               if 4 * total(fa1.model_forward(1, N_big, N_big, d_x, Br=min(Bc, d_x), Bc=Bc, warps=1,
                                              check_fit=False)) < 4 * (4 * N_big**2 + 4 * N_big * d_x))
M_star = 4 * d_x * (Bc_star - 1) + 1       # the smallest M with ⌈M/4d⌉ = Bc_star
print(f"FA1 beats Algorithm 0 at N = {N_big} from Bc = {Bc_star}  (paper's formula: M >= {M_star:,} elements"
      f" = {M_star * 4 / 1024:.1f} KiB in float32, {M_star * 2 / 1024:.1f} KiB in fp16)")
t_star = fa1.tiles(d_x, M=M_star, check_fit=False)
print(f"this kernel with M = {M_star:,}: Br = {t_star['Br']}, Bc = {t_star['Bc']}, shared memory "
      f"{t_star['shared_bytes_forward'] / 1024:.0f} KiB forward, {t_star['shared_bytes_backward'] / 1024:.0f} KiB"
      f" backward (static limit {fa1.SHARED_LIMIT_BYTES // 1024} KiB)")

assert cross["library", "Alg. 0"] is None                          # never, up to 64K
assert cross["paper", "Alg. 0"] is not None and cross["paper", "Alg. 0"] <= 2 * d_x
assert cross["library", "naive"] is not None and cross["paper", "naive"] is not None
for name in tiles_x:                                                # the ratio tends to the leading-term ratio
    assert abs(fa1_x[name][-1] / alg0_x[-1] - lead[name]) < 0.01 * lead[name]
assert tiles_x["library"]["Bc"] < Bc_star <= tiles_x["paper"]["Bc"] and M_lib < M_star <= M_paper
assert t_star["shared_bytes_forward"] > fa1.SHARED_LIMIT_BYTES

# %%
fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 4.3))
idx = Nx_plot - 1
ax0.loglog(Nx_plot, alg0_x[idx], "-", color="k", label="standard, Algorithm 0 ($4N^2 + 4Nd$)")
ax0.loglog(Nx_plot, naive_x[idx], "--", color="tab:gray", label="standard, flashnb naive kernels")
style = {"library": ("tab:red", "o-"), "paper": ("tab:blue", "s-")}
for name, t in tiles_x.items():
    color, marker = style[name]
    lab = f"FA1, {name} tiles (M = {t['M']:,}: Br = {t['Br']}, Bc = {t['Bc']})"
    ax0.loglog(Nx_plot, fa1_x[name][idx], marker, color=color, ms=4, label=lab)
    ax1.semilogx(Nx_plot, fa1_x[name][idx] / alg0_x[idx], marker, color=color, ms=4, label=lab)
    if cross[name, "Alg. 0"]:
        ax1.axvline(cross[name, "Alg. 0"], color=color, ls=":", lw=1)
        ax1.annotate(f"crosses at N = {cross[name, 'Alg. 0']}", (cross[name, "Alg. 0"], 1.0), color=color,
                     xytext=(6, 12), textcoords="offset points", fontsize=8)
    ax1.axhline(lead[name], color=color, lw=0.8, ls="--")
ax1.axhline(1, color="k", lw=1)
ax0.set_xlabel("sequence length N")
ax0.set_ylabel("forward HBM bytes, one head (float32)")
ax0.set_title(f"forward traffic at d = {d_x}")
ax0.legend(fontsize=7)
ax1.set_xlabel("sequence length N")
ax1.set_ylabel("FA1 bytes / Algorithm 0 bytes")
ax1.set_title("below 1: FA1 moves less (dashed: (3d+4)/(4Bc))")
ax1.legend(fontsize=7)
fig.tight_layout()
savefig(fig, "03_fa1_vs_standard_d64")
plt.show()

# %% [markdown]
# With the paper's tiles FA1 drops below Algorithm 0 at a short $N$ (printed above) and stays there, heading to the
# leading-term ratio. With the library's small float32 tiles it never does: it moves about three times
# Algorithm 0's bytes for every long $N$, and only beats flashnb's naive kernels, whose 16-wide matmul tiles
# re-read $Q$ and $K$ (§5). The $M$ from which the paper's formula wins is printed above; the library's
# budget is below it, and its kernels could not hold tiles that large inside 48 KiB anyway (printed: the
# split-K partials and the backward's tiles need more than the formula's four tiles, §1). So at $d = 64$ this
# kernel demonstrates the *algorithm* and its exact traffic, not the saving: the saving needs the SRAM.

# %% [markdown]
# ## 7 · The paper's Figure 2 (middle): traffic and runtime against block size
#
# FA1's Figure 2 (middle) shows, for GPT-2 medium ($N = 1024$, $d = 64$, 16 heads, batch 64) on an A100, the
# *forward* runtime and HBM accesses of FlashAttention for $B_c \in \{64, 128, 256, 512\}$: HBM accesses fall as
# the block grows, and runtime falls with them until about 256, then stays flat. (Figure 2's left panel, §8, is
# forward + backward.)
#
# **Counted, and modelled.** Traffic is per head and the same for every head, so one head is counted and the
# figure's batch multiplies it. At this shape the simulator can count flashnb's standard attention (the naive
# kernels, forward + backward: §8 uses both, the sweep below the forward) and FA1 with the library's tiles, at the $N$ printed below: FA1 runs one thread
# block per head that walks all $T_r T_c$ tiles one after another, so its simulated time grows as the number of
# tiles (the cell prints how many times more tiles $N = 1024$ has). The sweep's larger blocks cannot be
# launched at all: their tiles need more shared memory than the 48 KiB a block of this kernel may declare
# (printed), so the launchers refuse them. Everything at those tiles, and FA1 at $N = 1024$, is the model's,
# the model the counts below check exactly:

# %%
from flashnb.sim import vector  # noqa: E402


def count_fwd_bwd(mod, N_, d_, **opts):
    """Count one head's forward + backward of `mod` on the simulator; assert each equals its model."""
    q_, k_, v_, do_ = (common.to_device(rng.standard_normal((1, N_, d_))) for _ in range(4))
    with traffic.count() as tf:
        o_, L_ = mod.forward(q_, k_, v_, causal=False, scale=1 / np.sqrt(d_), **opts)
    with traffic.count() as tb:
        mod.backward(q_, k_, v_, o_, L_, do_, causal=False, scale=1 / np.sqrt(d_), **opts)
    assert tf.summary() == mod.model_forward(1, N_, N_, d_, **opts)
    assert tb.summary() == mod.model_backward(1, N_, N_, d_, **opts)
    return total(tf.summary()) + total(tb.summary())


B, H, N, d = 64, 16, 1024, 64
N_fa1 = 256                                   # FA1's counted N at d = 64 (one block per head: tiles in series)
lib = fa1.tiles(d)
sweep = {16: "library", 64: "paper", 128: "paper", 256: "paper", 384: "formula, A100 SRAM", 512: "paper"}
assert sweep[lib["Bc"]] == "library" and lib["Br"] == min(lib["Bc"], d)   # the sweep's first row is what FA1 counted
t_count = time.perf_counter()
counted_naive = count_fwd_bwd(naive, N, d)    # per head, at the paper's N
counted_fa1 = count_fwd_bwd(fa1, N_fa1, d)    # per head, library tiles
t_count = time.perf_counter() - t_count
assert not vector.notes(), vector.notes()     # every launch ran on the vectorised simulator
assert B * H * counted_naive == total(naive.model_forward(B * H, N, N, d)) + total(naive.model_backward(B * H, N, N, d))
tile_ratio = (common.cdiv(N, lib["Br"]) * common.cdiv(N, lib["Bc"])) / (common.cdiv(N_fa1, lib["Br"]) * common.cdiv(N_fa1, lib["Bc"]))
print(f"counted, one head, forward + backward (each launch == model), {t_count:.1f} s on the simulator:")
print(f"  naive kernels,  N = {N}, d = {d}: {counted_naive:>12,} elements; x B·H = {B * H}: {B * H * counted_naive:,}")
print(f"  FA1, Br = {lib['Br']}, Bc = {lib['Bc']}, N = {N_fa1}, d = {d}: {counted_fa1:>12,} elements"
      f"   (N = {N} has {tile_ratio:.0f}x as many tiles: modelled)")
for Bc in (b for b in sweep if b != lib["Bc"]):
    need = fa1.tiles(d, Bc=Bc, Br=min(Bc, d), check_fit=False)
    print(f"  Bc = {Bc:>3}: needs {need['shared_bytes_forward'] // 1024:>3} KiB forward, "
          f"{need['shared_bytes_backward'] // 1024:>3} KiB backward of shared memory "
          f"(limit {common.SHARED_LIMIT_BYTES // 1024} KiB): modelled")

# %% [markdown]
# The forward's runtime is **modelled** with the roofline of `flashnb.instruments.roofline` on the A100 40GB preset — both
# with the FP32 CUDA-core roof (what flashnb's kernels use) and the FP16 tensor-core roof (what the paper's kernel
# used):

# %%
gpu = roofline.get_gpu("A100 40GB SXM")
flops = roofline.flops_forward(B, H, N, N, d)
std_fb = B * H * (4 * N * N + 4 * N * d)                               # Alg. 0 as written, elements
rows = []
for Bc, who in sweep.items():
    el = total(fa1.model_forward(B * H, N, N, d, Bc=Bc, Br=min(Bc, d), check_fit=False))
    nbytes = 2 * el                                                   # fp16, as the paper ran it
    t32 = roofline.modelled_time(flops, nbytes, gpu)
    t_tc = max(flops / gpu.tensor_fp16_dense, nbytes / gpu.hbm_bandwidth)
    rows.append(dict(Bc=Bc, who=who, nbytes=nbytes, rel=el / std_fb, t32=t32.seconds, t_tc=t_tc,
                     mem=nbytes / gpu.hbm_bandwidth))
    print(f"Bc = {Bc:>3} ({who:<18}): {nbytes / 1e9:5.2f} GB fp16 = {el / std_fb:5.2f} x standard (Alg. 0)"
          f"   memory time {nbytes / gpu.hbm_bandwidth * 1e3:5.2f} ms")
floor32, floor_tc = flops / gpu.fp32_peak, flops / gpu.tensor_fp16_dense
print(f"compute floors: FP32 CUDA cores {floor32 * 1e3:.2f} ms, FP16 tensor cores {floor_tc * 1e3:.2f} ms")
assert rows[0]["rel"] > 1 > rows[1]["rel"]                # the library's Bc moves more than standard, 64 less
assert rows[0]["t32"] > floor32                           # FP32 roof: the library's Bc is memory-bound,
assert all(r["t32"] == floor32 for r in rows[1:])         # the paper's block sizes compute-bound -> flat

fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
x = np.arange(len(rows))
colors = ["tab:red" if r["who"] == "library" else "tab:blue" if r["who"] == "paper" else "tab:purple" for r in rows]
ax.bar(x, [r["rel"] for r in rows], width=0.55, color=colors)
ax.axhline(1, color="k", lw=1)
ax.text(len(rows) - 0.5, 1.05, "standard attention's forward (Alg. 0 count) = 1", ha="right", fontsize=8)
ax.set_xticks(x, [f"{r['Bc']}\n{r['who']}" for r in rows], fontsize=8)
ax.set_xlabel("block size Bc (Br = min(Bc, d))")
ax.set_ylabel("FA1 forward HBM traffic / standard's")
ax.set_title("traffic relative to standard attention")
ax2.plot(x, [r["t32"] * 1e3 for r in rows], "o-", color="tab:red", label="modelled time, FP32 roof")
ax2.plot(x, [r["t_tc"] * 1e3 for r in rows], "s-", color="tab:orange", label="modelled time, tensor roof")
ax2.plot(x, [r["mem"] * 1e3 for r in rows], ":", color="tab:gray", label="memory time (bytes / HBM bandwidth)")
ax2.axhline(floor32 * 1e3, color="tab:red", lw=0.8, ls="--", label="FP32 compute floor")
ax2.axhline(floor_tc * 1e3, color="tab:orange", lw=0.8, ls="--", label="tensor-core compute floor")
ax2.set_yscale("log")
ax2.set_xticks(x, [str(r["Bc"]) for r in rows])
ax2.set_xlabel("block size Bc")
ax2.set_ylabel("modelled ms (not measured)")
ax2.set_title("modelled time = max(compute floor, memory time)")
ax2.legend(fontsize=7)
fig.suptitle("GPT-2 medium forward on A100 40GB (model), as Figure 2 (middle)")
fig.tight_layout()
savefig(fig, "03_fa1_block_size_sweep")
plt.show()

# %% [markdown]
# Left: the forward's traffic relative to standard attention's forward. It roughly halves with every doubling of
# $B_c$ (its leading term is $\propto T_c$); the library's $B_c$ (red) is above 1 -- FA1 moves *more* than
# standard attention there, as §6 found -- and the paper's block sizes are all below it. Right: a roofline time
# is the larger of the compute floor and the memory time. On the FP32 roof (flashnb's kernels, no tensor cores)
# the library's $B_c$ is memory-bound, and every block size of the paper's sweep is **compute-bound**: "flat"
# there means the memory time is under the FP32 compute floor, so the model cannot see the block size at all --
# it does not mean the block size stopped mattering for traffic.
# On the tensor-core roof the time follows the memory time down until it meets that much lower floor, between
# the printed $B_c$ = 384 and 512 -- the shape, though not the exact knee, of the paper's measurement, where
# runtime stops improving beyond 256. This is a model; a measurement needs a GPU (`flashnb bench`).

# %% [markdown]
# ## 8 · GPT-2 medium: the validated model beside the paper's 40.3 GB → 4.4 GB
#
# The paper reports, for the same GPT-2 medium forward + backward on an A100: standard attention 40.3 GB of
# HBM reads + writes, FlashAttention 4.4 GB (arXiv v2; the GFLOP counts in that figure use an unstated
# convention, so they are not compared here). Standard attention's flashnb kernels are counted at this shape (one
# head, §7, times B·H); the rest are the models (FA1's checked against §7's count at a shorter $N$), in fp16 and fp32
# bytes:

# %%
BH = B * H
std_alg = BH * ((4 * N * N + 4 * N * d) + (7 * N * N + 8 * N * d))     # Alg. 0 + Alg. 3 as written
naive_el = BH * counted_naive                                          # counted per head in §7 (== model)
ours = fa1.tiles(d)
fa1_el = total(fa1.model_forward(BH, N, N, d)) + total(fa1.model_backward(BH, N, N, d))
M_a100 = 192 * 1024 // 2                                               # A100 SRAM per SM in fp16 elements
big = fa1.tiles(d, M=M_a100, check_fit=False)
fa1_big = (total(fa1.model_forward(BH, N, N, d, M=M_a100, check_fit=False))
           + total(fa1.model_backward(BH, N, N, d, M=M_a100, check_fit=False)))
table = [("standard, Alg. 0 + Alg. 3 count", std_alg, "40.3"),
         ("standard, flashnb naive kernels (counted, one head x B·H)", naive_el, ""),
         (f"FA1, this kernel's tiles Br={ours['Br']}, Bc={ours['Bc']} (M={ours['M']}), model", fa1_el, "4.4"),
         (f"FA1, M = A100 SRAM = {M_a100} fp16 elements: Br={big['Br']}, Bc={big['Bc']}, model", fa1_big, "4.4")]
print(f"{'':<69} {'fp16 GB':>8} {'fp32 GB':>8} {'paper GB':>9}")
for name, el, paper in table:
    print(f"{name:<69} {2 * el / 1e9:>8.1f} {4 * el / 1e9:>8.1f} {paper:>9}")
Tc_ours = common.cdiv(N, ours["Bc"])
print(f"FA1 with the A100-SRAM tiles / paper's 4.4 GB = {2 * fa1_big / 1e9 / 4.4:.3f};"
      f" this kernel's tiles: Tc = {N} / {ours['Bc']} = {Tc_ours}, FA1 / standard = {fa1_el / std_alg:.2f}")
print(f"leading terms, fwd + bwd: FA1 8·Tc·N·d < standard 11·N² <=> Bc > 8d/11 = {8 * d / 11:.1f} (= {8 / 11:.2f}·d)")
assert fa1_el > std_alg > fa1_big and abs(2 * fa1_big / 1e9 / 4.4 - 1) < 0.05

# %% [markdown]
# Read the table with its assumptions in mind:
#
# * The standard count as written in Algorithms 0 and 3 is of the paper's order in fp16 but not equal: the
#   paper *measured* PyTorch's kernels, which may make more passes over $N\times N$ arrays than the algorithms as
#   written (dropout, for one); the count is a floor for them. flashnb's own naive kernels move far more, because
#   their 16-wide tiled matmuls re-read their inputs once per output tile.
# * With the tiles the paper's formula gives for a full A100 SRAM (§6), FA1's model comes within a few per cent
#   of the paper's 4.4 GB (ratio printed above). The paper's kernel used its own tiles, so this agreement is
#   partly luck: §7 shows how fast the count moves with $B_c$.
# * With **this** kernel's tiles ($T_c$ printed above), $Q$, $O$, $dO$ and $dQ$ cross HBM $T_c$ times: the model says
#   FA1 would move *more* than standard attention, the fwd + bwd version of §6's finding. FA1 beats standard
#   attention only when $8 T_c N d$ (its leading term, forward + backward) is below $11N^2$, i.e. $B_c > 8d/11$
#   (printed) -- the $\Theta(N^2d^2/M)$ bound in action: IO-awareness needs a large enough SRAM.

# %% [markdown]
# ## 9 · Speed: modelled here, measured only on a GPU
#
# On the simulator the kernels' Python runs on a CPU, so wall time says nothing about a GPU. The
# numbers above are modelled. On a machine with a GPU, `flashnb bench` times every implementation with
# CUDA events; this cell does a tiny version of that when a GPU is present (in a separate process):

# %%
from flashnb.instruments import bench  # noqa: E402

gpu_rows = bench.on_gpu("flashnb.instruments.bench:measure_impls", impls=["naive", "fa1"], BH=8, N=1024, d=64)
print(bench.table(gpu_rows, ["impl", "direction", "median_ms", "q1_ms", "q3_ms", "tflops", "pct_fp32_peak", "gpu_name"]))

# %%
print(f"notebook ran in {time.perf_counter() - T0:.1f} s")

# %% [markdown]
# ## Exercises
#
# Each exercise has a check: fill in the `...` and run its cell (`...` means "not attempted yet"). Stuck?
# `exercises.hint("03.1")` gives a hint and `exercises.answer("03.1")` the worked answer -- try first.
# Levels: ★ a few lines, ★★ a small kernel or experiment, ★★★ a real change to a kernel.
# To change a library kernel, edit a copy. The lines worth changing are marked in the kernels as named regions
# (`# region loop-nest` ... `# endregion loop-nest`; `show_source(factory, region=name)` prints one):
# `registry.variant(factory, regions={name: new_lines})` replaces a region's lines, `registry.variant(factory,
# region=name, replace=(old_text, new_text))` one piece of text inside it. Run the copy through the library with
# `with registry.using(factory, variant):`.

# %%
from flashnb import exercises, registry  # noqa: E402,F401

# %% [markdown]
# **03.1 · Swap the loops** (★★★, ~40 min) Make a variant of `fa1.make_forward` with $i$ as the outer loop and
# $j$ the inner one, keeping $O_i, \ell_i, m_i$ on chip for the whole inner loop (and writing them once). Derive
# its traffic: write `model(N, d, Br)`, the global accesses of its main launch for one head ($N_q = N_k = N$;
# it still writes $\ell$ and $m$ for the `L = m + log l` kernel) -- compare with FA2's $2Nd + 2T_rNd + N$. The
# check runs your variant through `flashnb.attention_forward(..., impl="fa1", Br=16, Bc=16, warps=2)` against
# the reference, counts it, and race-checks it.

# %%
i_outer = ...     # registry.variant(fa1.make_forward, regions={"loop-nest": ..., "write-back": ...})
model = ...       # def model(N, d, Br): ...
passed = exercises.check("03.1", variant=i_outer, model=model)

# %% [markdown]
# **03.2 · Causal skipping** (★, ~15 min) With `causal=True` this kernel still visits every tile and masks.
# How many $(i, j)$ tiles lie entirely above the (bottom-right aligned) diagonal for $N_q = N_k = 1024$,
# $B_r = B_c = 64$? And for $N_q = 512$, $N_k = 1024$? How many global element accesses of the main launch
# would skipping them save (one head, $N_q = N_k = 1024$, $d = 64$)?

# %%
tiles_above = ...
tiles_above_short = ...
saved_elements = ...
passed = exercises.check("03.2", tiles_above=tiles_above, tiles_above_short=tiles_above_short, saved_elements=saved_elements)

# %% [markdown]
# **03.3 · The constant in front of $N^2d^2/M$** (★★, ~15 min) Using `fa1.model_forward`, fit the constant $c$ in
# $\text{traffic} \approx c\, N^2 d^2 / M$ for large $N$ ($N = 65536$, $d = 32$, $M = 4096$) and compare it with the
# $12$ derived in §5. Do the same for `fa1.model_backward`. Where do the differences come from?

# %%
c_forward = ...
c_backward = ...
passed = exercises.check("03.3", c_forward=c_forward, c_backward=c_backward)

# %% [markdown]
# **03.4 · Split-K's bill** (★★, ~20 min) From `model_forward` (or by counting a small run: the counter reports
# shared reads per shared array), compute the share of the forward's shared-memory reads that read the split-K
# partials `m_w`, `l_w`, `O_w`, for $W = 1, 2, 4, 8$ at $N = 1024$, $d = 64$, $B_r = 16$, $B_c = 128$. Why does
# FA2's split-Q layout not pay it?

# %%
fractions = ...   # {1: ..., 2: ..., 4: ..., 8: ...}
passed = exercises.check("03.4", fractions=fractions)

# %% [markdown]
# **03.5 · Dynamic shared memory** (★★, ~15 min) If the kernel could use 160 KiB of shared memory (an A100 with
# dynamic shared memory) as its budget $M$, which $B_c$ would the formula give at $d = 64$, and by what factor would
# GPT-2 medium's forward + backward traffic change (§8's setting, the models with `check_fit=False`)?

# %%
Bc = ...
traffic_ratio = ...
passed = exercises.check("03.5", Bc=Bc, traffic_ratio=traffic_ratio)
