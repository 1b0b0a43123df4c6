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
# # A1 · Online softmax and the merge operator
#
# FlashAttention stands on one idea: the softmax normaliser of a row can be built **piece by piece**, and two
# partial results combine exactly. You will write that combination (the *merge*), a kernel that computes the
# partial state of every chunk of a row in one read, and the two-pass online softmax (notebook 02 explains
# all three; read it first).
#
# A state is a pair $[m, d]$: the maximum $m$ of the elements seen and $d = \sum_k e^{x_k - m}$. Merging:
#
# $$[m_a, d_a] \oplus [m_b, d_b] = [m,\; d_a e^{m_a - m} + d_b e^{m_b - m}], \qquad m = \max(m_a, m_b).$$
#
# The empty state is $[-\infty, 0]$; merging two empty states must give an empty state (not NaN).
#
# **How this is graded** (points in brackets; the autograder also runs hidden tests on other shapes):
# correctness against a float64 reference, the kernels' HBM traffic counted on the simulator against the
# algorithm's IO model (a kernel that reads a row more times than the algorithm needs loses those points),
# freedom from data races (`flashnb.sim.racecheck`), and compiling for sm_80/sm_90 with no float64, shared memory
# within 48 KiB and no spills. Fill in the cells marked `TODO`, run the check cell after each question, and
# submit this notebook. Keep the answer cells (their tag `answer` is how the grader finds them); nothing else
# of the notebook is graded.
#
# Names you can use inside kernels: `NEG_INF`, `ZERO`, `ONE` (float32 constants), `math.exp`, `float32(...)`,
# `merge_state` (the library's, in questions 2 and 3), `block_reduce_state(red_m, red_d, m, d, tid)`.
# Never write a Python float literal (`0.0`, `-math.inf`) in a kernel: it makes float64 code.

# %% tags=["setup"]
import math  # noqa: F401  -- for your kernels (math.exp)
import os

os.environ.setdefault("FLASHNB_DEVICE", "sim")   # the CUDA simulator: no GPU needed
import flashnb  # noqa: E402,I001  -- first: it selects the simulator before numba.cuda is imported
import numpy as np
from numba import cuda, float32  # noqa: F401  -- float32 for your kernels

from flashnb import course, registry
from flashnb.stages import softmax
from flashnb.course import criteria
from flashnb.stages.softmax import NEG_INF, ONE, ZERO  # noqa: F401  -- for your kernels

# %% [markdown]
# ## Q1 · The merge operator [4 points]
#
# Complete the device function. Both exponents $m_a - m$ and $m_b - m$ are $\le 0$, so nothing overflows.
# Return the pair `m, d`.

# %% tags=["answer"]
# flashnb-course: from flashnb.stages.softmax import merge_state
# flashnb-course: todo merge_state "[m, d] = [m_a, d_a] ⊕ [m_b, d_b]; two empty states give [-inf, 0]"

# %% tags=["tests"]
# What the grader compiles before any test runs (a device function no kernel calls: with these argument types)
course.compiled("merge_state", question="q1", device=("float32",) * 4)

def _merge_kernel(merge):
    """A launch that applies ``merge`` elementwise (the test's harness, not part of the answer)."""
    @cuda.jit
    def apply(ma, da, mb, db, m, d):
        i = cuda.grid(1)
        if i < ma.shape[0]:
            m[i], d[i] = merge(ma[i], da[i], mb[i], db[i])
    return apply


def _merge_case(ns, seed, n, empty_fraction):
    rng = np.random.default_rng(seed)
    ma, mb = rng.normal(0, 4, n), rng.normal(0, 4, n)
    da, db = rng.uniform(1, 50, n), rng.uniform(1, 50, n)
    for m, d in ((ma, da), (mb, db)):          # some empty states [-inf, 0]
        e = rng.random(n) < empty_fraction
        m[e], d[e] = -np.inf, 0.0
    args = [flashnb.common.to_device(a) for a in (ma, da, mb, db)]
    m_out, d_out = flashnb.common.empty(n), flashnb.common.empty(n)
    flashnb.common.launch(_merge_kernel(ns["merge_state"]), (n + 31) // 32, 32, *args, m_out, d_out,
                          label="merge")
    want_m, want_d = softmax.merge((ma, da), (mb, db))
    criteria.close(m_out.copy_to_host(), want_m, what="m", case=f"{n} random states")
    criteria.close(d_out.copy_to_host(), want_d, what="d", case=f"{n} random states")


@course.test("q1", points=3, name="merge of random states matches float64")
def _(ns):
    _merge_case(ns, 1, 64, 0.0)


