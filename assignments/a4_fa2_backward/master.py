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
# # A4 · FlashAttention-2 backward: recompute P from L, D, dQ by atomics
#
# The backward pass of attention needs $dQ, dK, dV$ from $Q, K, V, O, dO$ and the one statistic the forward
# saved per query row, $L_i = m_i + \log \ell_i$. FlashAttention never stores the $N_q \times N_k$ matrix $P$:
# the backward **recomputes** it tile by tile, and since $L$ already holds the row maximum and the normaliser,
# $P_{ij} = \exp(\tau S_{ij} - L_i)$ is exact in one step (no online softmax this time). You will write the
# heart of FA2's **Algorithm 2** (notebook 06 explains it; read it first):
#
# | line | |
# |---|---|
# | 4 | (separate kernel, Q1) $D_i = \mathrm{rowsum}(dO_i \circ O_i)$; also zero the $dQ$ accumulator |
# | 5–9 | one thread block per K/V column block $j$; for each query block $i$: load $Q_i, dO_i, L_i, D_i$ (given) |
# | 10–11 | $S_{ij} = Q_i K_j^\top$ (given), $P_{ij} = \exp(\tau S_{ij} - L_i)$ (**Q2**) |
# | 12 | $dV_j \mathrel{+}= P_{ij}^\top dO_i$ (given) |
# | 13–14 | $dP_{ij} = dO_i V_j^\top$ (given), $dS_{ij} = P_{ij} \circ (dP_{ij} - D_i)$ (**Q2**) |
# | 15 | $dQ_i \mathrel{+}= \tau\, dS_{ij} K_j$ -- **atomic adds in HBM** (**Q2**) |
# | 16, 18 | $dK_j \mathrel{+}= \tau\, dS_{ij}^\top Q_i$; write $dK_j, dV_j$ once (given) |
#
# ($\tau$ is the softmax scale, `scale` in the kernels.)
#
# **How this is graded** (points in brackets; the autograder also runs hidden tests on other shapes):
# correctness of $D$, $dQ$, $dK$, $dV$ against a float64 reference; the HBM traffic of your kernels, counted
# on the simulator, against the algorithm's IO model at the same tiles (`fa2.model_backward`: a kernel that
# reads more than the algorithm needs loses those points); freedom from data races (`flashnb.sim.racecheck`,
# which also sees races *between thread blocks*, which the simulator, running blocks one after another,
# never shows you as a wrong result); compiling for sm_80/sm_90 with no float64, shared memory within 48 KiB
# and no spills. The IO, race and compile points are scored only once your kernel is correct. Your kernels
# run with the library's own launcher (`fa2.backward`), so keep the factories' names and arguments.
#
# Fill in the cells marked `TODO`, run the check cell after each question, and submit this notebook. Keep the
# answer cells (their tag `answer` is how the grader finds them); nothing else of the notebook is graded.
#
# **Names you can use inside the kernels** (your factories are compiled in the namespace of `flashnb.stages.fa2`):
# `NEG_INF`, `ZERO`, `ONE` (float32 constants), `float32(...)`, `math.exp`, `cuda.atomic.add`,
# `cuda.shfl_down_sync`, `FULL_MASK`, `PRE_WARPS` (rows per block of the preprocessing kernel), `LR`, `LC`
# (a warp's 4 × 8 lane grid), `cdiv_dev`. Never write a Python float literal (`0.0`, `-math.inf`) in a
# kernel: it makes float64 code.

# %% tags=["setup"]
import math  # noqa: F401  -- for your kernels (math.exp)
import os

os.environ.setdefault("FLASHNB_DEVICE", "sim")   # the CUDA simulator: no GPU needed
import flashnb  # first: it selects the simulator before anything imports numba.cuda

# isort: split
import numpy as np
from numba import cuda, float32  # noqa: F401  -- for your kernels

from flashnb import common, course, reference, registry
from flashnb.common import NEG_INF, ONE, ZERO, cdiv  # noqa: F401  -- for your kernels
from flashnb.course import criteria
from flashnb.stages import fa2
from flashnb.stages.fa2 import FULL_MASK, LC, LR, PRE_WARPS, cdiv_dev, geometry  # noqa: F401  -- names the kernels use

