# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# ## Attention dropout: a mask that is regenerated, never stored
#
# Training-time attention dropout multiplies each attention weight $P_{ij}$ by $Z_{ij}/(1-p)$, where
# $Z_{ij} \in \{0, 1\}$ is 1 with probability $1 - p$ (*inverted* dropout: the expectation of $O$ is unchanged).
# The standard implementation draws $Z$ as an $N \times N$ tensor, applies it, and **saves it for the
# backward** — another $N \times N$ array in HBM, which is exactly what FlashAttention exists to avoid.
#
# FlashAttention-1 (Algorithms 2 and 4) solves it with a random number generator whose output for an element
# depends only on *where the element is*: the forward saves the generator's state (a seed), and the backward
# **regenerates** each $Z_{ij}$ tile by tile, on chip. flashnb uses a counter-based generator, Philox4x32-10
# (Salmon et al., SC 2011): $u_{zij} = \mathrm{philox}(\text{counter} = (j, i, z, 0), \text{key} = \text{seed})$,
# so any thread of any kernel gets the same number for the same element $(z, i, j)$, in any order.
#
# | FA1 Alg. 2 (forward) | FA1 Alg. 4 (backward), in FA2 Alg. 2's loop order |
# |---|---|
# | $m_i$, $\ell_i$ (so $L_i$) from the **undropped** $\tilde P_{ij}$ | $P = \exp(S - L)$, the undropped softmax |
# | $\tilde O_i \mathrel{+}= (\tilde P_{ij} \circ Z_{ij}) V_j / (1-p)$ | $Z_{ij}$ regenerated from the same counters |
# | | $dV_j \mathrel{+}= (P \circ Z)^\top dO_i / (1-p)$, $\;dP = (dO_i V_j^\top) \circ Z / (1-p)$ |
# | | $D_i = \mathrm{rowsum}(dO_i \circ O_i)$ with the *dropped* $O$, $\;dS = P \circ (dP - D)$ |
#
# Why $D$ needs no change: with $W = Z/(1-p)$ and $O = (P \circ W) V$,
# $\sum_c dO_{ic} O_{ic} = \sum_j P_{ij} W_{ij} (dO_i \cdot V_j) = \sum_j P_{ij}\, dP_{ij}$ — the same identity
# as without dropout, with $dP$ now carrying $W$.

# %%
import os
import time

import matplotlib.pyplot as plt
import numpy as np

os.environ["FLASHNB_DEVICE"] = "sim"  # counting traffic needs the simulator
import flashnb
from flashnb import fa2, reference, rng, traffic
from flashnb.notebook import savefig, show_source

T0 = time.perf_counter()
gen = np.random.default_rng(11)

# %% [markdown]
# ### The generator, as the kernels run it
#
# Ten rounds of two 32×32→64-bit multiplications, XORs with the key, and a key bump; integer arithmetic only
# (the PTX guard checks that no float64 sneaks in). Straight from the package:

# %%
show_source(rng.philox4x32_10)
show_source(rng.dropout_uniform)
show_source(rng.dropout_keep)

# %% [markdown]
# A generator is only Philox if it gives Philox's published answers. Random123 (the reference
# implementation) ships known-answer vectors; here are its three Philox4x32-10 lines, checked against the device
# function (run by the simulator) and against its vectorised NumPy twin, which the tests and the reference use
# to rebuild the whole mask:

# %%
KAT = [((0, 0, 0, 0), (0, 0), (0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8)),
       ((0xffffffff,) * 4, (0xffffffff,) * 2, (0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd)),
       ((0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344), (0xa4093822, 0x299f31d0),
        (0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1))]   # Random123 tests/kat_vectors, lines 27-29
for counter, key, want in KAT:
    device = tuple(int(x) for x in rng.philox4x32_10(*counter, *key))
    twin = tuple(int(x) for x in rng.philox4x32_10_np(*counter, *key))
    print(" ".join(f"{w:08x}" for w in device), "device == twin == Random123:", device == twin == want)
    assert device == twin == want

# %% [markdown]
# In the FA2 forward kernel the whole change is one loop over the lane's $\tilde P_{ij}$, after they were added
# into $\ell_i$ and before $\tilde P V_j$; in the backward, one branch where $P$ and $dS$ are formed
# (`make_forward(..., dropout=True)`, `make_backward(..., dropout=True)`; without it the kernels compile to the
# same PTX as before):

