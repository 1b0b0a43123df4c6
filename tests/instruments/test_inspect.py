"""Occupancy arithmetic against hand-worked cases, the ptxas-report parser, and the report table.

Limits used by hand (flashnb.instruments.SM_LIMITS; CUDA Programming Guide + cuda_occupancy.h): 65536
registers per SM in 4 sub-partitions of 16384, allocated per warp in units of 256; 64 warps and 32 blocks
per SM; shared memory per SM 164 KiB (sm_80) / 228 KiB (sm_90), allocated per block as
round_up(static + 1 KiB reserved, 128).
"""

import pytest

from flashnb import instruments as fi
from flashnb.instruments import compiled, jobs, ptx_cache, ptxas
from flashnb.registry import KERNELS


def test_64_regs_256_threads_sm80_is_register_limited():
    # 64·32 = 2048 regs/warp; 16384 // 2048 = 8 warps per sub-partition -> 32 warps -> 32 // 8 = 4 blocks
    occ = fi.occupancy(64, 0, 256, (8, 0))
    assert (occ.blocks_per_sm, occ.warps_per_sm, occ.occupancy, occ.limiter) == (4, 32, 0.5, "registers")
    assert occ.limits == {"warps": 8, "blocks": 32, "registers": 4, "shared memory": 164}


def test_32_regs_full_occupancy_names_the_warp_cap():
    # 1024 regs/warp -> 16 warps per sub-partition -> 64 warps = the warp cap; 2048 + 1024 B smem -> 54 blocks
    occ = fi.occupancy(32, 2048, 256, (8, 0))
    assert (occ.blocks_per_sm, occ.occupancy, occ.limiter) == (8, 1.0, "warps")
    assert occ.limits["shared memory"] == 167936 // 3072 == 54


def test_register_rounding_is_per_sub_partition():
    # 80·32 = 2560 regs/warp; 16384 // 2560 = 6 per sub-partition -> 24 warps (not 65536 // 2560 = 25)
    occ = fi.occupancy(80, 0, 32, (9, 0))
    assert (occ.blocks_per_sm, occ.limiter) == (24, "registers")


def test_register_allocation_unit_rounds_up():
    # 33·32 = 1056 -> rounded to 1280 per warp; 16384 // 1280 = 12 -> 48 warps -> 6 blocks of 256 threads
    assert fi.occupancy(33, 0, 256, (8, 0)).blocks_per_sm == 6


def test_shared_memory_limit_differs_between_a100_and_h100():
    # 40 KiB static + 1 KiB reserved = 41984 B/block: sm_80 167936 // 41984 = 4, sm_90 233472 // 41984 = 5
    a = fi.occupancy(32, 40 * 1024, 128, (8, 0))
    h = fi.occupancy(32, 40 * 1024, 128, (9, 0))
    assert (a.blocks_per_sm, a.limiter) == (4, "shared memory")
    assert (h.blocks_per_sm, h.limiter) == (5, "shared memory")
    assert a.occupancy == 16 / 64 and h.occupancy == 20 / 64


def test_block_cap():
    # 16 regs, one warp per block: registers allow 128 warps, warps 64 blocks, the 32-block cap binds
    occ = fi.occupancy(16, 0, 32, (9, 0))
    assert (occ.blocks_per_sm, occ.warps_per_sm, occ.limiter) == (32, 32, "blocks")


def test_blocks_that_cannot_fit_give_zero():
    assert fi.occupancy(255, 0, 1024, (9, 0)).blocks_per_sm == 0           # 8192 regs/warp x 32 warps > 64K
    assert fi.occupancy(255, 0, 256, (9, 0)).blocks_per_sm == 1            # 8 warps x 8192 = 64K: fits once
    assert fi.occupancy(32, 48 * 1024 + 4, 128, (8, 0)).blocks_per_sm == 0  # over the 48 KiB static limit


def test_bad_arguments():
    with pytest.raises(ValueError, match="threads_per_block"):
        fi.occupancy(32, 0, 0, (8, 0))
    with pytest.raises(ValueError, match="cc"):
        fi.occupancy(32, 0, 128, (7, 0))   # no published limits known for sm_70 here


