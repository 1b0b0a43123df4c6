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
import os
import time

import matplotlib.pyplot as plt
import numpy as np

os.environ["FLASHNB_DEVICE"] = "sim"  # counting traffic needs the simulator
import flashnb
from flashnb import bench, common, decode, fa2, reference, softmax, traffic
from flashnb.notebook import savefig, show_source

T0 = time.perf_counter()
rng = np.random.default_rng(11)

# %% [markdown]
# ### Why FA2 at `Nq = 1` leaves most SMs idle
#
# The launches below are *modelled*, not run: a decoding step of 8 heads (one sequence of a model with 8
# K/V heads, `d = 128`) against a 32k-token cache, on the H100 SXM preset of `flashnb.roofline`. The model
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
q = rng.standard_normal((2, Nq, d))
k, v = rng.standard_normal((2, 2, length, d))
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
gpu_rows = bench.on_gpu("flashnb.decode:measure_gpu", BH=BH, length=LENGTH, d=D, Nq=1, splits=[1, 4, 16, None])
if gpu_rows:
    for r in gpu_rows:
        print(f"{r['impl']:<15} splits={r['num_splits']!s:>4} blocks={r['blocks']:>4} "
              f"median {r['median_ms'] * 1e3:8.1f} µs ({r['mode']} on {r['gpu_name']})")
show_source(decode.measure_gpu)

# %%
print(f"decode part ran in {time.perf_counter() - T0:.1f} s")
