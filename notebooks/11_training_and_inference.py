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
# # 11 · What training and inference need: half precision, dropout, decoding with a KV cache
#
# The kernels of notebooks 03-08 compute attention in float32, without dropout, for a whole sequence of queries at
# once. Production FlashAttention does three more things, and each one is again a question of **what crosses
# HBM**:
#
# 1. **Half-precision storage.** $Q, K, V, O$ are stored in float16 or bfloat16 (2 bytes instead of 4) while the
#    arithmetic, $m_i$, $\ell_i$ and $L$ stay float32. Same kernel, same tiles, half the bytes for the big arrays.
# 2. **Dropout with a regenerated mask** (FA1, Algorithms 2 and 4). Training drops attention weights at random;
#    storing the $N \times N$ mask for the backward would undo what FlashAttention saves, so the mask is a
#    *function* of (seed, batch·head, row, column), recomputed tile by tile in the backward.
# 3. **Flash-decoding.** At inference a model attends a handful of new queries to a long KV cache. FA2's grid is
#    (query blocks × heads): with one query it launches one block per head and leaves most SMs idle. Splitting the
#    *keys* over blocks and merging the partial results with notebook 02's merge operator fills the GPU again.
#
# Each section measures like the other notebooks: traffic *counted* by running the real kernels on the simulator
# and checked against an analytic model, errors against the float64 reference, speed *modelled* (labelled so),
# and a GPU cell that measures for real when a GPU is present.

# %%
import os
import time

import matplotlib.pyplot as plt
import numpy as np

# before flashnb's import: counting traffic needs the simulator (GPU timings run in a process of their own)
os.environ["FLASHNB_DEVICE"] = "sim"
import flashnb
from flashnb import common, reference, rng
from flashnb.instruments import bench, traffic
from flashnb.kernels import decode, flash, policies
from flashnb.notebook import savefig, show_source
from flashnb.stages import fa2, softmax

T_NOTEBOOK = time.perf_counter()

# %% [markdown]
# ## Half-precision storage: the same kernel, half the bytes
#
# FlashAttention is limited by memory traffic: its IO analysis counts *elements* read and written in HBM, and a
# GPU pays for *bytes*. Every kernel in this course so far keeps $Q, K, V, O$ in float32 (4 bytes an element).
# FlashAttention itself takes float16 or bfloat16 inputs (2 bytes) and does its arithmetic in float32: the
# matmuls accumulate in float32, and $m_i$, $\ell_i$, $L$, $D$ and the $dQ$ accumulator are float32.
#
# flashnb's product kernel (`flashnb.kernels.simt`, `impl="flash"`) does the same with one compile-time option of
# its factories, `storage`, a small policy (`policies.storage`) that its loop calls:
#
# * the kernel **signature** types $Q, K, V, O$ (and $dO, dK, dV$) as `float16[:, :, ::1]` (bfloat16: `uint16`
#   bit patterns, see below), and $L$, $D$, $dQ_{acc}$ stay `float32`;
# * every **load** from HBM widens an element to float32 (`to_f32`) as it goes into the float32 shared tile;
# * every **store** narrows once (`from_f32`): $O_i$ after the division by $\ell_i$, $dK_j, dV_j$ at the end;
# * $dQ$ is summed with float32 atomics from many thread blocks, so it cannot be rounded per block: a third
#   launch converts the float32 accumulator once, at the end (FlashAttention-2 ends its backward the same way).
#
# With `storage="float32"` both conversions are the identity and the kernel is the float32 kernel, instruction
# for instruction (stage 4's lesson kernels of notebooks 05-06 are float32 only: storage is a product feature).
# The policy and the lines of the forward that use it:

# %%
gen = np.random.default_rng(11)      # each part draws from a generator of its own
show_source(policies.storage)
show_source(flash.make_forward, grep="_f32")

# %% [markdown]
# and the conversions themselves (`flashnb/common.py`). For float32 and float16 they are numba's casts: float16
# is a plain `cvt` instruction each way (`cvt.f32.f16` is exact; `cvt.rn.f16.f32` rounds to nearest even, and a
# value beyond float16's largest, 65504, becomes inf), and `float32(x)` of a float32 is no instruction at all:

# %%
show_source(common, grep="_CONVERSIONS = ")
print({s: tuple(getattr(f, "__name__", str(f)) for f in common.storage_conversions(s)) for s in common.STORAGES})

