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
# # 13 · Beyond one GPU: context parallelism (ring attention)
#
# A sequence too long for one GPU is split over **W ranks**: each holds $n = N/W$ tokens of $Q$, $K$ and $V$.
# Every query still needs every key, so the K/V shards travel: around a **ring** of ranks, one hop per step
# (Ring Attention, Liu et al. 2023), or gathered once by every rank (Llama 3). At each step a rank computes its
# queries against the K/V it holds and folds the partial result into its $(O, L)$ with notebook 02's merge
# operator -- the same $[m, \ell] \oplus [m', \ell']$ that joins tiles inside one kernel, now joining
# devices:
#
# $$L = \log\left(e^{L_a} + e^{L_b}\right), \qquad O = O_a\, e^{L_a - L} + O_b\, e^{L_b - L}.$$
#
# `flashnb.distributed` builds this on `torch.distributed` (gloo on a CPU machine, NCCL on GPUs) with
# flashnb's own kernels computing the blocks. This notebook starts real process groups on this machine -- one
# process per rank -- and **counts** what the ring does: the pairs each rank attends under a causal mask, the
# bytes per step against the formulas, the compute and wait time per rank, the K/V each rank holds; then it
# models when the transfers hide behind the compute on NVLink and InfiniBand, and shows a wrong backward whose
# forward is still right.
#
# Ranks are processes, and a process can only start a function it can import: the workers live in
# `flashnb.distributed.lessons` and `flashnb.distributed.demo`, and `flashnb.distributed.launch.run` starts
# them (a function defined in a cell of this notebook could not be sent to another process).

# %%
import os
import time

T_NOTEBOOK = time.perf_counter()
os.environ["FLASHNB_DEVICE"] = "sim"  # the simulator runs the kernels (a GPU would only change the block compute)

import matplotlib.pyplot as plt
import numpy as np

import flashnb
from flashnb.distributed import LAYOUTS, RingStats, blocks, launch, lessons, model, positions, ring
from flashnb.instruments import roofline, traffic
from flashnb.notebook import savefig, show_source

print(flashnb.MODE, "mode;", "layouts:", LAYOUTS)

# %% [markdown]
# ## Three ways to split a sequence
#
# `positions(N, layout, rank, W)` is the list of global token positions a rank holds, in its local order.
# *Contiguous* gives rank $r$ one block of $n$ consecutive tokens. *Zigzag* cuts the sequence into $2W$
# chunks and gives rank $r$ chunks $r$ and $2W-1-r$: one early, one late. *Striped* deals the tokens out like
# cards: $r, r+W, r+2W, \dots$. Within a rank the positions are always increasing.

# %%
W, N = 4, 32
for layout in LAYOUTS:
    print(f"{layout:>10}: " + " | ".join(" ".join(f"{p:2d}" for p in positions(N, layout, r, W)[:8]) + " …"
                                         for r in range(W)))

owner = {layout: np.zeros(N, dtype=int) for layout in LAYOUTS}
for layout in LAYOUTS:
    for r in range(W):
        owner[layout][positions(N, layout, r, W)] = r
fig, axes = plt.subplots(3, 1, figsize=(9, 2.6), sharex=True)
for ax, layout in zip(axes, LAYOUTS):
    im = ax.imshow(owner[layout][None, :], aspect="auto", cmap="tab10", vmin=0, vmax=9)
    ax.set_yticks([0], [layout])
axes[-1].set_xlabel("global token position")
axes[0].set_title(f"which rank holds each token (W = {W}, N = {N})")
handles = [plt.Rectangle((0, 0), 1, 1, color=plt.cm.tab10(r)) for r in range(W)]
fig.legend(handles, [f"rank {r}" for r in range(W)], loc="center right", fontsize=8)
fig.subplots_adjust(right=0.85)
savefig(fig, "13_layouts")
plt.show()

# %% [markdown]
# ## The ring schedule
#
# At step $t$ rank $r$ holds the K/V of rank $s = (r - t) \bmod W$. Before computing, it posts the send of that
# K/V to rank $r+1$ and the receive of the next one from rank $r-1$, so the transfer runs *while* the step's
# blocks are computed; only then does it wait. After $W-1$ hops every K/V shard has visited every rank.

# %%
show_source(ring.RingSchedule.forward)
print("rank r holds the K/V of rank (r - t) mod W at step t:")
print("       " + "".join(f"t={t:<3}" for t in range(W)))
for r in range(W):
    print(f"rank {r}  " + "".join(f"{(r - t) % W:<5}" for t in range(W)))

