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
# # A3 · FlashAttention-2 forward: split-Q warps, causal block skipping, log-sum-exp
#
# You will complete the forward kernel of FlashAttention-2 (Dao 2023, Alg. 1). Against FA1 (assignment A2) three
# things changed, and notebook 05 counts each of them; read it first:
#
# 1. **The grid runs over query blocks.** Thread block $(i, z)$ loads $Q_i$ once, keeps the output $\tilde O_i$ and
#    the statistics $m_i, \ell_i$ in *registers* for the whole loop over $K_j, V_j$, and writes $O_i$ and
#    $L_i = m_i + \log \ell_i$ once at the end. Nothing but $K_j, V_j$ crosses HBM inside the loop.
# 2. **Delayed rescaling.** $\tilde O_i$ is kept *unnormalised*: per tile it is only multiplied by
#    $e^{m_i^{old} - m_i^{new}}$, and divided by $\ell_i$ once, after the last tile (lines 10 and 12).
# 3. **Split-Q warps.** Each warp owns $B_r / \text{warps}$ query rows and sees the whole key tile, so no warp ever
#    needs another warp's partial result. The 32 lanes of a warp form a $4 \times 8$ grid (`LR` $\times$ `LC`):
#    lane `(lr, lc)` owns the rows `r0 + LR·a` (`a < TM`), the key columns `lc + LC·b` (`b < TN`) of $S$ and the
#    head-dim columns `lc + LC·c` (`c < DN`) of $O$. One row of $S$ is spread over the 8 lanes of its row group, so
#    a row's maximum and sum are reduced with `cuda.shfl_xor_sync(FULL_MASK, x, off)` over `off = 4, 2, 1`.
#
# **Causal block skipping.** With a causal mask, a K/V tile whose keys all lie after the last key any row of the
# block may see is never loaded: query $r$ sees key $c$ iff $c \le r + \text{diag}$, `diag` $= N_k - N_q$
# (bottom-right alignment, FlashAttention $\ge$ 2.1; the launcher passes it). The IO test counts exactly the
# tiles FA2 visits (`fa2.tiles_visited`): a kernel that visits every tile and masks gives the right numbers and
# loses those points. When $N_q > N_k$, a block whose rows all precede the first key visits no tile at all:
# its rows get $O = 0$ and $L = -\infty$ (the backward needs exactly that $L$).
#
# **Names you can use in the kernel** (the module namespace of `flashnb.stages.fa2`, where your factory is compiled):
# `NEG_INF`, `ZERO`, `ONE` (float32 constants), `float32(...)`, `math.exp`, `math.log`, `cuda`, `FULL_MASK`
# (all 32 lanes take part in a shuffle), `LR = 4`, `LC = 8`, `cdiv_dev(a, b)` (ceiling division). Never write a
# Python float literal (`0.0`, `1.0`) in a kernel: it makes float64 code.
#
# **How this is graded** (points in brackets; the autograder also runs hidden tests on other shapes): your
# factory is run by the library's own launcher (`flashnb.attention_forward(..., impl="fa2")`); $O$ **and** the
# log-sum-exp $L$ are compared with the float64 reference (`flashnb.reference.attention_forward`; every element
# must be written); the counted HBM and shared-memory traffic must equal `fa2.model_forward` exactly (keep the
# given structure); the kernel must be free of data races and compile for sm_80/sm_90 with no float64 and no
# spills. The IO, race and compile points are scored only once the first correctness test passes. Keep the answer
# cell's tag `answer`; nothing else of the notebook is graded.

# %% tags=["setup"]
import math  # noqa: F401  -- for your kernel (math.exp, math.log)
import os

os.environ.setdefault("FLASHNB_DEVICE", "sim")   # the CUDA simulator: no GPU needed
import flashnb  # noqa: I001  -- first: it selects the simulator before anything imports numba.cuda
import numpy as np  # noqa: F401  -- for your experiments
from numba import cuda, float32, int32  # noqa: F401  -- for your kernel

from flashnb import course, registry
from flashnb.stages import fa2
from flashnb.common import NEG_INF, ONE, ZERO  # noqa: F401  -- for your kernel
from flashnb.course import criteria
from flashnb.stages.fa2 import FULL_MASK, LC, LR, cdiv_dev, geometry, group_sum  # noqa: F401  -- for your kernel

# %% [markdown]
# ## Q1 · The FA2 forward kernel [16 points]
#
# Complete the three TODOs of `make_forward` (the comments left in each TODO are what the removed lines did).
#
# The factory's `sparse` flag (block-sparse FlashAttention, notebook 07) is False in this assignment: leave its
# lines as they are.
#
# * **Causal block skipping** (in `fa2_forward`, before the loop over tiles): when `causal`, lower `n_tiles` to the
#   number of K/V tiles that hold a key some row of this block may see. The block's last row is
#   `min(i0 + Br, Nq) - 1`; a block whose last row sees no key visits no tile.
# * **Lines 9-10, the online update** (in `fa2_tile`, per row `a` of this lane, after the row maximum `mx` of the
#   tile has been reduced over the row group): the new maximum `m_new`, the factor `alpha` $= e^{m^{old} - m^{new}}$,
#   $\tilde P = e^{S - m^{new}}$ in place of `S[a, b]` and its sum `rs` over this lane's columns, then `l[a]`
#   (this lane's partial row sum: rescaled by `alpha`, plus `rs`), `m[a]`, and the rescale of this lane's `Oi[a, :]`
#   by `alpha` (the given code then adds $\tilde P V_j$). A row that has seen no key yet has `m_new` $= -\infty$:
#   then $\tilde P = 0$ and `alpha` $= 1$ -- never compute $e^{-\infty - (-\infty)}$ (NaN).
# * **Lines 12-14, the epilogue** (after the last tile): reduce each row's `l[a]` over the 8 lanes of its row group,
#   write $O_i = \tilde O_i / \ell_i$ (0 for a row with $\ell_i = 0$) for the rows `< Nq` and the columns `< d` this
#   lane owns, and $L_i = m_i + \log \ell_i$ ($-\infty$ when $\ell_i = 0$) from one lane of the row group.

