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
# # A2 · FlashAttention-1 forward (Algorithm 1)
#
# You will complete the forward kernel of FlashAttention-1 as the 2022 paper wrote it (Dao et al., Alg. 1 with
# Alg. 2's scale $\tau$ and causal MASK): one thread block per (batch, head), the **outer** loop over key/value
# tiles $K_j, V_j$ (loaded into shared memory once), the **inner** loop over query tiles $Q_i$, whose running
# output $O_i$ and statistics $\ell_i, m_i$ live in HBM and are read and written back every inner iteration.
# Notebook 03 explains every line; read it first (§2 "Algorithm 1, line by line" and §3 "Split-K").
#
# The tile loops, the loads and stores, the launch and the split-K merge of the warps' partial maxima are
# given. You write the three lines of the algorithm that carry the idea:
#
# * **line 9** -- the scores $S_{ij} = \tau\, Q_i K_j^\top$ of this warp's keys, with the mask;
# * **line 11** -- the new statistics $m_i^{new} = \max(m_i, \tilde m_{ij})$ and
#   $\ell_i^{new} = e^{m_i - m_i^{new}} \ell_i + e^{\tilde m_{ij} - m_i^{new}} \tilde\ell_{ij}$;
# * **line 12** -- the rescaled output
#   $O_i \leftarrow \mathrm{diag}(\ell_i^{new})^{-1}\big(\mathrm{diag}(\ell_i)\, e^{m_i - m_i^{new}} O_i
#   + e^{\tilde m_{ij} - m_i^{new}} \tilde P_{ij} V_j\big)$.
#
# **Split-K.** The block has $W$ warps; warp $w$ owns the keys $w B_w \ldots w B_w + B_w - 1$ of the tile
# ($B_w = B_c / W$). For each row $r$ it keeps a partial maximum `m_w[w, r]`, a partial row sum `l_w[w, r]` and a
# partial $\tilde P V_j$ in `O_w[w, r, :]`, each relative to *its own* maximum. The merge (given) forms
# $\tilde m_{ij}$ (`mt`) and $\tilde\ell_{ij}$ (`lt`) from them; in line 11 you then turn `l_w[v, r]` into the
# weight by which warp $v$'s partial enters the new $O_i$, and `a_i[r]` into the weight of the old $O_i$
# -- both already divided by $\ell_i^{new}$ -- so that line 12 is one weighted sum per element.
#
# **Causal masking** is bottom-right aligned (FlashAttention $\ge$ 2.1): query $r$ may see key $c$ iff
# $c \le r + \text{diag}$ with `diag` $= N_k - N_q$ (the launcher passes it). When $N_q > N_k$ the first
# $N_q - N_k$ queries see no key at all: their output is 0 and their log-sum-exp $-\infty$ (`exp_diff` and the
# `ln > 0` test already keep such rows free of NaN). Keys past $N_k$ in the last tile are masked too.
#
# **Names you can use in the kernel** (the module namespace of `flashnb.stages.fa1`, where your factory is compiled):
# `NEG_INF`, `ZERO` (float32 constants), `float32(...)`, `math.exp`, `exp_diff(a, b)` $= e^{a-b}$ (0 when
# $a = -\infty$), `causal_allowed(row, col, diag)` ($\text{col} \le \text{row} + \text{diag}$), `cuda`. Never write a
# Python float literal (`0.0`, `1.0`) in a kernel: it makes float64 code (write `float32(0.0)`).
#
# **How this is graded** (points in brackets; the autograder also runs hidden tests on other shapes): your
# factory is run by the library's own launcher (`flashnb.attention_forward(..., impl="fa1")`), so $O$ and
# $L = m + \log \ell$ are compared with the float64 reference (every element must be written); the kernel's HBM
# **and shared-memory** traffic counted on the simulator must equal the model `fa1.model_forward` exactly (keep
# the structure of the given code: each shared value your lines need is read once per use, as in the paper's
# lines); it must be free of data races and compile for sm_80/sm_90 with no float64 and no spills. The IO, race
# and compile points are scored only once the first correctness test passes. Keep the answer cell's tag
# `answer`: it is how the grader finds your code; nothing else of the notebook is graded.

