"""Exercises of notebook 12 (tensor cores: fragments, ldmatrix and the swizzle, the non-matmul FLOPs)."""

from __future__ import annotations

import numpy as np

from . import Wrong, close, exercise, require

# --------------------------------------------------------------------------- 12.1


@exercise("12.1", "who holds A[r][c]", level=1, minutes=15,
          hint="""In the PTX ISA's tables a lane is (groupID, threadID_in_group) = (lane // 4, lane % 4). Register
          0 of the m16n8k16 A fragment holds row groupID, columns 2·threadID and 2·threadID + 1 (low half, high
          half); register 1 the same columns 8 rows lower; registers 2 and 3 the same again 8 columns to the
          right. Invert that: from (r, c) find groupID, threadID, the register and the half.""",
          explain="""lane = 4·(r mod 8) + (c mod 8) // 2, register = (r // 8) + 2·(c // 8), half = c mod 2. Every
          one of the 256 elements is held by exactly one (lane, register, half) -- the four 8×8 quarters of A are the
          four matrices one ldmatrix.x4 loads, which is why the kernel's Q_i fragments are one ldmatrix each.""")
def check_12_1(owner):
    """owner(r, c): the (lane, register, half) holding element (r, c) of the 16×16 A operand of
    mma.m16n8k16 (.f16/.bf16), half 0 being the low 16 bits."""
    from ..sim.tensorcore import LAYOUTS

    require(callable(owner), "owner must be a function (r, c) -> (lane, register, half)")
    rows, cols = LAYOUTS[("m16n8k16", "a")]        # the twin's table: (32 lanes, 4 registers, 2 halves)
    seen = set()
    for lane in range(32):
        for reg in range(4):
            for half in range(2):
                r, c = int(rows[lane, reg, half]), int(cols[lane, reg, half])
                got = owner(r, c)
                require(isinstance(got, tuple) and len(got) == 3, "owner must return (lane, register, half)")
                if tuple(int(x) for x in got) != (lane, reg, half):
                    raise Wrong(f"element A[{r}][{c}] is not held by (lane, register, half) = {tuple(got)}")
                seen.add((r, c))
    require(len(seen) == 256, "every element of A must have exactly one owner")


@check_12_1.solves
def _():
    def owner(r, c):
        return 4 * (r % 8) + (c % 8) // 2, r // 8 + 2 * (c // 8), c % 2

    return dict(owner=owner)


@check_12_1.fails
def _():
    return dict(owner=lambda r, c: (4 * (c % 8) + (r % 8) // 2, c // 8 + 2 * (r // 8), r % 2))   # transposed


# --------------------------------------------------------------------------- 12.2


def _wavefronts(addresses):
    """Wavefronts of one 8-row ldmatrix phase: the most distinct 4-byte words one of the 32 banks serves."""
    per_bank: dict = {}
    for a in addresses:
        for w in range(a // 4, a // 4 + 4):                      # a 16-byte row is 4 words
            per_bank.setdefault(w % 32, set()).add(w)
    return max(len(v) for v in per_bank.values())


@exercise("12.2", "a swizzle without conflicts", level=2, minutes=20,
          hint="""A tile of 64 halves per row is 8 chunks of 16 bytes, a row 128 bytes: one line of the 32 banks.
          An ldmatrix matrix reads the same logical chunk c of 8 consecutive rows; stored as they are, all 8 land
          on the same 4 banks. Store chunk c of row r at another chunk of the same row -- a permutation of the 8 for
          each row -- so that for every c the 8 rows use 8 different chunks.""",
          explain="""physical = c XOR (r mod 8) does it: for a fixed c, r ↦ c ^ (r mod 8) takes 8 different values,
          and for a fixed r, c ↦ c ^ r is a permutation (nothing overwritten). Every 8-row matrix then costs one
          wavefront instead of eight; flashnb.kernels.tensorcore stores Q_i, K_j, V_j and dSᵀ this way
          (``_layout``), which is why ``flashnb profile`` finds no conflict in fa2-tc.""")
def check_12_2(swizzle):
    """swizzle(r, c): the physical chunk (0..7) where logical chunk c (0..7) of row r of a 64-half-wide tile
    is stored."""
    require(callable(swizzle), "swizzle must be a function (row, chunk) -> physical chunk")
    for r in range(64):
        phys = [int(swizzle(r, c)) for c in range(8)]
        if sorted(phys) != list(range(8)):
            raise Wrong(f"row {r}: chunks {phys} are not a permutation of 0..7 (two chunks would share a place)")
    for r0 in range(0, 64, 8):
        for c in range(8):
            addresses = [r * 128 + 16 * int(swizzle(r, c)) for r in range(r0, r0 + 8)]
            w = _wavefronts(addresses)
            if w != 1:
                raise Wrong(f"rows {r0}..{r0 + 7}, chunk {c}: the ldmatrix phase takes {w} wavefronts, not 1")


@check_12_2.solves
def _():
    return dict(swizzle=lambda r, c: c ^ (r % 8))


@check_12_2.fails
def _():
    return dict(swizzle=lambda r, c: c)                            # no swizzle: 8-way conflicts


@check_12_2.fails
def _():
    return dict(swizzle=lambda r, c: (c + r) % 4)                  # not a permutation of the row's chunks


# --------------------------------------------------------------------------- 12.3


@exercise("12.3", "exponentials per matmul", level=2, minutes=20,
          hint="""Per K/V tile a warp computes a 16·MT × Bc block of S: that many exponentials, on the MUFU pipe at
          16 per SM per clock. Its two matmuls are 2 · (16·MT) · Bc · d multiply-adds, on the tensor pipe at the
          GPU's FP16 multiply-adds per SM per clock (A100 1024, H100 2048); on stage 6's CUDA cores at the FP32
          lanes per SM (A100 64, H100 128). The ratio of the two times is what the softmax costs per matmul.""",
          explain="""exp time / matmul time = (rows·Bc / 16) / (2·rows·Bc·d / rate) = rate / (32·d): independent of
          the tiles. On the FP32 cores (stage 6) it is 64 / (32·64) = 3 % at d = 64 on an A100 -- noise. On the
          tensor cores it is 1024 / 2048 = 50 % on an A100 and 2048 / 2048 = 100 % on an H100: at d = 64 the
          exponentials alone take as long as both matmuls (FlashAttention-3's starting point), and the max,
          the rescaling and the sums come on top on the FP32 pipe.""")
def check_12_3(exp_over_matmul):
    """exp_over_matmul(d, rate): the time of a tile's exponentials over the time of its two matmuls, for head dim
    d and a matmul pipe of ``rate`` multiply-adds per SM per clock (MUFU: 16 exponentials per SM per clock)."""
    require(callable(exp_over_matmul), "exp_over_matmul must be a function (d, rate) -> a number")
    rng = np.random.default_rng(123)
    for _ in range(8):
        d, rate = int(rng.choice([16, 32, 64, 96, 128])), int(rng.choice([64, 128, 512, 1024, 2048]))
        rows, Bc = 16 * int(rng.integers(1, 3)), 16 * int(rng.integers(1, 9))     # any tile gives the same ratio
        want = (rows * Bc / 16) / (2 * rows * Bc * d / rate)
        close(exp_over_matmul(d, rate), want, rel=1e-9, what=f"exp_over_matmul({d}, {rate})")


@check_12_3.solves
def _():
    return dict(exp_over_matmul=lambda d, rate: rate / (32 * d))


@check_12_3.fails
def _():
    return dict(exp_over_matmul=lambda d, rate: rate / (16 * d))   # counts one matmul instead of two