PTXAS_LOG = """ptxas info    : 8 bytes gmem
ptxas info    : Compiling entry function '_Z1k' for 'sm_90'
ptxas info    : Function properties for _Z1k
    136 bytes stack frame, 132 bytes spill stores, 128 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 4096 bytes smem, 400 bytes cmem[0]
"""


def test_parse_ptxas_and_problems():
    res = fi.Resources("k", {}, (9, 0))
    ptxas._parse_ptxas(PTXAS_LOG, res)
    assert (res.registers, res.shared_bytes, res.stack_bytes) == (255, 4096, 136)
    assert (res.spill_store_bytes, res.spill_load_bytes, res.spill_bytes) == (132, 128, 260)
    assert any("spills" in p for p in fi.problems(res))
    assert res.occupancy(64).limiter == "registers"


def test_format_report_table():
    rows = [dict(name="naive.matmul", config=dict(T=16, causal=True), cc=(8, 0), regs=32, smem=2048, stack=0,
                 spills=0, f64=0, threads=256, blocks_per_sm=8, warps_per_sm=64, occupancy=1.0, limiter="warps",
                 problems=[])]
    text = fi.format_report(rows)
    assert "naive.matmul" in text and "T=16,causal=T" in text and "100%" in text and "warps" in text


def test_resources_for_compiles_without_gpu_and_caches(monkeypatch):
    res = fi.resources_for("naive.matmul", None, (9, 0))
    assert res.error is None and res.registers and res.shared_bytes == 2 * 16 * 16 * 4
    monkeypatch.setattr(compiled, "_in_subprocess", lambda *a, **k: pytest.fail("not cached"))
    assert fi.resources_for("naive.matmul", None, (9, 0)) is res
    assert fi.guard_kernel("naive.matmul", None, (9, 0)) == []
    with pytest.raises(ValueError, match="registered kernel"):
        fi.resources_for("no.such.kernel")


def test_occupancy_on_a_t4_by_hand():
    # sm_75 (T4): 32 warps, 16 blocks, 64 KB shared per SM, no reserved shared memory per block.
    # 128 threads = 4 warps: the warp cap allows 32 // 4 = 8 blocks; 32 registers -> 1024 per warp, 16 warps
    # per sub-partition, 64 per SM -> 16 blocks; so 8 blocks, 32 warps, occupancy 1.
    o = fi.occupancy(32, 0, 128, (7, 5))
    assert (o.blocks_per_sm, o.warps_per_sm, o.occupancy, o.limiter) == (8, 32, 1.0, "warps")
    # 20 KiB of shared memory per block: 65536 // 20480 = 3 blocks (no 1 KiB reserve on sm_75)
    o = fi.occupancy(32, 20 * 1024, 128, (7, 5))
    assert (o.blocks_per_sm, o.limiter) == (3, "shared memory")


# --------------------------------------------------------------------------- NVVM's PTX cached on disk


def _cache_kernel(body: str):
    """A user kernel written in a 'cell' (source read from linecache), like one a learner writes."""
    import linecache

    from numba import cuda

    src = f"def scale_in_place(x):\n    i = cuda.grid(1)\n    if i < x.size:\n        x[i] = {body}\n"
    name = f"<ipython-input-ptx-cache-{abs(hash(body))}>"
    linecache.cache[name] = (len(src), None, src.splitlines(True), name)
    ns = {"cuda": cuda, "float32": __import__("numba").float32}
    exec(compile(src, name, "exec"), ns)
    return cuda.jit(ns["scale_in_place"])


def test_ptx_cache_reuses_nvvm_and_never_a_changed_kernel(tmp_path, monkeypatch):
    """Same kernel source -> the PTX comes from the disk cache (no new file, same ptxas report); one edit of the
    kernel (a float64 literal, 1.1) -> a new key, compiled afresh, and the guard sees the float64 it introduced."""
    monkeypatch.setenv("FLASHNB_PTX_CACHE", str(tmp_path))
    sig = "void(float32[::1])"
    first = fi.resources(_cache_kernel("x[i] * float32(2)"), sig, (8, 0), keep_ptx=True)
    assert first.error is None and first.f64_count == 0
    files = sorted(tmp_path.glob("*.ptx"))
    assert len(files) == 1 and files[0].read_text() == first.ptx
    jobs._CACHE.clear()
    again = fi.resources(_cache_kernel("x[i] * float32(2)"), sig, (8, 0), keep_ptx=True)
    assert sorted(tmp_path.glob("*.ptx")) == files and again.ptx == first.ptx
    assert (again.registers, again.f64_count, again.shared_bytes) == (first.registers, 0, first.shared_bytes)
    changed = fi.resources(_cache_kernel("x[i] * 1.1"), sig, (8, 0), keep_ptx=True)
    assert len(list(tmp_path.glob("*.ptx"))) == 2 and changed.f64_count > 0


