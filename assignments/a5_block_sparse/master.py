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
# # A5 · Block-sparse FlashAttention: skip the tiles a mask zeroes
#
# Block-sparse FlashAttention (FA1 paper, Algorithm 5) is FlashAttention with one `if` around the body of the
# loop over K/V tiles: a block mask $M \in \{0, 1\}^{T_r \times T_c}$ holds one bit per $B_r \times B_c$ tile of
# the score matrix, and a tile with $M_{ij} = 0$ is **never loaded and never computed**. The attention it
# computes is the masked one, $S_{kl} = -\infty$ wherever $M_{\lfloor k/B_r \rfloor \lfloor l/B_c \rfloor} = 0$,
# and its HBM traffic is $\Theta(Nd + N^2 d^2 s / M)$ (Proposition 4), $s$ the fraction of nonzero blocks.
# Notebook 07 explains it on the library's FA2 kernels; read it first.
#
# You will write the part of the FA2 forward kernel that decides **which K/V tiles a query block visits**
# (Q1), count the traffic that saves (Q2), and explain why the decision is made the way it is (Q3).
#
# **How this is graded** (points in brackets; the autograder also runs hidden tests on other shapes):
# correctness against a float64 reference that applies the block mask, the kernel's HBM traffic counted on the
# simulator against the algorithm's IO model `fa2.model_forward(..., block_mask=...)` *exactly* (a kernel that
# loads every tile and discards the masked ones gets the right answer and loses those points), freedom from
# data races (`flashnb.sim.racecheck`), and compiling for sm_80/sm_90 with no float64, shared memory within
# 48 KiB and no spills. The numbers of Q2 are checked by the autograder; Q3 is read by a person. Fill in the
# cells marked `TODO`, run the check cell, and submit this notebook. Keep the answer cells (their tag
# `answer` is how the grader finds them); nothing else of the notebook is graded.
#
# Never write a Python float literal (`0.0`, `1.5`) or a true division (`/`) of integers in a kernel: both make
# float64 code. Integer ceiling division on the device is `cdiv_dev(a, b)`.

# %% tags=["setup"]
import math  # noqa: F401  -- for your kernels
import os

os.environ.setdefault("FLASHNB_DEVICE", "sim")   # the CUDA simulator: no GPU needed
import flashnb  # noqa: F401, I001  -- first: it selects the simulator before anything imports numba.cuda
import numpy as np
from numba import cuda, float32, int32  # noqa: F401  -- for your kernels

from flashnb.stages import block_sparse as bs
from flashnb import common, course, reference, registry
from flashnb.stages import fa2
from flashnb.common import NEG_INF, ONE, ZERO  # noqa: F401  -- float32 constants for your kernels
from flashnb.course import criteria
from flashnb.stages.fa2 import FULL_MASK, LC, LR, cdiv_dev, geometry  # noqa: F401  -- what make_forward uses

# %% [markdown]
# ## Q1 · Which K/V tiles does a query block visit? [14 points]
#
# Below is the whole FA2 forward kernel factory (`fa2.make_forward`, notebook 05), with two pieces cut out.
# Thread block `(blockIdx.x, z)` owns query block $i$ = `blockIdx.x` of head `z`, keeps $Q_i$ in shared memory,
# and loops over K/V tiles `jt = 0, 1, ...`, loading $K_j, V_j$ into shared memory and updating its running
# $m, \ell, \tilde O$ (`fa2_tile`, given). Write:
#
# 1. **The causal limit.** `n_tiles`, the number of K/V tiles the loop runs over: all $\lceil N_k / B_c\rceil$
#    of them, or, with `causal`, only those up to the tile holding the last key any row of this block may see
#    (row $r$ sees keys $\le r + $ `diag`; rows past $N_q$ do not exist). A block whose rows see no key at all
#    visits no tile. Tiles above the diagonal are then never loaded (`fa2_tile` masks the scores of the tiles
#    that cross the diagonal).
# 2. **The block-sparse skip** (compiled only when `sparse`): tile `jt` is skipped, `continue`, when
#    `M[z, blockIdx.x, jt] == 0`. The skip must be **block-uniform** -- every thread of the block takes the
#    same branch, since the loop body has barriers -- and cheap: lane 0 of each warp reads the one-byte
#    entry and hands it to the other 31 lanes with `cuda.shfl_sync(FULL_MASK, value, 0)` (shuffle an
#    `int32`, not the uint8).
#
# The IO model the autograder holds your kernel to (`fa2.model_forward(BH, Nq, Nk, d, causal=..., Br=, Bc=,
# warps=, block_mask=)`): $Q$ read once, $O$ and $L$ written once; $K_j$ and $V_j$ read once per *visited*
# tile (within the causal limit and $M_{ij} = 1$); and one read of $M_{ij}$ per warp for every tile within the
# causal limit (the entry must be read to be tested).
#
# Zero allowed tiles in a block row is legal: those rows get $O = 0$ and $L = -\infty$ (the epilogue, given,
# already does that when nothing was accumulated).