# %% tags=["setup"]
import math  # noqa: F401  -- for your kernel (math.exp)
import os

os.environ.setdefault("FLASHNB_DEVICE", "sim")   # the CUDA simulator: no GPU needed
import flashnb  # noqa: I001  -- first: it selects the simulator before anything imports numba.cuda
import numpy as np  # noqa: F401  -- for your experiments
from numba import cuda, float32  # noqa: F401  -- for your kernel

from flashnb import course, registry
from flashnb.stages import fa1
from flashnb.common import NEG_INF, ZERO, causal_allowed  # noqa: F401  -- for your kernel
from flashnb.course import criteria
from flashnb.stages.fa1 import WARP, exp_diff, load_rows, load_vec, store_rows, store_vec  # noqa: F401

# %% [markdown]
# ## Q1 · The FA1 forward kernel [15 points]
#
# Complete the three TODOs of `make_forward`. The comments left in each TODO are the paper's line numbers and
# what the removed lines computed.
#
# * **Line 9** (inside the loop over this thread's row `r`): for each of the warp's `Bw` keys `c = w * Bw + cc`,
#   the dot product of `Q_i[r, :]` and `K_j[c, :]` (over `dd` elements), scaled by `scale`; $-\infty$ for a key
#   past $N_k$ or one the causal mask forbids; store it in `S[cc]` and keep the running row maximum `mx`.
# * **Line 11** (one thread per row `r`, after the merge gave `mt`, `lt`; `mo`, `lo` are the old $m_i, \ell_i$):
#   `mn`, `ln`, the inverse `inv` of `ln` (0 when `ln` is 0), `a_i[r]` and `l_w[v, r]` for every warp `v` as above,
#   then `m_i[r]`, `l_i[r]` (line 13 stores them to HBM: given).
# * **Line 12** (element-parallel over the `Br × d` tile): `O_i[r, x] = a_i[r] O_i[r, x] + Σ_v l_w[v, r] O_w[v, r, x]`.

# %% tags=["answer"]
# flashnb-course: from flashnb.stages.fa1 import make_forward
# flashnb-course: todo scores "line 9: S[cc] = scale · Q_i[r]·K_j[c] for this warp's keys c = w·Bw + cc, -inf past Nk or where the causal mask forbids, and the row max mx"
# flashnb-course: todo statistics "line 11: m_new, l_new (and its inverse, 0 for an empty row); the weights a_i[r] of the old O_i and l_w[v, r] of each warp's partial, divided by l_new; then m_i[r], l_i[r]"
# flashnb-course: todo o-update "line 12: O_i[r, x] = a_i[r]·O_i[r, x] + Σ_v l_w[v, r]·O_w[v, r, x], element-parallel over the Br × d tile"

# %% tags=["tests"]
TILES = dict(Br=16, Bc=16, warps=2)     # small tiles: every CUDA thread is a Python thread on the simulator


def _mine(ns):
    return criteria.variant_from(ns, "make_forward", fa1.make_forward)


def _run(ns, q, k, v, causal, tiles=TILES):
    """Your factory, launched by the library's FA1 launcher: (o, lse) as NumPy arrays."""
    with registry.using(fa1.make_forward, _mine(ns)):
        return flashnb.attention_forward(q, k, v, impl="fa1", causal=causal, **tiles)


def _check(ns, seed, BH, Nq, Nk, d, causal, tiles=TILES):
    criteria.forward_close(lambda q, k, v: _run(ns, q, k, v, causal, tiles), seed, BH, Nq, Nk, d, causal=causal,
                           tiles=tiles)