# %% [markdown]
# ### Counted bytes, float32 against float16
#
# The traffic counter records element counts per kernel parameter and the itemsize of each array, so bytes are
# counted, not assumed. Same shape, same tiles, forward and backward, in both storages:

# %%
BH, N, d, causal = 1, 48, 16, True
tiles = dict(Br=16, Bc=16, warps=1)
x = [gen.standard_normal((BH, N, d)).astype(np.float16) for _ in range(4)]   # q, k, v, do: float16 values
counts = {}
for storage in ("float32", "float16"):
    q, k, v, do = (common.to_device(a, storage) for a in x)
    with traffic.count() as t:
        o, lse = flash.forward(q, k, v, causal=causal, scale=d ** -0.5, **tiles)
        flash.backward(q, k, v, o, lse, do, causal=causal, scale=d ** -0.5, **tiles)
    counts[storage] = t
    model = (flash.model_forward(BH, N, N, d, causal=causal, storage=storage, **tiles)
             + flash.model_backward(BH, N, N, d, causal=causal, storage=storage, **tiles))
    assert t.summary() == model    # elements: exactly the model's, in both storages
    assert [(lt.read_bytes, lt.write_bytes) for lt in t.launches] == \
        [(m["read_bytes"], m["write_bytes"]) for m in flash.model_bytes(model, storage)]


def bytes_by_array(t):
    out = {}
    for lt in t.launches:
        for name in set(lt.reads) | set(lt.writes) | set(lt.atomics):
            n = lt.reads.get(name, 0) + lt.writes.get(name, 0) + lt.atomics.get(name, 0)
            out[name] = out.get(name, 0) + n * lt.itemsize[name]
    return out


b32, b16 = bytes_by_array(counts["float32"]), bytes_by_array(counts["float16"])
names = [n for n in ("Q", "K", "V", "O", "dO", "dK", "dV", "dQh", "L", "D", "dQ") if n in b32 or n in b16]
print(f"{'array':>6} {'float32 B':>10} {'float16 B':>10} {'ratio':>6}")
for n in names:
    print(f"{n:>6} {b32.get(n, 0):>10,} {b16.get(n, 0):>10,} "
          f"{b16.get(n, 0) / b32[n] if b32.get(n) else float('nan'):>6.2f}")
tot32, tot16 = sum(b32.values()), sum(b16.values())
print(f"{'total':>6} {tot32:>10,} {tot16:>10,} {tot16 / tot32:>6.2f}")

# %%
fig, ax = plt.subplots(figsize=(8, 3.2))
pos = np.arange(len(names))
ax.bar(pos - 0.2, [b32.get(n, 0) for n in names], 0.4, label="float32 storage")
ax.bar(pos + 0.2, [b16.get(n, 0) for n in names], 0.4, label="float16 storage")
ax.set_xticks(pos, [{"dQ": "dQ (f32 acc.)", "dQh": "dQ (half)"}.get(n, n) for n in names], fontsize=8)
ax.set_ylabel("counted HBM bytes")
ax.set_title(f"product kernel forward + backward, N = {N}, d = {d}, causal (simulator count)")
ax.legend()
savefig(fig, "11_half_bytes")
plt.show()

# %% [markdown]
# $Q, K, V, O, dO, dK, dV$ move half the bytes. $L$, $D$ and the float32 $dQ$ accumulator (its zeroing, its
# atomics) do not shrink, and half storage adds the conversion launch ($dQ$ read in float32, $dQ_h$ written in
# float16): the total ratio printed above is therefore above one half. At a realistic size the models (checked
# against the counts above) give the ratio for the whole forward and backward:

# %%
for shape in ((16, 1024, 1024, 64), (16, 4096, 4096, 64)):
    for model in (flash.model_forward, flash.model_backward):
        tot = {s: sum(r["read_bytes"] + r["write_bytes"] + r["atomic_bytes"]
                      for r in flash.model_bytes(model(*shape, causal=True, storage=s), s))
               for s in ("float32", "float16")}
        print(f"{model.__name__:>15} BH, N, N, d = {shape}: float32 {tot['float32'] / 2**20:8.1f} MiB, "
              f"float16 {tot['float16'] / 2**20:8.1f} MiB, ratio {tot['float16'] / tot['float32']:.3f}")

