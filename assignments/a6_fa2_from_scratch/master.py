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
# # A6 · FlashAttention-2 forward from a blank cell: the kernel and its launch grid
#
# In A3 you completed the library's FA2 kernel. Here you write one yourself, with nothing given but the
# interface: a `@cuda.jit` kernel for the forward of FlashAttention-2 (Dao 2023, Alg. 1) with **one thread per
# query row**, and the host function that chooses its launch grid and launches it. Notebook 05 builds the same
# kernel step by step (`fa2_steps.make_rows_forward` is flashnb's, which the grader refuses to run for you).
#
# **The algorithm.** The grid runs over query blocks: thread block $(i, z)$ owns the $B_r$ query rows
# $i B_r, \dots, i B_r + B_r - 1$ of batch·head $z$, and thread $t$ of the block owns row $i B_r + t$. The thread
# reads its row of $Q_i$ once into registers, sets $\tilde O = 0$, $\ell = 0$, $m = -\infty$, and loops over the
# K/V tiles $K_j, V_j$ of $B_c$ key rows: the block's threads load each tile **together into shared memory**
# (every thread copies some of its elements; HBM sees each element of $K_j$ and $V_j$ once per query block), and
# every thread then reads the whole tile from shared memory for its row: $S = \text{scale} \cdot q K_j^T$, the new
# maximum $m^{new} = \max(m, \max S)$, $\tilde P = e^{S - m^{new}}$,
# $\ell \leftarrow e^{m - m^{new}} \ell + \sum \tilde P$, $\tilde O \leftarrow e^{m - m^{new}} \tilde O + \tilde P V_j$
# (lines 8-10: the *delayed* rescaling: $\tilde O$ stays unnormalised). After the last tile it writes
# $O = \tilde O / \ell$ and the log-sum-exp $L = m + \log \ell$ once (lines 12-13). Two barriers per tile: one
# after the load (every element is in shared memory before anyone reads it) and one before the next load
# overwrites the tile (every thread is done reading the old one).
#
# **Causal masks** are bottom-right aligned (FlashAttention $\ge$ 2.1): query row $r$ may see key $c$ iff
# $c \le r + \text{diag}$ with $\text{diag} = N_k - N_q$ (`flashnb.common.causal_allowed`). With $N_q < N_k$ every
# row sees at least the first $N_k - N_q + 1$ keys; with $N_q > N_k$ the first $N_q - N_k$ rows see **no** key:
# their $O$ row is 0 and their $L$ is $-\infty$ (never NaN: $e^{-\infty - (-\infty)}$ is NaN, so a row whose
# maximum is still $-\infty$ needs its own case). A K/V tile whose keys all lie after the last key the block's
# last row may see is never loaded (FA2's causal block skipping); a block whose rows see no key loads none.
#
# **The interface** (the grader calls exactly these names):
#
# * `make_forward(Br, Bc, d, causal)` -- a kernel factory: returns a `@cuda.jit` kernel
#   `fa2_forward(Q, K, V, O, L, scale, diag)` for query blocks of `Br` rows, K/V tiles of `Bc` rows, head dim `d`
#   (the shared tiles' shapes come from these compile-time constants) and `causal` (a bool). Name the kernel's
#   array parameters exactly `Q, K, V, O, L`: the traffic counter reports by parameter name.
# * `launch_forward(Q, K, V, O, L, scale, causal, Br, Bc)` -- the launcher: chooses the grid and the block for
#   these shapes, gets the kernel from `make_forward`, and launches it once. It returns nothing: the kernel writes
#   `O` and `L` in place.
#
# The arrays are float32 device arrays (`common.to_device`), C-contiguous: `Q` of shape `(BH, Nq, d)`, `K` and `V`
# `(BH, Nk, d)`, `O` `(BH, Nq, d)` and `L` `(BH, Nq)`, the last two allocated by the caller with `common.empty`
# (filled with NaN: an element your kernel never writes is found). `BH` is batch·heads (any number $\ge 1$, on the
# grid's y axis), $N_q \ne N_k$ in general, neither a multiple of `Br` or `Bc` (partial last blocks and tiles),
# `d` any head dim up to 64 (not only powers of two). `scale` is a float32 ($1/\sqrt{d}$ in the tests); `diag` is
# an int, $N_k - N_q$, which the launcher computes (the kernel uses it only when `causal`). One block of `Br`
# threads per query block: the grid is `(number of query blocks, BH)`, and it must cover every row.
#
# **Names you can use** (the setup cell imports them): `cuda`, `float32`, `int32`, `math.exp`, `math.log`,
# `NEG_INF`, `ZERO`, `ONE` (float32 constants), `cdiv(a, b)` (ceiling division, on the host), and
# `launch(kernel, grid, block, *args, label=...)` (`flashnb.common.launch`: it casts Python ints and floats to
# int32 and float32, the signature a GPU compiles; `kernel[grid, block](*args)` works too). Inside a kernel use
# `cuda.shared.array((R, C), float32)` with compile-time shapes (one declaration per line),
# `cuda.local.array(n, float32)` for a thread's row, and `float32(...)` for every constant: a Python float literal
# (`0.0`, `1.0`) makes float64 code.
#
# **How this is graded** (points in brackets; the autograder also runs hidden tests on other shapes):
# your launcher is called on seeded random inputs and $O$ **and** $L$ are compared with the float64 reference
# (`flashnb.reference.attention_forward`), every element must be written, and every launch must run a kernel of
# your answer cell. The counted HBM traffic must equal FA2's one-thread-per-row IO model
# (`fa2_steps.model_rows_forward`): $Q$ read once, each visited tile of $K$ and $V$ once per query block, $O$ and
# $L$ written once -- a kernel that reads $K$ from HBM for every row gets the right numbers and loses those
# points. The kernel must be free of data races (`flashnb.sim.racecheck`) and compile for sm_80 and sm_90 with no
# float64, shared memory within 48 KiB and no register spills (at `Br = Bc = d = 64`, causal). The IO, race and
# compile points are scored only once the first correctness test passes. Keep the answer cell's tag `answer`;
# nothing else of the notebook is graded.

