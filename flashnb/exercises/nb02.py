"""Exercises of notebook 02 (online softmax, the merge, and the one-pass attention row)."""

from __future__ import annotations

import ast
import inspect
import math  # noqa: F401  (the solutions' kernels use math.exp / math.log)
import textwrap

import numpy as np
from numba import cuda, float32  # module globals: the simulator swaps `cuda` in a kernel's globals only

from . import Wrong, close, exercise, require


def _state(x):
    """[m, d] of a set of numbers, in float64: the ground truth of the merge."""
    x = np.asarray(x, dtype=np.float64)
    if x.size == 0 or not np.isfinite(x.max()):
        return -math.inf, 0.0
    m = float(x.max())
    return m, float(np.exp(x - m).sum())


def _softmax64(X):
    X = np.asarray(X, dtype=np.float64)
    m = X.max(axis=-1, keepdims=True)
    e = np.exp(X - np.where(np.isfinite(m), m, 0.0))
    s = e.sum(axis=-1, keepdims=True)
    return e / np.where(s > 0, s, 1.0), np.where(s[..., 0] > 0, np.log(np.where(s[..., 0] > 0, s[..., 0], 1.0))
                                                 + np.where(np.isfinite(m[..., 0]), m[..., 0], 0.0), -np.inf)


def _sanitized(run):
    """Run ``run()`` under the sanitizer; raise Wrong with the report if it finds anything."""
    from .. import sim

    with sim.sanitize(raise_on_error=False) as report:
        run()
    require(not report, f"the sanitizer found errors:\n{report}")


# --------------------------------------------------------------------------- 02.1


@exercise("02.1", "the merge is associative", level=1, minutes=15,
          hint="""A state [m, d] stands for a set: its maximum and its sum shifted by that maximum. merge(a, b) must
          return the state of the union: M = max(m_a, m_b) and both sums re-shifted to M. Mind the empty set
          [-inf, 0]: (-inf) - (-inf) is NaN.""",
          explain="""Write A, B, C for the sets behind [a], [b], [c]. [a] ⊕ [b] = [max(A∪B), Σ_{x∈A∪B} e^(x - max)]
          because d_a·e^(m_a - M) = Σ_{x∈A} e^(x - m_a)·e^(m_a - M) = Σ_{x∈A} e^(x - M): the merge of two states is the
          state of the union. Applying that twice, ([a] ⊕ [b]) ⊕ [c] and [a] ⊕ ([b] ⊕ [c]) are both the state of
          A ∪ B ∪ C -- the same pair of numbers -- so ⊕ is associative (and commutative, since ∪ is). A tree
          reduction only regroups the merges, so any tree of threads, warps or blocks gives the state of the whole
          row (up to float rounding). The empty set is the neutral element [-inf, 0]; merging two of them must not
          compute e^((-inf) - (-inf)).""")
def check_02_1(merge):
    """merge(a, b): a, b are states (m, d) (floats); returns the state (m, d) of the union of their sets."""
    require(callable(merge), "merge must be a function merge(a, b) -> (m, d)")
    rng = np.random.default_rng(21)
    empty = (-math.inf, 0.0)

    def same(got, want, what):
        try:
            m, d = (float(x) for x in got)
        except (TypeError, ValueError):
            raise Wrong(f"{what}: merge must return a pair (m, d) of numbers, got {got!r}") from None
        ok = (m == want[0] or math.isclose(m, want[0], rel_tol=1e-12)) and math.isclose(d, want[1], rel_tol=1e-9,
                                                                                           abs_tol=1e-300)
        require(ok, f"{what}: got [{m:.6g}, {d:.6g}], the state of the union is different")

    for trial in range(30):
        scale = 1e4 if trial % 5 == 4 else 5.0              # some sets with values of 1e4: e^x overflows
        sets = [scale * rng.standard_normal(rng.integers(1, 6)) for _ in range(3)]
        a, b, c = (_state(s) for s in sets)
        union = _state(np.concatenate(sets))
        same(merge(merge(a, b), c), union, "(a ⊕ b) ⊕ c")
        same(merge(a, merge(b, c)), union, "a ⊕ (b ⊕ c)")
        same(merge(b, a), _state(np.concatenate(sets[:2])), "b ⊕ a")
        same(merge(a, empty), a, "a ⊕ [-inf, 0] (the empty set)")
    with np.errstate(invalid="ignore"):
        same(merge(empty, empty), empty, "[-inf, 0] ⊕ [-inf, 0]")
    return "30 random triples (some with values of ±1e4) and the empty state"


