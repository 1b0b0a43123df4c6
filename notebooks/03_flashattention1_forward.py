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
# (`flashnb/fa1.py`, `impl="fa1"`), on the Numba CUDA simulator.

# %%
import inspect
import os
import re
import time

import matplotlib.pyplot as plt
import numpy as np

os.environ["FLASHNB_DEVICE"] = "sim"  # counting traffic needs the simulator; GPU timings run in a process of their own
import flashnb
from flashnb import common, fa1, naive, reference, roofline, traffic
from flashnb.notebook import savefig, show_source

T0 = time.perf_counter()
rng = np.random.default_rng(3)
print("kernels run on the Numba CUDA simulator; GPU timings:",
      "on this machine's GPU, in a separate process" if flashnb.bench.gpu_available() else "none (no GPU here)")

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
# (H100) of *dynamic* shared memory per block, which would allow tiles 3-4× larger.

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
# NumPy transcription, loops and all, run against the reference:

# %%
def algorithm1(Q, K, V, Br, Bc, causal=False):
    """FA1 Algorithm 1 (+ Alg. 2's scale and mask) in float64 NumPy; returns O, l, m."""
    N, d = Q.shape
    Nk = K.shape[0]
    tau = 1 / np.sqrt(d)
    O, l, m = np.zeros((N, d)), np.zeros(N), np.full(N, -np.inf)          # line 2 (in "HBM")
    for j in range(0, Nk, Bc):                                            # line 5
        Kj, Vj = K[j:j + Bc], V[j:j + Bc]                                 # line 6
        for i in range(0, N, Br):                                         # line 7
            Qi, Oi, li, mi = Q[i:i + Br], O[i:i + Br], l[i:i + Br], m[i:i + Br]   # line 8
            S = tau * Qi @ Kj.T                                           # line 9
            if causal:
                rows, cols = np.arange(i, i + len(Qi))[:, None], np.arange(j, j + len(Kj))[None, :]
                S = np.where(cols <= rows + Nk - N, S, -np.inf)
            mt = S.max(axis=1)                                            # line 10
            Pt = np.exp(S - np.where(np.isfinite(mt), mt, 0)[:, None])
            lt = Pt.sum(axis=1)
            mn = np.maximum(mi, mt)                                       # line 11
            safe = np.where(np.isfinite(mn), mn, 0)
            ln = np.exp(mi - safe) * li + np.exp(mt - safe) * lt
            inv = np.where(ln > 0, 1 / np.where(ln > 0, ln, 1), 0)
            O[i:i + Br] = inv[:, None] * ((li * np.exp(mi - safe))[:, None] * Oi
                                          + np.exp(mt - safe)[:, None] * (Pt @ Vj))   # line 12
            l[i:i + Br], m[i:i + Br] = ln, mn                             # line 13
    return O, l, m


q, k, v = rng.standard_normal((3, 40, 16))
O_np, l_np, m_np = algorithm1(q, k, v, Br=16, Bc=16, causal=True)
o_ref, lse_ref = reference.attention_forward(q, k, v, causal=True)
print("NumPy Algorithm 1 vs reference: max |ΔO| =", np.abs(O_np - o_ref).max(),
      " max |Δ(m + log l) - lse| =", np.abs(m_np + np.log(l_np) - lse_ref).max())

# %% [markdown]
# The kernel does the same, with one thread block per (batch, head). Every line of the paper's algorithm is
# tagged `# line N` in the source, shown here straight from the package:

# %%
show_source(fa1.make_forward)

# %% [markdown]
# The map from the paper's lines to the kernel's source lines, extracted from those tags:

# %%
src, first = inspect.getsourcelines(fa1.make_forward.__wrapped__)
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
print("kernel vs reference:  max |ΔO| =", np.abs(O_k.copy_to_host()[0] - o_ref).max())
print("kernel vs NumPy Alg1: max |Δl| =", np.abs(l_k.copy_to_host()[0] - l_np).max(),
      " max |Δm| =", np.abs(m_k.copy_to_host()[0] - m_np).max())