def _ran_yours(run, label):
    """The launch ``label`` ran a kernel from your answer cell (the launcher's small init and L = m + log l
    launches are the library's: criteria.ran_student_kernels would count them against you)."""
    with criteria.launches() as t:
        run()
    mine = [lt for lt in t.launches if lt.label == label]
    if not mine:
        raise course.Fail(f"no {label!r} launch among {[lt.label for lt in t.launches]}")
    if not mine[0].source.startswith("<"):
        raise course.Fail(f"launch {label!r} ran flashnb's own kernel {mine[0].kernel} "
                          f"({os.path.basename(mine[0].source)}), not yours: build the kernel from your answer cell")


PUBLIC = "non-causal, 1 head, 48 x 48, d = 16 (3 x 3 tiles)"


@course.test("q1", points=4, name=PUBLIC)
def _(ns):
    _check(ns, 1, 1, 48, 48, 16, False)


@course.test("q1", points=2, name="causal, 2 heads, 40 x 40, d = 8 (a partial last tile)")
def _(ns):
    _check(ns, 2, 2, 40, 40, 8, True)


@course.test("q1", points=1, name="your kernel runs, not the library's", requires=PUBLIC)
def _(ns):
    q, k, v = criteria.qkv(3, 1, 16, 16, 8)
    _ran_yours(lambda: _run(ns, q, k, v, False), "FA1 forward")


@course.test("q1", points=2, name="IO budget: HBM and shared traffic equal fa1.model_forward", requires=PUBLIC)
def _(ns):
    q, k, v = criteria.qkv(4, 2, 40, 48, 8)
    criteria.io_budget(lambda: _run(ns, q, k, v, True),
                       fa1.model_forward(2, 40, 48, 8, causal=True, **TILES),
                       hint="FA1 reads K_j, V_j once (outer loop) and Q_i, O_i, l_i, m_i once per inner iteration; "
                            "each shared value is read once per use")


@course.test("q1", points=1, name="race-free", requires=PUBLIC)
def _(ns):
    q, k, v = criteria.qkv(5, 1, 24, 24, 4)
    criteria.race_free(lambda: _run(ns, q, k, v, True))


@course.test("q1", points=1, name="compiles for sm_80 and sm_90 (no float64, no spills)", requires=PUBLIC, timeout=240)
def _(ns):
    config = dict(Br=16, Bc=16, d=16, W=2, causal=True)
    criteria.compiles([(_mine(ns)(**config), registry.KERNELS["fa1.forward"].signature_for(config))])


# what the grader compiles before any test runs
course.compiled("make_forward", question="q1", kernels=lambda ns: [
    (_mine(ns)(**c), registry.KERNELS["fa1.forward"].signature_for(c))
    for c in [dict(Br=16, Bc=16, d=16, W=2, causal=True)]])


# %% tags=["hidden-tests"]
@course.test("q1", points=2, name="bottom-right causal with Nq != Nk (Nq > Nk: rows that see no key)",
             requires=PUBLIC)
def _(ns):
    _check(ns, 6, 2, 20, 44, 8, True)      # Nq < Nk: query r sees keys <= r + 24
    _check(ns, 7, 1, 44, 20, 8, True)      # Nq > Nk: the first 24 queries see no key (o = 0, lse = -inf)


@course.test("q1", points=2, name="N = 1, odd d, 3 heads, 4 warps, Nk not a multiple of Bc", requires=PUBLIC)
def _(ns):
    _check(ns, 8, 3, 1, 1, 7, False)
    _check(ns, 9, 2, 1, 1, 5, True)
    _check(ns, 10, 1, 23, 9, 3, False, dict(Br=8, Bc=32, warps=4))
    _check(ns, 11, 1, 5, 37, 9, False)


# %% [markdown]
# ## Check your work
#
# The public tests, with their points. They run in seconds on the simulator; a failure names the output, the row
# and tile that differ, or the array whose traffic differs from the model.

# %%
course.check()