# %% tags=["setup"]
import math  # noqa: F401  -- for your kernel (math.exp, math.log)
import os

os.environ.setdefault("FLASHNB_DEVICE", "sim")   # the CUDA simulator: no GPU needed
import flashnb  # noqa: F401, I001  -- first: it selects the simulator before anything imports numba.cuda
import numpy as np  # noqa: F401  -- for your experiments
from numba import cuda, float32, int32  # noqa: F401  -- for your kernel

from flashnb import common, course, reference  # noqa: F401  -- reference: for your experiments
from flashnb.common import NEG_INF, ONE, ZERO, cdiv, launch  # noqa: F401  -- for your kernel and launcher
from flashnb.course import criteria
from flashnb.stages import fa2_steps

# %% [markdown]
# ## Q1 · The kernel and its launcher [18 points]
#
# Write `make_forward` and `launch_forward` in the cell below, as the interface above says. A plan: the kernel's
# thread finds its row from `cuda.blockIdx.x`, `cuda.threadIdx.x` and its batch·head from `cuda.blockIdx.y`; it
# declares the two shared tiles, its rows of $Q$ and $\tilde O$ and its scores (local arrays), loads $q$, loops over
# the tiles it must visit (barrier, cooperative load with zeros past $N_k$, barrier, then its row's update if the
# row is $< N_q$), and writes its row of $O$ and $L$. The launcher reads the shapes, computes `diag` and the grid,
# and launches. To try it: `Q = common.to_device(np.random.default_rng(0).standard_normal((1, 40, 8)).astype(np.float32))`,
# `O = common.empty((1, 40, 8))`, and compare `O.copy_to_host()` with `reference.attention_forward(...)`.