# %% [markdown]
# ### What it costs in accuracy
#
# float16 keeps 11 significant bits: rounding to nearest changes a value by at most $u = 2^{-11}$ of itself (its
# *unit roundoff*). Because the inputs *are* float16 values, the kernels read them exactly; the only new error is
# the one rounding of each output at the store. So, on the same inputs:
#
# * against the **float32 kernels**, the float16 $O$ should be the float32 $O$ rounded to float16, bit for bit
#   (the arithmetic and its order are the same);
# * against the **float64 reference**, the error should be about $u\,|O|$, whatever the size of the inputs (the
#   float32 part, $\approx 2^{-24}$ per operation, is far below it).
#
# (bfloat16 cannot hold these float16 inputs exactly -- it keeps 8 significant bits -- so its run gets the
# inputs rounded to bfloat16 and the float64 reference of *those* inputs.)
#
# Inputs with large magnitudes are where a half format could hurt: $v$ up to a few hundred, $q, k$ scaled so the
# scores are $O(1\text{-}10)$ (softmax rows that mix many keys), and $N_q \ne N_k$.

# %%
Nq, Nk, d = 40, 56, 16
scale = d ** -0.5 * 4 / 60.0 ** 2
rows = []
for vscale in (1.0, 30.0, 300.0):
    q = (gen.standard_normal((1, Nq, d)) * 60).astype(np.float16)
    k = (gen.standard_normal((1, Nk, d)) * 60).astype(np.float16)
    v = (gen.standard_normal((1, Nk, d)) * vscale).astype(np.float16)
    o_ref, _ = reference.attention_forward(*(a.astype(np.float64) for a in (q, k, v)), causal=True, scale=scale)
    o32, _ = flashnb.attention_forward(q, k, v, causal=True, scale=scale, impl="flash", storage="float32", **tiles)
    o16, _ = flashnb.attention_forward(q, k, v, causal=True, scale=scale, impl="flash", **tiles)
    qb, kb, vb = (common.to_bfloat16(a) for a in (q, k, v))      # bfloat16 keeps 8 bits: other inputs,
    obf, _ = flashnb.attention_forward(qb, kb, vb, causal=True, scale=scale, impl="flash", storage="bfloat16", **tiles)
    ob_ref, _ = reference.attention_forward(*(common.from_bfloat16(a).astype(np.float64) for a in (qb, kb, vb)),
                                            causal=True, scale=scale)  # ... so their own reference
    rel = {name: float(np.max(np.abs(o.astype(np.float64) - ref) / np.abs(ref).max()))
           for name, o, ref in (("float32", o32, o_ref), ("float16", o16, o_ref),
                                ("bfloat16", common.from_bfloat16(obf), ob_ref))}
    same = bool(np.array_equal(o16, o32.astype(np.float16)))
    rows.append(dict(vscale=vscale, max_abs_v=float(np.abs(v).max()), same_as_float32_rounded=same, **rel))
    print(f"|v| up to {rows[-1]['max_abs_v']:7.1f}: max error / max|o|  float32 {rel['float32']:.1e}  "
          f"float16 {rel['float16']:.1e}  bfloat16 {rel['bfloat16']:.1e};  float16 o == round(float32 o): {same}")
print(f"unit roundoff: float16 2^-11 = {2.0 ** -11:.1e}, bfloat16 2^-8 = {2.0 ** -8:.1e}, "
      f"float32 2^-24 = {2.0 ** -24:.1e}")

# %%
fig, ax = plt.subplots(figsize=(6, 3.2))
for name, marker in (("float32", "o"), ("float16", "s"), ("bfloat16", "^")):
    ax.semilogy([r["max_abs_v"] for r in rows], [r[name] for r in rows], marker=marker, label=f"{name} storage")
for u, label in ((2.0 ** -11, "2^-11"), (2.0 ** -8, "2^-8"), (2.0 ** -24, "2^-24")):
    ax.axhline(u, color="gray", lw=0.8, ls=":")
    ax.text(rows[0]["max_abs_v"], u * 1.15, label, fontsize=8, color="gray")
ax.set_xscale("log")
ax.set_xlabel("max |v| (float16 inputs)")
ax.set_ylabel("max |o - o_ref| / max |o_ref|")
ax.set_title("product kernel forward vs the float64 reference")
ax.legend(fontsize=8)
savefig(fig, "11_half_error")
plt.show()