# %% tags=["hidden-tests"]
@course.test("q1", points=1, name="empty states: [-inf, 0] is neutral, two empties stay empty",
             requires="merge of random states matches float64")
def _(ns):
    _merge_case(ns, 2, 96, 0.4)


# %% [markdown]
# ## Q2 · The state of every chunk, in one read [6 points]
#
# `online_partials` runs one block per chunk of a row (grid `(chunks, rows)`): each thread folds its elements of
# the chunk into its own state with `merge_state`, then the block merges the threads' states
# (`block_reduce_state`, given) and thread 0 writes them. Each element of `X` is read **once**.

# %% tags=["answer"]
# flashnb-course: from flashnb.stages.softmax import make_online_partials
# flashnb-course: todo chunk-fold "fold this thread's elements of the chunk (every TPB-th, from c·C + tid) into [m, d]"

# %% tags=["tests"]
def _partials(ns, x, chunks, TPB=32):
    mine = criteria.variant_from(ns, "make_online_partials", softmax.make_online_partials)
    with registry.using(softmax.make_online_partials, mine):
        return softmax.online_partials(x, chunks, threads=TPB)


def _check_partials(ns, x, chunks, case):
    m, d = _partials(ns, x, chunks)
    C = -(-x.shape[1] // chunks)
    want_m = np.full((x.shape[0], chunks), -np.inf)
    want_d = np.zeros((x.shape[0], chunks))
    for c in range(chunks):
        part = x[:, c * C:(c + 1) * C].astype(np.float64)
        if part.shape[1]:
            want_m[:, c] = part.max(axis=1)
            want_d[:, c] = np.exp(part - want_m[:, c:c + 1]).sum(axis=1)
    criteria.close(m, want_m, what="M", case=case)
    criteria.close(d, want_d, what="D", case=case)


@course.test("q2", points=2, name="partial states of 2 rows x 100 in 3 chunks")
def _(ns):
    x = np.random.default_rng(3).normal(0, 3, (2, 100)).astype(np.float32)
    _check_partials(ns, x, 3, "2 x 100, 3 chunks")


@course.test("q2", points=1, name="your kernel runs, not the library's",
             requires="partial states of 2 rows x 100 in 3 chunks")
def _(ns):
    x = np.random.default_rng(5).normal(size=(2, 64)).astype(np.float32)
    criteria.ran_student_kernels(lambda: _partials(ns, x, 2), expect=1)


@course.test("q2", points=2, name="IO budget: X read once, one state written per chunk",
             requires="partial states of 2 rows x 100 in 3 chunks")
def _(ns):
    x = np.random.default_rng(6).normal(size=(2, 96)).astype(np.float32)
    criteria.io_budget(lambda: _partials(ns, x, 3), softmax.model_online_partials(2, 96, 3, threads=32),
                       hint="each element of X must be read exactly once")


@course.test("q2", points=1, name="race-free", requires="partial states of 2 rows x 100 in 3 chunks")
def _(ns):
    x = np.random.default_rng(7).normal(size=(1, 64)).astype(np.float32)
    criteria.race_free(lambda: _partials(ns, x, 2))


@course.test("q2", points=1, name="compiles for sm_80 and sm_90 (no float64, no spills)",
             requires="partial states of 2 rows x 100 in 3 chunks", timeout=240)
def _(ns):
    mine = criteria.variant_from(ns, "make_online_partials", softmax.make_online_partials)
    sig = registry.KERNELS["softmax.online_partials"].signature_for(dict(TPB=32))
    criteria.compiles([(mine(32), sig)])


course.compiled("make_online_partials", question="q2", kernels=lambda ns: [(
    criteria.variant_from(ns, "make_online_partials", softmax.make_online_partials)(32),
    registry.KERNELS["softmax.online_partials"].signature_for(dict(TPB=32)))])


# %% tags=["hidden-tests"]
@course.test("q2", points=1, name="other shapes: one chunk, one element per chunk, empty last chunks",
             requires="partial states of 2 rows x 100 in 3 chunks")
def _(ns):
    rng = np.random.default_rng(4)
    _check_partials(ns, rng.normal(0, 3, (1, 40)).astype(np.float32), 1, "1 x 40, 1 chunk")
    _check_partials(ns, rng.normal(0, 3, (3, 7)).astype(np.float32), 7, "3 x 7, 7 chunks")
    _check_partials(ns, rng.normal(0, 3, (1, 10)).astype(np.float32), 4, "1 x 10, 4 chunks (the last empty)")


# %% [markdown]
# ## Q3 · Online softmax in two passes [8 points]
#
# One block per row. Pass 1 builds each thread's $[m, d]$ over its elements in one read (the block then merges
# them: given); pass 2 writes $y_j = e^{x_j - m} / d$. A row of only $-\infty$ has $m = -\infty$ and $d = 0$: it
# must give zeros, not NaN (use `m_safe` and `inv_d`). Two reads of `X` and one write of `Y` per element -- the
# three-pass safe softmax reads `X` three times, and loses the IO points here.

# %% tags=["answer"]
# flashnb-course: from flashnb.stages.softmax import make_softmax_online
# flashnb-course: todo online-pass "pass 1: fold this thread's elements x_j (every TPB-th, from tid) into [m, d]"
# flashnb-course: todo normalise "pass 2: y_j = e^(x_j - m) / d for this thread's elements (a row of only -inf: zeros, never NaN)"

# %% tags=["tests"]
def _softmax(ns, x, TPB=32, reduce="block"):
    mine = criteria.variant_from(ns, "make_softmax_online", softmax.make_softmax_online)
    with registry.using(softmax.make_softmax_online, mine):
        library = softmax._FACTORIES["online"]
        softmax._FACTORIES["online"] = mine
        try:
            return softmax.softmax(x, "online", reduce=reduce, threads=TPB)
        finally:
            softmax._FACTORIES["online"] = library     # as it was: the grader checks nothing changed


def _softmax64(x):
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    e = np.exp(x - np.where(np.isfinite(m), m, 0.0))
    s = e.sum(axis=-1, keepdims=True)
    return np.divide(e, s, out=np.zeros_like(e), where=s > 0)


@course.test("q3", points=2, name="3 rows x 100 against float64")
def _(ns):
    x = np.random.default_rng(8).normal(0, 3, (3, 100)).astype(np.float32)
    criteria.close(_softmax(ns, x), _softmax64(x), what="y", case="3 x 100, 32 threads")


@course.test("q3", points=1, name="your kernel runs, not the library's", requires="3 rows x 100 against float64")
def _(ns):
    x = np.random.default_rng(10).normal(size=(2, 40)).astype(np.float32)
    criteria.ran_student_kernels(lambda: _softmax(ns, x), expect=1)


@course.test("q3", points=2, name="IO budget: X read twice, Y written once", requires="3 rows x 100 against float64")
def _(ns):
    x = np.random.default_rng(11).normal(size=(2, 64)).astype(np.float32)
    criteria.io_budget(lambda: _softmax(ns, x), softmax.model_softmax(2, 64, "online", threads=32),
                       hint="the online softmax reads each element twice (pass 1 and pass 2) and writes it once")


@course.test("q3", points=1, name="race-free", requires="3 rows x 100 against float64")
def _(ns):
    x = np.random.default_rng(12).normal(size=(1, 64)).astype(np.float32)
    criteria.race_free(lambda: _softmax(ns, x))


@course.test("q3", points=1, name="compiles for sm_80 and sm_90 (no float64, no spills)",
             requires="3 rows x 100 against float64", timeout=240)
def _(ns):
    mine = criteria.variant_from(ns, "make_softmax_online", softmax.make_softmax_online)
    spec = registry.KERNELS["softmax.online"]
    criteria.compiles([(mine(32, "block"), spec.signature_for(dict(TPB=32, reduce="block")))])


course.compiled("make_softmax_online", question="q3", kernels=lambda ns: [(
    criteria.variant_from(ns, "make_softmax_online", softmax.make_softmax_online)(32, "block"),
    registry.KERNELS["softmax.online"].signature_for(dict(TPB=32, reduce="block")))])


# %% tags=["hidden-tests"]
@course.test("q3", points=2, name="-inf entries, a row of only -inf, n = 1, n = 33, warp reduction",
             requires="3 rows x 100 against float64")
def _(ns):
    rng = np.random.default_rng(9)
    x = rng.normal(0, 3, (3, 33)).astype(np.float32)
    x[0, ::3] = -np.inf
    x[2, :] = -np.inf
    criteria.close(_softmax(ns, x), _softmax64(x), what="y", case="3 x 33 with -inf entries and a -inf row")
    x1 = rng.normal(size=(2, 1)).astype(np.float32)
    criteria.close(_softmax(ns, x1), _softmax64(x1), what="y", case="2 x 1")
    x2 = rng.normal(0, 3, (2, 70)).astype(np.float32)
    criteria.close(_softmax(ns, x2, TPB=64, reduce="warp"), _softmax64(x2), what="y",
                   case="2 x 70, 64 threads, warp reduction")


# %% [markdown]
# ## Check your work
#
# The public tests, with their points. They run in seconds on the simulator; a failure names the output, the
# row and the element that differ, or the array whose traffic differs from the model.

# %%
course.check()