# %% tags=["answer"]
### BEGIN SOLUTION write make_forward(Br, Bc, d, causal) (the kernel factory) and launch_forward(Q, K, V, O, L, scale, causal, Br, Bc) (the launcher), as the interface says
def make_forward(Br, Bc, d, causal):
    """FA2 Alg. 1 with one thread per query row: a kernel (Q, K, V, O, L, scale, diag) for the grid
    (ceil(Nq / Br), BH) of blocks of Br threads."""

    @cuda.jit
    def fa2_forward(Q, K, V, O, L, scale, diag):
        # region tiles
        # SRAM: the K/V tile every row of the block reads
        K_j = cuda.shared.array((Bc, d), float32)
        V_j = cuda.shared.array((Bc, d), float32)
        # endregion tiles
        # registers: this thread's row of Q_i, of the unnormalised O~_i, and of S (then P~)
        q = cuda.local.array(d, float32)
        o = cuda.local.array(d, float32)
        s = cuda.local.array(Bc, float32)
        z = cuda.blockIdx.y
        t = cuda.threadIdx.x
        i0 = cuda.blockIdx.x * Br
        i = i0 + t
        Nq = Q.shape[1]
        Nk = K.shape[1]
        # the head dim read at run time keeps the d-loops rolled (fewer registers: no spills)
        dd = Q.shape[2]
        active = i < Nq
        # lines 4-5: this row of Q_i, once; O~ = 0, l = 0, m = -inf
        for x in range(dd):
            q[x] = Q[z, i, x] if active else ZERO
            o[x] = ZERO
        m = NEG_INF
        l = ZERO
        # region tile-count
        # line 6: every K/V tile, or with causal only up to the last key the block's last row may see
        n_tiles = (Nk + Bc - 1) // Bc
        if causal:
            last = min(i0 + Br, Nq) - 1 + diag
            n_tiles = min(n_tiles, last // Bc + 1) if last >= 0 else 0
        # endregion tile-count
        for jt in range(n_tiles):
            j0 = jt * Bc
            # region kv-barrier
            # every thread is done reading K_{j-1}, V_{j-1} before they are overwritten
            cuda.syncthreads()
            # endregion kv-barrier
            # line 7: K_j, V_j to SRAM, the block's threads together (zeros past Nk)
            for e in range(t, Bc * dd, Br):
                c = e // dd
                x = e - c * dd
                kc = ZERO
                vc = ZERO
                if j0 + c < Nk:
                    kc = K[z, j0 + c, x]
                    vc = V[z, j0 + c, x]
                K_j[c, x] = kc
                V_j[c, x] = vc
            cuda.syncthreads()
            if active:
                # region scores
                # line 8: S = scale q K_j^T (masked), m_new = max(m, rowmax S)
                m_new = m
                for c in range(Bc):
                    acc = ZERO
                    for x in range(dd):
                        acc += q[x] * K_j[c, x]
                    sc = scale * acc
                    if j0 + c >= Nk or (causal and j0 + c > i + diag):
                        sc = NEG_INF
                    s[c] = sc
                    m_new = max(m_new, sc)
                # endregion scores
                # region online-update
                # line 9: P~ = e^(S - m_new), l = e^(m - m_new) l + rowsum P~ (P~ = 0, alpha = 1 while m_new = -inf)
                alpha = ONE
                if m_new != NEG_INF:
                    alpha = float32(math.exp(m - m_new))
                rs = ZERO
                for c in range(Bc):
                    p = ZERO
                    if s[c] != NEG_INF:
                        p = float32(math.exp(s[c] - m_new))
                    s[c] = p
                    rs += p
                l = alpha * l + rs
                # line 10: O~ = diag(e^(m - m_new)) O~ ...
                for x in range(dd):
                    o[x] *= alpha
                # endregion online-update
                # ... + P~ V_j
                for c in range(Bc):
                    p = s[c]
                    for x in range(dd):
                        o[x] += p * V_j[c, x]
                m = m_new
        # region epilogue
        # lines 12-13: O = O~ / l, L = m + log l, once (a row that saw no key: O = 0, L = -inf)
        if active:
            inv = ONE / l if l > ZERO else ZERO
            for x in range(dd):
                O[z, i, x] = o[x] * inv
            L[z, i] = m + float32(math.log(l)) if l > ZERO else NEG_INF
        # endregion epilogue

    return fa2_forward


def launch_forward(Q, K, V, O, L, scale, causal, Br, Bc):
    """One launch: a block of Br threads per query block, on the grid (ceil(Nq / Br), BH)."""
    BH, Nq, d = Q.shape
    Nk = K.shape[1]
    diag = Nk - Nq
    grid = (cdiv(Nq, Br), BH)
    launch(make_forward(Br, Bc, d, bool(causal)), grid, Br, Q, K, V, O, L, scale, diag, label="FA2 forward")
### END SOLUTION

# %% tags=["tests"]
#: The launch signature of your kernel: Q, K, V, O (BH, N, d), L (BH, Nq), scale, diag.
SIG = ("void(float32[:, :, ::1], float32[:, :, ::1], float32[:, :, ::1], float32[:, :, ::1], float32[:, ::1], "
       "float32, int32)")


def _defined(ns, name):
    fn = ns.get(name)
    if not callable(fn):
        raise course.Fail(f"{name} is not defined: run your answer cell (it defines {name})")
    return fn


def _run(ns, q, k, v, causal, Br, Bc):
    """Your launch_forward on float32 device copies of q, k, v, into NaN-poisoned O and L: (o, lse, launches),
    every launch checked to run a kernel of your answer cell."""
    launch_forward = _defined(ns, "launch_forward")
    Q, K, V = (common.to_device(np.ascontiguousarray(a, dtype=np.float32)) for a in (q, k, v))
    O, L = common.empty(q.shape), common.empty(q.shape[:2])
    with criteria.launches() as t:
        launch_forward(Q, K, V, O, L, np.float32(q.shape[2] ** -0.5), causal, Br, Bc)
    o, lse = O.copy_to_host(), L.copy_to_host()
    if not t.launches:
        raise course.Fail(f"launch_forward launched no kernel (Nq = {q.shape[1]}, Br = {Br}: the grid needs "
                          f"cdiv({q.shape[1]}, {Br}) = {cdiv(q.shape[1], Br)} query block(s) along x)")
    criteria.student_launches(t.launches)
    gx = t.launches[0].grid[0]
    if gx < cdiv(q.shape[1], Br) and np.isnan(lse).any():
        raise course.Fail(f"rows {gx * Br}..{q.shape[1] - 1} of O and L were never written: your grid has {gx} "
                          f"query block(s) of Br = {Br} rows along x, which cover rows 0..{gx * Br - 1}; "
                          f"Nq = {q.shape[1]} needs cdiv(Nq, Br) = {cdiv(q.shape[1], Br)} (the last one partial)")
    return o, lse, t.launches


def _check(ns, seed, BH, Nq, Nk, d, causal, Br=16, Bc=16):
    criteria.forward_close(lambda q, k, v: _run(ns, q, k, v, causal, Br, Bc)[:2], seed, BH, Nq, Nk, d,
                           causal=causal, tiles=dict(Br=Br, Bc=Bc))


PUBLIC = "non-causal, 1 head, 32 x 48, d = 16 (O and L)"


@course.test("q1", points=4, name=PUBLIC)
def _(ns):
    _check(ns, 1, 1, 32, 48, 16, False)


@course.test("q1", points=2, name="causal (bottom-right, Nq < Nk), 2 heads, 32 x 48, d = 8")
def _(ns):
    _check(ns, 2, 2, 32, 48, 8, True)


@course.test("q1", points=2, name="the grid covers every row: Nq = 40 with Br = 16 (a partial last query block)")
def _(ns):
    _check(ns, 3, 1, 40, 40, 8, False)


@course.test("q1", points=1, name="one launch, of your own kernel", requires=PUBLIC)
def _(ns):
    q, k, v = criteria.qkv(4, 1, 16, 16, 8)
    launches = _run(ns, q, k, v, False, 16, 16)[2]
    criteria.student_launches(launches, expect=1)


@course.test("q1", points=3, name="IO budget, causal 48 x 64: Q once, each visited K/V tile once per query block, "
             "O and L once", requires=PUBLIC)
def _(ns):
    q, k, v = criteria.qkv(5, 1, 48, 64, 8)
    criteria.io_budget(lambda: _run(ns, q, k, v, True, 16, 16),
                       fa2_steps.model_rows_forward(1, 48, 64, 8, causal=True, Br=16, Bc=16), labels=False,
                       hint="FA2 with one thread per query row reads Q once, each K_j, V_j once per query block (into "
                            "shared memory, where all Br rows of the block read it), and writes O and L once; under "
                            "causal, a tile after the block's last visible key is never loaded "
                            "(fa2_steps.model_rows_forward)")


@course.test("q1", points=1, name="race-free (2 warps per block, 3 K/V tiles)", requires=PUBLIC)
def _(ns):
    q, k, v = criteria.qkv(6, 1, 64, 40, 4)
    criteria.race_free(lambda: _run(ns, q, k, v, True, 64, 16))


@course.test("q1", points=1, name="compiles for sm_80 and sm_90 (no float64, shared memory within 48 KiB, no "
             "spills)", requires=PUBLIC, timeout=240)
def _(ns):
    criteria.compiles([(_defined(ns, "make_forward")(64, 64, 64, True), SIG)])


# what the grader compiles before any test runs (launch_forward is host code: the grammar's, never compiled)
course.compiled("make_forward", question="q1", kernels=lambda ns: [(_defined(ns, "make_forward")(64, 64, 64, True), SIG)])


# %% tags=["hidden-tests"]
@course.test("q1", points=2, name="bottom-right causal with Nq > Nk: rows and whole query blocks that see no key "
             "(O = 0, L = -inf)", requires=PUBLIC)
def _(ns):
    _check(ns, 7, 2, 44, 20, 8, True, Br=16, Bc=8)    # rows 0..23 see no key; block 0 visits no tile


@course.test("q1", points=2, name="d not a power of two, 3 heads, N = 1, partial blocks and tiles, other tiles",
             requires=PUBLIC)
def _(ns):
    _check(ns, 8, 3, 1, 1, 7, False)
    _check(ns, 9, 2, 23, 37, 5, True, Br=8, Bc=16)
    _check(ns, 10, 1, 50, 29, 12, False, Br=32, Bc=8)


# %% [markdown]
# ## Check your work
#
# The public tests, with their points. They run in seconds on the simulator; a failure names the output, the row
# and tile that differ, the array whose traffic differs from the model, or the lines that race.

# %%
course.check()