# %% [markdown]
# The relative error does not grow with the inputs' magnitude: float32 arithmetic on exact inputs, one rounding
# at the end. It sits below each format's unit roundoff, and the float16 result is the float32 kernel's rounded
# (the `==` column). `tests/kernels/test_half.py` checks the same claims with bounds derived per element (the scores'
# float32 error propagated through the softmax, plus one rounding), for forward and backward, causal or not.
#
# **Range.** float16's largest value is 65504. $O$ is a convex combination of rows of $V$, so it never leaves
# the range of its inputs; gradients can: $dV_j = \sum_i P_{ij}\, dO_i$ grows with the number of queries. The
# NumPy API refuses such a result with a `ValueError` naming the gradient instead of returning inf
# (`storage="float32"` computes it). bfloat16 has float32's exponent range and 8 significant bits.
#
# ### bfloat16, and what the simulator cannot show
#
# NumPy has no bfloat16 dtype, so flashnb passes bfloat16 arrays as their 16-bit patterns (`uint16`); a
# bfloat16 is the upper half of a float32, so widening is a shift and a reinterpretation of the bits, and
# narrowing rounds the dropped half to nearest even. On a GPU the reinterpretation is libdevice's
# `__nv_int_as_float` (no instruction at all); numba-cuda has a native bfloat16 *scalar* type on the GPU
# (`numba.cuda.bf16`), but no array type NumPy could hand it, and the simulator has none:

# %%
import numba.cuda.bf16 as nb_bf16  # noqa: E402

print("numba.cuda.bf16.bfloat16 on the simulator:", nb_bf16.bfloat16)
show_source(common.to_bfloat16)

# %% [markdown]
# Also out of the simulator's reach: **speed**. Halving the bytes matters where a kernel waits on HBM; the
# simulator's time is NumPy on a CPU. And FlashAttention's main win from half precision is elsewhere: tensor
# cores multiply float16/bfloat16 matrices many times faster than the FP32 units the product kernel uses, so
# its half storage saves bytes, not FLOPs; notebook 12's tensor-core kernel (`impl="fa2-tc"`) is the one whose
# half inputs also cut the matmuls' time. The cell below times the float32
# and half kernels with CUDA events when a GPU is present (in this process when `flashnb.MODE == "gpu"`, else in
# a child process on the machine's GPU); without one it prints that nothing was measured.

# %%
gpu_rows = bench.on_gpu("flashnb.instruments.measure.storage:measure_storage", BH=16, N=4096, d=64, repeats=10)
if gpu_rows:
    for r in gpu_rows:
        print(f"{r['storage']:>9} {r['direction']:>8}: {r['median_ms']:8.3f} ms, modelled "
              f"{r['model_bytes'] / 2**20:8.1f} MiB  ({r['gpu_name']})")

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
gen = np.random.default_rng(11)

# %% [markdown]
# ### The generator, as the kernels run it
#
# Ten rounds of two 32×32→64-bit multiplications, XORs with the key, and a key bump; integer arithmetic only
# (the PTX guard checks that no float64 sneaks in). An element is kept iff its first output word is at least
# $T = \lceil p\,2^{32} \rceil$, an integer comparison of all 32 bits; $T$ and the factor $1/(1-p)$ (in float64,
# rounded once to float32) are computed on the host and passed to the kernels. Straight from the package:

# %%
show_source(rng.philox4x32_10)
show_source(rng.dropout_word)
show_source(rng.dropout_keep)
show_source(rng.keep_threshold)
show_source(rng.keep_scale)

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
# In the product kernel dropout is one more policy, `policies.dropout`: `keep_bits` draws a lane's $Z_{ij}$ for
# its micro-tile from Philox, `factor` is $1/(1-p)$ for a kept element and 0 for a dropped one. The forward
# applies it to the lane's $\tilde P_{ij}$ after they were added into $\ell_i$ and before $\tilde P V_j$; the
# backward where $P$ and $dS$ are formed (`make_forward(..., dropout=True)`, `make_backward(..., dropout=True)`;
# without it the policy compiles to nothing):

# %%
show_source(policies.dropout)
show_source(flash.make_forward, grep="keep")
show_source(flash.make_backward, grep="factor(")

# %% [markdown]
# ### Counted: what crosses HBM with and without dropout
#
# One forward and one backward, counted element by element on the simulator, with and without dropout; next
# to them, what a stored mask would add (the forward writes it, the backward reads it, one byte per element).

# %%
BH, N, d, p, seed = 1, 48, 16, 0.2, 2024
q, k, v, do = (gen.standard_normal((BH, N, d)) for _ in range(4))
global_bytes = {}
for drop in (0.0, p):
    with traffic.count() as t:
        o, lse = flashnb.attention_forward(q, k, v, impl="flash", dropout_p=drop, seed=seed)
        flashnb.attention_backward(q, k, v, o, lse, do, impl="flash", dropout_p=drop, seed=seed)
    global_bytes[drop] = sum(e["read_bytes"] + e["write_bytes"] for e in t.totals_by_array().values()
                             if e["kind"] == "global")
