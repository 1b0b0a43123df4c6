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
# # 04 · FlashAttention-1, backward: recompute instead of remember
#
# The standard backward (Algorithm 3 of the FA1 paper) needs the $N\times N$ matrix $P$ from the forward pass:
# $dV = P^\top dO$, $dP = dO\,V^\top$, $dS = P\circ(dP - \mathrm{rowsum}(P\circ dP))$, $dQ = dS\,K$, $dK = dS^\top Q$.
# Storing $P$ for every head of every layer is what makes attention's training memory quadratic in $N$.
#
# FlashAttention-1's backward (*Algorithm 4*) keeps only $O$ and the softmax statistics from the forward and
# **recomputes** $S$ and $P$ tile by tile, on chip, from $Q$, $K$ and the statistics. This notebook shows the
# derivation of $dS = P\circ(dP - D)$, Algorithm 4 in NumPy, the kernel (`fa1.make_backward`), checks the
# gradients numerically, counts the backward's traffic, and computes the memory each implementation
# allocates, set beside the paper's Table 21.

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
from flashnb.instruments import traffic
from flashnb.notebook import savefig, show_source
from flashnb.stages import fa1, naive

T0 = time.perf_counter()
rng = np.random.default_rng(4)
print("kernels run on the Numba CUDA simulator; GPU timings:",
      "on this machine's GPU, in a separate process" if flashnb.instruments.bench.gpu_available() else "none (no GPU here)")

# %% [markdown]
# ## 1 · Recomputation is gradient checkpointing
#
# *Gradient checkpointing* trades compute for memory: keep a few activations from the forward, and rebuild
# the others in the backward by running that part of the forward again. FA1 applies it *inside* one
# operator: the checkpoint is $(O, \ell, m)$ — or, as here, $(O, L)$ with $L = m + \log\ell$ — which is $O(Nd)$;
# the rebuilt activations are $S_{ij}$ and $P_{ij} = \exp(S_{ij} - L_i)$ (Alg. 4 lines 11-13; the paper writes
# $\mathrm{diag}(\ell_i)^{-1}\exp(S_{ij} - m_i)$, the same number).
#
# What it costs: one extra $QK^\top$ product. By the usual FLOP convention the backward does 5 matrix
# products (recompute $S$, then $dV$, $dP$, $dQ$, $dK$) instead of 4, i.e. $2.5\times$ the forward's 2 instead of
# $2\times$. What it buys: no $N\times N$ array in memory, and — because every tile of $P$ is consumed on chip —
# no $N\times N$ traffic either.

# %%
B, H, N, d = 16, 8, 2048, 64
saved_std = B * H * N * N                      # P kept for the backward (standard attention)
saved_fa = B * H * (N * d + N)                 # O and L kept (O is an output anyway)
print(f"per layer, B={B}, H={H}, N={N}, d={d}: standard keeps P = {saved_std * 2 / 2**20:,.0f} MiB (fp16); "
      f"FA1 keeps O and L = {saved_fa * 2 / 2**20:,.0f} MiB (fp16)")
print("matmul FLOPs (x 2·N²·d per head): forward 2, standard backward 4, FA1 backward 5 (recomputes S)")

# %% [markdown]
# ## 2 · $dS = P \circ (dP - D)$, from the softmax Jacobian
#
# Write one row $i$ of the forward, with $k$ running over the keys: $S_{ik} = \tau\, q_i \cdot k_k$,
# $P_{ik} = e^{S_{ik}} / \sum_{k'} e^{S_{ik'}}$, $O_i = \sum_k P_{ik} V_k$. Given $dO = \partial\phi/\partial O$, the chain
# rule gives $dV = P^\top dO$ and $dP_{ik} = \partial\phi/\partial P_{ik} = dO_i \cdot V_k$, i.e. $dP = dO\,V^\top$
# (Alg. 4 lines 16-17). The softmax of a row has the Jacobian
#
# $$\frac{\partial P_{ik}}{\partial S_{ij}} = P_{ik}\,(\delta_{jk} - P_{ij}),$$
#
# so
#
# $$dS_{ij} = \sum_k dP_{ik}\, P_{ik}\,(\delta_{jk} - P_{ij}) = P_{ij}\Big(dP_{ij} - \sum_k P_{ik}\, dP_{ik}\Big).$$
#
# The row sum $\sum_k P_{ik}\,dP_{ik}$ runs over **all** keys, which a tile-by-tile backward does not have when it
# processes tile $(i, j)$. But it collapses:
#
# $$\sum_k P_{ik}\, dP_{ik} = \sum_k P_{ik}\,(dO_i \cdot V_k) = dO_i \cdot \Big(\sum_k P_{ik} V_k\Big) = dO_i \cdot O_i =: D_i .$$
#
# So $dS = P \circ (dP - D)$ with $D = \mathrm{rowsum}(dO \circ O)$ (Alg. 4 lines 19-20), and then $dQ = \tau\, dS\,K$,
# $dK = \tau\, dS^\top Q$ (lines 21-22). The forward's output row $O_i$ *is* stored, so $D_i$ costs $d$ multiply-adds
# per row and no pass over the keys. FA1 recomputes it in every inner iteration (line 19 sits inside the loop
# over $i$), which is why its backward reads $O_i$ $T_c$ times; FA2 computes $D$ once in a separate kernel.
# Numerically, in float64 with a causal mask (masked $P_{ik} = 0$, so the sums still run over the allowed keys):

