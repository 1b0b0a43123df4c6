"""Exercises of notebook 00 (why attention is limited by memory traffic, and the toolkit of its appendix)."""

from __future__ import annotations

import numpy as np
from numba import cuda, float32  # module globals: the simulator swaps `cuda` in a kernel's globals only

from . import close, exercise, require


def _crossing(gpu: str, d: int = 64) -> int:
    """Smallest N (a multiple of 64) at which the modelled FA2 forward (B = H = 1) is compute-bound on ``gpu``."""
    from ..instruments import bench, roofline

    for N in range(64, 1 << 20, 64):
        flops = roofline.flops_forward(1, 1, N, N, d)
        t = roofline.modelled_time(flops, bench.modelled_bytes("fa2", 1, 1, N, d, False), gpu)
        if t.bound == "compute":
            return N
    raise AssertionError(f"never compute-bound on {gpu}")  # pragma: no cover


@exercise("00.1", "when does FA2's forward become compute-bound?", level=1, minutes=10,
          hint="""Loop N over multiples of 64 at d = 64 (B = H = 1): flops = roofline.flops_forward(1, 1, N, N, 64),
          bytes = bench.modelled_bytes("fa2", 1, 1, N, 64, False); roofline.modelled_time(flops, bytes, gpu).bound
          says which roof binds. The presets are listed by roofline.GPUS.""",
          explain="""FA2 reads K and V once per block of Br query rows, so its bytes grow like N²d/Br while its FLOPs
          grow like N²d: the arithmetic intensity approaches Br/2 FLOP per byte (32 at d = 64, Br = 64) from below. The
          kernel becomes compute-bound once the intensity passes the GPU's ridge point (FP32 peak / HBM bandwidth).
          The A100's ridge is lower than the H100's (its FP32 peak is lower relative to its bandwidth), so it
          crosses at a smaller N.""")
def check_00_1(N_h100, N_a100):
    """N_h100, N_a100: the smallest N (multiple of 64) at which the modelled FA2 forward is compute-bound."""
    close(N_h100, _crossing("H100 SXM"), abs=64, what="N_h100")
    close(N_a100, _crossing("A100 80GB SXM"), abs=64, what="N_a100")
    require(N_a100 < N_h100, "which GPU's ridge point is lower?")


@check_00_1.solves
def _():
    from flashnb.instruments import bench, roofline

    def first_compute_bound(gpu, d=64):
        for N in range(64, 1 << 20, 64):
            flops = roofline.flops_forward(1, 1, N, N, d)
            if roofline.modelled_time(flops, bench.modelled_bytes("fa2", 1, 1, N, d, False), gpu).bound == "compute":
                return N

    return dict(N_h100=first_compute_bound("H100 SXM"), N_a100=first_compute_bound("A100 80GB SXM"))


@check_00_1.fails
def _():
    return dict(N_h100=64, N_a100=64)