# %%
show_source(fa2.make_forward, grep="dropout_scale(")
show_source(fa2.make_backward, grep="dropout_scale(")
show_source(fa2.make_backward, grep="= pv * ")

# %% [markdown]
# ### Counted: what crosses HBM with and without dropout
#
# One forward and one backward, counted element by element on the simulator, with and without dropout; next
# to them, what a stored mask would add (the forward writes it, the backward reads it, one byte per element).

# %%
BH, N, d, p, seed = 2, 64, 16, 0.2, 2024
q, k, v, do = (gen.standard_normal((BH, N, d)) for _ in range(4))
global_bytes = {}
for drop in (0.0, p):
    with traffic.count() as t:
        o, lse = flashnb.attention_forward(q, k, v, impl="fa2", dropout_p=drop, seed=seed)
        flashnb.attention_backward(q, k, v, o, lse, do, impl="fa2", dropout_p=drop, seed=seed)
    global_bytes[drop] = sum(e["read_bytes"] + e["write_bytes"] for e in t.totals_by_array().values()
                             if e["kind"] == "global")
stored_mask = 2 * BH * N * N                     # written once, read once, 1 byte per element
print(f"HBM bytes, forward + backward, BH={BH}, N={N}, d={d}:")
print(f"  no dropout            {global_bytes[0.0]:>9,}")
print(f"  dropout, regenerated  {global_bytes[p]:>9,}")
print(f"  dropout, mask stored  {global_bytes[0.0] + stored_mask:>9,}  (+{stored_mask:,} for a uint8 N×N mask)")
assert global_bytes[p] == global_bytes[0.0]

# %% [markdown]
# At longer sequences the counts come from fa2's traffic model (`fa2.model_forward` / `model_backward`, which the
# tests hold equal to the counts above): one head, $d = 64$, default tiles, float32 arrays, against a uint8
# mask written by the forward and read by the backward.

# %%
print(f"{'N':>6}  {'FA2 fwd+bwd bytes':>17}  {'stored mask bytes':>17}  {'mask / FA2':>10}")
for N_ in (1024, 4096, 16384):
    model = fa2.model_forward(1, N_, N_, 64) + fa2.model_backward(1, N_, N_, 64)
    fa_bytes = 4 * sum(sum(launch[kind].values()) for launch in model for kind in ("reads", "writes", "atomics"))
    mask_bytes = 2 * N_ * N_
    print(f"{N_:>6}  {fa_bytes:>17,}  {mask_bytes:>17,}  {mask_bytes / fa_bytes:>10.2f}")

# %% [markdown]
# Both columns grow as $N^2$ at fixed tiles (FA2 streams $K$, $V$ once per query block), so the ratio stays where
# the table puts it: a stored mask is an extra $N^2$ term of traffic on top of FlashAttention's. Its memory is
# the bigger cost: an $N \times N$ allocation per head, kept from the forward to the backward, where everything
# else FlashAttention keeps ($O$, $L$) is linear in $N$. The regenerated mask costs arithmetic instead: one
# Philox call (ten rounds) per element in the forward and again in the backward.
#
# ### The forward's mask and the backward's mask are the same mask
#
# Both can be read off the kernels' own outputs. With $V = I$ (so $d = N_k$) the forward returns
# $O = (P \circ W) I = P \circ W$; with $dO = I$ (so $d = N_q$) the backward returns $dV = (P \circ W)^\top$.
# Dividing by the undropped $P$ from the reference leaves each kernel's $W$ — no access to the generator needed.

# %%
n, p, seed = 48, 0.3, 7
q1, k1 = gen.standard_normal((1, n, n)), gen.standard_normal((1, n, n))
eye = np.eye(n)[None]
P_ref = reference.attention_forward(q1, k1, eye)[0]             # softmax itself, since V = I
o1, lse1 = flashnb.attention_forward(q1, k1, eye, impl="fa2", dropout_p=p, seed=seed, Br=16, Bc=16, warps=1)
dq1, dk1, dv1 = flashnb.attention_backward(q1, k1, eye, o1, lse1, eye, impl="fa2", dropout_p=p, seed=seed,
                                           Br=16, Bc=16, warps=1)
