"""flashnb.sim.profile: sectors per request and shared-memory bank conflicts, worked out by hand for small
kernels, and the known cases in the library's kernels (FA2's transposed tile stores, FA1's row-per-lane reads)."""

import numpy as np
import pytest
from numba import cuda, float32

import flashnb
from flashnb import cli, sim
from flashnb.common import to_device
from flashnb.sim.memprofile import METRICS, request_cost

pytestmark = pytest.mark.skipif(flashnb.MODE != "sim", reason="simulator-only tool")


@pytest.fixture(autouse=True)
def _installed():
    assert sim.install()


# --------------------------------------------------------------------------- one request, by hand


def test_request_cost_by_hand():
    f32 = [(4 * lane, 4) for lane in range(32)]
    assert request_cost("global", f32) == (4, 4)                     # 128 consecutive bytes: 4 sectors
    assert request_cost("global", [(4 + o, s) for o, s in f32]) == (5, 4)   # shifted by one: straddles 5
    assert request_cost("global", [(256 * lane, 4) for lane in range(32)]) == (32, 4)  # a column: 1 each
    assert request_cost("global", [(0, 4)] * 32) == (1, 1)           # broadcast
    assert request_cost("global", [(8 * lane, 8) for lane in range(32)]) == (8, 8)   # 256 bytes of float64
    assert request_cost("shared", f32) == (1, 1)                     # word w in bank w: conflict-free
    assert request_cost("shared", [(8 * lane, 4) for lane in range(32)]) == (2, 1)   # stride 2: 2-way
    assert request_cost("shared", [(128 * lane, 4) for lane in range(32)]) == (32, 1)  # stride 32: 32-way
    assert request_cost("shared", [(132 * lane, 4) for lane in range(32)]) == (1, 1)   # padded stride 33
    assert request_cost("shared", [(0, 4)] * 32) == (1, 1)           # one word for every lane: broadcast
    # lanes 0-15 read word 0, lanes 16-31 word 32 (same bank 0, different words): 2 wavefronts
    assert request_cost("shared", [(0, 4)] * 16 + [(128, 4)] * 16) == (2, 1)


# --------------------------------------------------------------------------- hand-made kernels


@cuda.jit
def copy_row(A, B):
    i = cuda.threadIdx.x
    B[i] = A[0, i]              # lane i reads A[0, i]: 32 consecutive float32 = 128 bytes = 4 sectors


@cuda.jit
def copy_column(A, B):
    i = cuda.threadIdx.x
    B[i] = A[i, 0]              # lane i reads A[i, 0]: rows are 64 floats = 256 bytes apart: 32 sectors


@cuda.jit
def copy_scalar(A, B):
    i = cuda.threadIdx.x
    B[i] = A[0, 0]              # every lane reads one element: 1 sector


@cuda.jit
def shared_stride(B, stride):
    sh = cuda.shared.array(1100, float32)
    i = cuda.threadIdx.x
    w = (i % 32) * stride + i // 32     # lane l of warp v: word l·stride + v (the same pattern in both warps)
    sh[w] = float32(i)
    cuda.syncthreads()
    B[i] = sh[w]


def _profile(kernel, grid, block, *args):
    with sim.profile() as prof:
        kernel[grid, block](*args)
    return prof


def test_coalesced_strided_and_broadcast_global_loads():
    A = to_device(np.random.default_rng(0).standard_normal((64, 64)))
    B = to_device(np.zeros(64, np.float32))
    cases = {copy_row: 4, copy_column: 32, copy_scalar: 1}
    for kernel, sectors in cases.items():
        prof = _profile(kernel, 2, 32, A, B)          # two blocks, one warp each: 2 requests per line
        (ld,) = prof.select(array="A")
        assert (ld.memory, ld.op, ld.requests, ld.cost) == ("global", "ld", 2, 2 * sectors), kernel
        assert ld.per_request == sectors and ld.bytes == 2 * sectors * 32
        (st,) = prof.select(array="B")
        assert (st.op, st.requests, st.cost, st.ideal) == ("st", 2, 8, 8)    # B[i]: coalesced, 4 each
        m = prof.metrics()[kernel.py_func.__name__]
        assert m["l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum"] == 2 * sectors
        assert m["l1tex__average_t_sectors_per_request_pipe_lsu_mem_global_op_ld.ratio"] == sectors