stored_mask = 2 * BH * N * N                     # written once, read once, 1 byte per element
print(f"HBM bytes, forward + backward, BH={BH}, N={N}, d={d}:")
print(f"  no dropout            {global_bytes[0.0]:>9,}")
print(f"  dropout, regenerated  {global_bytes[p]:>9,}")
print(f"  dropout, mask stored  {global_bytes[0.0] + stored_mask:>9,}  (+{stored_mask:,} for a uint8 N×N mask)")
assert global_bytes[p] == global_bytes[0.0]

# %% [markdown]
# At longer sequences the counts come from the traffic model (`flash.model_forward` / `model_backward`, which the
# tests hold equal to the counts above): one head, $d = 64$, default tiles, float32 arrays, against a uint8
# mask written by the forward and read by the backward.

# %%
print(f"{'N':>6}  {'FA2 fwd+bwd bytes':>17}  {'stored mask bytes':>17}  {'mask / FA2':>10}")
for N_ in (1024, 4096, 16384):
    model = flash.model_forward(1, N_, N_, 64) + flash.model_backward(1, N_, N_, 64)
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
o1, lse1 = flashnb.attention_forward(q1, k1, eye, impl="flash", dropout_p=p, seed=seed, Br=16, Bc=16, warps=1)
dq1, dk1, dv1 = flashnb.attention_backward(q1, k1, eye, o1, lse1, eye, impl="flash", dropout_p=p, seed=seed,
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
# Each element is kept iff Philox's first output word (32 bits) is at least $T = \lceil p\,2^{32} \rceil$, so the
# keep probability is $1 - T / 2^{32}$, within $2^{-32}$ of $1 - p$. Over $n$ elements the kept count is then
# Binomial: below, each measured rate with its distance from the expected one in standard deviations (on the
# twin's mask, which the tests hold bit for bit to the device's), and the spread of the per-row rates.

# %%
shape = (4, 128, 128)
print(f"{'p':>5}  {'kept':>8}  {'expected':>8}  {'z-score':>7}  {'row rates: min .. max':>22}")
for p_ in (0.1, 0.3, 0.5, 0.9):
    keep = rng.dropout_keep_np(99, p_, *shape)
    q_ = 1 - int(rng.keep_threshold(p_)) / 2.0**32
    zscore = (keep.sum() - keep.size * q_) / np.sqrt(keep.size * q_ * (1 - q_))
    rows = keep.mean(axis=2)
    print(f"{p_:>5}  {keep.mean():>8.4f}  {q_:>8.4f}  {zscore:>7.2f}  {rows.min():>10.3f} .. {rows.max():.3f}")

# %% [markdown]
# And dropout trained through `flashnb.pytorch` keeps its seed in the autograd context, so `loss.backward()`
# regenerates the same mask (`flashnb.pytorch.attention(q, k, v, dropout_p=0.1)`; a seed is drawn from torch's
# generator when none is given). The gradients against the float64 reference with the twin's mask:

# %%
q2, k2, v2, do2 = (gen.standard_normal((2, 40, 16)) for _ in range(4))
o2, lse2 = flashnb.attention_forward(q2, k2, v2, causal=True, impl="flash", dropout_p=0.25, seed=5)
grads = flashnb.attention_backward(q2, k2, v2, o2, lse2, do2, causal=True, impl="flash", dropout_p=0.25, seed=5)
W2 = rng.dropout_scale_np(5, 0.25, 2, 40, 40)
ref = reference.attention_backward(q2, k2, v2, do2, causal=True, dropout_mask=W2)
o_err = np.abs(o2 - reference.attention(q2, k2, v2, causal=True, dropout_mask=W2)).max()
print(f"max |error|: o {o_err:.1e}, " + ", ".join(f"{n_} {np.abs(g - r).max():.1e}"
                                                   for n_, g, r in zip(("dq", "dk", "dv"), grads, ref)))

# %% [markdown]
# ## Decoding: a few new queries against a long KV cache (flash-decoding)
#
# A language model generates text one token at a time. At each step the new token's query attends to the keys
# and values of every earlier token, which the model keeps in a **KV cache**: `Nq = 1` query (a few with
# speculative decoding) against `length` cached keys. The attention is the same formula as before; what
# changes is the *shape* of the problem, and with it which kernel keeps the GPU busy.
#
# FA2's forward (stage 4) gives each thread block `Br` query rows of one head: its grid is
# `(ceil(Nq / Br), BH)`. At `Nq = 1` that is **one block per head**. Flash-decoding splits the other axis,
# the keys: `num_splits` blocks per head each read one chunk of the cache and write a *partial* output and
# its log-sum-exp, and a second kernel merges the partials with stage 2's merge operator.

# %%
gen = np.random.default_rng(11)

# %% [markdown]
# ### Why FA2 at `Nq = 1` leaves most SMs idle
#
# The launches below are *modelled*, not run: a decoding step of 8 heads (one sequence of a model with 8
# K/V heads, `d = 128`) against a 32k-token cache, on the H100 SXM preset of `flashnb.instruments.roofline`. The model
# (`decode.modelled_time`, `decode.fa2_modelled_time`) is a roofline **per SM**: each SM is given its share of
# the HBM bandwidth and of the FP32 peak, blocks go to SMs in launch order, and the launch lasts until the
# busiest SM is done. That share is an assumption (a real SM can pull more than 1/132 of the bandwidth when
# the others are idle, limited by the loads it keeps in flight), so the penalty for idle SMs is an upper
# bound; launch overhead and caches are left out.

# %%
GPU = "H100 SXM"
BH, LENGTH, D = 8, 32768, 128
f = decode.fa2_modelled_time(BH, 1, LENGTH, D, causal=True, gpu=GPU)
g = decode.modelled_time(BH, 1, LENGTH, D, causal=True, gpu=GPU)
print(f"{'impl':<15} {'blocks':>7} {'SMs busy':>9} {'HBM bytes':>12} {'modelled':>12}")
for r in (f, g):
    print(f"{r['impl']:<15} {r['blocks']:>7} {r['busy_sms']:>5} / {r['sms']} {r['bytes']:>12,} "
          f"{r['seconds'] * 1e6:>9.1f} µs")
print(f"flash-decoding: {g['num_splits']} splits x {BH} heads = {g['split_blocks']} split blocks, then "
      f"{g['merge_blocks']} merge blocks; modelled speed-up over fa2: {f['seconds'] / g['seconds']:.1f}x "
      f"(modelled, {GPU})")

# %% [markdown]
# Both read the cache once (the bytes barely differ: flash-decoding adds the partials, `num_splits · (d + 1)`
# numbers per query and head, written once and read once). The difference is how many SMs do the reading.
# The default split count (`decode.default_splits`) is the largest whose blocks all fit on the SMs in one
# wave, `floor(SMs / BH)`, capped so that every split has at least one K/V tile of the cache. Rounding up
# instead would give every SM a block *and* queue a few more in a second wave; the plot of modelled time
# against `num_splits` further down shows what that wave costs.

# %%
show_source(decode.default_splits)

# %% [markdown]
# ### The split-KV schedule
#
# Block `(s, z)` takes chunk `s` of head `z`'s cache: `length / num_splits` keys, rounded up to the K/V tile
# (`Bc = 32 · warps` keys, one per thread). Rounding to whole tiles can leave the last splits with nothing to
# read (right: 300 keys in 12 splits of 32 keys); such a split writes `O_s = 0`, `L_s = -inf` and weighs
# nothing in the merge.

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 2.6))
for ax, S in zip(axes, (4, 12)):
    Bc, length = 32, 300
    chunk = decode.chunk_length(length, S, Bc)
    colors = plt.cm.tab20(np.arange(S) % 20)
    for z in range(2):
        for s in range(S):
            lo, hi = s * chunk, min((s + 1) * chunk, length)
            if hi > lo:
                ax.barh(z, hi - lo, left=lo, color=colors[s], edgecolor="black", lw=0.5)
                ax.text((lo + hi) / 2, z, f"({s},{z})", ha="center", va="center", fontsize=7)
    empty = [s for s in range(S) if s * chunk >= length]
    ax.set_title(f"num_splits = {S}: chunks of {chunk} keys; empty splits: {empty or 'none'}", fontsize=9)
    ax.set_yticks([0, 1], ["head 0", "head 1"])
    ax.set_xlabel("cache position (keys)")
    ax.set_xlim(0, length)