# %%
q, k, v, do = rng.standard_normal((4, 37, 16))
o, lse = reference.attention_forward(q, k, v, causal=True)    # float64 O and L = log-sum-exp of each row
S = q @ k.T / np.sqrt(16)                                      # default scale tau = 1/sqrt(d)
P = np.where(np.tri(37, dtype=bool), np.exp(S - lse[:, None]), 0.0)   # P = exp(S - L), causal
dP = do @ v.T                                                  # dP_ik = dO_i · V_k
D_sum = (P * dP).sum(axis=1)                                   # Σ_k P_ik dP_ik: a pass over all keys
D = (do * o).sum(axis=1)                                       # rowsum(dO ∘ O): d numbers per row
err_D = np.abs(D_sum - D).max()
print(f"max |Σ_k P_ik dP_ik - rowsum(dO ∘ O)_i| = {err_D:.1e}")
assert err_D < 1e-12          # float64: the same sum in two orders, a few ulps of O(1) values

# The Jacobian route and the D route give the same dS, and with it the reference's gradients:
J = P[:, :, None] * (np.eye(37)[None] - P[:, None, :])         # J[i, k, j] = ∂P_ik/∂S_ij
dS_jac = np.einsum("ik,ikj->ij", dP, J)
dS = P * (dP - D[:, None])
dq_ref = reference.attention_backward(q, k, v, do, causal=True)[0]
err_dS, err_dq = np.abs(dS_jac - dS).max(), np.abs(dS @ k / np.sqrt(16) - dq_ref).max()
print(f"max |dS (Jacobian) - P∘(dP - D)| = {err_dS:.1e};  max |τ dS K - reference dQ| = {err_dq:.1e}")
assert err_dS < 1e-12 and err_dq < 1e-12

# %% [markdown]
# ## 3 · Algorithm 4 in NumPy
#
# The backward with recomputation, transcribed loop for loop into float64 NumPy (`fa1.fa1_backward_numpy`, each
# line tagged with the paper's line number; dropout, lines 14-15 and 18, is the identity here). Its inputs are
# exactly what Algorithm 1 leaves in HBM -- $O$, $\ell$, $m$ -- so the forward's transcription
# (`fa1.fa1_forward_numpy`, notebook 03) produces them:

# %%
show_source(fa1.fa1_backward_numpy)

# %%
Nq_t, Nk_t, d_t, Br_t, Bc_t = 37, 29, 16, 8, 12          # ragged last tiles, Nq != Nk, Tr = 5, Tc = 3
q, do = rng.standard_normal((2, Nq_t, d_t))
k, v = rng.standard_normal((2, Nk_t, d_t))
O_np, l_np, m_np = fa1.fa1_forward_numpy(q, k, v, Br_t, Bc_t, causal=True)           # Alg. 1: O, l, m
grads_np = fa1.fa1_backward_numpy(q, k, v, O_np, do, l_np, m_np, Br_t, Bc_t, causal=True)   # Alg. 4
grads_ref = reference.attention_backward(q, k, v, do, causal=True)
for name, g, r in zip(("dQ", "dK", "dV"), grads_np, grads_ref):
    err = np.abs(g - r).max()
    print(f"{name}: max |Alg. 4 (NumPy) - reference| = {err:.1e}")
    # both float64, the same products summed tile by tile instead of at once: a few ulps of O(1-10) values
    assert err < 1e-12