@check_02_1.solves
def _():
    import math

    def merge(a, b):
        (m_a, d_a), (m_b, d_b) = a, b
        M = max(m_a, m_b)
        if M == -math.inf:                    # both empty: stay empty, never e^(-inf - -inf) = NaN
            return M, 0.0
        return M, d_a * math.exp(m_a - M) + d_b * math.exp(m_b - M)

    return dict(merge=merge)


@check_02_1.fails
def _():
    def merge(a, b):                          # forgets to re-shift the sums to the new maximum
        return max(a[0], b[0]), a[1] + b[1]

    return dict(merge=merge)


@check_02_1.fails
def _():
    import math

    def merge(a, b):                          # right for non-empty sets, NaN for two empty ones
        M = max(a[0], b[0])
        return M, a[1] * math.exp(a[0] - M) + b[1] * math.exp(b[0] - M)

    return dict(merge=merge)


# --------------------------------------------------------------------------- 02.2


def _lse_case():
    X = (3 * np.random.default_rng(22).standard_normal((3, 70))).astype(np.float32)
    X[1, ::3] = -np.inf                       # masked entries
    return X


@exercise("02.2", "an online softmax that also stores the log-sum-exp", level=2, minutes=20,
          signatures={"kernel": "void(float32[:, ::1], float32[:, ::1], float32[::1])"},
          hint="""Copy the kernel of softmax.make_softmax_online (show_source(..., numbers=False)) with TPB = 32
          and reduce="block", add a parameter L, and let thread 0 write L[row] = m + log d once the block has
          merged the states (-inf when d = 0). Import merge_state and block_reduce_state from
          flashnb.stages.softmax, NEG_INF, ZERO, ONE from flashnb.common. Accesses per element: count the passes
          over X, the write of Y, and one L per row.""",
          explain="""The log-sum-exp comes for free: after the merge the block already holds [m, d] for the row, and
          L = m + ln d is one more write per row. The model is 2n reads of X, n writes of Y and 1 write of L per
          row: (3n + 1)/n = 3 + 1/n accesses per element, 3.000244 at n = 4096 -- the unsafe softmax's traffic,
          with the safe one's robustness and the statistic the attention backward needs.""")
def check_02_2(kernel, accesses_per_element):
    """kernel: a cuda.jit kernel (X, Y, L) launched as kernel[rows, 32] that writes Y = softmax(X) row-wise and
    L[row] = log Σ e^X[row]; accesses_per_element: global accesses per element of X at n = 4096 (one row)."""
    from .. import common
    from ..instruments import traffic

    X = _lse_case()
    rows, n = X.shape

    def run():
        Xd, Y, L = common.to_device(X), common.empty(X.shape), common.empty((rows,))
        kernel[rows, 32](Xd, Y, L)
        return Y.copy_to_host(), L.copy_to_host()

    _sanitized(run)
    with traffic.count() as t:
        Y, L = run()
    want_y, want_l = _softmax64(X)
    # float32 softmax of 70 entries: errors of a few ulps of 1
    require(np.allclose(Y, want_y, atol=1e-6), "Y is not the softmax of X (rows of 70 entries, some of them -inf)")
    require(np.allclose(L, want_l, atol=1e-5), "L is not log Σ e^X of each row")
    launch = t.launches[-1]
    x_reads = launch.reads.get("X", 0)
    require(x_reads <= 2 * rows * n, f"X is read {x_reads / (rows * n):g} times per element: the online softmax "
            "reads it twice")
    close(accesses_per_element, 3 + 1 / 4096, rel=1e-7, what="accesses_per_element")