fig.suptitle("which block (split, head) reads which chunk of the cache (Bc = 32, length = 300)", fontsize=10)
fig.tight_layout()
savefig(fig, "11_decode_schedule")
plt.show()
plt.close(fig)

# %% [markdown]
# Inside a block the warps (`decode.default_warps`: 4 up to `d = 64`, 2 beyond) share each K/V tile of `Bc` keys: thread `t` computes the scores of key
# `j0 + t` for all `Nq <= 8` queries (`Q_i` stays in shared memory), each warp keeps its own running `m`, `l`
# and `O~` (FA2 Alg. 1 lines 8-10 on its 32 keys: row max by shuffles, `P~` passed lane to lane for `P~ V_j`,
# `V_j` read straight from HBM by consecutive lanes), and at the end the block merges its warps with the
# stage-2 operator and writes `O_s = O~ / l`, `L_s = m + log l`. Bottom-right causal alignment: query `i` of
# `Nq` sees cache positions `j <= length - Nq + i` (the new tokens were appended last). With grouped-query
# attention (`G` query heads per K/V head) the grid runs over the K/V heads and a block's rows are the `G · Nq`
# (query head, query) pairs of its group, up to 8: the group reads each chunk once, together.

# %%
show_source(decode.make_split)

# %% [markdown]
# ### The merge
#
# Stage 2 merged two softmax states `[m, l] ⊕ [m', l'] = [max, l·e^(m - max) + l'·e^(m' - max)]`. A split's
# log-sum-exp `L_s` is the state `[L_s, 1]`, so folding the operator over the splits gives
# `L = log Σ_s e^(L_s)`, and the output is each split's normalised output re-weighted:
# `O = Σ_s e^(L_s - L) O_s`. The merge kernel calls stage 2's device functions as they are:

# %%
show_source(softmax.merge_state)
show_source(decode.make_merge)

# %% [markdown]
# The merged result is one-pass attention, whatever the split: here 3 queries against a 200-key cache with
# spare capacity (its unwritten positions are NaN, so reading one would show), for several split counts,
# against the float64 reference and against FA2's forward.

# %%
Nq, length, d = 3, 200, 16
q = gen.standard_normal((2, Nq, d))
k, v = gen.standard_normal((2, 2, length, d))
cache = decode.KVCache(2, 256, d).append(k[:, :150], v[:, :150]).append(k[:, 150:], v[:, 150:])
print(cache)
o_ref, lse_ref = reference.attention_forward(q, k, v, causal=True)
o_fa2, _ = flashnb.attention_forward(q, k, v, causal=True, impl="fa2", Br=16, Bc=16, warps=1)
for S in (1, 2, 3, 7, 9):
    O, L = decode.decode(q, cache, causal=True, num_splits=S, warps=1)
    O, L = O.copy_to_host(), L.copy_to_host()
    print(f"num_splits = {S}: max |O - reference| = {np.abs(O - o_ref).max():.1e}, "
          f"max |L - reference| = {np.abs(L - lse_ref).max():.1e}, max |O - fa2| = {np.abs(O - o_fa2).max():.1e}")

# %% [markdown]
# ### Counted traffic against the model, and the blocks each kernel launches
#
# One decoding step (the last of the 3 queries alone, `Nq = 1`) against the same cache. The traffic counter
# runs the launches on the simulator and counts every element access; the analytic models
# (`decode.model_forward`, `fa2.model_forward`) must give the same numbers, launch by launch and array by
# array. The counter also records each launch's grid, i.e. how many blocks it launches.

# %%
q1 = q[:, -1:]                      # Nq = 1: bottom-right causal, so it sees every cached key
with traffic.count() as t:
    decode.decode(q1, cache, causal=True, num_splits=3, warps=1)
print(t)
print("flash-decoding counted == model:", t.summary() == decode.model_forward(2, 1, length, d, causal=True,
                                                                                num_splits=3, warps=1))
with traffic.count() as t2:
    fa2.forward(*(common.to_device(a) for a in (q1, k, v)), causal=True, scale=d ** -0.5)
print("fa2 counted == model:", t2.summary() == fa2.model_forward(2, 1, length, d, causal=True))
for name, tt in (("flash-decoding", t), ("fa2", t2)):
    launches = ", ".join(f"{lt.label} grid {lt.grid} = {int(np.prod(lt.grid))} blocks" for lt in tt.launches)
    print(f"{name:<15} HBM bytes counted {tt.global_bytes:>7,}: {launches}")

# %% [markdown]
# ### Modelled time against the number of splits
#
# Back to the 8-head, 32k-token step: more splits put more SMs to work until every SM has a block; past that,
# blocks queue in waves (one block more than the SMs hold costs a whole second wave of block time in this
# model, since every block of a launch is equally heavy), and the merge reads more partials. Modelled, not
# measured.