# %% [markdown]
# ## 4 · The kernel, Algorithm 4 line by line
#
# One thread block per (batch, head); outer loop over key blocks $j$ with $K_j, V_j$ in shared memory and
# $dK_j, dV_j$ accumulated there (written to HBM once, line 24); inner loop over query blocks $i$ that reads
# $Q_i, O_i, dO_i, dQ_i, L_i$, and read-modify-writes $dQ_i$ in HBM (line 21) every time. Inside the block the work
# is split element by element over the threads (the FA2 paper notes that FA1's backward, too, suffers from
# the warps' communication through shared memory; here every phase ends in a barrier). Region by region, with the
# file's line numbers (`show_source(fa1.make_backward)` prints the whole factory); first the loop nest, lines 6–10:

# %%
show_source(fa1.make_backward, region="bwd-loop-nest")

# %% [markdown]
# The recomputation, lines 11–13 and 19: $D_i = \mathrm{rowsum}(dO_i \circ O_i)$, then $P_{ij} = \exp(S_{ij} - L_i)$
# straight from the saved log-sum-exp — no running max, no rescaling, because $L_i$ is already final:

# %%
show_source(fa1.make_backward, region="recompute")

# %% [markdown]
# Lines 16, 17 and 20: $d\tilde V_j \mathrel{+}= P_{ij}^\top dO_i$ (accumulated on chip), then
# $dS_{ij} = P_{ij} \circ (dO_i V_j^\top - D_i)$:

# %%
show_source(fa1.make_backward, region="dv-ds")

# %% [markdown]
# Lines 21–22: $dQ_i \mathrel{+}= \tau\, dS_{ij} K_j$ and $d\tilde K_j \mathrel{+}= \tau\, dS_{ij}^\top Q_i$. $dK_j$
# stays on chip until the outer step ends; $dQ_i$ goes back to HBM after **every** inner step (line 21), the
# read-modify-write that FlashAttention-2 turns into atomics or a separate pass (notebook 06):

# %%
show_source(fa1.make_backward, region="dq-dk")

# %%
src, first = inspect.getsourcelines(inspect.unwrap(fa1.make_backward))
for n, text in enumerate(src):
    tag = re.search(r"#.*?\b(lines? \d+(?:-\d+)?)", text)
    if tag:
        print(f"fa1.py:{first + n:<4} {tag.group(1):<9} {text.split('#')[0].strip()}")

# %% [markdown]
# ## 5 · Gradient check
#
# Two checks of `attention_backward(..., impl="fa1")`: against the float64 reference gradients, and against
# central finite differences of the scalar $\phi = \sum O \circ dO$ (whose gradient is exactly what the backward
# returns) along random directions — a check that does not trust the reference's formulas.

# %%
Nq, Nk, d_g = 21, 13, 8
q, k, v, do = (rng.standard_normal(s) for s in [(Nq, d_g), (Nk, d_g), (Nk, d_g), (Nq, d_g)])
o, lse = flashnb.attention_forward(q, k, v, causal=True, impl="fa1", Br=8, Bc=4, warps=2)
dq, dk, dv = flashnb.attention_backward(q, k, v, o, lse, do, causal=True, impl="fa1", Br=8, Bc=4, warps=2)
for name, g, r in zip(("dq", "dk", "dv"), (dq, dk, dv), reference.attention_backward(q, k, v, do, causal=True)):
    print(f"{name}: max |FA1 - reference| = {np.abs(g - r).max():.2e}")
    assert np.abs(g - r).max() < 1e-4     # float32 kernel; dP, dS, dQ chain products reach O(10)


def phi(q_, k_, v_):
    return float((reference.attention(q_, k_, v_, causal=True) * do).sum())


eps = 1e-5
for name, grad, which in (("dq", dq, 0), ("dk", dk, 1), ("dv", dv, 2)):
    u = rng.standard_normal(grad.shape)
    plus = [q, k, v]
    minus = [q, k, v]
    plus[which] = plus[which] + eps * u
    minus[which] = minus[which] - eps * u
    fd = (phi(*plus) - phi(*minus)) / (2 * eps)
    print(f"{name}: directional derivative, finite difference {fd:+.6f}   FA1 <grad, u> {np.sum(grad * u):+.6f}")
    # float64 central difference: O(eps²) truncation; the float32 gradient summed over ~100 entries: ~1e-5
    assert abs(fd - np.sum(grad * u)) < 1e-4 * (1 + abs(fd))