def test_ptx_cache_key_covers_toolchain_source_and_imports(monkeypatch):
    job = dict(name="fa2.forward", config=dict(Br=16, Bc=16, d=20, warps=1, causal=False), cc=[8, 0])
    key = ptx_cache._ptx_key(job, None, (8, 0))
    assert key == ptx_cache._ptx_key(dict(job), None, (8, 0))
    assert key != ptx_cache._ptx_key(dict(job, config=dict(job["config"], causal=True)), None, (8, 0))
    assert key != ptx_cache._ptx_key(job, None, (9, 0))
    monkeypatch.setitem(ptx_cache._DIGESTS, "toolchain", fi.toolchain_versions() + ";numba-cuda==other")
    assert key != ptx_cache._ptx_key(job, None, (8, 0))
    monkeypatch.setitem(ptx_cache._DIGESTS, "package", "an edited package")
    # a kernel importing a module outside flashnb/numba/numpy/math: never cached (its key could not see it change)
    desc = {"source": "def k(x): pass", "env": {"helpers": {"kind": "module", "module": "my_helpers"}}}
    assert ptx_cache._ptx_key({"source": desc, "signature": "void()"}, "void()", (8, 0)) is None
    assert ptx_cache._ptx_key({"module": "my_helpers", "attr": "k", "signature": "void()"}, "void()", (8, 0)) is None


def test_ptx_cache_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("FLASHNB_PTX_CACHE", "off")
    assert fi.ptx_cache_dir() is None and ptx_cache._cached_ptx("0" * 64) is None


# --------------------------------------------------------------------------- saying what a long compile does


def test_inspect_says_what_it_compiles_and_shows_its_progress(tmp_path, monkeypatch, capfd):
    """Before: `flashnb inspect` compiled for many minutes with no output.  A run that needs NVVM says what it
    compiles, in how many passes, where the PTX is kept, and a progress bar counts the builds to the end; a second
    run (the PTX on disk) says nothing of the kind, and gives the same table."""
    monkeypatch.setenv("FLASHNB_PTX_CACHE", str(tmp_path))
    jobs._CACHE.clear()
    n = 2 * len(KERNELS["naive.matmul"].configs)               # every config for sm_80 and sm_90
    assert fi.main_inspect(["--kernel", "naive.matmul", "--cc", "8.0", "--cc", "9.0"]) == 0
    first = capfd.readouterr()
    assert (f"flashnb inspect: compiling {n} kernel build(s) for a GPU -- {n // 2} NVVM pass(es)" in first.err
            and str(tmp_path) in first.err), first.err
    assert f"{n}/{n}" in first.err, first.err
    jobs._CACHE.clear()
    assert fi.main_inspect(["--kernel", "naive.matmul", "--cc", "8.0", "--cc", "9.0"]) == 0
    second = capfd.readouterr()
    assert "compiling" not in second.err and second.out == first.out


def test_resources_of_a_user_kernel_says_it_compiles(tmp_path, monkeypatch, capfd):
    """resources() of a kernel written in a cell: the NVVM pass in a child process is announced (with the
    kernel's name) and counted; progress=False keeps it silent."""
    monkeypatch.setenv("FLASHNB_PTX_CACHE", str(tmp_path))
    res = fi.resources(_cache_kernel("x[i] + float32(3)"), "void(float32[::1])", (8, 0))
    err = capfd.readouterr().err
    assert res.error is None and res.registers
    assert "flashnb.instruments.resources(scale_in_place): compiling 1 kernel build(s) for a GPU" in err, err
    assert "1/1" in err, err
    quiet = fi.resources(_cache_kernel("x[i] - float32(3)"), "void(float32[::1])", (8, 0), progress=False)
    assert quiet.error is None and capfd.readouterr().err == ""