# %% [markdown]
# ### Which blocks a step computes
#
# The causal mask is a mask of *global* positions: key $\le$ query. Because both position lists are
# increasing, query row $i$ sees a prefix of the keys it is given, of length $c_i$. `blocks.plan` cuts the rows
# where $c_i$ is constant into **full** blocks (no mask, on the first $c_i$ keys), rows where $c_i$ rises by
# one into **diagonal** blocks -- flashnb's bottom-right aligned `causal=True` on exactly the keys the last
# row sees, which places the diagonal -- and skips rows that see nothing. No new kernel, no per-step mask:

# %%
show_source(blocks.plan)
for layout in LAYOUTS:
    r = 1
    print(f"{layout}, rank {r}:")
    for t in range(W):
        s = (r - t) % W
        plan = blocks.plan_for(N, layout, W, r, s, True)
        print(f"  step {t} (K/V of rank {s}): " + ("nothing" if not plan else "; ".join(
            f"rows {b.row0}-{b.row1 - 1} × keys 0-{b.keys - 1} {'causal, diag ' + str(b.diag) if b.causal else 'full'}"
            for b in plan)))

# %% [markdown]
# The partials are merged in float32. One detail matters: a row that saw no key in *either* partial has
# $L_a = L_b = -\infty$, and $e^{L_a - L}$ would be $e^{-\infty - (-\infty)}$ = NaN. The merge takes the
# exponents against 0 on such rows, so they stay $O = 0$, $L = -\infty$:

# %%
show_source(blocks.merge)

# %% [markdown]
# ## Running it: four ranks on this machine
#
# `launch.run(worker, W, ...)` starts W processes, sets up a gloo process group in each, and calls the
# worker on every rank. `lessons.run_cases` runs a list of cases in that one group, each through
# `demo.check`: the same seeded q, k, v, dO on every rank, each rank keeps its shard, runs `ring_attention`
# forward and backward, and the gathered o, dq, dk, dv are compared with float64 attention on the whole
# sequence. These runs use `Exact()` blocks (float64 arithmetic from the definition) so that many cases fit in
# seconds; the kernels run below.

# %%
show_source(flashnb.distributed.demo.check)

# %%
common = dict(B=1, H=2, H_kv=1, d=16, impl="exact")
work_cases = [dict(common, N=64, layout=layout, mode="ring", causal=True) for layout in LAYOUTS]
memory_Ns = (32, 64, 128, 256)
memory_cases = [dict(common, N=n_tok, layout="zigzag", mode=mode, causal=True)
                for mode in ("ring", "allgather") for n_tok in memory_Ns]
stale_case = dict(common, H_kv=2, N=32, layout="zigzag", mode="ring", causal=True, schedule="stale-kv")
t0 = time.perf_counter()
out = launch.run(lessons.run_cases, W, work_cases + memory_cases + [stale_case], timeout=300)
print(f"{len(out[0])} cases on {W} ranks in {time.perf_counter() - t0:.1f} s (process start included)")
results = out[0]                      # every rank returns the same gathered results; rank 0's
work, memory, stale = results[:3], results[3:3 + len(memory_cases)], results[-1]
for r in work + memory:
    errs = ", ".join(f"{k} {e['max_abs']:.1e}" for k, e in r["errors"].items())
    print(f"{r['layout']:>10} {r['mode']:>9} N={r['N']:<4} ok={r['ok']}  max |error| vs float64: {errs}")
assert all(r["ok"] for r in work + memory)

# %% [markdown]
# ## Causal work per rank and step
#
# Every rank records, per step, the (query, key) pairs its blocks attend (`RingStats`). Under a causal mask a
# contiguous shard's queries see all of an earlier shard, half of their own and nothing of a later one: the
# last rank works at every step, the first only at step 0. Zigzag pairs a cheap chunk with an expensive one;
# striped shifts the diagonal by at most one token.

