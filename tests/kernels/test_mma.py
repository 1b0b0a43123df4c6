"""The tensor-core twins (flashnb.sim.tensorcore) against NumPy on plain matrices, and what the simulator's tools see.

Each check builds the 32 lanes' registers from plain matrices with the fragment layouts *as the PTX ISA states
them* (written out below, formula by formula, independently of the twins' tables), runs the instruction -- through
a kernel on both simulators (the threads simulator's twin is a warp collective, the vectorised one's runs every
warp at once) and through the NumPy core with a leading warps axis -- and compares what comes back, read with the
same stated layout, with NumPy's ``A @ B + C``.  Never twin against twin.  A deliberately wrong layout put into
the twin must make the same check fail (the negative tests): a check that passed with any layout would prove
nothing.  What the tools see (traffic, memcheck, initcheck, racecheck, the profiler's wavefronts) is checked on
both simulators, with the same findings.
"""

import contextlib
import inspect
from pathlib import Path

import numpy as np
import pytest
from numba import cuda, uint16, uint32

import flashnb
from flashnb import sim
from flashnb.kernels.tensorcore import check as mma_check
from flashnb.kernels.tensorcore import mma
from flashnb.kernels.tensorcore.mma import SHARED_ALIGN
from flashnb.sim import tensorcore as tc
from flashnb.sim import vector

pytestmark = pytest.mark.skipif(flashnb.MODE != "sim", reason="simulator twins")

MODES = ("vector", "threads")


def on_both(fn):
    """``fn()`` on the vectorised and on the threads simulator: {mode: result}.  The vectorised run must run its
    launches itself (none handed to the threads simulator)."""
    out = {}
    for mode in MODES:
        with sim.simulating(mode):
            before = vector.counts()
            out[mode] = fn()
            after = vector.counts()
        if mode == "vector":
            assert after["threads"] == before["threads"], vector.notes()[-2:]
    return out

LANE = np.arange(32)
G, T = LANE // 4, LANE % 4     # the PTX ISA's groupID and threadID_in_group


# --------------------------------------------------------------------------- layouts as the PTX ISA states them