o_api, lse_api = flashnb.attention_forward(q, k, v, causal=True, impl="fa1", Br=16, Bc=16)
print("public API (o, lse = m + log l): max |Δlse| =", np.abs(lse_api - lse_ref).max())

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
# for FA1's speed. The model counts it exactly (`shared_reads` / `shared_writes`); splitting over more warps
# costs more:

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
# The traffic counter (`flashnb.traffic`) counts every element each launch reads and writes. Below both
# implementations run on the simulator for small $N$ ($d = 16$, budget $M = 1024$, so $B_r = B_c = 16$),
# and each count is checked against its analytic model, which then extends the curves to long sequences.
# Per head, the FA1 main kernel moves $2Nd + 3T_c Nd + 4T_c N$ elements (the paper's count), plus $Nd + 2N$
# for initialising $O, \ell, m$ and $3N$ for the final $L = m + \log \ell$. With $T_c = \lceil 4dN/M\rceil$ the
# leading term is $3 T_c N d \approx 12 N^2 d^2 / M$: $\Theta(N^2 d^2 / M)$.

# %%
def total(model):
    return sum(sum(x["reads"].values()) + sum(x["writes"].values()) for x in model)


d_c, M_c = 16, 1024
counted = {}
for N in (16, 32, 64):
    q, k, v = (common.to_device(rng.standard_normal((1, N, d_c))) for _ in range(3))
    with traffic.count() as t:
        fa1.forward(q, k, v, causal=False, scale=0.25, M=M_c)
    assert t.summary() == fa1.model_forward(1, N, N, d_c, M=M_c)
    with traffic.count() as t2:
        naive.forward(q, k, v, causal=False, scale=0.25)
    assert t2.summary() == naive.model_forward(1, N, N, d_c)
    counted[N] = (total(t.summary()), total(t2.summary()))
    print(f"N = {N:>3}: counted FA1 {counted[N][0]:>7,}  naive {counted[N][1]:>7,}   (both == model)")

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
# library GEMM with bigger tiles would not; the paper's "standard" count is $4N^2 + 4Nd$ forward.)

# %% [markdown]
# ## 6 · The paper's Figure 2 (middle): traffic and runtime against block size
#
# FA1's Figure 2 (middle) runs the forward + backward of GPT-2 medium ($N = 1024$, $d = 64$, 16 heads,
# batch 64) on an A100 for $B_c \in \{64, 128, 256, 512\}$: HBM accesses fall as the block grows, and runtime
# falls with them until about 256, then stays flat. The model validated above predicts the traffic for
# *any* block size (tiles this large do not fit this kernel's 48 KiB, so `check_fit=False`). Runtime is
# **modelled** with the roofline of `flashnb.roofline` on the A100 40GB preset — both with the FP32 CUDA-core
# roof (what flashnb's kernels use) and the FP16 tensor-core roof (what the paper's kernel used):

# %%
B, H, N, d = 64, 16, 1024, 64
gpu = roofline.get_gpu("A100 40GB SXM")
flops = roofline.flops_forward(B, H, N, N, d) + roofline.flops_backward(B, H, N, N, d)
rows = []
for Bc in (64, 128, 256, 512):
    el = (total(fa1.model_forward(B * H, N, N, d, Bc=Bc, Br=min(Bc, d), check_fit=False))
          + total(fa1.model_backward(B * H, N, N, d, Bc=Bc, Br=min(Bc, d), check_fit=False)))
    nbytes = 2 * el                                                   # fp16, as the paper ran it
    t32 = roofline.modelled_time(flops, nbytes, gpu)
    t_tc = max(flops / gpu.tensor_fp16_dense, nbytes / gpu.hbm_bandwidth)
    rows.append((Bc, nbytes, t32.seconds, t_tc))
    print(f"Bc = {Bc:>3}: {nbytes / 1e9:5.2f} GB fp16   modelled {t32.seconds * 1e3:5.2f} ms (FP32 roof, "
          f"{t32.bound}-bound)   {t_tc * 1e3:5.2f} ms (tensor roof)")