# %% [markdown]
# ## Q1 · The preprocessing kernel: $D = \mathrm{rowsum}(dO \circ O)$ [5 points]
#
# $D_i = \sum_j P_{ij}\, dP_{ij}$ is needed by every column block; since $O = PV$ and $dP = dO\,V^\top$ it
# equals $\sum_e dO_{ie}\, O_{ie}$, a dot product of two rows of length $d$. One **warp** per query row
# `i` (grid `(ceil(Nq / PRE_WARPS), BH)`, `32·PRE_WARPS` threads): lane `lane` takes the head-dim columns
# `e = lane, lane + 32, ...` (so any $d$ works, also $d > 32$) and, while it is there, writes 0 into
# `dQ[z, i, e]` (the main kernel *adds* into `dQ`). Then the warp sums its 32 partial sums with
# `cuda.shfl_down_sync(FULL_MASK, acc, off)` for `off = 16, 8, 4, 2, 1`, after which lane 0 holds the row's
# total and writes `D[z, i]` (given). Each element of `O` and `dO` is read once.

# %% tags=["answer"]
# flashnb-course: from flashnb.stages.fa2 import make_preprocess
# flashnb-course: todo rowsum "Alg. 2 line 4: add this lane's products dO·O over e = lane, lane + 32, ... into acc, and zero dQ[z, i, e] there"
# flashnb-course: todo warp-sum "sum acc over the 32 lanes of the warp with cuda.shfl_down_sync (lane 0 ends with the row's total)"

# %% tags=["tests"]
def _mine(ns, name):
    """Your factory ``name`` as a variant of the library's (run by the library's launchers)."""
    where = getattr(getattr(ns.get(name), "__code__", None), "co_filename", "")
    if os.path.abspath(where).startswith(os.path.dirname(os.path.abspath(flashnb.__file__)) + os.sep):
        raise course.Fail(f"{name} is flashnb's own factory (imported?): define it in your answer cell")
    return criteria.variant_from(ns, name, getattr(fa2, name))


def _preprocess(ns, o, do):
    """Your preprocessing kernel launched exactly as fa2.backward launches it; returns (D, dQ)."""
    mine = _mine(ns, "make_preprocess")
    BH, Nq, d = o.shape
    D, dQ = common.empty((BH, Nq)), common.empty((BH, Nq, d))        # NaN-poisoned: unwritten elements show
    common.launch(mine(), (cdiv(Nq, PRE_WARPS), BH), 32 * PRE_WARPS, common.to_device(o), common.to_device(do),
                  D, dQ, label="D = rowsum(dO∘O)")
    return D.copy_to_host(), dQ.copy_to_host()


def _check_preprocess(ns, seed, BH, Nq, d):
    rng = np.random.default_rng(seed)
    o, do = (rng.standard_normal((BH, Nq, d)).astype(np.float32) for _ in range(2))
    D, dQ = _preprocess(ns, o, do)
    case = f"{BH} head(s) x {Nq} rows, d = {d}"
    criteria.close(D, (o.astype(np.float64) * do).sum(axis=-1), what="D", case=case)
    criteria.close(dQ, np.zeros(dQ.shape), what="dq (must be zeroed)", case=case)


# (a name holding ':' is taken as a full test id in requires=, so requires= gets the full ids "q1: ...")
Q1_OK = "q1: D = rowsum(dO∘O) and dQ = 0, 2 heads x 9 rows, d = 40"


@course.test("q1", points=2, name=Q1_OK[4:])
def _(ns):
    _check_preprocess(ns, 1, 2, 9, 40)


@course.test("q1", points=1, name="IO budget: O and dO read once, D and dQ written once",
             requires=Q1_OK)
def _(ns):
    rng = np.random.default_rng(2)
    o, do = (rng.standard_normal((2, 8, 40)).astype(np.float32) for _ in range(2))
    criteria.io_budget(lambda: _preprocess(ns, o, do), fa2.model_backward(2, 8, 8, 40)[:1],
                       hint="each element of O and dO is read once; D and dQ are written once (no atomics)")


@course.test("q1", points=1, name="compiles for sm_80 and sm_90 (no float64, no spills)",
             requires=Q1_OK, timeout=240)
def _(ns):
    mine = _mine(ns, "make_preprocess")
    criteria.compiles([(mine(), fa2._PRE_SIG)])


# what the grader compiles before any test runs
course.compiled("make_preprocess", question="q1", kernels=lambda ns: [(_mine(ns, "make_preprocess")(), fa2._PRE_SIG)])


# %% tags=["hidden-tests"]
@course.test("q1", points=1, name="other shapes: d = 1, d = 70 (three columns per lane), one row, 3 heads",
             requires=Q1_OK)
def _(ns):
    _check_preprocess(ns, 3, 3, 5, 1)
    _check_preprocess(ns, 4, 1, 1, 70)