# %% tags=["answer"]
# flashnb-course: from flashnb.stages.fa2 import make_forward
# flashnb-course: todo tile-count "n_tiles: the number of K/V tiles this query block loops over -- all ceil(Nk/Bc), or with causal only up to the tile of the last key its rows may see (0 if none)"
# flashnb-course: todo block-skip "block-sparse (only if sparse): skip tile jt when M[z, blockIdx.x, jt] == 0 -- lane 0 of each warp reads it, the warp shares it by shuffle, the whole block skips together"

# %% tags=["tests"]
def _mine(ns):
    return criteria.variant_from(ns, "make_forward", fa2.make_forward)


def _forward(ns, q, k, v, bm, *, causal=False, Br=16, Bc=16, warps=1):
    """The library's launcher with your kernel factory: device arrays in, numpy (o, lse) out."""
    with registry.using(fa2.make_forward, _mine(ns)):
        O, L = fa2.forward(*(common.to_device(a) for a in (q, k, v)), causal=causal, scale=q.shape[-1] ** -0.5,
                           Br=Br, Bc=Bc, warps=warps, block_mask=bm)
    return O.copy_to_host(), L.copy_to_host()


def _mask(rows, Br=16, Bc=16):
    return bs.BlockMask(np.array(rows, dtype=bool), Br, Bc)


def _check_forward(ns, seed, BH, Nq, Nk, d, bm, *, causal=False, Br=16, Bc=16, warps=1, case=""):
    q, k, v = criteria.qkv(seed, BH, Nq, Nk, d)
    o, lse = _forward(ns, q, k, v, bm, causal=causal, Br=Br, Bc=Bc, warps=warps)
    mask = np.broadcast_to(bm.expand(Nq, Nk).reshape((-1, Nq, Nk)), (BH, Nq, Nk))
    want_o, want_lse = reference.attention_forward(q, k, v, causal=causal, mask=mask)
    with np.errstate(invalid="ignore"):     # -inf - (-inf) in the rows with no allowed key
        criteria.close(o, want_o, what="o", rows_per_tile=Br, case=case)
        criteria.close(lse, want_lse, what="lse", rows_per_tile=Br, case=case)


# an asymmetric mask, every block row and column with a nonzero block (read transposed, it is another mask)
_M4 = [[1, 0, 0, 1],
       [0, 1, 1, 0],
       [1, 1, 0, 0],
       [0, 0, 1, 1]]


@course.test("q1", points=3, name="block-sparse forward matches float64 (N = 64, d = 16, 16x16 tiles)")
def _(ns):
    _check_forward(ns, 1, 1, 64, 64, 16, _mask(_M4), case="4x4 block mask, not causal")


@course.test("q1", points=2, name="causal, sliding-window mask", requires="block-sparse forward matches float64 "
                                                                         "(N = 64, d = 16, 16x16 tiles)")
def _(ns):
    _check_forward(ns, 2, 1, 64, 64, 16, bs.local(64, 64, 16, 16, 2), causal=True,
                   case="causal, local window of 2 blocks")


_Q1_OK = "block-sparse forward matches float64 (N = 64, d = 16, 16x16 tiles)"


@course.test("q1", points=1, name="your kernel runs, not the library's", requires=_Q1_OK)
def _(ns):
    q, k, v = criteria.qkv(3, 1, 32, 32, 8)
    criteria.ran_student_kernels(lambda: _forward(ns, q, k, v, _mask([[1, 0], [1, 1]])), expect=1)