fig, ax = plt.subplots(figsize=(6.5, 4.2))
xs = [r[0] for r in rows]
ax.bar(np.arange(4), [r[1] / 1e9 for r in rows], width=0.5, color="tab:blue", label="HBM traffic (GB, model)")
ax.set_xticks(np.arange(4), [str(x) for x in xs])
ax.set_xlabel("block size Bc")
ax.set_ylabel("GB read + written (fp16)")
ax2 = ax.twinx()
ax2.plot(np.arange(4), [r[2] * 1e3 for r in rows], "o-", color="tab:red", label="modelled time, FP32 roof")
ax2.plot(np.arange(4), [r[3] * 1e3 for r in rows], "s--", color="tab:orange", label="modelled time, tensor roof")
ax2.set_ylabel("modelled ms (not measured)")
ax2.set_ylim(0, None)
fig.legend(fontsize=8, loc="upper center", ncol=3, bbox_to_anchor=(0.5, 0.0))
ax.set_title("GPT-2 medium fwd+bwd on A100 40GB: traffic and modelled runtime")
savefig(fig, "03_fa1_block_size_sweep")
plt.show()

# %% [markdown]
# Traffic roughly halves with every doubling of $B_c$ (its leading term is $\propto T_c$). The modelled runtime
# follows it only while the kernel is memory-bound. On the FP32 roof (flashnb's kernels, no tensor cores)
# the kernel is compute-bound at every block size and the curve is flat. On the tensor-core roof the time
# falls with the traffic and flattens once it meets the compute floor — the shape of the paper's measurement,
# where runtime stops improving beyond 256 because other factors (arithmetic) take over.
# This is a model; a measurement needs a GPU (`flashnb bench`).

# %% [markdown]
# ## 7 · GPT-2 medium: the validated model beside the paper's 40.3 GB → 4.4 GB
#
# The paper reports, for the same GPT-2 medium forward + backward on an A100: standard attention 40.3 GB of
# HBM reads + writes, FlashAttention 4.4 GB (arXiv v2; the GFLOP counts in that figure use an unstated
# convention, so they are not compared here). The models give, in fp16 and fp32 bytes:

# %%
BH = B * H
std_alg = BH * ((4 * N * N + 4 * N * d) + (7 * N * N + 8 * N * d))     # Alg. 0 + Alg. 3 as written
naive_el = total(naive.model_forward(BH, N, N, d)) + total(naive.model_backward(BH, N, N, d))
ours = fa1.tiles(d)
fa1_el = total(fa1.model_forward(BH, N, N, d)) + total(fa1.model_backward(BH, N, N, d))
M_a100 = 192 * 1024 // 2                                               # A100 SRAM per SM in fp16 elements
big = fa1.tiles(d, M=M_a100, check_fit=False)
fa1_big = (total(fa1.model_forward(BH, N, N, d, M=M_a100, check_fit=False))
           + total(fa1.model_backward(BH, N, N, d, M=M_a100, check_fit=False)))
table = [("standard, Alg. 0 + Alg. 3 count", std_alg, "40.3"),
         ("standard, flashnb naive kernels (counted model)", naive_el, ""),
         (f"FA1, this kernel's tiles Br={ours['Br']}, Bc={ours['Bc']} (M={ours['M']})", fa1_el, "4.4"),
         (f"FA1, M = A100 SRAM = {M_a100} fp16 elements: Br={big['Br']}, Bc={big['Bc']}", fa1_big, "4.4")]
print(f"{'':<62} {'fp16 GB':>8} {'fp32 GB':>8} {'paper GB':>9}")
for name, el, paper in table:
    print(f"{name:<62} {2 * el / 1e9:>8.1f} {4 * el / 1e9:>8.1f} {paper:>9}")

# %% [markdown]
# Read the table with its assumptions in mind:
#
# * The standard count as written in Algorithms 0 and 3 is of the paper's order in fp16 but not equal: the
#   paper *measured* PyTorch's kernels, which do more passes than the algorithm as written (dropout masks,
#   separate softmax passes); the count is a floor for them. flashnb's own naive kernels move far more, because
#   their 16-wide tiled matmuls re-read their inputs once per output tile.
# * With the tile the paper's formula gives for a full A100 SRAM, FA1's model lands on the paper's 4.4 GB.
# * With **this** kernel's tiles ($M$ = 16 KiB of fp32 budget, $B_c = 16$ at $d = 64$), $T_c = 64$ and $Q, O$ cross
#   HBM 64 times: the model says FA1 would move *more* than standard attention. FA1 beats standard attention
#   only when $8 T_c N d$ (its leading term, forward + backward) is below $11N^2$, i.e. $B_c \gtrsim 0.7\,d$ — the
#   $\Theta(N^2d^2/M)$ bound in action: IO-awareness needs a large enough SRAM.