def _moving_average_case(kernel, n=256, threads=64, seed=0):
    from ..instruments import traffic

    x = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    y = np.zeros(n, np.float32)
    with traffic.count() as t:
        kernel[n // threads, threads](x, y)
    return x, y, t


@exercise("00.2", "moving average through shared memory", level=2, minutes=20,
          signatures={"kernel": "void(float32[::1], float32[::1])"},
          hint="""Each block of T threads needs x[start-1 .. start+T]: T + 2 values. Let every thread copy x[i] into
          s[t + 1]; threads 0 and T-1 also copy the halo elements x[start-1] and x[start+T] (when they exist).
          Then cuda.syncthreads(), then average s[t], s[t+1], s[t+2]. Launch: [n // 64, 64].""",
          explain="""Global reads fall from about 3 per element to about 1 (each element once, plus two halo elements
          per block); the other reads moved to shared memory, which is where the re-reads belong: 3 shared reads
          per output. The barrier is what makes the halo written by a neighbouring thread visible.""")
def check_00_2(kernel):
    """kernel: a cuda.jit kernel (x, y) launched as kernel[n // 64, 64] that writes y[i] for 1 <= i < n - 1."""
    from .. import sim

    n, threads = 256, 64
    with sim.sanitize(raise_on_error=False) as report:
        x, y, _ = _moving_average_case(kernel, n, threads)
    require(not report, f"the sanitizer found errors:\n{report}")
    want = (x[:-2].astype(np.float64) + x[1:-1] + x[2:]) / 3
    err = np.abs(y[1:-1] - want)
    bad = np.flatnonzero(err > 1e-5)   # float32 sum of three O(1) values: a few ulps
    require(bad.size == 0, f"wrong output at i = {list(bad[:5] + 1)} (first few)")
    _, _, t = _moving_average_case(kernel, n, threads)
    reads = t.summary()[0]["reads"].get("x", 0)
    require(reads <= n + 2 * (n // threads), f"x is read {reads} times from global memory for n = {n}: each "
            "element should come from global memory about once (plus a halo of 2 per block)")
    require(t.shared_reads >= 3 * (n - 2), "the three values of each average should come from shared memory")
    return f"x read {reads} times from global memory ({reads / n:.2f} per element), {t.shared_reads} shared reads"


@check_00_2.solves
def _():
    @cuda.jit
    def moving_average3_shared(x, y):
        s = cuda.shared.array(66, float32)          # 64 threads + one halo element on each side
        t = cuda.threadIdx.x
        i = cuda.grid(1)
        n = x.shape[0]
        s[t + 1] = x[i]
        if t == 0:
            s[0] = x[i - 1] if i > 0 else float32(0)
        if t == cuda.blockDim.x - 1:
            s[t + 2] = x[i + 1] if i + 1 < n else float32(0)
        cuda.syncthreads()
        if 1 <= i < n - 1:
            y[i] = (s[t] + s[t + 1] + s[t + 2]) / float32(3)

    return dict(kernel=moving_average3_shared)


@check_00_2.fails
def _():
    @cuda.jit
    def moving_average3(x, y):                      # the global-memory version: 3 reads per element
        i = cuda.grid(1)
        if 1 <= i < x.shape[0] - 1:
            y[i] = (x[i - 1] + x[i] + x[i + 1]) / float32(3)

    return dict(kernel=moving_average3)


@exercise("00.3", "sectors per request of strided reads", level=1, minutes=10,
          hint="""Profile a kernel with the lines `out[lane] = A[0, 2 * lane]` and `out[lane] = A[0, 8 * lane]` (A of
          shape (1, 256) float32) and read the sectors per request from prof.select(...). Or work it out: which
          32-byte sectors do the 32 addresses 4·stride·lane fall into?""",
          explain="""Lane l reads byte 4·s·l. With stride 2 the warp spans 256 bytes: 8 sectors. With stride 8 the
          lanes are 32 bytes apart: every lane in its own sector, 32 sectors -- the most a 32-lane request of
          4-byte loads can touch, so any stride >= 8 is equally bad (the bytes moved per useful byte stop growing).""")
def check_00_3(sectors_stride2, sectors_stride8, worst_from_stride):
    """Sectors one 32-lane request of float32 loads touches at stride 2 and 8, and the smallest stride from
    which it gets no worse."""
    from ..sim.memprofile import request_cost

    def sectors(stride):
        return request_cost("global", [(4 * stride * lane, 4) for lane in range(32)])[0]

    close(sectors_stride2, sectors(2), what="sectors_stride2")
    close(sectors_stride8, sectors(8), what="sectors_stride8")
    first = next(s for s in range(1, 64) if sectors(s) == 32)
    close(worst_from_stride, first, what="worst_from_stride")


@check_00_3.solves
def _():
    import numpy as np

    def sectors(stride):
        return len(np.unique(4 * stride * np.arange(32) // 32))

    return dict(sectors_stride2=sectors(2), sectors_stride8=sectors(8),
                worst_from_stride=next(s for s in range(1, 64) if sectors(s) == 32))


@check_00_3.fails
def _():
    return dict(sectors_stride2=4, sectors_stride8=8, worst_from_stride=32)


def _matmul_resources():
    from .. import instruments as fi
    from ..registry import KERNELS

    return fi.resources_for("naive.matmul", KERNELS["naive.matmul"].configs[0], (9, 0))   # what A.2 prints


def _matmul_threads() -> int:
    from ..stages import naive

    return naive.TILE * naive.TILE     # naive's launcher: a T x T block per output tile


@exercise("00.4", "registers to spare before occupancy drops", level=2, minutes=15,
          hint="""Take naive.matmul's registers and static shared memory on sm_90 from the resource report that
          Appendix A.2 of notebook 00 prints (naive.TILE² threads per block).
          fi.occupancy(R, shared_bytes, threads, (9, 0)).blocks_per_sm is the number of resident blocks with R
          registers per thread: find the largest R that keeps today's number.""",
          explain="""Registers are allocated per warp in units of 256 (8 per thread), from four sub-partitions of
          16,384 each; the number of warps per sub-partition only changes when R crosses 16384 / (32 · warps)
          rounded to the allocation unit, and another resource (warps, blocks or shared memory per SM) may limit
          first. So a kernel below a step can grow by several registers "for free", one that sits on it has none
          to spare -- and one register past the step costs whole blocks per SM.""")
def check_00_4(max_registers):
    """max_registers: the most registers per thread naive.matmul (the configuration Appendix A.2 prints) could use
    on sm_90 and keep its current number of resident blocks per SM."""
    from .. import instruments as fi

    r, threads = _matmul_resources(), _matmul_threads()
    now = fi.occupancy(r.registers, r.shared_bytes, threads, (9, 0)).blocks_per_sm
    best = max(R for R in range(1, 256) if fi.occupancy(R, r.shared_bytes, threads, (9, 0)).blocks_per_sm >= now)
    close(max_registers, best, what="max_registers")
    return (f"naive.matmul uses {r.registers} registers per thread today and could use up to {best} and keep "
            f"{now} blocks/SM")


@check_00_4.solves
def _():
    from flashnb import instruments as fi
    from flashnb.registry import KERNELS
    from flashnb.stages import naive

    r = fi.resources_for("naive.matmul", KERNELS["naive.matmul"].configs[0], (9, 0))
    threads = naive.TILE * naive.TILE
    blocks = fi.occupancy(r.registers, r.shared_bytes, threads, (9, 0)).blocks_per_sm
    return dict(max_registers=max(R for R in range(1, 256)
                                  if fi.occupancy(R, r.shared_bytes, threads, (9, 0)).blocks_per_sm >= blocks))


@check_00_4.fails
def _():
    return dict(max_registers=255)


@exercise("00.5", "a warp inclusive scan with shuffles", level=2, minutes=20,
          signatures={"kernel": "void(float32[::1], float32[::1])"},
          hint="""Five steps, offset = 1, 2, 4, 8, 16: v_up = cuda.shfl_up_sync(0xFFFFFFFF, v, offset); a lane whose
          lane index is >= offset adds v_up, the others keep v (shfl_up_sync gives them their own value back).
          Every lane must call the shuffle -- only the add is conditional.""",
          explain="""After step k every lane holds the sum of the 2^k lanes ending at itself (Hillis-Steele). A lane
          with lane - offset < 0 has no partner: it must still call shfl_up_sync (all 32 lanes named in the mask
          must), and then ignore the result.""")
def check_00_5(kernel):
    """kernel: a cuda.jit kernel (x, out) that writes, in each warp, out[i] = x[warp start] + ... + x[i]
    (float32), launched as kernel[1, 64]."""
    from .. import sim

    x = np.random.default_rng(5).standard_normal(64).astype(np.float32)
    out = np.full(64, np.nan, np.float32)
    with sim.sanitize(raise_on_error=False) as report:
        kernel[1, 64](x, out)
    require(not report, f"the sanitizer found errors:\n{report}")
    want = np.concatenate([np.cumsum(x[:32].astype(np.float64)), np.cumsum(x[32:].astype(np.float64))])
    bad = np.flatnonzero(~(np.abs(out - want) <= 1e-5 * 32))   # ≤ 32 float32 adds of O(1) values
    require(bad.size == 0, f"wrong (or unwritten) out[i] at lanes {list(bad[:6])} (first few); each warp scans "
            "its own 32 lanes")


@check_00_5.solves
def _():
    @cuda.jit
    def warp_scan(x, out):
        i = cuda.threadIdx.x
        lane = i % 32
        v = x[i]
        offset = 1
        while offset < 32:
            up = cuda.shfl_up_sync(0xFFFFFFFF, v, offset)
            if lane >= offset:
                v += up
            offset *= 2
        out[i] = v

    return dict(kernel=warp_scan)


@check_00_5.fails
def _():
    @cuda.jit
    def not_a_scan(x, out):
        i = cuda.threadIdx.x
        out[i] = x[i]

    return dict(kernel=not_a_scan)