# %% [markdown]
# ## 6 · Counted traffic of the backward against standard attention
#
# Per head, the backward's main kernel reads $K, V$ once and writes $dK, dV$ once ($4Nd$), and reads
# $Q_i, O_i, dO_i, dQ_i$ and writes $dQ_i$ at every one of the $T_c$ outer steps ($5T_c Nd$); the statistic is one
# vector $L$ ($T_c N$ reads, where the paper's $\ell$ and $m$ cost $2T_cN$). Add $Nd$ for the $dQ = 0$
# initialisation (Alg. 4 line 5). The counter agrees with this model exactly at the $N$ printed (counted on the
# simulator); the longer sequences of the figure are the model's:

# %%
def total(model):
    return sum(sum(x["reads"].values()) + sum(x["writes"].values()) for x in model)


d_c, M_c = 16, 1024
counted = {}
for N_ in (16, 32, 64, 128, 256):
    q_, k_, v_, do_ = (common.to_device(rng.standard_normal((1, N_, d_c))) for _ in range(4))
    o_, L_ = fa1.forward(q_, k_, v_, causal=False, scale=0.25, M=M_c)
    with traffic.count() as t:
        fa1.backward(q_, k_, v_, o_, L_, do_, causal=False, scale=0.25, M=M_c)
    assert t.summary() == fa1.model_backward(1, N_, N_, d_c, M=M_c)
    with traffic.count() as t2:
        naive.backward(q_, k_, v_, o_, L_, do_, causal=False, scale=0.25)
    assert t2.summary() == naive.model_backward(1, N_, N_, d_c)
    counted[N_] = (total(t.summary()), total(t2.summary()))
    Tc = common.cdiv(N_, fa1.tiles(d_c, M=M_c)["Bc"])
    paper = 4 * N_ * d_c + 5 * Tc * N_ * d_c + 2 * Tc * N_
    ours = paper - Tc * N_ + N_ * d_c             # L instead of l, m; plus the dQ = 0 initialisation
    assert ours == counted[N_][0]
    print(f"N = {N_:>3}: counted FA1 {counted[N_][0]:>9,} = Alg. 4 as written {paper:>9,} - Tc·N + N·d   naive {counted[N_][1]:>10,}")

# %%
Ns = 2 ** np.arange(4, 15)
fa1_b = [total(fa1.model_backward(1, int(n), int(n), d_c, M=M_c)) for n in Ns]
naive_b = [total(naive.model_backward(1, int(n), int(n), d_c)) for n in Ns]
fig, ax = plt.subplots(figsize=(6.5, 4.2))
ax.loglog(Ns, naive_b, "-", color="tab:gray", label="standard (flashnb naive), model")
ax.loglog(Ns, fa1_b, "-", color="tab:blue", label=f"FA1 backward, model (M = {M_c})")
ax.loglog(Ns, [20 * n**2 * d_c**2 / M_c for n in Ns], ":", color="tab:blue", label=r"$20 N^2 d^2/M$")
ax.loglog(list(counted), [c[0] for c in counted.values()], "o", color="tab:blue", label="FA1, counted")
ax.loglog(list(counted), [c[1] for c in counted.values()], "s", color="tab:gray", label="naive, counted")
ax.set_xlabel("sequence length N")
ax.set_ylabel("global elements read + written (one head)")
ax.set_title(f"backward, d = {d_c}")
ax.legend(fontsize=8)
savefig(fig, "04_fa1_backward_traffic_vs_N")
plt.show()
print(f"at N = {Ns[-1]}: naive / FA1 backward traffic = {naive_b[-1] / fa1_b[-1]:.1f}x")

# %% [markdown]
# The leading term $5T_cNd \approx 20N^2d^2/M$ (with $T_c \approx 4dN/M$) is drawn dotted. As in the forward, the
# backward's traffic is still quadratic in $N$; what changed is the constant, set by the SRAM size.

# %% [markdown]
# ## 7 · Memory: what each implementation allocates
#
# The FA1 paper's Table 21 reports the memory of forward + backward for batch 16, 8 heads, $d = 64$:
# standard attention 1,184 / 4,416 / 17,024 MB at $N$ = 1K / 2K / 4K (and out of memory beyond), FlashAttention
# 209 / 418 / 836 MB, growing linearly up to 13,376 MB at 64K.
#
# The same shapes cannot run on the simulator, but the memory does not need a run: `common.dry_run` calls an
# implementation's host launcher with shape-only arrays, so every `empty(...)` it executes is recorded and no
# kernel is launched. These are each implementation's **own allocations**, not a formula:

# %%
S = common.ShapeOnly
print("naive forward allocates:", common.dry_run(naive.forward, S((128, 2048, 64)), S((128, 2048, 64)),
                                                 S((128, 2048, 64)), causal=False, scale=0.125))
print("FA1 forward allocates:  ", common.dry_run(fa1.forward, S((128, 2048, 64)), S((128, 2048, 64)),
                                                 S((128, 2048, 64)), causal=False, scale=0.125))


def memory(mod, B, H, N, d):
    """Peak bytes (float32) of forward + backward: inputs q, k, v, dO; the forward's allocations; then the
    forward's outputs (O, L) kept while the backward's allocations are all live."""
    BH = B * H
    x = S((BH, N, d))
    fwd = common.dry_run(mod.forward, x, x, x, causal=False, scale=0.125)
    bwd = common.dry_run(mod.backward, x, x, x, x, S((BH, N)), x, causal=False, scale=0.125)
    inputs = 4 * x.nbytes
    kept = x.nbytes + S((BH, N)).nbytes
    return inputs + max(sum(a.nbytes for a in fwd), kept + sum(a.nbytes for a in bwd))


paper = {1024: (1184, 209), 2048: (4416, 418), 4096: (17024, 836), 8192: (None, None), 16384: (None, None)}
MB = 2**20
print(f"{'N':>6} | {'naive fp32 MB':>13} {'fp16':>7} {'paper std':>9} | {'FA1 fp32 MB':>11} {'fp16':>6} {'paper FA':>8}"
      f" | {'naive/FA1':>9} {'paper':>6}")
mem = {}
for N_ in paper:
    mn, mf = memory(naive, 16, 8, N_, 64), memory(fa1, 16, 8, N_, 64)
    mem[N_] = (mn, mf)
    ps, pf = paper[N_]
    print(f"{N_:>6} | {mn / MB:>13,.0f} {mn / 2 / MB:>7,.0f} {ps or '-':>9} | {mf / MB:>11,.0f} {mf / 2 / MB:>6,.0f} "
          f"{pf or '-':>8} | {mn / mf:>9.1f} {f'{ps / pf:.1f}' if ps else '-':>6}")

# %%
for N_ in (1024, 2048, 4096):
    ps, pf = paper[N_]
    print(f"N = {N_}: fp16 bytes / paper's MB — naive {mem[N_][0] / 2 / MB / ps:.2f}, FA1 {mem[N_][1] / 2 / MB / pf:.2f}")
growth = {name: mem[4096][i] / mem[1024][i] for i, name in enumerate(("naive", "FA1"))}
print(f"N = 1024 -> 4096 (4x): naive memory x{growth['naive']:.1f}, FA1 x{growth['FA1']:.1f}"
      f"   (paper: standard x{17024 / 1184:.1f}, FlashAttention x{836 / 209:.1f})")
assert growth["naive"] > 12 and growth["FA1"] < 4.5      # N² against N

# %%
fig, ax = plt.subplots(figsize=(6.5, 4.2))
Nm = list(mem)
ax.loglog(Nm, [mem[n][0] / 2 / MB for n in Nm], "o-", color="tab:gray", label="naive, own allocations (fp16 bytes)")
ax.loglog(Nm, [mem[n][1] / 2 / MB for n in Nm], "o-", color="tab:blue", label="FA1, own allocations (fp16 bytes)")
ax.loglog([1024, 2048, 4096], [1184, 4416, 17024], "x--", color="tab:gray", label="paper Table 21, standard")
ax.loglog([1024, 2048, 4096], [209, 418, 836], "x--", color="tab:blue", label="paper Table 21, FlashAttention")
ax.set_xlabel("sequence length N")
ax.set_ylabel("MB (forward + backward)")
ax.set_title("memory, batch 16, 8 heads, d = 64")
ax.legend(fontsize=8)
savefig(fig, "04_fa1_memory_vs_N")
plt.show()