@pytest.mark.parametrize("stride, wavefronts", [(1, 1), (2, 2), (4, 4), (32, 32), (33, 1), (0, 1)])
def test_shared_bank_conflicts(stride, wavefronts):
    # word i·stride sits in bank (i·stride) mod 32: stride 2 puts two lanes in each even bank (2-way), stride 32
    # all 32 lanes in bank 0 (32-way), an odd stride (33) spreads them over all banks; stride 0 is one word that
    # every lane shares (a broadcast for loads; for stores one lane's value lands, also one wavefront)
    prof = _profile(shared_stride, 1, 64, to_device(np.zeros(64, np.float32)), stride)
    for op in ("st", "ld"):
        (s,) = prof.select(array="sh", op=op)
        assert (s.memory, s.requests, s.cost, s.ideal) == ("shared", 2, 2 * wavefronts, 2)
        assert s.bank_conflicts == 2 * (wavefronts - 1)
    m = prof.metrics()["shared_stride"]
    assert m["l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum"] == 2 * (wavefronts - 1)
    assert m["smsp__sass_inst_executed_op_shared_st.sum"] == 2
    assert set(m) <= {name for names in METRICS.values() for name in names if name} | {
        "l1tex__average_t_sectors_per_request_pipe_lsu_mem_global_op_st.ratio"}


# --------------------------------------------------------------------------- the library's kernels


@pytest.mark.parametrize("d, Br", [(32, 64), (16, 32)])
def test_fa2_forward_transposed_tile_stores_conflict(d, Br):
    # FA2 Alg. 1 line 4 stores Q_i transposed: element e of the tile goes to QsT[k, r] with k = e mod d, so the
    # 32 lanes of a warp write words k·Br + r. With Br a multiple of 32 every row k starts in bank r: the
    # lanes that share r (min(32, d) of them) all hit one bank -- 32-way at d = 32, 16-way at d = 16 (two
    # rows r, r+1 per warp). K_j (KsT, Bc = 32) is stored the same way. Reads of them are conflict-free.
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 64, d)) for _ in range(3))
    with sim.profile() as prof:
        flashnb.attention_forward(q, k, v, impl="fa2", Br=Br, Bc=32, warps=4)
    ways = min(32, d)
    for name in ("QsT", "KsT"):
        (st,) = prof.select(array=name, op="st")
        assert st.per_request == ways and st.ideal == st.requests, name
        assert all(s.bank_conflicts == 0 for s in prof.select(array=name, op="ld"))
    assert {s.array for s in prof.worst(2)} == {"QsT", "KsT"}
    for name in ("Q", "K", "V"):                # the global loads behind them are coalesced
        (ld,) = prof.select(array=name, op="ld")
        assert ld.cost == ld.ideal and ld.per_request == 4


def test_fa1_row_per_lane_reads_of_Q_i_conflict():
    # FA1's S_ij = Q_i K_jᵀ (fa1.py, Alg. 1 line 9): lane r reads Q_i[r, x] for x = 0..d-1, so the lanes of a warp
    # read words r·d + x -- stride d. At d = 32 every lane is in bank x: Br = 32 rows, 32-way conflicts.
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 32, 32)) for _ in range(3))
    with sim.profile() as prof:
        flashnb.attention_forward(q, k, v, impl="fa1", Br=32, Bc=16, warps=2)
    (qi,) = [s for s in prof.select(array="Q_i", op="ld") if s.bank_conflicts]
    assert qi.per_request == 32 and qi.ideal == qi.requests


@pytest.mark.slow   # CI budget (~16 s): the profiler's counts are checked above; this is the CLI's printing of them
def test_cli_profile_prints_the_known_case(capsys):
    assert cli.main(["profile", "fa2", "--nq", "32", "--nk", "32", "--d", "32", "--lines", "2"]) == 0
    out = capsys.readouterr().out
    assert "fa2        forward" in out and "QsT" in out and "KsT" in out and "32.00 wave" in out
    assert "no cache modelling" in out


def test_profiler_refuses_to_nest():
    with sim.profile():
        with pytest.raises(RuntimeError, match="already active"):
            with sim.sanitize():
                pass