# %%
splits = [1, 2, 4, 8, 12, 16, 17, 24, 32, 33, 48, 64, 128]
times = [decode.modelled_time(BH, 1, LENGTH, D, causal=True, num_splits=S, gpu=GPU)["seconds"] * 1e6 for S in splits]
best = splits[int(np.argmin(times))]
fig, ax = plt.subplots(figsize=(7, 4))
ax.plot(splits, times, "o-", label="flash-decoding (split + merge)")
ax.axhline(f["seconds"] * 1e6, color="grey", ls="--", label=f"fa2 forward ({f['blocks']} blocks)")
ax.axvline(g["num_splits"], color="green", ls=":", label=f"heuristic: {g['num_splits']} splits")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("num_splits")
ax.set_ylabel("modelled time (µs)")
ax.set_title(f"Nq = 1, BH = {BH}, length = {LENGTH}, d = {D} on {GPU} -- modelled, not measured", fontsize=9)
ax.legend(fontsize="small")
savefig(fig, "11_decode_splits")
plt.show()
plt.close(fig)
print(f"modelled best of these: {best} splits, {min(times):.1f} µs; heuristic {g['num_splits']} splits, "
      f"{g['seconds'] * 1e6:.1f} µs; fa2 {f['seconds'] * 1e6:.1f} µs")

# %% [markdown]
# ### On a GPU
#
# The cell below times `decode` at several split counts (and the heuristic's) and FA2's forward at `Nq = 1`
# with CUDA events, on the same cache. It runs only where a GPU is present (`bench.on_gpu` starts a GPU process
# and `decode.measure_gpu` refuses to run unless `flashnb.MODE == "gpu"`); here it measures nothing.

# %%
gpu_rows = bench.on_gpu("flashnb.instruments.measure.decode:measure_gpu", BH=BH, length=LENGTH, d=D, Nq=1, splits=[1, 4, 16, None])
if gpu_rows:
    for r in gpu_rows:
        print(f"{r['impl']:<15} splits={r['num_splits']!s:>4} blocks={r['blocks']:>4} "
              f"median {r['median_ms'] * 1e3:8.1f} µs ({r['mode']} on {r['gpu_name']})")
show_source(decode.measure_gpu)

# %% [markdown]
# ## Exercises
#
# Each exercise has a check: fill in the `...` and run its cell (`...` means "not attempted yet"). Stuck?
# `exercises.hint("11.1")` gives a hint and `exercises.answer("11.1")` the worked answer -- try first.
# Levels: ★ a few lines, ★★ a small model or experiment, ★★★ a real change to a kernel.

# %%
from flashnb import exercises  # noqa: E402

# %% [markdown]
# **11.1 · The bytes of a half-precision forward** (★, ~10 min) Write `forward_bytes(BH, Nq, Nk, d, itemsize)`:
# the HBM bytes (reads + writes) of the product kernel's forward at tiles $B_r = 64$, $B_c = 32$ (no causal mask),
# with $Q, K, V, O$ stored at `itemsize` bytes per element. The check runs the kernel on the simulator in float16
# and float32 storage and counts.

# %%
forward_bytes = ...   # def forward_bytes(BH, Nq, Nk, d, itemsize): ...
passed = exercises.check("11.1", forward_bytes=forward_bytes)

# %% [markdown]
# **11.2 · Dropout in the forward, in NumPy** (★★, ~15 min) Write `dropout_forward(q, k, v, keep, p)` for one
# head: `keep` is the boolean keep-mask (as `flashnb.rng.dropout_keep_np` makes it), `p` the drop probability,
# scale $1/\sqrt{d}$. It must give what the kernel computes (FA1 Alg. 2: which softmax statistics?).

# %%
dropout_forward = ...   # def dropout_forward(q, k, v, keep, p): ...
passed = exercises.check("11.2", dropout_forward=dropout_forward)

# %% [markdown]
# **11.3 · Merging split-KV partials** (★, ~10 min) Flash-decoding's merge kernel in NumPy: write
# `merge(O_parts, L_parts)` taking $S$ splits' $O_s$ `(S, Nq, d)` (each normalised over its own keys) and
# $L_s$ `(S, Nq)` (their log-sum-exps; $-\infty$ for a split that saw no key) and returning the whole rows'
# `(O, L)`.

# %%
merge = ...   # def merge(O_parts, L_parts): ...
passed = exercises.check("11.3", merge=merge)

# %%
print(f"notebook ran in {time.perf_counter() - T_NOTEBOOK:.1f} s")
