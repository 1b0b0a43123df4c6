"""flashnb.instruments.sass: SASS and its instruction mix without a GPU.  Parsing is checked on hand-written SASS whose
counts are known; compiling, on small kernels whose instructions can be counted by hand (4 dependent FFMAs; a
loop with a multiply-add; a float64 literal; a run-time-indexed local array)."""

import pytest
from numba import cuda, float32

import flashnb  # noqa: F401
from flashnb.instruments import sass

SNIPPET = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
.L_x_1:
        /*0020*/                   LDS.128 R4, [R2] ;
        /*0030*/                   LDS R8, [R2+0x200] ;
        /*0040*/                   FFMA R10, R4, R8, R10 ;
        /*0050*/                   FFMA R11, R5, R8, R11 ;
        /*0060*/                   SHFL.IDX PT, R9, R8, RZ, 0x1f ;
        /*0070*/                   IADD3 R2, R2, 0x4, RZ ;
        /*0080*/                   ISETP.NE.AND P0, PT, R2, R3, PT ;
        /*0090*/               @P0 BRA `(.L_x_1) ;
        /*00a0*/                   DADD R12, R12, 1 ;
        /*00b0*/                   STL [R1], R10 ;
        /*00c0*/                   STG.E [R6.64], R10 ;
        /*00d0*/                   EXIT ;
"""


def test_parse_hand_written_sass():
    s = sass.parse(SNIPPET, "snippet")
    assert len(s.instructions) == 14 and s.loops == [(2, 9)]
    hot = s.hot_loop
    assert [i.opcode for i in hot] == ["LDS", "LDS", "FFMA", "FFMA", "SHFL", "IADD3", "ISETP", "BRA"]
    assert s.mix(hot) == dict(hmma=0, ffma=2, fp32=0, fp64=0, lds=2, ldsm=0, sts=0, ldg=0, ldgsts=0, stg=0, atom=0,
                              ldl=0, stl=0, shfl=1, int=2, control=1)
    assert s.fma_fraction(hot) == 2 / 8 and s.load_widths(hot) == {32: 1, 128: 1}
    whole = s.mix()
    assert (whole["fp64"], whole["stl"], whole["stg"], whole["int"], whole["control"]) == (1, 1, 1, 3, 3)


# A tensor-core kernel's shape: a loop with more FFMAs (the softmax's) and one with the HMMAs, fed by LDSM; the cp.async
# copy of the next tile (LDGSTS) beside them.  The hot loop is the HMMA loop.
TENSOR_SNIPPET = """
        /*0000*/                   S2R R0, SR_TID.X ;
.L_x_1:
        /*0010*/                   FFMA R10, R4, R8, R10 ;
        /*0020*/                   FFMA R11, R5, R8, R11 ;
        /*0030*/                   FFMA R12, R5, R8, R12 ;
        /*0040*/                   MUFU.EX2 R12, R12 ;
        /*0050*/               @P0 BRA `(.L_x_1) ;
