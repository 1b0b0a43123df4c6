"""Resident blocks and warps per SM from a kernel's registers, shared memory and block size, against the
published per-SM limits of each compute capability (:data:`SM_LIMITS`), and which limit binds."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_STATIC_SHARED = 48 * 1024  # bytes of *static* shared memory one block may declare (all cc >= 2.0)
# Bytes of shared memory (static + dynamic) one block may use after the driver opt-in
# (cudaFuncAttributeMaxDynamicSharedMemorySize; CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN):
# CUDA C++ Programming Guide, "Technical Specifications per Compute Capability".
MAX_OPTIN_SHARED = {(7, 5): 64 * 1024, (8, 0): 163 * 1024, (9, 0): 227 * 1024}
# The architectures whose opt-in limit the PTX guard holds dynamic shared memory to (A100, H100/H200: what the
# dynamic defaults are chosen for).  Elsewhere (a T4's 64 KiB) the launcher reads the device's own limit at run
# time and refuses or falls back (``common.shared_optin_limit``); occupancy there says 0 blocks.
OPTIN_CHECKED_CCS = ((8, 0), (9, 0))


# --------------------------------------------------------------------------- per-SM limits


@dataclass(frozen=True)
class SMLimits:
    """Per-SM resource limits of one compute capability.

    Sources: CUDA C++ Programming Guide, "Technical Specifications per Compute Capability" (registers,
    warps, blocks, shared memory per SM, 48 KiB static shared per block, 255 registers per thread), and
    ``cuda_occupancy.h`` from the CUDA 12.9 runtime (shipped in the nvidia-cuda-runtime-cu12 wheel):
    register allocation unit 256 per warp, 4 sub-partitions per SM (registers are split between them),
    shared memory allocation unit 128 bytes, and 1 KiB of shared memory reserved per block on cc >= 8.0
    (``cudaDevAttrReservedSharedMemoryPerBlock``).
    """

    cc: tuple[int, int]
    gpus: str
    regs_per_sm: int = 64 * 1024
    max_regs_per_block: int = 64 * 1024
    max_regs_per_thread: int = 255
    reg_alloc_unit: int = 256        # registers are allocated per warp in units of 256
    sub_partitions: int = 4          # each SM's register file is split over 4 sub-partitions
    max_warps_per_sm: int = 64
    max_blocks_per_sm: int = 32
    max_threads_per_block: int = 1024
    smem_per_sm: int = 164 * 1024    # usable shared memory per SM at the maximum carve-out
    smem_alloc_unit: int = 128
    reserved_smem_per_block: int = 1024
    max_static_smem_per_block: int = MAX_STATIC_SHARED
    max_optin_smem_per_block: int = MAX_STATIC_SHARED   # static + dynamic, after the driver opt-in


SM_LIMITS: dict[tuple[int, int], SMLimits] = {
    # T4 (TU104, Colab's free GPU): 64 KB shared per SM, 16 blocks and 32 warps (1,024 threads) per SM, no
    # reserved shared memory per block before cc 8.0.
    (7, 5): SMLimits((7, 5), "T4", smem_per_sm=64 * 1024, max_blocks_per_sm=16, max_warps_per_sm=32,
                     reserved_smem_per_block=0, max_optin_smem_per_block=MAX_OPTIN_SHARED[(7, 5)]),
    # A100 (GA100): 164 KB shared per SM (of the 192 KB L1/shared array), 32 blocks, 64 warps.
    (8, 0): SMLimits((8, 0), "A100", smem_per_sm=164 * 1024, max_blocks_per_sm=32,
                     max_optin_smem_per_block=MAX_OPTIN_SHARED[(8, 0)]),
    # H100/H200 (GH100): 228 KB shared per SM (of the 256 KB L1/shared array), 32 blocks, 64 warps.
    (9, 0): SMLimits((9, 0), "H100/H200", smem_per_sm=228 * 1024, max_blocks_per_sm=32,
                     max_optin_smem_per_block=MAX_OPTIN_SHARED[(9, 0)]),
}


def _limits(cc) -> SMLimits:
    cc = tuple(cc)
    if cc not in SM_LIMITS:
        raise ValueError(f"cc must be one of {sorted(SM_LIMITS)} (published per-SM limits known), got {cc}")
    return SM_LIMITS[cc]


def _round_up(x: int, unit: int) -> int:
    return -(-x // unit) * unit


@dataclass(frozen=True)
class Occupancy:
    """Resident blocks per SM for one kernel at one block size, and the limit that binds.

    ``limits`` maps each resource (``warps``, ``blocks``, ``registers``, ``shared memory``) to the number
    of blocks it alone would allow; ``limiter`` names the smallest (ties: the first in that order, so
    registers or shared memory are named only when they cost blocks the warp/block caps would allow).
    """

    cc: tuple[int, int]
    threads_per_block: int
    blocks_per_sm: int
    warps_per_sm: int
    occupancy: float               # resident warps / max warps per SM
    limiter: str
    limits: dict = field(default_factory=dict)


def occupancy(registers: int, shared_bytes: int, threads_per_block: int, cc=(9, 0), dynamic_bytes: int = 0
              ) -> Occupancy:
    """Blocks per SM the hardware can keep resident, following ``cuda_occupancy.h`` (CUDA 12.9).

    * registers: ``regs_per_warp = round_up(registers · 32, 256)``; each of the 4 sub-partitions holds
      ``floor(16384 / regs_per_warp)`` warps, so ``blocks = 4 · that // warps_per_block``;
    * shared memory: ``round_up(static + dynamic + 1 KiB reserved, 128)`` per block out of the SM's shared
      memory (static <= 48 KiB, static + dynamic <= the opt-in limit, :data:`MAX_OPTIN_SHARED`);
    * warps: ``64 // warps_per_block``; blocks: 32.

    A block that cannot fit at all (too many registers or shared bytes for one block) gives 0 blocks.
    """
    lim = _limits(cc)
    if threads_per_block <= 0 or threads_per_block > lim.max_threads_per_block:
        raise ValueError(f"threads_per_block must be in 1..{lim.max_threads_per_block}, got {threads_per_block}")
    if registers < 0 or shared_bytes < 0 or dynamic_bytes < 0:
        raise ValueError(f"registers, shared_bytes and dynamic_bytes must be >= 0, got {registers}, {shared_bytes}, "
                         f"{dynamic_bytes}")
    warps = -(-threads_per_block // 32)
    # registers
    regs_per_warp = _round_up(registers * 32, lim.reg_alloc_unit)
    if registers > lim.max_regs_per_thread or regs_per_warp * _round_up(warps, lim.sub_partitions) > \
            lim.max_regs_per_block:
        by_regs = 0
    elif regs_per_warp == 0:
        by_regs = lim.max_blocks_per_sm
    else:
        warps_per_sub = (lim.regs_per_sm // lim.sub_partitions) // regs_per_warp
        by_regs = warps_per_sub * lim.sub_partitions // warps
    # shared memory
    smem_alloc = _round_up(shared_bytes + dynamic_bytes + lim.reserved_smem_per_block, lim.smem_alloc_unit)
    if shared_bytes > lim.max_static_smem_per_block or shared_bytes + dynamic_bytes > lim.max_optin_smem_per_block \
            or smem_alloc > lim.smem_per_sm:
        by_smem = 0
    elif smem_alloc == 0:              # no shared memory and no per-block reserve (cc < 8.0)
        by_smem = lim.max_blocks_per_sm
    else:
        by_smem = lim.smem_per_sm // smem_alloc
    by_warps = lim.max_warps_per_sm // warps
    by_blocks = lim.max_blocks_per_sm
    # On a tie the hardware caps (warps, blocks) are named: a resource binds only when it alone costs blocks.
    limits = {"warps": by_warps, "blocks": by_blocks, "registers": by_regs, "shared memory": by_smem}
    blocks = min(limits.values())
    limiter = min(limits, key=lambda k: limits[k])  # dict order breaks ties
    return Occupancy(tuple(cc), threads_per_block, blocks, blocks * warps,
                     blocks * warps / lim.max_warps_per_sm, limiter, limits)