# %% [markdown]
# ## Q2 · The main kernel: recompute $P$, form $dS$, add into $dQ$ [16 points]
#
# Grid `(ceil(Nk / Bc), BH)`: thread block `j` owns the key rows `j0 .. j0 + Bc - 1` and walks every query
# block `i` (rows `i0 .. i0 + Br - 1`). The warps split the `Bc` key rows; lane `(lr, lc)` owns key rows
# `c0 + LR·a` (`a < TM`) and query columns `r = lc + LC·b` (`b < TN`) of the **transposed** score tile, held in
# registers: `S[a, b]` $= (Q_i K_j^\top)_{r, c}$ (no scale yet) and `dP[a, b]` $= (dO_i V_j^\top)_{r, c}$.
# Three parts are yours:
#
# * **line 11** -- overwrite `S[a, b]` with $P = \exp(\tau S - L_r)$, where `Lr`, `Dr` (loaded for you)
#   are $L$ and $D$ of query row `i0 + r`. $P$ is 0 for a key `key >= Nk` (the padding of the last tile),
#   for a key the causal mask hides, and for a row with $L = -\infty$ (a query that sees no key at all: never
#   `exp(-inf - (-inf))`). The causal mask is **bottom-right aligned** (FlashAttention ≥ 2.1): query row
#   `i` sees keys `0 .. i + diag` with `diag = Nk - Nq` (given as a kernel argument), so with $N_q > N_k$
#   the first $N_q - N_k$ rows see nothing.
# * **line 14** -- overwrite `dP[a, b]` with $dS = P \circ (dP - D_r)$.
# * **line 15** -- once every warp has put its $dS^\top$ into shared memory (`dSs[c, r]`, given), each thread
#   forms some elements `(r, k)` of $\tau\, dS\, K_j$ (`acc` $= \sum_c$ `dSs[c, r] · KsT[k, c]`) and adds them
#   into `dQ[z, i0 + r, k]` for the rows `< Nq`. Every column block adds into the same $dQ_i$ at the same
#   time on a GPU: a plain `+=` loses updates. Read `dSs` and `KsT` once per term (the IO test counts
#   shared-memory accesses too).

# %% tags=["answer"]
# flashnb-course: from flashnb.stages.fa2 import make_backward
# flashnb-course: todo recompute-p "Alg. 2 line 11: P = exp(scale·S - L_r) into S[a, b]; 0 for a key >= Nk, a causal-masked key and a row with L_r = -inf"
# flashnb-course: todo ds "Alg. 2 line 14: dS = P ∘ (dP - D_r) into dP[a, b]"
# flashnb-course: todo dq-update "Alg. 2 line 15: acc = Σ_c dSs[c, r]·KsT[k, c]; add scale·acc into dQ[z, i0 + r, k] for rows < Nq (other thread blocks add into it too)"

# %% tags=["tests"]
# Your make_backward runs after a copy of the library's preprocessing kernel (so Q1 does not count twice)
_GIVEN_PREPROCESS = registry.variant(fa2.make_preprocess, filename="<given make_preprocess>")
_RUNS: dict = {}


def _problem(seed, BH, Nq, Nk, d, causal):
    q, k, v, do = criteria.qkv(seed, BH, Nq, Nk, d, do=True)
    o, lse = reference.attention_forward(q, k, v, causal=causal)
    return (q, k, v, o, lse, do), reference.attention_backward(q, k, v, do, causal=causal)


def _backward(ns, args, *, causal, Br, Bc, warps=1):
    """fa2.backward (the library's launcher) with your make_backward: (dq, dk, dv) on the host."""
    mine = _mine(ns, "make_backward")
    with registry.using(fa2.make_backward, mine), registry.using(fa2.make_preprocess, _GIVEN_PREPROCESS):
        return flashnb.attention_backward(*args, causal=causal, impl="fa2", Br=Br, Bc=Bc, warps=warps,
                                          check_forward=False)


def _grads(ns, seed, BH, Nq, Nk, d, *, causal=False, Br, Bc, warps=1):
    """(got, want, case) of one problem; the run is kept for the next test of the same answer."""
    key = (seed, BH, Nq, Nk, d, causal, Br, Bc, warps)
    fn = ns.get("make_backward")
    if key in _RUNS and _RUNS[key][0] is fn:
        return _RUNS[key][1]
    args, want = _problem(seed, BH, Nq, Nk, d, causal)
    got = _backward(ns, args, causal=causal, Br=Br, Bc=Bc, warps=warps)
    case = (f"{'causal' if causal else 'not causal'}, BH = {BH}, Nq = {Nq}, Nk = {Nk}, d = {d}, "
            f"Br = {Br}, Bc = {Bc}, warps = {warps}")
    _RUNS[key] = (fn, (got, want, case))
    return got, want, case


