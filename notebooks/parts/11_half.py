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
# ## Half-precision storage: the same kernel, half the bytes
#
# FlashAttention is limited by memory traffic: its IO analysis counts *elements* read and written in HBM, and a
# GPU pays for *bytes*. Every kernel in this course so far keeps $Q, K, V, O$ in float32 (4 bytes an element).
# FlashAttention itself takes float16 or bfloat16 inputs (2 bytes) and does its arithmetic in float32: the
# matmuls accumulate in float32, and $m_i$, $\ell_i$, $L$, $D$ and the $dQ$ accumulator are float32.
#
# flashnb's `fa2` kernels do the same with one compile-time option of their factories, `storage`:
#
# * the kernel **signature** types $Q, K, V, O$ (and $dO, dK, dV$) as `float16[:, :, ::1]` (bfloat16: `uint16`
#   bit patterns, see below), and $L$, $D$, $dQ_{acc}$ stay `float32`;
# * every **load** from HBM widens an element to float32 (`to_f32`) as it goes into the float32 shared tile;
# * every **store** narrows once (`from_f32`): $O_i$ after the division by $\ell_i$, $dK_j, dV_j$ at the end;
# * $dQ$ is summed with float32 atomics from many thread blocks, so it cannot be rounded per block: a third
#   launch converts the float32 accumulator once, at the end (FlashAttention-2 ends its backward the same way).
#
# With `storage="float32"` both conversions are the identity and the kernel is the float32 kernel of
# notebooks 05-06, instruction for instruction. The lines that changed:

# %%
import os
import time

import matplotlib.pyplot as plt
import numpy as np

os.environ["FLASHNB_DEVICE"] = "sim"  # counting traffic needs the simulator; GPU timings run in a process of their own
import flashnb
from flashnb import bench, common, fa2, reference, traffic
from flashnb.notebook import savefig, show_source

T0 = time.perf_counter()
rng = np.random.default_rng(11)
show_source(fa2.make_forward, grep="_f32")

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
x = [rng.standard_normal((BH, N, d)).astype(np.float16) for _ in range(4)]   # q, k, v, do: float16 values
counts = {}
for storage in ("float32", "float16"):
    q, k, v, do = (common.to_device(a, storage) for a in x)
    with traffic.count() as t:
        o, lse = fa2.forward(q, k, v, causal=causal, scale=d ** -0.5, **tiles)
        fa2.backward(q, k, v, o, lse, do, causal=causal, scale=d ** -0.5, **tiles)
    counts[storage] = t
    model = (fa2.model_forward(BH, N, N, d, causal=causal, storage=storage, **tiles)
             + fa2.model_backward(BH, N, N, d, causal=causal, storage=storage, **tiles))
    assert t.summary() == model    # elements: exactly the model's, in both storages
    assert [(lt.read_bytes, lt.write_bytes) for lt in t.launches] == \
        [(m["read_bytes"], m["write_bytes"]) for m in fa2.model_bytes(model, storage)]


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
ax.set_title(f"fa2 forward + backward, N = {N}, d = {d}, causal (simulator count)")
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
    for model in (fa2.model_forward, fa2.model_backward):
        tot = {s: sum(r["read_bytes"] + r["write_bytes"] + r["atomic_bytes"]
                      for r in fa2.model_bytes(model(*shape, causal=True, storage=s), s))
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
    q = (rng.standard_normal((1, Nq, d)) * 60).astype(np.float16)
    k = (rng.standard_normal((1, Nk, d)) * 60).astype(np.float16)
    v = (rng.standard_normal((1, Nk, d)) * vscale).astype(np.float16)
    o_ref, _ = reference.attention_forward(*(a.astype(np.float64) for a in (q, k, v)), causal=True, scale=scale)
    o32, _ = flashnb.attention_forward(q, k, v, causal=True, scale=scale, impl="fa2", storage="float32", **tiles)
    o16, _ = flashnb.attention_forward(q, k, v, causal=True, scale=scale, impl="fa2", **tiles)
    qb, kb, vb = (common.to_bfloat16(a) for a in (q, k, v))      # bfloat16 keeps 8 bits: other inputs,
    obf, _ = flashnb.attention_forward(qb, kb, vb, causal=True, scale=scale, impl="fa2", storage="bfloat16", **tiles)
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
ax.set_title("fa2 forward vs the float64 reference")
ax.legend(fontsize=8)
savefig(fig, "11_half_error")
plt.show()

# %% [markdown]
# The relative error does not grow with the inputs' magnitude: float32 arithmetic on exact inputs, one rounding
# at the end. It sits below each format's unit roundoff, and the float16 result is the float32 kernel's rounded
# (the `==` column). `tests/test_half.py` checks the same claims with bounds derived per element (the scores'
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
# simulator's time is Python threads. And FlashAttention's main win from half precision is elsewhere: tensor
# cores multiply float16/bfloat16 matrices many times faster than the FP32 units flashnb's kernels use (numba-cuda
# has no tensor-core API), so flashnb's half storage saves bytes, not FLOPs. The cell below times the float32
# and half kernels with CUDA events when a GPU is present (in this process when `flashnb.MODE == "gpu"`, else in
# a child process on the machine's GPU); without one it prints that nothing was measured.

# %%
gpu_rows = bench.on_gpu("flashnb.bench:measure_storage", BH=16, N=4096, d=64, repeats=10)
if gpu_rows:
    for r in gpu_rows:
        print(f"{r['storage']:>9} {r['direction']:>8}: {r['median_ms']:8.3f} ms, modelled "
              f"{r['model_bytes'] / 2**20:8.1f} MiB  ({r['gpu_name']})")
print(f"part 11 (half storage) ran in {time.perf_counter() - T0:.1f} s")