# %% tags=["answer"]
# flashnb-course: from flashnb.stages.fa2 import make_forward
# flashnb-course: todo causal-skip "causal block skipping: visit only the K/V tiles holding a key some row of this block may see (row r sees keys <= r + diag); none when the block's last row sees no key"
# flashnb-course: todo online-update "lines 9-10: m_new, alpha = e^(m_old - m_new), P~ = e^(S - m_new) in S[a, b] and its sum rs (P~ = 0, alpha = 1 while m_new = -inf); l[a], m[a]; rescale Oi[a, :] by alpha"
# flashnb-course: todo epilogue "lines 12-14: l summed over the row group's 8 lanes (group_sum(l[a], LC), a shfl_xor_sync butterfly), O = O~ / l (0 when l = 0) for rows < Nq and columns < d, L = m + log l (-inf when l = 0) written by one lane"

# %% tags=["tests"]
TILES = dict(Br=16, Bc=16, warps=2)     # small tiles: every CUDA thread is a Python thread on the simulator


def _mine(ns):
    return criteria.variant_from(ns, "make_forward", fa2.make_forward)


def _run(ns, q, k, v, causal, tiles=TILES):
    """Your factory, launched by the library's FA2 launcher: (o, lse) as NumPy arrays."""
    with registry.using(fa2.make_forward, _mine(ns)):
        return flashnb.attention_forward(q, k, v, impl="fa2", causal=causal, **tiles)


def _check(ns, seed, BH, Nq, Nk, d, causal, tiles=TILES):
    criteria.forward_close(lambda q, k, v: _run(ns, q, k, v, causal, tiles), seed, BH, Nq, Nk, d, causal=causal,
                           tiles=tiles)


PUBLIC = "non-causal, 1 head, 48 x 48, d = 16 (o and lse)"


@course.test("q1", points=4, name=PUBLIC)
def _(ns):
    _check(ns, 1, 1, 48, 48, 16, False)


@course.test("q1", points=2, name="causal, 2 heads, 40 x 40, d = 8 (a partial last tile)")
def _(ns):
    _check(ns, 2, 2, 40, 40, 8, True)


@course.test("q1", points=1, name="your kernel runs, not the library's", requires=PUBLIC)
def _(ns):
    q, k, v = criteria.qkv(3, 1, 16, 16, 8)
    criteria.ran_student_kernels(lambda: _run(ns, q, k, v, False), expect=1)


@course.test("q1", points=3, name="IO budget, causal 64 x 64: only the visited K/V tiles (fa2.model_forward)",
             requires=PUBLIC)
def _(ns):
    q, k, v = criteria.qkv(4, 1, 64, 64, 8)
    criteria.io_budget(lambda: _run(ns, q, k, v, True), fa2.model_forward(1, 64, 64, 8, causal=True, **TILES),
                       hint="FA2 reads Q_i once, K_j and V_j once per visited tile, and writes O and L once; under "
                            "causal, a tile entirely above the diagonal is never visited (fa2.tiles_visited)")


@course.test("q1", points=1, name="race-free", requires=PUBLIC)
def _(ns):
    q, k, v = criteria.qkv(5, 1, 32, 24, 4)
    criteria.race_free(lambda: _run(ns, q, k, v, True))


@course.test("q1", points=1, name="compiles for sm_80 and sm_90 (no float64, no spills)", requires=PUBLIC, timeout=240)
def _(ns):
    config = dict(Br=16, Bc=16, d=16, warps=2, causal=True)
    criteria.compiles([(_mine(ns)(**config), registry.KERNELS["fa2.forward"].signature_for(config))])


# what the grader compiles before any test runs
course.compiled("make_forward", question="q1", kernels=lambda ns: [
    (_mine(ns)(**c), registry.KERNELS["fa2.forward"].signature_for(c))
    for c in [dict(Br=16, Bc=16, d=16, warps=2, causal=True)]])


# %% tags=["hidden-tests"]
@course.test("q1", points=2, name="bottom-right causal with Nq != Nk (Nq > Nk: rows and blocks that see no key)",
             requires=PUBLIC)
def _(ns):
    _check(ns, 6, 2, 20, 44, 8, True)      # Nq < Nk: query r sees keys <= r + 24
    _check(ns, 7, 1, 44, 20, 8, True)      # Nq > Nk: the first 24 queries see no key (o = 0, lse = -inf)


@course.test("q1", points=2, name="N = 1, odd d, 3 heads, 1 and 4 warps, Nk not a multiple of Bc", requires=PUBLIC)
def _(ns):
    _check(ns, 8, 3, 1, 1, 7, False)
    _check(ns, 9, 2, 1, 1, 5, True)
    _check(ns, 10, 1, 23, 9, 3, False, dict(Br=16, Bc=8, warps=4))
    _check(ns, 11, 1, 5, 37, 9, True, dict(Br=8, Bc=16, warps=1))


# %% [markdown]
# ## Check your work
#
# The public tests, with their points. They run in seconds on the simulator; a failure names the output, the row
# and tile that differ, or the array whose traffic differs from the model.

# %%
course.check()
