"""The SASS time model (flashnb.instruments.sass_model) on hand-written SASS whose counts are worked out by hand, and
its list scheduling (why heavy-first causal scheduling pays).  No compiler needed: the text is nvdisasm's format."""

import pytest

from flashnb.instruments import sass, sass_model
from flashnb.instruments.roofline import GPU

# prologue: 2 LDG (Q_i); tile loop: K/V copy unrolled (2 LDG + 2 STS), matmul 1 (LDS.128 + 4 FFMA per
# iteration), softmax (MUFU, FADD), matmul 2 (SHFL + 8 FFMA per iteration); epilogue: 1 STG
_TEXT = """
        /*0000*/                   LDG.E R2, [R4.64] ;
        /*0010*/                   LDG.E R3, [R4.64+0x4] ;
        /*0020*/                   IMAD R5, R6, R7, R8 ;
.L_x_0:
        /*0030*/                   LDG.E R9, [R10.64] ;
        /*0040*/                   STS [R11], R9 ;
        /*0050*/                   LDG.E R12, [R10.64+0x80] ;
        /*0060*/                   STS [R11+0x80], R12 ;
.L_x_1:
        /*0070*/                   LDS.128 R16, [R13] ;
        /*0080*/                   FFMA R20, R16, R17, R20 ;
        /*0090*/                   FFMA R21, R16, R18, R21 ;
        /*00a0*/                   FFMA R22, R16, R19, R22 ;
        /*00b0*/                   FFMA R23, R17, R18, R23 ;
        /*00c0*/                   ISETP.GE.U32.AND P0, PT, R13, 0x40, PT ;
        /*00d0*/              @!P0 BRA `(.L_x_1) ;
        /*00e0*/                   MUFU.EX2 R24, R20 ;
        /*00f0*/                   FADD R25, R24, R25 ;
.L_x_2:
        /*0100*/                   SHFL.IDX PT, R26, R24, R27, 0x1f ;
        /*0110*/                   FFMA R30, R26, R16, R30 ;
        /*0120*/                   FFMA R31, R26, R16, R31 ;
        /*0130*/                   FFMA R32, R26, R16, R32 ;
        /*0140*/                   FFMA R33, R26, R16, R33 ;
        /*0150*/                   FFMA R34, R26, R16, R34 ;
        /*0160*/                   FFMA R35, R26, R16, R35 ;
        /*0170*/                   FFMA R36, R26, R16, R36 ;
        /*0180*/                   FFMA R37, R26, R16, R37 ;
        /*0190*/              @!P1 BRA `(.L_x_2) ;
        /*01a0*/              @!P2 BRA `(.L_x_0) ;
        /*01b0*/                   STG.E [R4.64], R30 ;
        /*01c0*/                   EXIT ;
.L_x_3:
        /*01d0*/                   BRA `(.L_x_3) ;
"""


def _counts(phases=(16, 32)):
    s = sass.parse(_TEXT, "hand-made")
    return sass_model.count(s, sass_model.KernelShape(phases=phases, tile_loads=2, prologue_loads=2,
                                                     epilogue_stores=1))


def test_trip_counts_and_pipe_demand_worked_by_hand():
    c = _counts()
    trips = {role: n for _, _, n, role in c.loops}
    assert trips["matmul phase 1"] == 4          # 16 FFMAs needed / 4 per iteration
    assert trips["matmul phase 2"] == 4          # 32 / 8
    # outside the inner loops: LDG STS LDG STS MUFU FADD BRA = 7; loop 1: 7 x 4; loop 2: 10 x 4
    assert c.tile.issued == 7 + 28 + 40
    assert c.tile.ffma == 48
    assert c.tile.pipes["fp32"] == 48 + 1        # the FFMAs and the FADD (MUFU has its own pipe)
    assert c.tile.pipes["mufu"] == 1
    assert c.tile.pipes["mio"] == 2 + 4 * 4 + 4  # 2 STS, 4 LDS.128 of 4 wavefronts each, 4 SHFL
    assert c.prologue.issued == 3 and c.epilogue.issued == 2   # STG, EXIT (the padding after EXIT never runs)
    assert c.tile_ffma_fraction == pytest.approx(48 / 75)


def test_a_phase_the_loops_cannot_divide_is_an_error():
    with pytest.raises(ValueError, match="divides no phase"):
        _counts(phases=(18, 30))


def test_missing_ffmas_are_an_error():
    with pytest.raises(ValueError, match="matmuls need"):
        _counts(phases=(16, 32, 100))