@course.test("q1", points=2, name="IO budget: only the allowed K/V tiles are loaded", requires=_Q1_OK)
def _(ns):
    q, k, v = criteria.qkv(4, 1, 64, 64, 16)
    bm = _mask([[1, 0, 1, 0], [0, 1, 1, 0]], Br=32, Bc=16)    # 2 query blocks of 32 rows, 2 warps each
    criteria.io_budget(lambda: _forward(ns, q, k, v, bm, Br=32, Bc=16, warps=2),
                       fa2.model_forward(1, 64, 64, 16, Br=32, Bc=16, warps=2, block_mask=bm),
                       hint="K_j and V_j are read only for tiles with M_ij = 1; lane 0 of each warp reads M_ij "
                            "once per tile and shares it by shuffle")


@course.test("q1", points=1, name="IO budget, causal: no tile above the diagonal is loaded or tested",
             requires=_Q1_OK)
def _(ns):
    q, k, v = criteria.qkv(5, 1, 64, 64, 16)
    bm = _mask([[1, 1, 0, 1], [0, 1, 1, 1], [1, 0, 1, 1], [1, 1, 0, 1]])   # allows tiles above the diagonal
    criteria.io_budget(lambda: _forward(ns, q, k, v, bm, causal=True),
                       fa2.model_forward(1, 64, 64, 16, causal=True, Br=16, Bc=16, warps=1, block_mask=bm),
                       hint="with causal, the loop stops at the tile of the last key the block's rows may see: "
                            "tiles beyond it are neither loaded nor their M_ij read")


@course.test("q1", points=1, name="race-free", requires=_Q1_OK)
def _(ns):
    q, k, v = criteria.qkv(6, 1, 32, 32, 8)
    criteria.race_free(lambda: _forward(ns, q, k, v, _mask([[0, 1], [1, 1]])))


@course.test("q1", points=1, name="compiles for sm_80 and sm_90 (no float64, no spills)", requires=_Q1_OK,
             timeout=240)
def _(ns):
    cfg = dict(Br=64, Bc=32, d=64, warps=4, causal=True, sparse=True)   # fa2's default forward tiles at d = 64
    sig = registry.KERNELS["fa2.forward"].signature_for(cfg)
    criteria.compiles([(_mine(ns)(**cfg), sig)])


# what the grader compiles before any test runs
course.compiled("make_forward", question="q1", kernels=lambda ns: [
    (_mine(ns)(**c), registry.KERNELS["fa2.forward"].signature_for(c))
    for c in [dict(Br=64, Bc=32, d=64, warps=4, causal=True, sparse=True)]])


# %% tags=["hidden-tests"]
@course.test("q1", points=2, name="Nq != Nk, a block row with no allowed tile (o = 0, lse = -inf), two heads "
                                  "with their own masks", requires=_Q1_OK)
def _(ns):
    heads = bs.BlockMask(np.array([[[1, 0, 0, 1], [0, 0, 0, 0], [0, 1, 1, 1]],
                                   [[0, 1, 0, 0], [1, 1, 0, 1], [0, 0, 0, 0]]], dtype=bool), 16, 16)
    _check_forward(ns, 7, 2, 40, 64, 12, heads, case="2 heads, Nq = 40, Nk = 64, d = 12, per-head masks")


@course.test("q1", points=1, name="causal with Nq > Nk (query blocks that see no key) and Nq < Nk",
             requires=_Q1_OK)
def _(ns):
    _check_forward(ns, 8, 1, 56, 24, 8, _mask([[1, 1], [1, 0], [0, 1], [1, 1]]), causal=True,
                   case="causal, Nq = 56, Nk = 24")
    _check_forward(ns, 9, 1, 24, 56, 8, _mask([[1, 0, 1, 1], [1, 1, 0, 1]]), causal=True,
                   case="causal, Nq = 24, Nk = 56")