@check_02_2.solves
def _():
    from flashnb.common import NEG_INF, ONE, ZERO
    from flashnb.stages.softmax import block_reduce_state, merge_state

    @cuda.jit
    def softmax_lse(X, Y, L):
        red_m = cuda.shared.array(32, float32)
        red_d = cuda.shared.array(32, float32)
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        n = X.shape[1]
        m = NEG_INF
        d = ZERO
        for j in range(tid, n, 32):                        # pass 1: [m, d] ← [m, d] ⊕ [x_j, 1]
            m, d = merge_state(m, d, X[row, j], ONE)
        m, d = block_reduce_state(red_m, red_d, m, d, tid)
        m_safe = m if m != NEG_INF else ZERO
        inv_d = ONE / d if d > ZERO else ZERO
        for j in range(tid, n, 32):                        # pass 2: y_j = e^(x_j - m) / d
            Y[row, j] = float32(math.exp(X[row, j] - m_safe)) * inv_d
        if tid == 0:                                       # one more write per row: L = m + ln d
            L[row] = m + float32(math.log(d)) if d > ZERO else NEG_INF

    return dict(kernel=softmax_lse, accesses_per_element=(2 * 4096 + 4096 + 1) / 4096)


@check_02_2.fails
def _():
    return dict(kernel=check_02_2.solution()["kernel"], accesses_per_element=3)   # forgets the write of L


# --------------------------------------------------------------------------- 02.3


def _split_case():
    X = (3 * np.random.default_rng(23).standard_normal((2, 100))).astype(np.float32)
    X[1, :30] = -np.inf                       # row 1: its first chunk is empty, the state [-inf, 0]
    return X


@exercise("02.3", "the second half of a split-row softmax", level=3, minutes=30,
          signatures={"kernel": "void(float32[:, ::1], float32[:, ::1], float32[:, ::1], float32[:, ::1])"},
          hint="""Block (c, row) first folds all the chunk states of its row: m, d = merge_state(m, d, M[row, k],
          D[row, k]) for k in range(M.shape[1]) (every thread can do it: it is a handful of reads), then
          normalises its own chunk: elements c·C .. (c+1)·C - 1 with C = ⌈n / chunks⌉, as online_partials splits
          them. The check runs softmax.online_partials first, then your kernel.""",
          explain="""Kernel 1 (online_partials) reads every element once and writes one state [m, d] per chunk;
          kernel 2 reads each chunk's elements once more, plus the row's states, and writes Y. So the split softmax
          moves 3 accesses per element, like the fused online softmax, plus 2 per chunk written and (in this
          version) 2·chunks read by each thread of each block -- negligible while chunks ≪ n, and one launch more.
          What it buys is parallelism: the one-block-per-row kernel runs `rows` blocks, which cannot fill a GPU of
          100+ SMs when there are few rows; splitting very long rows over chunks gives rows × chunks blocks. (The
          same idea, for attention, is FlashDecoding's split-K over the keys.)""")