W_fwd = (o1 / P_ref)[0] * (1 - p)                               # 1 kept, 0 dropped (up to rounding)
W_bwd = (dv1[0].T / P_ref[0]) * (1 - p)
keep_twin = rng.dropout_keep_np(seed, p, 1, n, n)[0]
print("forward's mask == backward's mask == NumPy twin:",
      np.array_equal(W_fwd > 0.5, W_bwd > 0.5) and np.array_equal(W_fwd > 0.5, keep_twin))
print(f"largest distance of a read-off entry from 0 or 1: "
      f"{max(np.abs(W - np.round(W)).max() for W in (W_fwd, W_bwd)):.1e}")
assert np.array_equal(W_fwd > 0.5, keep_twin) and np.array_equal(W_bwd > 0.5, keep_twin)

fig, axes = plt.subplots(1, 3, figsize=(11, 3.8))
for ax, (title, W) in zip(axes, [("forward: O / P  (V = I)", W_fwd), ("backward: dVᵀ / P  (dO = I)", W_bwd),
                                 (f"forward XOR backward: {np.logical_xor(W_fwd > 0.5, W_bwd > 0.5).sum()} differ",
                                  np.logical_xor(W_fwd > 0.5, W_bwd > 0.5))]):
    ax.imshow(W, cmap="gray_r", vmin=0, vmax=1, interpolation="nearest")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("key j")
axes[0].set_ylabel("query i")
fig.suptitle(f"dropout mask read off the kernels' outputs (p = {p}, seed = {seed}; black = kept)")
savefig(fig, "11_dropout_mask")
plt.show()

# %% [markdown]
# ### Keep-rate statistics
#
# Each element is kept iff $u \ge p$ with $u$ the top 24 bits of Philox's first output word times $2^{-24}$,
# so the keep probability is $1 - \lceil p\,2^{24} \rceil / 2^{24}$. Over $n$ elements the kept count is then
# Binomial: below, each measured rate with its distance from the expected one in standard deviations (on the
# twin's mask, which the tests hold bit for bit to the device's), and the spread of the per-row rates.

# %%
shape = (4, 128, 128)
print(f"{'p':>5}  {'kept':>8}  {'expected':>8}  {'z-score':>7}  {'row rates: min .. max':>22}")
for p_ in (0.1, 0.3, 0.5, 0.9):
    keep = rng.dropout_keep_np(99, p_, *shape)
    q_ = 1 - np.ceil(np.float32(p_) * 2.0**24) / 2.0**24
    zscore = (keep.sum() - keep.size * q_) / np.sqrt(keep.size * q_ * (1 - q_))
    rows = keep.mean(axis=2)
    print(f"{p_:>5}  {keep.mean():>8.4f}  {q_:>8.4f}  {zscore:>7.2f}  {rows.min():>10.3f} .. {rows.max():.3f}")

# %% [markdown]
# And dropout trained through `flashnb.torch` keeps its seed in the autograd context, so `loss.backward()`
# regenerates the same mask (`flashnb.torch.attention(q, k, v, dropout_p=0.1)`; a seed is drawn from torch's
# generator when none is given). The gradients against the float64 reference with the twin's mask:

# %%
q2, k2, v2, do2 = (gen.standard_normal((2, 40, 16)) for _ in range(4))
o2, lse2 = flashnb.attention_forward(q2, k2, v2, causal=True, impl="fa2", dropout_p=0.25, seed=5)
grads = flashnb.attention_backward(q2, k2, v2, o2, lse2, do2, causal=True, impl="fa2", dropout_p=0.25, seed=5)
W2 = rng.dropout_scale_np(5, 0.25, 2, 40, 40)
ref = reference.attention_backward(q2, k2, v2, do2, causal=True, dropout_mask=W2)
o_err = np.abs(o2 - reference.attention(q2, k2, v2, causal=True, dropout_mask=W2)).max()
print(f"max |error|: o {o_err:.1e}, " + ", ".join(f"{n_} {np.abs(g - r).max():.1e}"
                                                   for n_, g, r in zip(("dq", "dk", "dv"), grads, ref)))
print(f"part ran in {time.perf_counter() - T0:.1f} s")