# %% [markdown]
# ## Q2 · What the skip saves [6 points]
#
# One head, $N = N_q = N_k = 1024$, $d = 64$, fa2's default forward tiles at $d = 64$: $B_r = 64$, $B_c = 32$,
# 4 warps, float32 arrays (4 bytes) and a one-byte mask. The forward is causal (`causal=True`) with the causal
# sliding-window mask `bs.local(1024, 1024, 64, 32, window=4)`: query block $I$ may see key block $J$ when
# $J$ is one of its diagonal key blocks or one of the `window` - 1 key blocks before the first of them (notebook 07,
# "Patterns"). Count, by reasoning about the tiles (you may check your reasoning with code):
#
# * **(a)** `kv_bytes`: the HBM bytes of $K$ and $V$ the block-sparse forward reads.
# * **(b)** `traffic_ratio`: *all* HBM bytes of the block-sparse forward (every read and write: $Q$, $K$, $V$,
#   the mask entries, $O$, $L$) divided by all HBM bytes of the dense causal FA2 forward (`causal=True`, no
#   mask, same tiles).
# * **(c)** `s_star`: now take a random **non-causal** block mask of density $s$ at the same tiles. Its $K, V$
#   bytes grow in proportion to $s$. At which density $s^*$ do they equal the bytes of $Q$ read plus $O$ written?
#   (Below $s^*$, the $Nd$ term of Proposition 4 is most of the traffic.)

# %% tags=["answer"]
N, d, Br, Bc, warps, window = 1024, 64, 64, 32, 4, 4
Tr, Tc = N // Br, N // Bc

kv_bytes = ...
traffic_ratio = ...
s_star = ...
### BEGIN SOLUTION count the visited tiles, then the bytes; set kv_bytes, traffic_ratio and s_star
# query block I (rows 64I .. 64I+63) has its diagonal keys in key blocks 2I and 2I+1 (Br = 2 Bc); the window
# adds the window - 1 blocks before 2I: blocks max(0, 2I - window + 1) .. 2I + 1
visited = sum(min(window + 1, 2 * I + 2) for I in range(Tr))
kv_bytes = 2 * visited * Bc * d * 4
# dense causal: key blocks 0 .. 2I+1 of every query block I; both read Q and write O and L once
causal_tiles = sum(2 * I + 2 for I in range(Tr))
nd_bytes = (2 * N * d + N) * 4
# the block-sparse forward also reads one byte of M per warp for every tile within the causal limit
sparse_total = nd_bytes + kv_bytes + warps * causal_tiles
dense_total = nd_bytes + 2 * causal_tiles * Bc * d * 4
traffic_ratio = sparse_total / dense_total
# K and V at density s: 2 s Tr Tc Bc d elements; Q read and O written: 2 N d elements
s_star = (2 * N * d) / (2 * Tr * Tc * Bc * d)
### END SOLUTION

# %% tags=["tests"]
@course.test("q2", points=0, name="kv_bytes, traffic_ratio and s_star are numbers (the autograder checks "
                                  "their values)")
def _(ns):
    for name in ("kv_bytes", "traffic_ratio", "s_star"):
        value = ns.get(name, ...)
        if value is ... or value is None:
            raise course.Fail(f"{name}: not answered yet (still `...`)")
        if not isinstance(value, (int, float, np.integer, np.floating)) or not np.isfinite(value):
            raise course.Fail(f"{name}: expected a finite number, got {value!r}")


# %% tags=["hidden-tests"]
def _q2_nbytes(model):
    """HBM bytes of a model: float32 arrays, the uint8 block mask M."""
    return sum(n * (1 if name == "M" else 4) for launch in model for kind in ("reads", "writes", "atomics")
               for name, n in launch[kind].items())


def _q2_models():
    N, d = 1024, 64
    sparse = fa2.model_forward(1, N, N, d, causal=True, block_mask=bs.local(N, N, 64, 32, 4))
    dense_causal = fa2.model_forward(1, N, N, d, causal=True, Br=64, Bc=32, warps=4)
    dense = fa2.model_forward(1, N, N, d, Br=64, Bc=32, warps=4)
    return sparse[0], dense_causal, dense[0]


@course.test("q2", points=2, name="(a) K and V bytes of the block-sparse forward")
def _(ns):
    sparse, _, _ = _q2_models()
    criteria.numeric(ns.get("kv_bytes"), 4 * (sparse["reads"]["K"] + sparse["reads"]["V"]), what="kv_bytes",
                     rtol=0.01)