def check_02_3(kernel):
    """kernel: a cuda.jit kernel (X, M, D, Y) launched as kernel[(chunks, rows), 32] that writes the softmax of
    chunk c of each row, given the chunk states M, D that softmax.online_partials computed."""
    from .. import common
    from ..instruments import traffic
    from ..stages import softmax as S

    X = _split_case()
    rows, n = X.shape
    chunks = 4
    M, D = S.online_partials(X, chunks, threads=32)

    def run():
        Y = common.empty(X.shape)
        kernel[(chunks, rows), 32](common.to_device(X), common.to_device(M), common.to_device(D), Y)
        return Y.copy_to_host()

    _sanitized(run)
    with traffic.count() as t:
        Y = run()
    want, _ = _softmax64(X)
    bad = sorted({(int(r), int(j) // 25) for r, j in zip(*np.nonzero(~np.isclose(Y, want, atol=1e-6)))})
    require(not bad, f"wrong output in (row, chunk) {bad[:4]} (first few): does each block normalise with the "
            "state of the *whole* row?")
    launch = t.launches[-1]
    require(launch.reads.get("X", 0) == rows * n and launch.writes.get("Y", 0) == rows * n,
            "each element of X should be read once and each of Y written once by this kernel")
    states = launch.reads.get("M", 0) + launch.reads.get("D", 0)
    return f"besides X once and Y once, this kernel read {states // (rows * chunks)} chunk-state values per block"


@check_02_3.solves
def _():
    from flashnb.common import NEG_INF, ONE, ZERO
    from flashnb.stages.softmax import merge_state

    @cuda.jit
    def normalise_chunks(X, M, D, Y):
        c = cuda.blockIdx.x
        row = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        n = X.shape[1]
        chunks = M.shape[1]
        C = (n + chunks - 1) // chunks                     # online_partials' chunk size
        m = NEG_INF
        d = ZERO
        for k in range(chunks):                            # the state of the whole row
            m, d = merge_state(m, d, M[row, k], D[row, k])
        m_safe = m if m != NEG_INF else ZERO
        inv_d = ONE / d if d > ZERO else ZERO
        for j in range(c * C + tid, min(n, (c + 1) * C), 32):
            Y[row, j] = float32(math.exp(X[row, j] - m_safe)) * inv_d

    return dict(kernel=normalise_chunks)


@check_02_3.fails
def _():
    from flashnb.common import NEG_INF, ONE, ZERO

    @cuda.jit
    def normalise_own_chunk(X, M, D, Y):                   # uses its own chunk's state: each chunk sums to 1
        c = cuda.blockIdx.x
        row = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        n = X.shape[1]
        C = (n + M.shape[1] - 1) // M.shape[1]
        m = M[row, c]
        d = D[row, c]
        m_safe = m if m != NEG_INF else ZERO
        inv_d = ONE / d if d > ZERO else ZERO
        for j in range(c * C + tid, min(n, (c + 1) * C), 32):
            Y[row, j] = float32(math.exp(X[row, j] - m_safe)) * inv_d

    return dict(kernel=normalise_own_chunk)


# --------------------------------------------------------------------------- 02.4


@exercise("02.4", "warp totals reduced by warp 0 with shuffles", level=2, minutes=20,
          signatures={"kernel": "void(float32[:, ::1], float32[::1])"},
          hint="""Count first: softmax.model_softmax(1, 256, "unsafe", reduce="warp", threads=256) holds exactly one
          warp_reduce_sum (or count it with traffic.count()). Then: butterfly in each warp (shfl_xor_sync, offsets
          16..1), lane 0 writes red[warp], cuda.syncthreads(), and only warp 0 reads: lane l < 8 takes red[l], the
          others 0, and a second butterfly gives the total. Every lane of warp 0 must take part in its shuffles.""",
          explain="""In warp_reduce_sum every one of the T threads reads all T/32 warp totals: T²/32 shared reads, 2048
          per reduction at T = 256 (and twice that for the [m, d] state). Letting warp 0 pick up the T/32 totals,
          one per lane, and finish with shuffles costs T/32 = 8 shared reads; the other warps wait at no further
          barrier (if every thread needs the total, warp 0 writes it once to shared memory and, after a barrier,
          everyone reads it: T more reads, still far fewer). Shuffles move data between registers of a warp
          without shared memory or barriers.""")
def check_02_4(kernel, shared_reads_now):
    """kernel: a cuda.jit kernel (X, out) launched as kernel[rows, 256] writing out[row] = Σ X[row, 0:256];
    shared_reads_now: shared-memory reads of one softmax.warp_reduce_sum call with 256 threads."""
    from .. import common
    from ..instruments import traffic
    from ..stages import softmax as S

    close(shared_reads_now, S.model_softmax(1, 256, "unsafe", reduce="warp", threads=256)[0]["shared_reads"],
          what="shared_reads_now")
    rows = 1                                  # 256 simulated threads: one block is enough
    X = np.random.default_rng(24).standard_normal((rows, 256)).astype(np.float32)

    def run():
        out = common.empty((rows,))
        kernel[rows, 256](common.to_device(X), out)
        return out.copy_to_host()

    _sanitized(run)
    with traffic.count() as t:
        out = run()
    # a float32 sum of 256 O(1) values: rounding errors of about 1e-5
    require(np.allclose(out, X.astype(np.float64).sum(axis=1), atol=1e-4), "out[row] is not the sum of the row")
    per_block = t.launches[-1].shared_reads and sum(t.launches[-1].shared_reads.values()) / rows
    require(per_block <= 32, f"{per_block:g} shared reads per block: each warp total should be read once, by "
            "warp 0")
    return f"{per_block:g} shared reads per block instead of {shared_reads_now}"


@check_02_4.solves
def _():
    @cuda.jit
    def block_sum(X, out):
        red = cuda.shared.array(8, float32)               # one total per warp (256 / 32)
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        lane = tid % 32
        v = X[row, tid]
        offset = 16
        while offset > 0:                                 # butterfly within each warp
            v += cuda.shfl_xor_sync(0xFFFFFFFF, v, offset)
            offset //= 2
        if lane == 0:
            red[tid // 32] = v
        cuda.syncthreads()
        if tid < 32:                                      # warp 0 only: 8 shared reads in all
            v = red[lane] if lane < 8 else float32(0.0)
            offset = 4
            while offset > 0:
                v += cuda.shfl_xor_sync(0xFFFFFFFF, v, offset)
                offset //= 2
            if lane == 0:
                out[row] = v

    return dict(kernel=block_sum, shared_reads_now=256 * 8)


@check_02_4.fails
def _():
    @cuda.jit
    def block_sum_all_read(X, out):                       # today's scheme: every thread reads all 8 totals
        red = cuda.shared.array(8, float32)
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        v = X[row, tid]
        offset = 16
        while offset > 0:
            v += cuda.shfl_xor_sync(0xFFFFFFFF, v, offset)
            offset //= 2
        if tid % 32 == 0:
            red[tid // 32] = v
        cuda.syncthreads()
        total = float32(0.0)
        for w in range(8):
            total += red[w]
        if tid == 0:
            out[row] = total

    return dict(kernel=block_sum_all_read, shared_reads_now=256 * 8)


@check_02_4.fails
def _():
    return dict(kernel=check_02_4.solution()["kernel"], shared_reads_now=256)


# --------------------------------------------------------------------------- 02.5


def _tiles_truth(Nq, Nk, d, B):
    """Shared reads of make_attention_tiles when each row skips the key tiles that are fully masked for it
    (bottom-right causal alignment): 2·B·d per (row, tile with at least one allowed key)."""
    diag = Nk - Nq
    reads = 0
    for r0 in range(0, Nq, B):
        last = max(0, min(Nk, r0 + B + diag))
        for k0 in range(0, last, B):
            reads += sum(2 * B * d for i in range(r0, min(Nq, r0 + B)) if k0 <= i + diag)
    return reads


@exercise("02.5", "causal: skip the work, not just the load", level=3, minutes=30,
          hint="""In make_attention_tiles a row i may see key j when j <= i + diag (diag = Nk - Nq: the diagonal is
          aligned to the bottom-right corner). The tile starting at key k0 is fully masked for row i when
          k0 > i + diag: guard the work of row i (`if active:`, the first line of the kernel's region tile-update)
          accordingly: registry.variant(softmax.make_attention_tiles, region="tile-update", replace=(old, new))
          replaces `old` inside that region; run it with registry.using(...) through flashnb.attention(...,
          causal=True, impl="onepass", tile=8).""",
          explain="""The block still loads every K/V tile that *some* of its rows need (the last row of the block sees
          the most keys), so global reads and shared writes stay as they are. What changes is the work per row:
          a row skips the scores and P̃V of the tiles entirely right of its diagonal -- in model_forward only
          `shared_reads` changes (each live row reads 2·Bc·d per tile it processes). A skipped tile leaves the
          state unchanged anyway (m̃ = -inf, so its weight is 0): skipping is exact. Aligning to the top-left
          (k0 <= i) is wrong whenever Nq < Nk: rows then miss keys they may see.""")
def check_02_5(variant, changed):
    """variant: a factory replacing softmax.make_attention_tiles (same arguments) that skips, per row, the key
    tiles fully masked for that row; changed: the set of model_forward fields ("reads", "writes",
    "shared_reads", "shared_writes") whose counts this changes."""
    from .. import api, reference, registry
    from ..instruments import traffic
    from ..stages import softmax as S

    require(callable(variant), "variant must be a kernel factory (what registry.variant returns)")
    B, d = 8, 8
    for Nq, Nk in ((16, 28), (24, 24), (28, 12)):
        rng = np.random.default_rng(Nq + Nk)
        q, k, v = rng.standard_normal((1, Nq, d)), rng.standard_normal((1, Nk, d)), rng.standard_normal((1, Nk, d))
        with registry.using(S.make_attention_tiles, variant), traffic.count() as t:
            o, lse = api.attention_forward(q, k, v, causal=True, impl="onepass", tile=B)
        o_ref, lse_ref = reference.attention_forward(q, k, v, causal=True)
        # float32 online softmax over <= 28 keys and O(1) values: within 1e-5
        require(np.allclose(o, o_ref, atol=1e-5) and np.allclose(lse, lse_ref, atol=1e-5),
                f"wrong output for Nq={Nq}, Nk={Nk}: does row i skip only tiles with no key j <= i + (Nk - Nq)?")
        got, model = t.summary()[0], S.model_forward(1, Nq, Nk, d, causal=True, tile=B)[0]
        require(got["reads"] == model["reads"] and got["writes"] == model["writes"]
                and got["shared_writes"] == model["shared_writes"],
                "the block must still load every tile one of its rows needs (global reads and shared writes change)")
        require(got["shared_reads"] <= _tiles_truth(Nq, Nk, d, B),
                f"Nq={Nq}, Nk={Nk}: {got['shared_reads']} shared reads -- rows still work on tiles that are fully "
                "masked for them")
    require(isinstance(changed, (set, frozenset, list, tuple)), "changed must be a set of field names")
    fields = {"reads", "writes", "shared_reads", "shared_writes"}
    require(set(changed) <= fields, f"changed must name fields of model_forward among {sorted(fields)}")
    require(set(changed) == {"shared_reads"}, "changed: which counts did your variant change when you counted it?")


@check_02_5.solves
def _():
    from flashnb import registry
    from flashnb.stages import softmax as S

    skip = registry.variant(S.make_attention_tiles, region="tile-update", replace=(
        "if active:", "if active and (not causal or k0 <= i + diag):   # tile not fully masked for row i"))
    return dict(variant=skip, changed={"shared_reads"})


@check_02_5.fails
def _():
    from flashnb import registry
    from flashnb.stages import softmax as S

    top_left = registry.variant(S.make_attention_tiles, region="tile-update", replace=(   # aligned to the top-left
        "if active:", "if active and (not causal or k0 <= i):"))
    return dict(variant=top_left, changed={"shared_reads"})


@check_02_5.fails
def _():
    from flashnb.stages import softmax as S

    return dict(variant=S.make_attention_tiles, changed={"reads", "shared_reads"})   # unchanged kernel


# --------------------------------------------------------------------------- 02.6


def _divisions_in_key_loop(factory) -> int:
    """Divisions inside the kernel's loop over keys (the for loop that calls math.exp)."""
    src = getattr(factory, "variant_source", None)
    if src is None:
        src = textwrap.dedent(inspect.getsource(getattr(factory, "__wrapped__", factory)))
    loops = [n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.For)
             and any(isinstance(c, ast.Call) and getattr(c.func, "attr", "") == "exp" for c in ast.walk(n))]
    require(loops, "no loop over keys calling math.exp found in the variant's source")
    return max(sum(isinstance(x, (ast.BinOp, ast.AugAssign)) and isinstance(x.op, ast.Div) for x in ast.walk(loop))
               for loop in loops)


@exercise("02.6", "keep o unnormalised, divide once", level=2, minutes=20,
          hint="""In make_attention_rows replace the lines computing a, b and the update of o_i (the kernel's region
          o-update) by o_i[t] = o_i[t] * decay + p * V[z, j, t] (o = Σ e^(x_k - m_j) V_k, rescaled only when the
          maximum grows), and divide by dn once after the loop, where O is written (region write-o; 0 for a row with
          no key): registry.variant(softmax.make_attention_rows, regions={"o-update": ..., "write-o": ...}). Count
          divisions per query row before (per key: a and b) and after.""",
          explain="""With o kept unnormalised the per-key update is o ← o·e^(m_j - m_{j+1}) + e^(x - m_{j+1})·V_{j+1}:
          the same 2 multiply-adds per element of o, but no divisions -- the old version computed a = d_j·e^(..)/d_{j+1}
          and b = p/d_{j+1}, two divisions (and a multiplication) per key. The normalisation moves after the last key:
          d divisions per row (or one reciprocal and d multiplications). For N_k = 1024, d = 64 that is 2048 → 64
          divisions per row. FlashAttention-2 does exactly this per tile ("delayed rescaling"): divisions are slow
          on a GPU, and non-matmul FLOPs cost 16x more than tensor-core FLOPs.""")
def check_02_6(variant, divisions_saved):
    """variant: a factory replacing softmax.make_attention_rows with o kept unnormalised in the key loop;
    divisions_saved: divisions per query row it saves at N_k = 1024, d = 64."""
    from .. import api, reference, registry
    from ..stages import softmax as S

    require(callable(variant), "variant must be a kernel factory (what registry.variant returns)")
    for Nq, Nk, causal in ((12, 20, False), (20, 12, True)):   # the causal case has rows that see no key
        rng = np.random.default_rng(Nq)
        q, k, v = rng.standard_normal((1, Nq, 8)), rng.standard_normal((1, Nk, 8)), rng.standard_normal((1, Nk, 8))
        with registry.using(S.make_attention_rows, variant):
            o, lse = api.attention_forward(q, k, v, causal=causal, impl="onepass", tile=None)
        o_ref, lse_ref = reference.attention_forward(q, k, v, causal=causal)
        # float32 over <= 20 keys of O(1) values: within 1e-5
        require(np.allclose(o, o_ref, atol=1e-5) and np.allclose(lse, lse_ref, atol=1e-5),
                f"wrong output (Nq={Nq}, Nk={Nk}, causal={causal}): is o divided by d once, at the end (and 0 "
                "for a row with no key)?")
    n = _divisions_in_key_loop(variant)
    require(n == 0, f"the key loop still has {n} division(s): keep o unnormalised inside it")
    require(isinstance(divisions_saved, (int, float, np.integer, np.floating)), "divisions_saved must be a number")
    require(divisions_saved in (2 * 1024 - 64, 2 * 1024 - 1),
            "divisions_saved: count the divisions per key before, and those at the end after")


@check_02_6.solves
def _():
    from flashnb import registry
    from flashnb.stages import softmax as S

    unnormalised = registry.variant(S.make_attention_rows, regions={
        "o-update": """
for t in range(d):                             # o = Σ e^(x_k - m_j) V_k, not normalised
    o_i[t] = o_i[t] * decay + p * V[z, j, t]
""",
        "write-o": """
inv = ONE / dn if dn > ZERO else ZERO          # normalise once, after the last key
for t in range(d):
    O[z, i, t] = o_i[t] * inv
"""})
    return dict(variant=unnormalised, divisions_saved=2 * 1024 - 64)    # 2 per key before; d at the end after


@check_02_6.fails
def _():
    from flashnb.stages import softmax as S

    return dict(variant=S.make_attention_rows, divisions_saved=2048)    # unchanged kernel; forgets the end