def a_m16n8k16(i):
    """Element a_i (i = 0..7) of the f16/bf16 A fragment: row groupID (+8 for a2, a3, a6, a7), column
    threadID_in_group*2 + (i & 1) (+8 for a4..a7)."""
    return G + 8 * ((i // 2) % 2), 2 * T + (i % 2) + 8 * (i // 4)


def b_m16n8k16(i):
    """b_i (i = 0..3): row threadID_in_group*2 + (i & 1) (+8 for b2, b3), column groupID."""
    return 2 * T + (i % 2) + 8 * (i // 2), G


def c_m16n8(i):
    """c_i (i = 0..3): row groupID (+8 for c2, c3), column threadID_in_group*2 + (i & 1)."""
    return G + 8 * (i // 2), 2 * T + (i % 2)


def a_m16n8k8_tf32(i):
    """a_i (i = 0..3): row groupID (+8 for a1, a3), column threadID_in_group (+4 for a2, a3)."""
    return G + 8 * (i % 2), T + 4 * (i // 2)


def b_m16n8k8_tf32(i):
    """b_i (i = 0, 1): row threadID_in_group (+4 for b1), column groupID."""
    return T + 4 * i, G


def a_m16n8k8_f16(i):
    """a_i (i = 0..3): row groupID (+8 for a2, a3), column threadID_in_group*2 + (i & 1)."""
    return G + 8 * (i // 2), 2 * T + (i % 2)


def b_m16n8k8_f16(i):
    """b_i (i = 0, 1): row threadID_in_group*2 + i, column groupID."""
    return 2 * T + i, G


SHAPES = {  # shape: (M, N, K, element kind, A elements, B elements, A's element function, B's)
    "m16n8k16.f16": (16, 8, 16, "f16", 8, 4, a_m16n8k16, b_m16n8k16),
    "m16n8k16.bf16": (16, 8, 16, "bf16", 8, 4, a_m16n8k16, b_m16n8k16),
    "m16n8k8.tf32": (16, 8, 8, "tf32", 4, 2, a_m16n8k8_tf32, b_m16n8k8_tf32),
    "m16n8k8.f16": (16, 8, 8, "f16", 4, 2, a_m16n8k8_f16, b_m16n8k8_f16),
}


def bits16(x, kind):
    """16-bit patterns of float values (exactly representable in ``kind``)."""
    x = np.asarray(x, dtype=np.float32)
    if kind == "f16":
        return x.astype(np.float16).view(np.uint16).astype(np.uint32)
    return (x.view(np.uint32) >> 16).astype(np.uint32)          # bf16: the high half of a float32


def registers(matrix, n_elements, element, kind):
    """The 32 lanes' registers holding ``matrix`` by the stated layout: (32, registers) uint32."""
    vals = np.stack([matrix[element(i)] for i in range(n_elements)], axis=1)    # (32, elements)
    if kind == "tf32":
        return vals.astype(np.float32).view(np.uint32)
    b = bits16(vals, kind)
    return b[:, 0::2] | (b[:, 1::2] << np.uint32(16))            # element 2r low, 2r + 1 high


def representable(rng, shape, kind):
    """Random O(1) values exactly representable in ``kind`` (so the inputs are what the registers hold)."""
    x = rng.standard_normal(shape).astype(np.float32)
    if kind == "f16":
        return x.astype(np.float16).astype(np.float32)
    if kind == "bf16":
        return ((x.view(np.uint32) >> 16) << 16).astype(np.uint32).view(np.float32)
    return (x.view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)          # tf32: 10 mantissa bits


def mma_case(shape, seed=0):
    M, N, K, kind, na, nb, fa, fb = SHAPES[shape]
    rng = np.random.default_rng(seed)
    A, B = representable(rng, (M, K), kind), representable(rng, (K, N), kind)
    C = rng.standard_normal((M, N)).astype(np.float32)
    a, b = registers(A, na, fa, kind), registers(B, nb, fb, kind)
    c = np.stack([C[c_m16n8(i)] for i in range(4)], axis=1)
    return A, B, C, a, b, c


def read_d(d):
    """D (16 × 8) from the lanes' accumulators by the stated C layout."""
    D = np.full((16, 8), np.nan)
    for i in range(4):
        D[c_m16n8(i)] = d[:, i]
    return D


def launch_mma(shape, a, b, c):
    out = cuda.to_device(np.full((32, 4), np.nan, np.float32))
    if shape == "m16n8k8.f16":
        kernel = mma_check.make_mma1688()
        a = np.pad(a, ((0, 0), (0, 2)))
        b = np.pad(b, ((0, 0), (0, 1)))
    else:
        kernel = mma_check.make_mma(shape)
    kernel[1, 32](np.ascontiguousarray(a), np.ascontiguousarray(b), np.ascontiguousarray(c, np.float32), out)
    return out.copy_to_host()


# float64 product of exactly representable inputs plus C, rounded once to float32 (the twin's contract; a GPU's
# float32 accumulation is checked against it in scripts/gpu_check.py): a float32 ulp of sums of size ~10
TOL = dict(rtol=1e-6, atol=1e-6)


def check_mma(shape, seed=0):
    A, B, C, a, b, c = mma_case(shape, seed)
    want = A.astype(np.float64) @ B.astype(np.float64) + C
    for mode, d in on_both(lambda: launch_mma(shape, a, b, c)).items():
        np.testing.assert_allclose(read_d(d), want, **TOL, err_msg=f"{shape} through the {mode} simulator's twin")
    # the NumPy core, three warps at once (a vectorised simulator's call): each warp its own matrices
    cases = [mma_case(shape, seed + w) for w in range(3)]
    d = tc.mma_core(shape, np.stack([x[3] for x in cases]), np.stack([x[4] for x in cases]),
                    np.stack([x[5] for x in cases]))
    for w, (A, B, C, *_) in enumerate(cases):
        np.testing.assert_allclose(read_d(d[w]), A.astype(np.float64) @ B + C, **TOL, err_msg=f"{shape} core warp {w}")


@pytest.mark.parametrize("shape", list(SHAPES))
def test_mma_equals_numpy_on_plain_matrices(shape):
    check_mma(shape)


def _swap_registers(layout, i, j):
    rows, cols = layout
    rows, cols = rows.copy(), cols.copy()
    rows[:, [i, j]] = rows[:, [j, i]]
    cols[:, [i, j]] = cols[:, [j, i]]
    return rows, cols


WRONG = {   # plausible mistakes, each in one table of the twin
    "A registers 1 and 2 swapped ((g, 2t+8) taken for (g+8, 2t))":
        ("m16n8k16.f16", ("m16n8k16", "a"), lambda L: _swap_registers(L, 1, 2)),
    "B registers swapped (k 8..15 taken for k 0..7)":
        ("m16n8k16.bf16", ("m16n8k16", "b"), lambda L: _swap_registers(L, 0, 1)),
    "C rows g and g+8 swapped":
        ("m16n8k16.f16", ("c", "c"), lambda L: _swap_registers(_swap_registers(L, 0, 2), 1, 3)),
    "tf32 A: columns t and t+4 taken as rows g and g+8":
        ("m16n8k8.tf32", ("m16n8k8.tf32", "a"), lambda L: _swap_registers(L, 1, 2)),
    "f16 m16n8k8 B: halves swapped":
        ("m16n8k8.f16", ("m16n8k8", "b"), lambda L: (L[0][:, :, ::-1].copy(), L[1][:, :, ::-1].copy())),
}


@pytest.mark.parametrize("what", list(WRONG))
def test_a_wrong_layout_fails_the_check(monkeypatch, what):
    shape, key, wrong = WRONG[what]
    monkeypatch.setitem(tc.LAYOUTS, key, wrong(tc.LAYOUTS[key]))
    with pytest.raises(AssertionError):
        check_mma(shape)


# --------------------------------------------------------------------------- ldmatrix


def ldmatrix_expected(M, rows, num, trans):
    """PTX ISA: lanes 8j..8j+7 address the rows of matrix j; lane l's register j holds row l/4, columns 2(l%4)
    and 2(l%4)+1 of matrix j -- with .trans, rows 2(l%4) and 2(l%4)+1 of column l/4 -- low half first."""
    out = np.zeros((32, num), np.uint32)
    for j in range(num):
        Mj = M[rows[8 * j:8 * j + 8]].astype(np.uint32)            # (8, 8): row r is lane 8j + r's row
        for lane in range(32):
            r, c = lane // 4, 2 * (lane % 4)
            lo, hi = (Mj[c, r], Mj[c + 1, r]) if trans else (Mj[r, c], Mj[r, c + 1])
            out[lane, j] = lo | (hi << 16)
    return out


def check_ldmatrix(num, trans, seed=0):
    rng = np.random.default_rng(seed)
    M = rng.integers(0, 1 << 16, (32, 8), dtype=np.uint16)
    rows = rng.permutation(32).astype(np.int32)
    def run():
        R = cuda.to_device(np.zeros((32, num), np.uint32))
        mma_check.make_ldmatrix(num, trans)[1, 32](M, rows, R)
        return R.copy_to_host()
    for mode, R in on_both(run).items():
        np.testing.assert_array_equal(R, ldmatrix_expected(M, rows, num, trans),
                                      err_msg=f"ldmatrix x{num} trans={trans} ({mode})")


@pytest.mark.parametrize("trans", [False, True])
@pytest.mark.parametrize("num", [1, 2, 4])
def test_ldmatrix_equals_the_stated_layout(num, trans):
    check_ldmatrix(num, trans)


def test_a_wrong_ldmatrix_layout_fails_the_check(monkeypatch):
    monkeypatch.setitem(tc.LDMATRIX_LAYOUT, True, tc.LDMATRIX_LAYOUT[False])     # .trans forgotten
    with pytest.raises(AssertionError):
        check_ldmatrix(4, True)


def test_ldmatrix_feeds_mma_as_fa2_uses_it():
    # Q (16 × 16) row-major in shared memory, ldmatrix.x4 with lane l addressing row l % 16, columns 8·(l // 16):
    # the four matrices are exactly the A fragment of m16n8k16 (the rows/columns of r0..r3)
    rng = np.random.default_rng(3)
    Q = rng.integers(0, 1 << 16, (16, 16), dtype=np.uint16)
    rows = np.concatenate([Q[:, :8], Q[:, 8:]])                  # lane l's row: Q[l % 16, 8·(l // 16):]
    got = tc.ldmatrix_core(rows, 4, False)
    want = np.zeros((32, 4), np.uint32)
    for i in range(8):
        r, c = a_m16n8k16(i)
        want[:, i // 2] |= Q[r, c].astype(np.uint32) << np.uint32(16 * (i % 2))
    np.testing.assert_array_equal(got, want)


# --------------------------------------------------------------------------- conversions


def test_conversions_round_as_ptx_says():
    x = np.array([1 + 2.0 ** -11, -(1 + 2.0 ** -11), 1 + 2.0 ** -12, 1 + 3 * 2.0 ** -11, np.inf, 2.5], np.float32)
    # cvt.rna.tf32.f32: nearest, ties away from zero (tf32 keeps 10 mantissa bits: ulp(1) = 2^-10)
    want = np.array([1 + 2.0 ** -10, -(1 + 2.0 ** -10), 1, 1 + 2 * 2.0 ** -10, np.inf, 2.5], np.float32)
    assert np.array_equal(tc.to_tf32_core(x).view(np.float32), want)
    assert np.isnan(tc.to_tf32_core(np.float32(np.nan)).view(np.float32))
    # cvt.rn.f16x2.f32 / bf16x2: nearest even; lo in the low half.  f16 ties: 1 + 2^-11 -> 1, 1 + 3·2^-11 -> 1 + 2^-9
    r = tc.pack_core(np.float32(1 + 2.0 ** -11), np.float32(1 + 3 * 2.0 ** -11), "f16")
    assert int(r) == 0x3C00 | (0x3C02 << 16)
    # bf16 (7 mantissa bits): 1 + 2^-8 is a tie -> 1.0 (0x3F80); 1 + 3·2^-8 -> 1 + 2^-6 (0x3F82)
    r = tc.pack_core(np.float32(1 + 2.0 ** -8), np.float32(1 + 3 * 2.0 ** -8), "bf16")
    assert int(r) == 0x3F80 | (0x3F82 << 16)
    assert np.array_equal(tc.unpack_core(r, "bf16"), np.array([1.0, 1 + 2.0 ** -6], np.float32))


# --------------------------------------------------------------------------- cp.async and the tools


def test_cp_async_lands_at_wait_group():
    rng = np.random.default_rng(1)
    G_ = rng.integers(0, 1 << 16, (32, 8), dtype=np.uint16)
    rows = rng.permutation(32).astype(np.int32)
    nbytes = (2 * rng.integers(0, 9, 32)).astype(np.int32)

    def run():
        out = cuda.to_device(np.zeros((32, 16), np.uint16))
        mma_check.make_cp_async()[1, 32](G_, rows, nbytes, out)
        return out.copy_to_host()
    other = (LANE + 1) % 32
    for out in on_both(run).values():
        for lane in range(32):
            n = nbytes[other[lane]] // 2
            np.testing.assert_array_equal(out[lane, :n], G_[rows[other[lane]], :n])
            assert not out[lane, n:8].any()                                            # zero-filled
            np.testing.assert_array_equal(out[lane, 8:], G_[31 - rows[other[lane]]])


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")    # 7e4 is beyond float16: inf, as cvt.rn gives
def test_conversions_on_both_simulators():
    # the conversion kernel on random values and on the edges (ties, infinities, NaN, beyond f16's range, a
    # subnormal), bit for bit against the cores on the same inputs
    rng = np.random.default_rng(6)
    X = rng.standard_normal((32, 2)).astype(np.float32) * np.float32(8)
    X[:8, 0] = [1 + 2.0 ** -11, -(1 + 2.0 ** -11), np.inf, -np.inf, np.nan, 7e4, 1e-40, 1 + 2.0 ** -8]
    want = np.stack([tc.to_tf32_core(X[:, 0]), tc.pack_core(X[:, 0], X[:, 1], "f16"),
                     tc.pack_core(X[:, 0], X[:, 1], "bf16")], axis=1)

    def run():
        R = cuda.to_device(np.zeros((32, 3), np.uint32))
        mma_check.make_convert()[1, 32](X, R)
        return R.copy_to_host()
    for mode, R in on_both(run).items():
        np.testing.assert_array_equal(R, want, err_msg=mode)


@cuda.jit
def copy_then_read(G_, out, wait, barrier):
    """64 threads: thread t copies row t of G_ into chunk t, then reads chunk 63 - t (another warp's copy)."""
    S = cuda.shared.array(512, uint16, alignment=SHARED_ALIGN)
    t = cuda.threadIdx.x
    mma.cp_async_16(S, t * 8, G_, (t, 0), uint32(16))
    mma.cp_async_commit()
    if wait:
        mma.cp_async_wait_group(0)
    if barrier:
        cuda.syncthreads()
    for e in range(8):
        out[t, e] = S[(63 - t) * 8 + e]


def _copy_then_read(wait, barrier):
    G_ = np.random.default_rng(2).integers(0, 1 << 16, (64, 8), dtype=np.uint16)
    out = cuda.to_device(np.zeros((64, 8), np.uint16))
    with sim.sanitize(raise_on_error=False) as report:
        copy_then_read[1, 64](G_, out, wait, barrier)
    return G_, out.copy_to_host(), report


@pytest.mark.parametrize("wait, barrier", [(True, True), (False, True), (True, False)],
                         ids=["clean", "missing-wait", "missing-barrier"])
def test_the_sanitizer_finds_the_same_on_both_simulators(wait, barrier):
    runs = on_both(lambda: _copy_then_read(wait, barrier))
    (_, out_v, report_v), (_, out_t, report_t) = runs["vector"], runs["threads"]
    # the same findings: tool, kind, kernel, line(s) and how often.  The example each message names (which thread,
    # which element) is the first the threads simulator's threads happen to run into after the barrier (the last
    # thread to arrive leaves it first), the first in start order on the vectorised one.  Without the barrier the
    # threads simulator, running one thread after another, also reads copies later threads have not landed yet
    # (initcheck); in lockstep every copy lands before any read, and the race is the finding
    tools = sim.sanitizer.TOOLS if barrier else ("memcheck", "racecheck", "synccheck")

    def found(report):
        return [(f.tool, f.kind, f.launch, f.kernel, f.where, f.count) for t in tools for f in report.by_tool(t)]
    assert found(report_v) == found(report_t), f"vector:\n{report_v}\nthreads:\n{report_t}"
    want = (set() if wait else {"initcheck"}) | (set() if barrier else {"racecheck"})
    assert {f.tool for f in report_v.findings} == want, str(report_v)
    assert report_v.traffic.summary() == report_t.traffic.summary()
    if wait and barrier:
        np.testing.assert_array_equal(out_v, out_t)


@cuda.jit
def two_groups(G_, out, n_wait):
    """Two groups of copies, issued by different threads: a first (threads t % 3 != 0: row t), a second (odd
    threads: half of row 63 - t, zero-filled); ``cp.async.wait_group n_wait``; each thread reads back its own."""
    S = cuda.shared.array(64 * 16, uint16, alignment=SHARED_ALIGN)
    t = cuda.threadIdx.x
    if t % 3 != 0:
        mma.cp_async_16(S, t * 16, G_, (t, 0), uint32(16))
    mma.cp_async_commit()
    if t % 2 == 1:
        mma.cp_async_16(S, t * 16 + 8, G_, (63 - t, 0), uint32(8))
    mma.cp_async_commit()
    mma.cp_async_wait_group(n_wait)
    for e in range(8):
        if t % 3 != 0:
            out[t, e] = S[t * 16 + e]                 # GROUP 0: in flight still when n_wait >= 2
        if t % 2 == 1:
            out[t, 8 + e] = S[t * 16 + 8 + e]         # GROUP 1: in flight still when n_wait >= 1


@pytest.mark.parametrize("n_wait", [0, 1, 3])
def test_cp_async_groups_land_per_thread(n_wait):
    # wait_group n lands all but a thread's newest n committed groups (none when it has n or fewer): an in-flight
    # copy read back is initcheck's error at that line; the same on both simulators
    G_ = np.random.default_rng(7).integers(0, 1 << 16, (64, 8), dtype=np.uint16)

    def run():
        out = cuda.to_device(np.zeros((64, 16), np.uint16))
        with sim.sanitize(raise_on_error=False) as report:
            two_groups[1, 64](G_, out, n_wait)
        return out.copy_to_host(), [(f.tool, f.where, f.count) for f in report.findings]
    runs = on_both(run)
    lines, first = inspect.getsourcelines(two_groups.py_func)
    at = {g: f"{Path(__file__).name}:{first + i} (two_groups)" for i, line in enumerate(lines)
          for g in ("GROUP 0", "GROUP 1") if g in line}
    t = np.arange(64)
    want = {0: [], 1: [("initcheck", at["GROUP 1"], 32 * 8)],
            3: [("initcheck", at["GROUP 0"], int((t % 3 != 0).sum()) * 8), ("initcheck", at["GROUP 1"], 32 * 8)]}
    for mode, (out, found) in runs.items():
        assert found == want[n_wait], (mode, found)
        if n_wait == 0:
            first_group, second = t % 3 != 0, t % 2 == 1
            np.testing.assert_array_equal(out[first_group, :8], G_[t[first_group]])
            np.testing.assert_array_equal(out[second, 8:12], G_[63 - t[second], :4])
            assert not out[second, 12:].any() and not out[~first_group, :8].any()
    if n_wait == 0:
        np.testing.assert_array_equal(runs["vector"][0], runs["threads"][0])


@cuda.jit
def ldmatrix_past_the_end(out):
    S = cuda.shared.array(256, uint16, alignment=SHARED_ALIGN)
    lane = cuda.laneid
    for e in range(8):
        S[lane * 8 + e] = uint16(e)
    cuda.syncwarp()
    out[lane] = mma.ldmatrix_x1(S, lane * 8 + 200)     # BUG: lane 7's row is S[256:264], past the end


@cuda.jit
def copy_past_the_end(G_, out):
    S = cuda.shared.array(256, uint16, alignment=SHARED_ALIGN)
    lane = cuda.laneid
    mma.cp_async_16(S, lane * 8, G_, (lane + 1, 0), uint32(16))   # BUG: lane 31 copies row 32 of 32
    mma.cp_async_wait_all()
    out[lane] = S[lane * 8]


@pytest.mark.parametrize("kernel, text", [
    (ldmatrix_past_the_end, "invalid shared read of S[256] by thread [7, 0, 0]"),
    (copy_past_the_end, "invalid global read of G_[32, 0] by thread [31, 0, 0]")])
def test_memcheck_checks_the_instructions_addresses(kernel, text):
    # ldmatrix's rows and cp.async's source are element reads like any other: an index past the end is memcheck's
    # error, named by the instruction's line (a copy's by the line that issued it), on both simulators
    G_ = np.random.default_rng(5).integers(0, 1 << 16, (32, 8), dtype=np.uint16)
    args = (G_,) if kernel is copy_past_the_end else ()

    def run():
        with sim.sanitize(tools="memcheck", raise_on_error=False) as report:
            kernel[1, 32](*args, cuda.to_device(np.zeros(32, np.uint32)))
        return report.findings
    runs = on_both(run)
    (f,) = runs["vector"]
    lines, first = inspect.getsourcelines(kernel.py_func)
    (k,) = [i for i, line in enumerate(lines) if "# BUG" in line]
    assert f.tool == "memcheck" and text in f.message, f.message
    assert f.where == f"{Path(__file__).name}:{first + k} ({kernel.py_func.__name__})"
    assert runs["threads"] == runs["vector"]


def test_cp_async_with_wait_and_barrier_is_clean_and_right():
    G_, out, report = _copy_then_read(True, True)
    assert not report.findings, str(report)
    np.testing.assert_array_equal(out, G_[::-1])
    lt = report.traffic.launches[0]                        # the copies are counted: 8 elements read, 8 written
    assert lt.reads == {"G_": 64 * 8} and lt.shared_writes == {"S": 64 * 8} and lt.shared_reads == {"S": 64 * 8}


def test_a_missing_wait_is_an_initcheck_error():
    _, _, report = _copy_then_read(False, True)
    found = report.by_tool("initcheck")
    assert found and "uninitialized shared" in found[0].message, str(report)


def test_a_missing_barrier_is_a_racecheck_error():
    _, _, report = _copy_then_read(True, False)
    races = report.by_tool("racecheck")
    assert races and "read/write race on shared S" in races[0].message, str(report)
    assert Path(__file__).name in races[0].where            # named by the kernel's lines (the copy's, the read's)


@cuda.jit
def ldsm_rows(out, stride, swizzle):
    """One warp: lane l addresses row l of a (32, 64) half tile (row stride ``stride`` halves), chunk 0 -- or,
    swizzled, chunk l % 8 of the row's 8 chunks (chunk c of row r lives at c ^ (r % 8))."""
    S = cuda.shared.array(4096, uint16, alignment=SHARED_ALIGN)
    lane = cuda.laneid
    for e in range(128):
        S[lane * 128 + e] = uint16(e)
    cuda.syncwarp()
    chunk = (lane % 8) if swizzle else 0
    r0, r1, r2, r3 = mma.ldmatrix_x4(S, lane * stride + 8 * chunk)
    out[lane] = r0 + r1 + r2 + r3


@pytest.mark.parametrize("swizzle, conflicts", [(False, 4 * 7), (True, 0)])
def test_profiler_counts_ldmatrix_wavefronts_by_8_row_phases(swizzle, conflicts):
    # rows 64 halves = 128 bytes apart: all 8 rows of a matrix start in bank 0 -> 8 wavefronts where 1 is
    # ideal (7 conflicts per matrix, 4 matrices); with the XOR swizzle the 8 rows cover all 32 banks
    def run():
        out = cuda.to_device(np.zeros(32, np.uint32))
        with sim.profile() as prof:
            ldsm_rows[1, 32](out, 64, swizzle)
        return prof
    profs = on_both(run)
    prof = profs["vector"]
    line = [s for s in prof.select(array="S", op="ld")]
    assert len(line) == 1 and line[0].requests == 4, prof.table()
    assert line[0].bank_conflicts == conflicts and line[0].ideal == 4, prof.table()
    assert profs["threads"].lines == prof.lines, profs["threads"].table()


@cuda.jit
def partial_warp_mma(out):
    lane = cuda.laneid
    if lane == 31:
        return
    d0, d1, d2, d3 = mma.mma_m16n8k16_f16(uint32(0), uint32(0), uint32(0), uint32(0), uint32(0), uint32(0),
                                          out[lane], out[lane], out[lane], out[lane])
    out[lane] = d0


@cuda.jit
def misaligned_ldmatrix(out):
    S = cuda.shared.array(512, uint16, alignment=SHARED_ALIGN)
    lane = cuda.laneid
    for e in range(16):
        S[lane * 16 + e] = uint16(e)
    cuda.syncwarp()
    out[lane] = mma.ldmatrix_x1(S, lane * 16 + 4)


@contextlib.contextmanager
def fastbarrier_lenient():
    """CUDA's documented rule for exited lanes (not waited for), in place of the simulator's strict default."""
    from flashnb.sim import fastbarrier
    saved = fastbarrier.STRICT_EXITED_LANES
    fastbarrier.STRICT_EXITED_LANES = False
    try:
        yield
    finally:
        fastbarrier.STRICT_EXITED_LANES = saved


def test_misuse_is_an_error_naming_what_is_wrong():
    # a lane that returned before a warp collective: the simulator's check of exited lanes names it first (the
    # twin's own "did not take part" is what it says with that check off)
    with pytest.raises(RuntimeError, match=r"in warp 0: lanes \[31\] named in the mask had already returned"):
        partial_warp_mma[1, 32](cuda.to_device(np.zeros(32, np.float32)))
    with fastbarrier_lenient(), pytest.raises(tc.TensorCoreError, match=r"lanes \[31\] of warp 0 did not take part"):
        partial_warp_mma[1, 32](cuda.to_device(np.zeros(32, np.float32)))
    with pytest.raises(tc.TensorCoreError, match="not 16-byte aligned"):
        misaligned_ldmatrix[1, 32](cuda.to_device(np.zeros(32, np.uint32)))
    with pytest.raises(RuntimeError, match="only be called from a kernel"):
        mma.mma_m16n8k8_f16(0, 0, 0, 0.0, 0.0, 0.0, 0.0)


def test_the_gpu_check_runs_on_the_twins():
    # scripts/gpu_check.py's first step, rehearsed: on the simulator every intrinsic's kernel runs on its twin
    rows = mma_check.run(seed=4)
    assert len(rows) == 15 and all(r["ok"] for r in rows), rows