def _check(ns, seed, BH, Nq, Nk, d, *, which="qkv", **kw):
    (dq, dk, dv), (wq, wk, wv), case = _grads(ns, seed, BH, Nq, Nk, d, **kw)
    for name, got, want, rows in (("dv", dv, wv, kw["Bc"]), ("dk", dk, wk, kw["Bc"]), ("dq", dq, wq, kw["Br"])):
        if name[1] in which:
            criteria.close(got, want, what=name, rows_per_tile=rows, case=case)


_BIG = dict(seed=5, BH=1, Nq=32, Nk=32, d=16, Br=16, Bc=8)    # 4 column blocks add into every dQ row
Q2_DV = "q2: dV = Pᵀ dO, P recomputed from L (1 head x 32 x 32, d = 16, Br = 16, Bc = 8)"
Q2_DKDQ = "q2: dK and dQ, dS = P∘(dP − D), dQ summed over 4 column blocks (same problem)"
Q2_CAUSAL = "q2: causal, Nq = Nk = 20, d = 8 (the last Q and K/V tiles are partial)"


@course.test("q2", points=2, name=Q2_DV[4:])
def _(ns):
    _check(ns, which="v", **_BIG)


@course.test("q2", points=3, name=Q2_DKDQ[4:])
def _(ns):
    _check(ns, which="kq", **_BIG)


@course.test("q2", points=2, name=Q2_CAUSAL[4:])
def _(ns):
    _check(ns, 6, 1, 20, 20, 8, causal=True, Br=8, Bc=8)


@course.test("q2", points=1, name="your kernel runs, not the library's", requires=(Q2_DV, Q2_DKDQ))
def _(ns):
    args, _ = _problem(7, 1, 16, 16, 8, False)
    criteria.ran_student_kernels(lambda: _backward(ns, args, causal=False, Br=8, Bc=4), expect=2)


@course.test("q2", points=2, name="race-free (4 column blocks add into the same dQ rows)", requires=(Q2_DV, Q2_DKDQ))
def _(ns):
    args, _ = _problem(8, 1, 16, 16, 8, False)
    criteria.race_free(lambda: _backward(ns, args, causal=False, Br=8, Bc=4))


@course.test("q2", points=2, name="IO budget: exactly fa2.model_backward at the same tiles", requires=(Q2_DV, Q2_DKDQ))
def _(ns):
    args, _ = _problem(9, 2, 16, 16, 8, False)
    criteria.io_budget(lambda: _backward(ns, args, causal=False, Br=8, Bc=4),
                       fa2.model_backward(2, 16, 16, 8, Br=8, Bc=4, warps=1),
                       hint="per visited tile: Q_i, dO_i, L_i, D_i read once, one atomic add per dQ element; "
                            "dS and K_j come from shared memory")


@course.test("q2", points=1, name="compiles for sm_80 and sm_90 (no float64, no spills)", requires=(Q2_DV, Q2_DKDQ),
             timeout=240)
def _(ns):
    mine = _mine(ns, "make_backward")
    config = dict(Br=16, Bc=16, d=32, warps=2, causal=True)
    criteria.compiles([(mine(**config), registry.KERNELS["fa2.backward"].signature_for(config))])


course.compiled("make_backward", question="q2", kernels=lambda ns: [
    (_mine(ns, "make_backward")(**c), registry.KERNELS["fa2.backward"].signature_for(c))
    for c in [dict(Br=16, Bc=16, d=32, warps=2, causal=True)]])


# %% tags=["hidden-tests"]
@course.test("q2", points=3, name="causal Nq ≠ Nk (bottom-right, fully masked rows), N = 1, odd d, 3 heads",
             requires=(Q2_DV, Q2_DKDQ, Q2_CAUSAL))
def _(ns):
    _check(ns, 10, 1, 20, 12, 8, causal=True, Br=8, Bc=4)       # rows 0..7 see no key: L = -inf, dq = 0
    _check(ns, 11, 1, 12, 20, 8, causal=True, Br=8, Bc=8)
    _check(ns, 12, 2, 1, 1, 5, causal=True, Br=8, Bc=4)
    _check(ns, 13, 3, 11, 13, 9, causal=False, Br=8, Bc=8)


# %% [markdown]
# ## Check your work
#
# The public tests, with their points. They run in seconds on the simulator; a failure names the output, the
# row (and its tile) and the element that differ, the array whose traffic differs from the model, or the two
# accesses that race.

# %%
course.check()