# %% [markdown]
# The shapes agree with the paper: standard attention grows as $N^2$ (the backward holds $S$, $P$, $dP$, $dS$,
# four $N\times N$ arrays per head, at once), FA1 linearly (inputs, outputs and gradients only, all $N\times d$).
# Counted in fp16 bytes (the paper ran fp16), the naive implementation's own arrays come very close to the
# paper's standard column, and FA1's are somewhat below the paper's FlashAttention column (ratios printed
# above). The paper measured a PyTorch training step (its own layouts, dropout state, the caching allocator),
# so exact agreement is not expected; the growth laws — $N^2$ against $N$ — and the widening ratio between the
# two implementations are what carry over.

# %%
print(f"notebook ran in {time.perf_counter() - T0:.1f} s")

# %% [markdown]
# ## Exercises
#
# Each exercise has a check: fill in the `...` and run its cell (`...` means "not attempted yet"). Stuck?
# `exercises.hint("04.1")` gives a hint and `exercises.answer("04.1")` the worked answer -- try first.
# Levels: ★ a few lines, ★★ a small model or experiment, ★★★ a real change to a kernel.

# %%
from flashnb import exercises

# %% [markdown]
# **04.1 · D once, not $T_c$ times** (★★, ~20 min) Move $D_i = \mathrm{rowsum}(dO_i\circ O_i)$ into its own small
# kernel run before the backward (as FA2 does) and pass $D$ instead of $O$. Write the model of that design:
# a function `model(BH, Nq, Nk, d, M)` returning its launches like `fa1.model_backward` does (a list of dicts
# with `"reads"` and `"writes"`, `{array: elements}`; name the new vector `"D"`). The check compares the
# global reads and writes per array with the counted design on a few sizes. Which reads disappear from the
# main loop, and which appear?

# %%
model = ...   # def model(BH, Nq, Nk, d, M): ... return [launch, ...]
passed = exercises.check("04.1", model=model)

# %% [markdown]
# **04.2 · The checkpoint's size** (★, ~10 min) Storing $\ell$ and $m$ (as the paper does) instead of $L$ costs
# one more vector. Write `model_lm(N, d, M)`: the global elements (reads + writes) of the backward of one
# head ($N_q = N_k = N$) that reads $\ell_i$ and $m_i$ instead of $L_i$, and `gap(N, d, M)`: `model_lm` minus the
# paper's $4Nd + 5T_cNd + 2T_cN$. What is the gap?

# %%
model_lm = ...   # def model_lm(N, d, M): ...
gap = ...        # def gap(N, d, M): ...
passed = exercises.check("04.2", model_lm=model_lm, gap=gap)

# %% [markdown]
# **04.3 · dQ in HBM** (★★, ~20 min) $dQ_i$ is read and written $T_c$ times. Swap the loops of the backward
# (outer loop over query blocks $i$, $T_r = \lceil N/B_r\rceil$ steps, FA1's tiles): $Q_i, O_i, dO_i, L_i$ are read
# once and $dQ_i$ is written once, a kernel first sets $dK = dV = 0$, and each inner step reads and writes what it
# must. Write `swapped_total(N, d, M)` (global elements, one head, $N_q = N_k = N$) and name the arrays that now
# have to be read-modified-written in HBM. Does the swap save traffic at FA1's tiles?

# %%
swapped_total = ...   # def swapped_total(N, d, M): ...
rmw_arrays = ...      # a set of array names, e.g. {"dQ"}
passed = exercises.check("04.3", swapped_total=swapped_total, rmw_arrays=rmw_arrays)

# %% [markdown]
# **04.4 · Dropout** (★, ~10 min) Algorithm 4 regenerates the dropout mask from the saved RNG state instead of
# storing it. How many bytes would storing an $N\times N$ boolean mask (one byte per element, every head) add to
# the memory table at $N$ = 16K (batch 16, 8 heads), and how many times FA1's own fp16 memory there is that?

# %%
mask_bytes = ...
times_fa1 = ...
passed = exercises.check("04.4", mask_bytes=mask_bytes, times_fa1=times_fa1)

# %% [markdown]
# **04.5 · Finite differences in float32** (★★, ~20 min) Repeat the directional-derivative check of section 5
# for `dq` with `phi` computed by the FA1 forward itself (float32), for $\varepsilon = 10^{-1}, \dots, 10^{-6}$.
# Which step size balances truncation and rounding error? (The check wants its order of magnitude.)

# %%
eps_best = ...
passed = exercises.check("04.5", eps_best=eps_best)