# %%
fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
imbalance = {}
for ax, r in zip(axes, work):
    st = RingStats.combine([r["stats"]])
    counted = np.array([[next(x.pairs for x in st.select(phase="forward", rank=k) if x.step == t) for t in range(W)]
                        for k in range(W)])
    assert np.array_equal(counted, model.pairs_per_step(r["layout"], W, r["N"], True))   # the formulas, exactly
    imbalance[r["layout"]] = (model.imbalance(counted), model.step_imbalance(counted))
    im = ax.imshow(counted, cmap="viridis", vmin=0, vmax=(r["N"] // W) ** 2)
    for k in range(W):
        for t in range(W):
            ax.text(t, k, counted[k, t], ha="center", va="center", color="w" if counted[k, t] < 150 else "k",
                    fontsize=8)
    ax.set_title(f"{r['layout']}: max/mean {imbalance[r['layout']][0]:.3f}", fontsize=10)
    ax.set_xlabel("step t")
axes[0].set_ylabel("rank")
fig.colorbar(im, ax=axes, label="attended (q, k) pairs per head")
fig.suptitle(f"causal pairs per rank and step (W = {W}, N = {work[0]['N']}), counted by the ranks")
savefig(fig, "13_causal_work")
plt.show()
n = work[0]["N"] // W
for layout, (tot, path) in imbalance.items():
    print(f"{layout:>10}: max/mean work per rank {tot:.3f}, ring critical path / ideal {path:.3f}, "
          f"long-shard limit {model.imbalance_limit(layout, W):.3f}")
print(f"contiguous at n = {n}: exact (2n²(W-1) + n(n+1)) / (n²(W-1) + n(n+1)) = "
      f"{(2 * n * n * (W - 1) + n * (n + 1)) / (n * n * (W - 1) + n * (n + 1)):.3f}; (2W-1)/W = {(2 * W - 1) / W:.3f}")

# %% [markdown]
# Every step of a ring lasts as long as its busiest rank. With contiguous shards some rank computes a full
# $n^2$ block at every step but the first, while the mean rank does half of that: the ring's critical path is
# $(2W-1)/W$ times the ideal for long shards (the print above counts it at this $n$). Zigzag is balanced
# exactly; striped to within the diagonal's $n$ pairs.

# %% [markdown]
# ## Bytes per step, against the formulas and the kernels' HBM traffic
#
# A ring forward sends each rank's K/V shard $W-1$ hops: $(W-1)\cdot 2\,n\,H_{kv}\,d\,b$ bytes per rank and
# sequence, whatever the layout or the mask. The backward sends K/V the same way and dK/dV (float32) $W$ hops,
# the last one home. The ranks count the bytes of the tensors they hand to `torch.distributed`:

# %%
r = work[1]                                          # zigzag, ring
st = RingStats.combine([r["stats"]])
msg = model.kv_message_bytes(r["B"], r["N"] // W, r["H_kv"], r["d"], 4)
for phase in ("forward", "backward"):
    tot = [st.totals(phase=phase, rank=k)["sent_bytes"] for k in range(W)]
    print(f"{phase:>8}: sent per rank {tot}, formula {r['formula'][phase]:,} B (one K/V message: {msg:,} B)")
    assert all(x == r["formula"][phase] for x in tot)

tiles = dict(Br=16, Bc=16, warps=1)
dkv = model.kv_message_bytes(r["B"], r["N"] // W, r["H_kv"], r["d"], 4)     # dK/dV travel in float32
print(f"\nrank 1, zigzag: bytes on the link per step, the formula's, and the HBM bytes of the step's kernels "
      f"(the product kernel's traffic model, tiles {tiles})")
print(f"{'phase':>8} {'step':>4} {'link sent B':>12} {'formula B':>10} {'HBM B (model)':>14} {'HBM / link':>10}")
ratios = []
for phase in ("forward", "backward"):
    for rec in st.select(phase=phase, rank=1):
        hop = msg if rec.step < W - 1 else 0                      # K/V: one hop per step but the last
        want = hop + (dkv if phase == "backward" else 0)          # dK/dV: every step, the last one home
        assert rec.sent_bytes == want
        plan = blocks.plan_for(r["N"], "zigzag", W, 1, rec.src, True)
        hbm = model.block_hbm_bytes(plan, r["B"], r["H"], r["H_kv"], r["d"], phase, **tiles)
        ratios += [hbm / rec.sent_bytes] if rec.sent_bytes else []
        ratio = f"{hbm / rec.sent_bytes:.1f}" if rec.sent_bytes else "(no send)"
        print(f"{phase:>8} {rec.step:>4} {rec.sent_bytes:>12,} {want:>10,} {hbm:>14,} {ratio:>10}")
print(f"HBM bytes per link byte: {min(ratios):.1f} to {max(ratios):.1f}")
hbm_bw = roofline.GPUS["H100 SXM"].hbm_bandwidth
print("H100 HBM bandwidth over a link's (datasheet): " +
      ", ".join(f"{name} {hbm_bw / link.bandwidth:.0f}x" for name, link in model.LINKS.items()))

# %% [markdown]
# The HBM column is the product kernel's traffic model for the blocks of each step. The traffic counter checks it on one of
# them, the step-0 diagonal block of rank 1, run here on the simulator:

# %%
plan0 = blocks.plan_for(r["N"], "zigzag", W, 1, 1, True)
b = plan0[0]
rng = np.random.default_rng(13)
q = rng.standard_normal((r["B"], r["H"], b.rows, r["d"])).astype(np.float32)
k, v = (rng.standard_normal((r["B"], r["H_kv"], b.keys, r["d"])).astype(np.float32) for _ in range(2))
with traffic.count() as t:
    flashnb.attention_forward(q, k, v, causal=b.causal, impl="flash", **tiles)
counted_hbm = t.global_read_bytes + t.global_write_bytes
print(f"block {b}: counted {counted_hbm:,} HBM bytes, model {model.block_hbm_bytes(plan0, r['B'], r['H'], r['H_kv'], r['d'], 'forward', **tiles):,}")
assert counted_hbm == model.block_hbm_bytes(plan0, r["B"], r["H"], r["H_kv"], r["d"], "forward", **tiles)

# %% [markdown]
# A step's kernels move a few times more bytes through HBM than the ring moves over the link, but HBM is
# several to tens of times faster than a link between GPUs (both ratios printed above). What decides
# whether the transfer is hidden is the compute it runs beside: that grows like $n^2$ per step, the link bytes
# like $n$ -- the overlap condition below.

# %% [markdown]
# ## Compute and wait, per rank: flashnb's kernels in the ring
#
# Now the blocks are flashnb's product kernel on the simulator, two ranks (so that on a two-core machine they do
# not share a core), contiguous against zigzag, causal. Each rank records when it computed and when
# it waited on a transfer. Times are simulator seconds -- Python running every CUDA thread -- so only the
# *shape* carries over to a GPU: who works, who waits.

# %%
W2 = 2
kernel_cases = [dict(N=32, B=1, H=2, H_kv=1, d=16, layout=layout, mode="ring", causal=True, impl="flash")
                for layout in ("contiguous", "zigzag")]
t0 = time.perf_counter()
# each layout twice in the same ranks: the first runs compile the kernels (whichever ran first would carry that
# cost), the second are the ones timed and drawn
kout = launch.run(lessons.run_cases, W2, kernel_cases * 2, timeout=300)[0][len(kernel_cases):]
print(f"2 warm-up and 2 timed runs through the product kernel in {time.perf_counter() - t0:.1f} s")
for r in kout:
    print(f"{r['layout']:>10}: {r['impl']}, ok={r['ok']}, " +
          ", ".join(f"{k} {e['max_abs']:.1e} (bound {e['bound']:.0e})" for k, e in r["errors"].items()))
assert all(r["ok"] for r in kout)

# %%
fig, axes = plt.subplots(2, 1, figsize=(10, 3.6), sharex=False)
colors = {"compute": "tab:blue", "wait": "tab:red"}
for ax, r in zip(axes, kout):
    st = RingStats.combine([r["stats"]])
    start = min(s[1] for rec in st.records for s in rec.spans)
    for rec in st.records:
        y = rec.rank + (0.0 if rec.phase == "forward" else 0.4)
        for kind, a, b_ in rec.spans:
            ax.broken_barh([(a - start, b_ - a)], (y, 0.35), color=colors[kind],
                           alpha=1.0 if rec.phase == "forward" else 0.55)
    ax.set_yticks([k + d_ for k in range(W2) for d_ in (0.17, 0.57)],
                  [f"rank {k} {p}" for k in range(W2) for p in ("fwd", "bwd")], fontsize=8)
    ax.set_title(f"{r['layout']}, causal, W = {W2}: per-rank compute and wait (simulator seconds)", fontsize=10)
    ax.set_xlabel("seconds since the first step")
handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
axes[0].legend(handles, list(colors), loc="upper right", fontsize=8)
fig.tight_layout()
savefig(fig, "13_timeline")
plt.show()
for r in kout:
    st = RingStats.combine([r["stats"]])
    print(f"{r['layout']:>10}: " + "; ".join(
        f"rank {k} computes {st.totals(rank=k)['compute_s']:.2f} s, waits {st.totals(rank=k)['wait_s']:.2f} s"
        for k in range(W2)))

# %% [markdown]
# In the contiguous ring rank 0 has nothing to compute at step 1 (rank 1's keys are all in its future), so in
# the backward it sits waiting for the dK/dV rank 1 is still computing; zigzag gives both ranks the same work.
# (The simulator's per-launch overhead blurs the durations; the pairs above are the exact account.)

# %% [markdown]
# ## Memory per rank: O(N/W) against O(N)
#
# A ring holds two K/V shards at a time (the one it computes with and the one arriving), the backward two
# dK/dV buffers more: $O(N/W)$. An all-gather holds all $W$ shards at once, $O(N)$ -- Llama 3 accepts that for
# its simpler schedule. The ranks counted the bytes of the K/V buffers they held:

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
for ax, phase in zip(axes, ("forward", "backward")):
    for mode, color in (("ring", "tab:blue"), ("allgather", "tab:orange")):
        got = [max(x["kv_bytes_held"] for x in r["stats"] if x["phase"] == phase and x["rank"] == 0)
               for r in memory if r["mode"] == mode]
        assert got == [model.kv_bytes_held(mode, phase, W, 1, n_tok // W, 1, 16) for n_tok in memory_Ns]
        ax.plot(memory_Ns, got, "o-", color=color, label=f"{mode}, W = {W} (counted by the ranks)")
        ax.plot(memory_Ns, [model.kv_bytes_held(mode, phase, 2 * W, 1, n_tok // (2 * W), 1, 16) for n_tok in memory_Ns],
                ":", color=color, label=f"{mode}, W = {2 * W} (model{': on the W = 4 line' if mode == 'allgather' else ''})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("sequence length N")
    ax.set_title(f"{phase}: K/V{' + dK/dV' if phase == 'backward' else ''} buffers held by one rank", fontsize=10)
    ax.legend(fontsize=8)
axes[0].set_ylabel("bytes (H_kv = 1, d = 16, float32)")
savefig(fig, "13_memory")
plt.show()
for w in (W, 2 * W):
    ratio = (model.kv_bytes_held("allgather", "forward", w, 1, memory_Ns[-1] // w, 1, 16)
             / model.kv_bytes_held("ring", "forward", w, 1, memory_Ns[-1] // w, 1, 16))
    print(f"W = {w}: an all-gather holds {ratio:.0f}x the ring's K/V (W/2: all W shards against two)")

# %% [markdown]
# ## When do the transfers hide?
#
# A step computes $c$ queries against $c$ keys, $4c^2 d H$ FLOPs, while $2 c\, d\, H_{kv}\, b$ bytes cross
# the link. The transfer hides when $4c^2dH/F \ge 2c\,d\,H_{kv}\,b/B$:
#
# $$c \;\ge\; \frac{b\,H_{kv}}{2H}\cdot\frac{F}{B} \qquad (= F/B \text{ for bf16 and } H_{kv} = H).$$
#
# A model with datasheet numbers (the dense bf16 tensor rate of one H100, one direction of NVLink 4 and of an
# InfiniBand NDR port), not a measurement:

# %%
F = roofline.GPUS["H100 SXM"].tensor_fp16_dense
c = np.logspace(1, 6, 200)
fig, ax = plt.subplots(figsize=(7, 4))
compute = [model.step_times(ci, 128, 32, 32, 2, F, 1.0)[0] for ci in c]
ax.loglog(c, compute, color="k", label="compute, 4c²dH / F (H100 dense bf16)")
for (name, link), color in zip(model.LINKS.items(), ("tab:green", "tab:orange")):
    transfer = [model.step_times(ci, 128, 32, 32, 2, F, link.bandwidth)[1] for ci in c]
    c_min = model.min_block_tokens(F, link.bandwidth, H=32, H_kv=32, itemsize=2)
    ax.loglog(c, transfer, color=color, label=f"K/V transfer over {name}")
    ax.axvline(c_min, color=color, ls=":", label=f"hides for c ≥ {c_min:,.0f} tokens")
    print(f"{name:>26}: {link.bandwidth / 1e9:,.0f} GB/s per direction -> c ≥ {c_min:,.0f} tokens per rank "
          f"(H_kv = H/8: {model.min_block_tokens(F, link.bandwidth, H=32, H_kv=4, itemsize=2):,.0f})")
ax.set_xlabel("tokens per rank and step, c")
ax.set_ylabel("seconds per step (model)")
ax.set_title("overlap condition: d = 128, H = H_kv = 32, bf16")
ax.legend(fontsize=8)
savefig(fig, "13_overlap")
plt.show()

# %% [markdown]
# Within a node a few thousand tokens per GPU suffice; across nodes a ring step needs blocks of tens of
# thousands of tokens, or fewer K/V heads (grouped-query attention sends $H_{kv}$ heads, computes $H$), or
# the ring only inside a node. (A causal step of a balanced layout computes half the pairs for the same bytes:
# it needs twice the tokens.)

# %% [markdown]
# ## A wrong backward whose forward is right
#
# The backward is a second ring, and it can be wrong while every forward check passes. `StaleKVRing` waits for
# every transfer -- nothing hangs, the byte counts are right -- but its backward keeps computing with the K/V
# it already held instead of the one that arrived:

# %%
show_source(lessons.StaleKVRing)
for name, e in stale["errors"].items():
    print(f"stale K/V, {name}: max |error| vs float64 {e['max_abs']:.2e} (bound {e['bound']:.1e}) "
          f"{'ok' if e['ok'] else 'WRONG'}")
assert stale["errors"]["o"]["ok"] and not stale["errors"]["dq"]["ok"]

# %% [markdown]
# The output is exact, so a forward test, a loss curve's first step or an inference benchmark all pass. Only
# gradients against a single-device reference catch it -- which is why `tests/distributed/test_distributed.py` asserts dq,
# dk and dv for every layout, mode and W in {2, 3, 4}, not only o.

# %% [markdown]
# ## On GPUs
#
# The same code runs with NCCL, one GPU per rank: `torchrun --standalone --nproc_per_node 8 -m
# flashnb.distributed.demo --N 8192`, and `scripts/ring_gpu_check.py` runs every layout and mode on the GPUs of
# a machine and records per-step times and peak memory (on a CPU machine it rehearses the same steps with
# gloo and marks every row as a rehearsal). This notebook measured nothing on a GPU.

# %% [markdown]
# ## Exercises
#
# Each exercise has a check: fill in the `...` and run its cell (`...` means "not attempted yet"). Stuck?
# `exercises.hint("13.1")` gives a hint and `exercises.answer("13.1")` the worked answer -- try first.
# Levels: ★ a few lines, ★★ a small model or experiment, ★★★ a real change to a kernel.

# %%
from flashnb import exercises  # noqa: E402

# %% [markdown]
# **13.1 · The zigzag layout** (★, ~5 min) Write `zigzag(N, rank, world)`: the global positions rank `rank`
# holds, in its local order.

# %%
zigzag = ...   # def zigzag(N, rank, world): ...
passed = exercises.check("13.1", zigzag=zigzag)

# %% [markdown]
# **13.2 · The diagonal of a striped step** (★, ~10 min) With the striped layout, write
# `striped_offset(rank, src, world)`: the offset $o$ such that query row $i$ of `rank` may see key row $j$ of
# `src` exactly when $j \le i + o$.

# %%
striped_offset = ...   # def striped_offset(rank, src, world): ...
passed = exercises.check("13.2", striped_offset=striped_offset)

# %% [markdown]
# **13.3 · Causal work per rank and step** (★★, ~20 min) Write `pairs(layout, W, N)` for `"contiguous"` and
# `"zigzag"`: the `(W, W)` array of (query, key) pairs rank $r$ attends at step $t$ under a causal mask.

# %%
pairs = ...   # def pairs(layout, W, N): ...
passed = exercises.check("13.3", pairs=pairs)

# %% [markdown]
# **13.4 · The ring's bytes** (★, ~10 min) Write `ring_bytes(phase, W, B, N, H_kv, d, itemsize)`: the bytes one
# rank sends in the ring's forward or backward (dK/dV travel in float32).

# %%
ring_bytes = ...   # def ring_bytes(phase, W, B, N, H_kv, d, itemsize): ...
passed = exercises.check("13.4", ring_bytes=ring_bytes)

# %% [markdown]
# **13.5 · When the transfers hide** (★★, ~15 min) Write `min_tokens(flops, bandwidth, itemsize, H, H_kv)`: the
# smallest block whose modelled compute time covers its K/V transfer.

# %%
min_tokens = ...   # def min_tokens(flops, bandwidth, itemsize, H, H_kv): ...
passed = exercises.check("13.5", min_tokens=min_tokens)

# %%
print(f"notebook ran in {time.perf_counter() - T_NOTEBOOK:.1f} s")