.L_x_2:
        /*0060*/                   LDGSTS.E.BYPASS.128 [R2], desc[UR4][R6.64] ;
        /*0070*/                   LDSM.16.M88.4 R16, [R3] ;
        /*0080*/                   LDSM.16.MT88.2 R20, [R3+0x800] ;
        /*0090*/                   HMMA.16816.F32 R24, R16, R20, R24 ;
        /*00a0*/                   HMMA.1688.F32.TF32 R28, R16, R20, R28 ;
        /*00b0*/               @P1 BRA `(.L_x_2) ;
        /*00c0*/                   EXIT ;
"""


def test_parse_tensor_core_sass():
    s = sass.parse(TENSOR_SNIPPET, "tensor")
    assert s.work == "hmma" and [i.opcode for i in s.hot_loop] == ["LDGSTS", "LDSM", "LDSM", "HMMA", "HMMA", "BRA"]
    hot = s.mix(s.hot_loop)
    assert (hot["hmma"], hot["ldsm"], hot["ldgsts"], hot["ffma"], hot["control"]) == (2, 2, 1, 0, 1)
    assert s.load_widths(s.hot_loop, "ldsm") == {64: 1, 128: 1}          # x2 and x4: 2 and 4 matrices per lane
    assert s.load_widths(s.hot_loop, "ldgsts") == {128: 1}
    assert s.hmma_fraction(s.hot_loop) == 2 / 6 and "HMMA %" in s.table()


def test_registered_tensor_core_kernel():
    s = sass.sass("mma_check.mma", config={"shape": "m16n8k16.f16"}, cc=(8, 0))
    assert [i.opcode + i.modifiers for i in s.instructions if i.category == "hmma"] == ["HMMA.16816.F32"]
    s = sass.sass("mma_check.ldmatrix", config={"num": 4, "trans": True}, cc=(8, 0))
    assert [i.opcode + i.modifiers for i in s.instructions if i.category == "ldsm"] == ["LDSM.16.MT88.4"]
    s = sass.sass("mma_check.cp_async", config={}, cc=(9, 0))
    assert s.mix()["ldgsts"] == 2 and {"LDGDEPBAR", "DEPBAR"} <= {i.opcode for i in s.instructions}


@cuda.jit
def four_fmas(x, out):
    v, a, b = x[0], x[1], x[2]
    v = cuda.fma(v, a, b)
    v = cuda.fma(v, a, b)
    v = cuda.fma(v, a, b)
    v = cuda.fma(v, a, b)
    out[0] = v


@cuda.jit
def dot_loop(x, y, out):
    acc = float32(0)
    for i in range(x.shape[0]):
        acc += x[i] * y[i]
    out[0] = acc


@cuda.jit
def leaks_float64(x, out):
    out[0] = x[0] * 0.1          # 0.1 is a float64 (not exact in float32): the product is computed in float64


@cuda.jit
def local_array(x, out):
    a = cuda.local.array(64, float32)
    t = cuda.threadIdx.x
    for i in range(64):
        a[(i * t) % 64] = x[i]             # written and read at run-time indices: it must live in local memory
    out[0] = a[(t * 7) % 64]


SIG1 = "void(float32[::1], float32[::1])"
SIG2 = "void(float32[::1], float32[::1], float32[::1])"


@pytest.fixture(scope="module")
def compiled():
    return {k.py_func.__name__: sass.sass(k, sig) for k, sig in
            ((four_fmas, SIG1), (dot_loop, SIG2), (leaks_float64, SIG1), (local_array, SIG1))}


def test_small_kernels_counted_by_hand(compiled):
    four = compiled["four_fmas"]
    assert four.mix()["ffma"] == 4 and four.loops == []        # a dependent chain: nothing to fold or merge
    dot = compiled["dot_loop"]
    assert dot.loops and dot.mix(dot.hot_loop)["ffma"] >= 1 and dot.mix(dot.hot_loop)["ldg"] >= 2
    assert compiled["leaks_float64"].mix()["fp64"] >= 1 and four.mix()["fp64"] == 0
    loc = compiled["local_array"].mix()
    assert loc["ldl"] >= 1 and loc["stl"] >= 1 and four.mix()["ldl"] == 0


def test_registered_kernel_and_table():
    s = sass.sass("fa2.forward", config=dict(Br=16, Bc=16, warps=2, d=16, causal=False), cc=(8, 0))
    assert s.cc == (8, 0) and s.loops and s.mix(s.hot_loop)["ffma"] > 0
    text = s.table()
    assert "FFMA %" in text and "hot loop" in text
    assert set(s.summary()) >= {"kernel", "hot_loop_ffma_fraction", "hot_ffma", "hot_lds_bits", "local"}


def test_cli(capsys):
    from flashnb import cli

    cfg = '{"Br": 16, "Bc": 16, "warps": 2, "d": 16, "causal": true}'
    assert cli.main(["sass", "fa2.forward", "--config", cfg, "--cc", "80", "--hot"]) == 0
    out = capsys.readouterr().out
    assert "fa2.forward" in out and "'causal': True" in out and "on sm_80" in out and "FFMA" in out
    assert cli.main(["sass", "no.such.kernel"]) == 2
    assert cli.main(["sass", "fa2.forward", "--config", "{oops"]) == 2


def test_cli_config_is_merged_over_the_default_and_bad_ones_are_usage_errors(capsys):
    """Before: a partial --config, a non-object, a bad value or an unknown key printed a raw traceback (exit 1).
    Now a partial config is merged over the kernel's default (the first the PTX guard compiles: causal False
    here), and the rest are one-line usage errors (exit 2) naming what is wrong."""
    from flashnb import cli

    assert cli.main(["sass", "fa2.forward", "--config", '{"Br": 16, "Bc": 16, "warps": 2, "d": 16}', "--cc", "80"]) == 0
    assert "'causal': False" in capsys.readouterr().out
    for config, message in [('[16, 16]', "--config must be a JSON object of fa2.forward's options"),
                            ('{"Brr": 16}', "fa2.forward has no option(s) 'Brr'; its options: Br, Bc, d, warps"),
                            ('{"Br": 7}', "the rows split over warps (7) must be a multiple of 4·warps = 16"),
                            ('{"d": "64"}', 'd must be an integer (as in the default'),
                            ('{"causal": 1}', "causal must be true or false"),
                            ('{"storage": "float16"}', "fa2.forward has no option(s) 'storage'")]:   # stage 4: float32
        assert cli.main(["sass", "fa2.forward", "--config", config]) == 2, config
        err = capsys.readouterr().err
        assert err.startswith("flashnb sass: ") and message in err and "Traceback" not in err, err