@course.test("q2", points=2, name="(b) all bytes, block-sparse / dense causal")
def _(ns):
    sparse, dense_causal, _ = _q2_models()
    criteria.numeric(ns.get("traffic_ratio"), _q2_nbytes([sparse]) / _q2_nbytes(dense_causal),
                     what="traffic_ratio", rtol=0.01)


@course.test("q2", points=2, name="(c) the density where K + V bytes equal Q + O bytes")
def _(ns):
    _, _, dense = _q2_models()          # K, V bytes at density s: s times the dense ones
    criteria.numeric(ns.get("s_star"), (dense["reads"]["Q"] + dense["writes"]["O"])
                     / (dense["reads"]["K"] + dense["reads"]["V"]), what="s_star", rtol=0.01)


# %% [markdown]
# ## Q3 · Why block-uniform, and what never shrinks [4 points, graded by a person]
#
# Answer in the cell below, in a few sentences each:
#
# 1. Your skip is decided once per thread block: lane 0 of each warp reads $M_{ij}$ and every thread takes the
#    same branch. What would go wrong if the threads of one block could decide differently (for example
#    with a mask given per query *row* instead of per $B_r \times B_c$ block)? What would a per-row mask cost
#    in the loop over K/V tiles, and why does FlashAttention's block mask have exactly the granularity of its
#    tiles?
# 2. As $s \to 0$, which traffic of the forward does not shrink? Name the terms (with their size in $N$, $d$,
#    $T_r$, $T_c$) and one change to the kernel or the mask format that would remove or shrink one of them.

# %% [markdown] tags=["answer-prose"]
# *Your answer to Q3 here (double-click to edit).*

# %% [markdown] tags=["solution-only"]
# **Q3, a model answer.**
#
# 1. The loop body has `cuda.syncthreads()` around the K/V tile load: if some threads of a block skipped a tile
#    and others did not, the two groups would reach different barriers (or one a barrier the other never
#    reaches) -- undefined behaviour, in practice a hang or a K/V tile read while another warp overwrites it.
#    The tile is loaded *cooperatively* by all warps into shared memory that all warps read, so a tile is either
#    needed by the block or not: the natural unit of skipping is the $B_r \times B_c$ tile. With a per-row mask
#    the block would have to load $K_j, V_j$ whenever *any* of its rows needs them (an OR over the rows, itself
#    a reduction per tile) and mask the others' scores element by element: no IO saved unless whole tiles are
#    empty, and a mask $B_r$ times larger to read. A block mask at the tile size makes the test one
#    byte per tile (per warp) and the saving exact: the skipped tile is never loaded.
# 2. What does not shrink: the $Nd$ term -- $Q$ read once ($N d$), $O$ written once ($N d$), $L$ ($N$) -- since
#    every query block runs even when it visits no tile; and the mask reads, one byte per warp for every tile
#    within the causal limit, $\propto T_r T_c \cdot$ warps, not $\propto s$. Remedies: store the mask as a list of
#    nonzero blocks per row (CSR: row pointers and column indices), so the loop runs over the nonzero blocks
#    and reads $\propto s\,T_r T_c$ entries; read $M_{ij}$ once per block (thread 0 into shared memory) instead of
#    once per warp; skip query blocks with no nonzero block entirely (their $O = 0$, $L = -\infty$ could be
#    written by a cheaper kernel or by the launcher), which saves their $Q_i$ reads.

# %% tags=["tests"]
course.manual("q3", points=4, rubric="1: barriers (syncthreads in the loop) must be reached by all threads / the "
              "K,V tile is loaded cooperatively and shared by all warps, so skipping is per tile; a per-row mask "
              "saves no IO unless a whole tile is empty (2 points). 2: the Nd term (Q read, O and L written) and "
              "the mask reads ~ Tr·Tc·warps stay as s -> 0; one sound remedy (CSR mask, one read per block, "
              "skip empty query blocks) (2 points)")

# %% [markdown]
# ## Check your work
#
# The public tests, with their points. Each runs in seconds on the simulator; a failure names the output, the
# row and the tile that differ, or the array whose traffic differs from the model.

# %%
course.check()