# %% [markdown]
# ## 8 · Speed: modelled here, measured only on a GPU
#
# On the simulator every CUDA thread is a Python thread, so wall time says nothing about a GPU. The
# numbers above are modelled. On a machine with a GPU, `flashnb bench` times every implementation with
# CUDA events; this cell does a tiny version of that when a GPU is present (in a separate process):

# %%
from flashnb import bench  # noqa: E402

gpu_rows = bench.on_gpu("flashnb.bench:measure_impls", impls=["naive", "fa1"], BH=8, N=1024, d=64)
print(bench.table(gpu_rows, ["impl", "direction", "median_ms", "q1_ms", "q3_ms", "tflops", "pct_fp32_peak", "gpu_name"]))

# %%
print(f"notebook ran in {time.perf_counter() - T0:.1f} s")

# %% [markdown]
# ## Exercises
#
# Each exercise has a check: fill in the `...` and run its cell (`...` means "not attempted yet"). Stuck?
# `exercises.hint("03.1")` gives a hint and `exercises.answer("03.1")` the worked answer -- try first.
# Levels: ★ a few lines, ★★ a small kernel or experiment, ★★★ a real change to a kernel.
# To change a library kernel, edit a copy: `registry.variant(factory, replace=(old_text, new_text))` (copy
# `old_text` from `show_source`), and run it through the library with `with registry.using(factory, variant):`.

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
i_outer = ...     # registry.variant(fa1.make_forward, replace=[(old, new), ...])
model = ...       # def model(N, d, Br): ...
exercises.check("03.1", variant=i_outer, model=model)

# %% [markdown]
# **03.2 · Causal skipping** (★, ~15 min) With `causal=True` this kernel still visits every tile and masks.
# How many $(i, j)$ tiles lie entirely above the (bottom-right aligned) diagonal for $N_q = N_k = 1024$,
# $B_r = B_c = 64$? And for $N_q = 512$, $N_k = 1024$? How many global element accesses of the main launch
# would skipping them save (one head, $N_q = N_k = 1024$, $d = 64$)?

# %%
tiles_above = ...
tiles_above_short = ...
saved_elements = ...
exercises.check("03.2", tiles_above=tiles_above, tiles_above_short=tiles_above_short, saved_elements=saved_elements)

# %% [markdown]
# **03.3 · The constant in front of $N^2d^2/M$** (★★, ~15 min) Using `fa1.model_forward`, fit the constant $c$ in
# $\text{traffic} \approx c\, N^2 d^2 / M$ for large $N$ ($N = 65536$, $d = 32$, $M = 4096$) and compare it with the
# $12$ derived in §5. Do the same for `fa1.model_backward`. Where do the differences come from?

# %%
c_forward = ...
c_backward = ...
exercises.check("03.3", c_forward=c_forward, c_backward=c_backward)

# %% [markdown]
# **03.4 · Split-K's bill** (★★, ~20 min) From `model_forward` (or by counting a small run: the counter reports
# shared reads per shared array), compute the share of the forward's shared-memory reads that read the split-K
# partials `m_w`, `l_w`, `O_w`, for $W = 1, 2, 4, 8$ at $N = 1024$, $d = 64$, $B_r = 16$, $B_c = 128$. Why does
# FA2's split-Q layout not pay it?

# %%
fractions = ...   # {1: ..., 2: ..., 4: ..., 8: ...}
exercises.check("03.4", fractions=fractions)

# %% [markdown]
# **03.5 · Dynamic shared memory** (★★, ~15 min) If the kernel could use 160 KiB of shared memory (an A100 with
# dynamic shared memory) as its budget $M$, which $B_c$ would the formula give at $d = 64$, and by what factor would
# GPT-2 medium's forward + backward traffic change (§7's setting, the models with `check_fit=False`)?

# %%
Bc = ...
traffic_ratio = ...
exercises.check("03.5", Bc=Bc, traffic_ratio=traffic_ratio)