def test_heavy_first_shortens_a_causal_launch():
    """Two slots, blocks of 1, 1, 1 and 3 tiles: light first ends after 1 + 3 tile-times, heavy first after 3."""
    c = _counts()
    gpu = GPU("toy", (9, 0), 1, 1e15, 1e12, 1e12, 1e9, 228 * 1024, 128)   # 1 SM, HBM never the bound
    kw = dict(warps=1, blocks_per_sm=2, hbm_bytes=0.0, flops=1.0, gpu=gpu)
    assert c.tile.pipes["mio"] / 1 > c.tile.issued / 4     # 22 wavefronts at 1 per clock > 75 issues at 4
    block = lambda tiles: 2 * (c.prologue.pipes["mio"] + tiles * c.tile.pipes["mio"] + c.epilogue.pipes["mio"]) / 1e9
    light = sass_model.modelled_time(c, tiles_per_block=[1, 1, 1, 3], **kw)
    heavy = sass_model.modelled_time(c, tiles_per_block=[3, 1, 1, 1], **kw)
    assert light.bound == heavy.bound == "mio"
    assert light.seconds == pytest.approx(block(1) + block(3))
    assert heavy.seconds == pytest.approx(max(block(3), 3 * block(1)))
    assert heavy.seconds < light.seconds


def test_hbm_bound_when_the_bytes_dominate():
    c = _counts()
    gpu = GPU("toy", (9, 0), 1, 1e6, 1e12, 1e12, 1e9, 228 * 1024, 128)
    t = sass_model.modelled_time(c, tiles_per_block=[1], warps=1, blocks_per_sm=1, hbm_bytes=1e6, flops=1.0,
                                 gpu=gpu)
    assert t.bound == "hbm" and t.seconds == pytest.approx(1.0)


# A tensor-core tile loop: everything of a tile unrolled (no inner loop), 2 HMMAs per matmul, 2 LDSM.x4 and one
# LDSM.x2 feeding them, a cp.async of the next tile, 4 exponentials.
_TC_TEXT = """
        /*0000*/                   LDG.E.128 R2, [R4.64] ;
.L_x_0:
        /*0010*/                   LDGSTS.E.BYPASS.128 [R2], desc[UR4][R6.64] ;
        /*0020*/                   LDSM.16.M88.4 R16, [R3] ;
        /*0030*/                   LDSM.16.M88.4 R20, [R3+0x200] ;
        /*0040*/                   HMMA.16816.F32 R24, R16, R20, R24 ;
        /*0050*/                   HMMA.16816.F32 R28, R16, R22, R28 ;
        /*0060*/                   MUFU.EX2 R30, R24 ;
        /*0070*/                   MUFU.EX2 R31, R25 ;
        /*0080*/                   MUFU.EX2 R32, R26 ;
        /*0090*/                   MUFU.EX2 R33, R27 ;
        /*00a0*/                   LDSM.16.MT88.2 R34, [R3+0x400] ;
        /*00b0*/                   HMMA.16816.F32 R36, R30, R34, R36 ;
        /*00c0*/                   HMMA.1688.F32.TF32 R40, R30, R34, R40 ;
        /*00d0*/              @!P2 BRA `(.L_x_0) ;
        /*00e0*/                   STG.E.128 [R4.64], R36 ;
        /*00f0*/                   EXIT ;
"""


def test_tensor_pipe_worked_by_hand():
    s = sass.parse(_TC_TEXT, "hand-made tensor")
    c = sass_model.count(s, sass_model.KernelShape(phases=(2, 2), tile_loads=4, prologue_loads=4,
                                                   epilogue_stores=4))
    assert c.work == "hmma" and c.tile.hmma == 4 and c.tile.issued == 13
    # HMMA.16816: 16·8·16 = 2048 multiply-adds; the TF32 m16n8k8 (1024) counts twice: it runs at half the rate
    assert c.tile.pipes["tensor"] == 3 * 2048 + 2 * 1024
    assert c.tile.pipes["mio"] == 4 + 4 + 4 + 2              # LDGSTS.128 (its shared write), LDSM x4, x4, x2
    assert c.tile.pipes["mufu"] == 4 and c.tile_work_fraction == pytest.approx(4 / 13)
    # one SM of an A100: 1024 FP16 multiply-adds per clock at 1.41 GHz (its tensor clock is its boost clock); 4 warps
    # x 10 tiles: 8 tensor cycles per warp-tile, but 14 wavefronts of shared memory -- 3 LDSM for 4 HMMAs is too few
    # MMAs per byte: the shared-memory pipe binds (why fa2-tc gives each warp more rows than one m16 tile)
    a100 = GPU("toy A100", (8, 0), 1, 1e15, 19.5e12 / 108, 312e12 / 108, 1410e6, 164 * 1024, 64, 156e12 / 108, 1024)
    t = sass_model.modelled_time(c, tiles_per_block=[10], warps=4, blocks_per_sm=1, hbm_bytes=0.0, flops=1.0,
                                 gpu=a100)
    assert t.pipe_seconds["tensor"] == pytest.approx(4 * 10 * c.tile.pipes["tensor"] / 1024 / 1410e6, rel=1e-3)
    assert t.bound == "mio" and t.seconds == pytest.approx(4 * 10 * 14 / 1410e6, rel=1e-3)
    no_tensor = GPU("toy", (9, 0), 1, 1e15, 1e12, 1e12, 1e9, 228 * 1024, 128)
    with pytest.raises(ValueError, match="no tensor pipe rate"):
        sass_model.modelled_time(c, tiles_per_block=[1], warps=1, blocks_per_sm=1, hbm_bytes=0.0, flops=1.0,
                                 gpu=no_tensor)
