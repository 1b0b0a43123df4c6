"""flashnb.distributed: layouts, the block plan, the merge, and ring attention on real gloo process groups of
W = 2, 3 and 4 ranks (one process each), against float64 attention on one device.

Each W starts its processes once (``launch.run``) and runs every case of its matrix in that process group;
the tests then check the gathered results.  Ranks hold float32 shards; the reference is flashnb.reference in
float64 on the whole sequence.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from conftest import assert_close  # noqa: E402

import flashnb.distributed as fd  # noqa: E402
from flashnb import reference, rng  # noqa: E402
from flashnb.distributed import blocks, launch, model  # noqa: E402
from flashnb.distributed.errors import RanksFailed  # noqa: E402
from flashnb.distributed.layouts import positions  # noqa: E402

# Exact blocks are float64, rounded to float32 once per block; each rank merges W partials in float32 and sums
# dQ (and dK/dV around the ring) in float32: a few roundings of 2^-24 relative each, on values of size ~1-3.
# 2e-6 (abs and rel) is ~5x the largest error seen; a wrong block, mask or merge is O(0.1-1).
EXACT = dict(atol=2e-6, rtol=2e-6)
# flashnb's float32 kernels: tests/stages/test_fa2.py's tolerances (float32 sums of <= 64 terms), plus W merges.
KERNEL_FWD = dict(atol=2e-5, rtol=2e-5)
KERNEL_BWD = dict(atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def free_port():
    """A function giving a TCP port free at the time of the call, for each process group's rendezvous."""
    return launch.free_port


# --------------------------------------------------------------------------- workers (run in the ranks)


def _inputs(case):
    g = torch.Generator().manual_seed(case.get("seed", 0))
    B, H, H_kv, N, d = case["B"], case["H"], case["H_kv"], case["N"], case["d"]
    return (torch.randn(B, H, N, d, generator=g), torch.randn(B, H_kv, N, d, generator=g),
            torch.randn(B, H_kv, N, d, generator=g), torch.randn(B, H, N, d, generator=g))


def _gathered(t, world):
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous())
    return [p.numpy() for p in parts]


def _run_case(rank, world, case, group=None, ranks=None):
    """One forward and backward; the shards of o, dq, dk, dv of every rank, and this rank's stats rows."""
    from flashnb.distributed.function import _ring_attention

    W = world if ranks is None else len(ranks)
    me = rank if ranks is None else ranks.index(rank)
    q, k, v, do = (fd.shard(t, layout=case["layout"], rank=me, world=W) for t in _inputs(case))
    for t in (q, k, v):
        t.requires_grad_(True)
    stats = fd.RingStats()
    impl = case.get("impl") or fd.Exact()
    o = _ring_attention(q, k, v, causal=case["causal"], layout=case["layout"], mode=case["mode"], group=group,
                        impl=impl, scale=None, stats=stats, dropout_p=case.get("dropout_p", 0.0),
                        seed=case.get("dropout_seed"), timeout=20, schedule=case.get("schedule"))
    o.backward(do)
    return dict(shards={name: t.detach().numpy() for name, t in (("o", o), ("dq", q.grad), ("dk", k.grad),
                                                                  ("dv", v.grad))}, stats=stats.rows())


def matrix_worker(rank, world, cases):
    return [_run_case(rank, world, case) for case in cases]


def subgroup_worker(rank, world, case, ranks):
    import torch.distributed as dist

    group = dist.new_group(ranks)
    return _run_case(rank, world, case, group=group, ranks=ranks) if rank in ranks else None


def _outcome(fn):
    t0 = time.perf_counter()
    try:
        fn()
        return ("ok", "", time.perf_counter() - t0)
    except Exception as e:          # noqa: BLE001 -- the test looks at the type and message
        return (type(e).__name__, str(e), time.perf_counter() - t0)


def error_worker(rank, world):
    """Bad arguments on one or all ranks, each caught by every rank before the ring; then a good run (no rank
    was left behind)."""
    def call(q, k, v, **kw):
        args = dict(causal=True, layout="zigzag", mode="ring", impl=fd.Exact(), timeout=10)
        args.update(kw)
        return fd.ring_attention(q, k, v, **args)

    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g) for _ in range(3))
    out = {}
    out["shapes"] = _outcome(lambda: call(q if rank != 1 else torch.randn(1, 2, 6, 8), k if rank != 1 else
                                          torch.randn(1, 2, 6, 8), v if rank != 1 else torch.randn(1, 2, 6, 8)))
    odd = torch.randn(1, 2, 5, 8)
    out["split"] = _outcome(lambda: call(odd, odd.clone(), odd.clone()))
    strided = torch.randn(1, 2, 8, 4).transpose(-1, -2)          # shape (1, 2, 4, 8), not contiguous
    out["contiguous"] = _outcome(lambda: call(strided if rank == 2 else q, k, v))
    out["dtype"] = _outcome(lambda: call(q.double() if rank == 0 else q, k, v))
    out["dropout"] = _outcome(lambda: call(q, k, v, impl=fd.Kernels("fa2"), dropout_p=0.1, seed=3))
    out["differ"] = _outcome(lambda: call(q, k, v, causal=(rank == 1)))
    out["good"] = _outcome(lambda: call(*(t.requires_grad_(True) for t in (q, k, v))).sum().backward())
    return out


def skip_backward_worker(rank, world, timeout):
    """Every rank runs the forward; the last one never runs the backward (its loss does not use o)."""
    import torch.distributed as dist

    dist.barrier()                    # the ranks start together (the group's own timeout), then the short one applies
    q, k, v = (torch.randn(1, 2, 4, 8, requires_grad=True) for _ in range(3))
    o = fd.ring_attention(q, k, v, causal=True, layout="zigzag", impl=fd.Exact(), timeout=timeout)
    if rank == world - 1:
        time.sleep(timeout + 1)
        return ("skipped", "", 0.0)
    return _outcome(lambda: o.sum().backward())


def absent_rank_worker(rank, world, timeout):
    """Rank 0 never calls ring_attention; the others must not wait for it forever."""
    import torch.distributed as dist

    dist.barrier()
    if rank == 0:
        time.sleep(timeout + 1)
        return ("absent", "", 0.0)
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    return _outcome(lambda: fd.ring_attention(q, k, v, layout="contiguous", impl=fd.Exact(), timeout=timeout))


def failing_worker(rank, world):
    if rank == 1:
        raise ValueError("rank 1 refuses")
    return rank


# --------------------------------------------------------------------------- the matrix


def _matrix(W):
    """Every layout × causal × mode at W ranks; grouped-query K/V and a batch of 2 in half of the cases."""
    n = 6                                              # zigzag: two chunks of 3 per rank
    cases = []
    for i, (layout, causal, mode) in enumerate((lay, c, m) for lay in fd.LAYOUTS for c in (False, True)
                                                for m in ("ring", "allgather")):
        cases.append(dict(layout=layout, causal=causal, mode=mode, N=n * W, B=1 + i % 2, H=2,
                          H_kv=1 if i % 4 < 2 else 2, d=8, seed=100 * W + i))
    return cases


_RESULTS = {}


def _results(W, port):
    if W not in _RESULTS:
        cases = _matrix(W)
        _RESULTS[W] = (cases, launch.run(matrix_worker, W, cases, port=port, timeout=120, group_timeout=30))
    return _RESULTS[W]


def _reference(case, dropout_mask=None):
    q, k, v, do = (t.numpy().astype(np.float64) for t in _inputs(case))
    o, _ = reference.attention_forward(q, k, v, causal=case["causal"], dropout_mask=dropout_mask)
    dq, dk, dv = reference.attention_backward(q, k, v, do, causal=case["causal"], dropout_mask=dropout_mask)
    return dict(o=o, dq=dq, dk=dk, dv=dv)


def _unshard(results, i, case, W):
    return {name: fd.unshard([r[i]["shards"][name] for r in results], layout=case["layout"], world=W)
            for name in ("o", "dq", "dk", "dv")}


CASE_IDS = [f"{lay}-{'causal' if c else 'full'}-{m}" for lay in fd.LAYOUTS for c in (False, True)
            for m in ("ring", "allgather")]


@pytest.mark.parametrize("W", [2, 3, 4])
@pytest.mark.parametrize("i", range(12), ids=CASE_IDS)
def test_forward_and_gradients_match_one_device(W, i, free_port):
    cases, results = _results(W, free_port())
    case = cases[i]
    got, want = _unshard(results, i, case, W), _reference(case)
    for name in ("o", "dq", "dk", "dv"):
        assert_close(got[name], want[name], **EXACT, what=f"W={W} {CASE_IDS[i]} {name}")


def _msg(case, W, itemsize=4):
    """One K/V shard: 2 (K and V) · B · n · H_kv · d · itemsize bytes."""
    return 2 * case["B"] * (case["N"] // W) * case["H_kv"] * case["d"] * itemsize


@pytest.mark.parametrize("W", [2, 3, 4])
def test_bytes_equal_the_formulas(W, free_port):
    cases, results = _results(W, free_port())
    for i, case in enumerate(cases):
        kv, dkv = _msg(case, W), _msg(case, W, 4)
        for rank in range(W):
            rows = results[rank][i]["stats"]
            fwd = [r for r in rows if r["phase"] == "forward"]
            bwd = [r for r in rows if r["phase"] == "backward"]
            assert len(fwd) == len(bwd) == W
            want_fwd = (W - 1) * kv                           # ring and all-gather: (W−1)·2n·H_kv·d·bytes
            want_bwd = (W - 1) * kv + (W * dkv if case["mode"] == "ring" else (W - 1) * dkv)
            for phase, sel, want in (("forward", fwd, want_fwd), ("backward", bwd, want_bwd)):
                assert sum(r["sent_bytes"] for r in sel) == want, (W, CASE_IDS[i], rank, phase)
                assert sum(r["recv_bytes"] for r in sel) == want, (W, CASE_IDS[i], rank, phase)
            if case["mode"] == "ring":       # one K/V hop per step but the last; dK/dV every step (the last: home)
                assert [r["sent_bytes"] for r in fwd] == [kv] * (W - 1) + [0]
                assert [r["sent_bytes"] for r in bwd] == [kv + dkv] * (W - 1) + [dkv]
                assert max(r["kv_bytes_held"] for r in fwd) == 2 * kv       # O(N/W)
            else:
                assert max(r["kv_bytes_held"] for r in fwd) == W * kv       # O(N)


def _pairs_by_definition(layout, W, N, rank, src, causal):
    """Visible (query, key) pairs of rank's queries against src's keys, from the layouts' definitions."""
    n, c = N // W, N // (2 * W)
    if layout == "contiguous":
        tok = lambda r: np.arange(r * n, (r + 1) * n)
    elif layout == "zigzag":
        tok = lambda r: np.r_[r * c:(r + 1) * c, (2 * W - 1 - r) * c:(2 * W - r) * c]
    else:
        tok = lambda r: np.arange(r, N, W)
    qp, kp = tok(rank), tok(src)
    return int((kp[None, :] <= qp[:, None]).sum()) if causal else n * n


@pytest.mark.parametrize("W", [2, 3, 4])
def test_attended_pairs_are_counted_per_rank_and_step(W, free_port):
    cases, results = _results(W, free_port())
    for i, case in enumerate(cases):
        for rank in range(W):
            for r in results[rank][i]["stats"]:
                assert r["src"] == (rank - r["step"]) % W
                assert r["pairs"] == _pairs_by_definition(case["layout"], W, case["N"], rank, r["src"],
                                                          case["causal"]), (W, CASE_IDS[i], rank, r["step"])
                assert r["compute_s"] >= 0 and r["wait_s"] >= 0


# --------------------------------------------------------------------------- one run through flashnb's kernels


def test_kernels_on_the_simulator(free_port):
    # W = 2, zigzag, causal, grouped-query K/V: diagonal blocks (step 0) and full ones (step 1) in the product kernel
    case = dict(layout="zigzag", causal=True, mode="ring", N=16, B=1, H=2, H_kv=1, d=8, seed=7,
                impl=fd.Kernels("flash", Br=16, Bc=16, warps=1))
    results = launch.run(matrix_worker, 2, [case], port=free_port(), timeout=180, group_timeout=60)
    got, want = _unshard(results, 0, case, 2), _reference(case)
    assert_close(got["o"], want["o"], **KERNEL_FWD, what="flash ring o")
    for name in ("dq", "dk", "dv"):
        assert_close(got[name], want[name], **KERNEL_BWD, what=f"flash ring {name}")


# --------------------------------------------------------------------------- more of the API, in two more groups


def _extras(rank, world):
    """W = 3: dropout keyed by global positions (Exact), the wrong stale-K/V backward, a group of two of the
    three ranks, and the bad-argument errors."""
    from flashnb.distributed.lessons import StaleKVRing

    drop = dict(layout="striped", causal=True, mode="ring", N=12, B=1, H=2, H_kv=1, d=8, seed=5, dropout_p=0.3,
                dropout_seed=1234)
    stale = dict(layout="zigzag", causal=True, mode="ring", N=12, B=1, H=2, H_kv=2, d=8, seed=6,
                 schedule=StaleKVRing)
    kdrop = dict(layout="zigzag", causal=True, mode="ring", N=12, B=1, H=2, H_kv=1, d=8, seed=4, dropout_p=0.3,
                 dropout_seed=2**40 + 3, impl=fd.Kernels("flash", Br=16, Bc=16, warps=1))
    sub = dict(layout="zigzag", causal=True, mode="ring", N=8, B=1, H=2, H_kv=1, d=8, seed=8)
    solo = dict(layout="striped", causal=True, mode="ring", N=6, B=1, H=2, H_kv=1, d=8, seed=9)
    return dict(dropout=_run_case(rank, world, drop), kernel_dropout=_run_case(rank, world, kdrop),
                stale=_run_case(rank, world, stale),
                subgroup=subgroup_worker(rank, world, sub, [0, 2]), solo=subgroup_worker(rank, world, solo, [1]),
                errors=error_worker(rank, world),
                cases=dict(dropout=drop, kernel_dropout=kdrop, stale={**stale, "schedule": None}, subgroup=sub,
                           solo=solo))


def extras_worker(rank, world):
    return _extras(rank, world)


@pytest.fixture(scope="module")
def extras(free_port):
    return launch.run(extras_worker, 3, port=free_port(), timeout=120, group_timeout=30)


@pytest.mark.parametrize("which, tol", [("dropout", (EXACT, EXACT)), ("kernel_dropout", (KERNEL_FWD, KERNEL_BWD))],
                         ids=["exact-striped", "flash-zigzag"])
def test_dropout_draws_the_single_device_mask(extras, which, tol):
    # Exact blocks, and the product kernel's (its dropout_at option): the ring's o and gradients are those of
    # one device drawing the whole sequence's mask
    case = extras[0]["cases"][which]
    B, H, N = case["B"], case["H"], case["N"]
    mask = rng.dropout_scale_np(case["dropout_seed"], case["dropout_p"], B * H, N, N).reshape(B, H, N, N)
    got = {name: fd.unshard([r[which]["shards"][name] for r in extras], layout=case["layout"], world=3)
           for name in ("o", "dq", "dk", "dv")}
    want = _reference(case, dropout_mask=mask)
    for name in ("o", "dq", "dk", "dv"):
        assert_close(got[name], want[name], **tol[name != "o"], what=f"{which} {name}")
    assert not np.allclose(got["o"], _reference(case)["o"], atol=1e-3)       # the mask did drop something


@pytest.mark.parametrize("layout", fd.LAYOUTS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_kernel_blocks_draw_the_exact_blocks_dropout(layout, causal):
    """Every block of every (rank, source) pair at W = 3, through the product kernel with dropout, against the
    float64 Exact block keyed by the same global rows and keys: forward (o, lse) and backward (given Exact's
    o, lse).  No processes: the blocks are what a ring step computes."""
    W, N, p, seed = 3, 12, 0.3, 77
    case = dict(B=1, H=2, H_kv=1, N=N, d=8, seed=11)
    q, k, v, do = _inputs(case)
    kernels, exact = fd.Kernels("flash", Br=16, Bc=16, warps=1), fd.Exact()
    scale = 8 ** -0.5
    for r in range(W):
        q_pos = positions(N, layout, r, W)
        qs, dos = (fd.shard(t, layout=layout, rank=r, world=W) for t in (q, do))
        for src in range(W):
            k_pos = positions(N, layout, src, W)
            ks, vs = (fd.shard(t, layout=layout, rank=src, world=W) for t in (k, v))
            for b in blocks.plan_for(N, layout, W, r, src, causal):
                args = (qs[:, :, b.row0:b.row1], ks[:, :, :b.keys], vs[:, :, :b.keys])
                kw = dict(causal=b.causal, scale=scale, rows=q_pos[b.row0:b.row1], keys=k_pos[:b.keys],
                          dropout=(p, seed))
                what = f"{layout} rank {r} src {src} rows {b.row0}:{b.row1}"
                o, lse = kernels.forward(*args, **kw)
                o_x, lse_x = exact.forward(*args, **kw)
                assert_close(o.numpy(), o_x.numpy(), **KERNEL_FWD, what=f"{what} o")
                assert_close(lse.numpy(), lse_x.numpy(), **KERNEL_FWD, what=f"{what} lse")
                grads = kernels.backward(*args, o_x, lse_x, dos[:, :, b.row0:b.row1], **kw)
                for name, g, g_x in zip(("dq", "dk", "dv"), grads,
                                        exact.backward(*args, o_x, lse_x, dos[:, :, b.row0:b.row1], **kw)):
                    assert_close(g.numpy(), g_x.numpy(), **KERNEL_BWD, what=f"{what} {name}")


def test_stale_kv_backward_has_a_right_forward_and_wrong_gradients(extras):
    case = extras[0]["cases"]["stale"]
    got = {name: fd.unshard([r["stale"]["shards"][name] for r in extras], layout=case["layout"], world=3)
           for name in ("o", "dq", "dk", "dv")}
    want = _reference(case)
    assert_close(got["o"], want["o"], **EXACT, what="stale-K/V forward")
    for name in ("dq", "dk", "dv"):
        assert np.abs(got[name] - want[name]).max() > 1e-2, f"the stale K/V should have broken {name}"


def test_a_subgroup_runs_its_own_ring(extras):
    case = extras[0]["cases"]["subgroup"]
    assert extras[1]["subgroup"] is None
    got = {name: fd.unshard([extras[r]["subgroup"]["shards"][name] for r in (0, 2)], layout=case["layout"], world=2)
           for name in ("o", "dq", "dk", "dv")}
    want = _reference(case)
    for name in ("o", "dq", "dk", "dv"):
        assert_close(got[name], want[name], **EXACT, what=f"group of ranks 0, 2: {name}")


def test_a_group_of_one_rank_needs_no_transfer(extras):
    case = extras[1]["cases"]["solo"]
    assert extras[0]["solo"] is None and extras[2]["solo"] is None
    got, want = extras[1]["solo"]["shards"], _reference(case)
    for name in ("o", "dq", "dk", "dv"):
        assert_close(got[name], want[name], **EXACT, what=f"a group of rank 1 alone: {name}")
    assert all(r["sent_bytes"] == r["recv_bytes"] == 0 for r in extras[1]["solo"]["stats"])


@pytest.mark.parametrize("scenario, kind, words", [
    ("shapes", "ValueError", ["differ across ranks", "shape", "rank 1"]),
    ("split", "ValueError", ["zigzag", "N = 15", "cannot be split"]),
    ("contiguous", "ValueError", ["rank 2", "q is not contiguous", "contiguous()"]),
    ("dtype", "TypeError", ["rank 0", "float32"]),
    ("dropout", "NotImplementedError", ["dropout_p"]),
    ("differ", "ValueError", ["causal differs across ranks", "rank 1"]),
])
def test_errors_on_every_rank_before_the_ring(extras, scenario, kind, words):
    outcomes = [r["errors"][scenario] for r in extras]
    for rank, (got, message, seconds) in enumerate(outcomes):
        assert got == kind, f"rank {rank}: {scenario} raised {got}: {message}"
        for w in words:
            assert w in message, f"rank {rank}: {w!r} not in {message!r}"
        assert seconds < 10
    assert len({m for _, m, _ in outcomes}) == 1          # the same error on every rank


def test_the_group_still_works_after_refused_calls(extras):
    assert all(r["errors"]["good"][0] == "ok" for r in extras), [r["errors"]["good"] for r in extras]


def test_a_rank_that_skips_the_backward_is_a_timeout_naming_step_and_peer(free_port):
    t0 = time.perf_counter()
    out = launch.run(skip_backward_worker, 3, 2.5, port=free_port(), timeout=60, group_timeout=20)
    assert out[2][0] == "skipped"
    for rank in (0, 1):
        kind, message, seconds = out[rank]
        assert kind == "RingTimeout", (rank, kind, message)
        # rank 0 waits for K/V from rank 2, rank 1 to hand its K/V to rank 2: both name the rank that is missing
        assert "backward, step" in message and ("from rank 2" in message or "to rank 2" in message), message
        assert seconds < 2.5 + 8.0
    assert time.perf_counter() - t0 < 40


def test_a_rank_that_never_calls_is_a_timeout_of_the_check(free_port):
    out = launch.run(absent_rank_worker, 3, 2.5, port=free_port(), timeout=60, group_timeout=20)
    for rank in (1, 2):
        kind, message, seconds = out[rank]
        assert kind == "RingTimeout", (rank, kind, message)
        assert "check of the shards" in message and "did not complete in time" in message, message
        assert seconds < 2.5 + 8.0


def test_launch_reports_every_failing_rank(free_port):
    with pytest.raises(RanksFailed, match="rank 1: ValueError: rank 1 refuses") as e:
        launch.run(failing_worker, 2, port=free_port(), timeout=60)
    assert set(e.value.errors) == {1} and e.value.results == {0: 0}
    with pytest.raises(TypeError, match="module level"):
        launch.run(lambda rank, world: None, 2)


def test_demo_check_runs_and_reports(free_port):
    from flashnb.distributed import demo

    out = launch.run(demo.check, 4, N=32, impl="exact", layout="striped", port=free_port(), timeout=60)
    r = out[0]
    assert r["ok"] and all(e["max_abs"] < 1e-5 for e in r["errors"].values()), r["errors"]
    text = demo.report(r)
    assert "W=4 (gloo)" in text and "ok" in text and "FAILED" not in text
    msg = 2 * 1 * 8 * 1 * 16 * 4                                # 2·B·n·H_kv·d·4 with the demo's B, H_kv, d
    assert r["formula"] == {"forward": 3 * msg, "backward": 3 * msg + 4 * msg}


def test_gpu_measurement_rehearsed_through_the_cuda_tensor_path(free_port):
    # scripts/ring_gpu_check.py's worker, rehearsed: the kernels on the simulator through flashnb.pytorch's CUDA-tensor
    # path (flashnb.instruments.rehearsal.pretend_gpu + flashnb.pytorch.rehearse_cuda), gloo instead of NCCL; no time is
    # reported
    from flashnb.distributed import measure

    case = dict(layout="striped", mode="ring", causal=True, N=8, check_N=8, B=1, H=2, H_kv=1, d=8)
    rows = launch.run(measure.measure_cases, 2, [case], reps=0, rehearse=True, port=free_port(), timeout=180,
                      group_timeout=60)                # reps=0: the check and the per-step run, no timing loop
    for rank, (row,) in enumerate(rows):
        assert row["mode_of_run"] == "rehearsal" and row["fwd_ms"] is None and row["peak_bytes"] is None
        assert row["ok"] and all(row["errors"][k] <= row["bounds"][k] for k in row["errors"]), row
        msg = 2 * 1 * 4 * 1 * 8 * 4
        assert row["sent_bytes"] == {"forward": msg, "backward": msg + 2 * msg} == row["formula_bytes"]


@pytest.mark.slow   # ~90 s on 2 cores: every layout and mode at W = 4 through the simulator's kernels
def test_ring_gpu_check_script_rehearsal(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "ring_gpu_check.py"
    done = subprocess.run([sys.executable, str(script), "--rehearse", "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "nothing here is a measurement" in done.stdout and "all checks passed" in done.stdout
    import json

    data = json.loads((tmp_path / "ring_gpu_check.json").read_text())
    assert data["meta"]["mode_of_run"] == "rehearsal" and len(data["rows"]) == 6 * 4
    assert all(r["fwd_ms"] is None and r["mode_of_run"] == "rehearsal" for r in data["rows"])


@pytest.mark.slow   # ~15-40 s on 2 cores (torch imported by every rank): the command the docs give
def test_torchrun_demo():
    import shutil
    import subprocess
    import sys

    torchrun = shutil.which("torchrun") or pytest.skip("torchrun not on PATH")
    done = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "4", "-m", "flashnb.distributed.demo"],
                          capture_output=True, text=True, timeout=600, env={**__import__("os").environ,
                                                                            "FLASHNB_DEVICE": "sim"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count(" ok") == 4 and "W=4 (gloo)" in done.stdout, done.stdout
    del sys


# --------------------------------------------------------------------------- no processes: layouts, plan, merge


@pytest.mark.parametrize("W", [1, 2, 3, 4])
def test_positions_by_definition(W):
    N = 4 * W
    n, c = N // W, N // (2 * W)
    for r in range(W):
        assert positions(N, "contiguous", r, W).tolist() == list(range(r * n, (r + 1) * n))
        assert positions(N, "zigzag", r, W).tolist() == list(range(r * c, (r + 1) * c)) + \
            list(range((2 * W - 1 - r) * c, (2 * W - r) * c))
        assert positions(N, "striped", r, W).tolist() == list(range(r, N, W))
    for layout in fd.LAYOUTS:
        allpos = np.concatenate([positions(N, layout, r, W) for r in range(W)])
        assert sorted(allpos.tolist()) == list(range(N))


@pytest.mark.parametrize("layout", fd.LAYOUTS)
def test_shard_unshard_round_trip(layout, rng):
    W = 3
    x = rng.standard_normal((2, 3, 12, 5))
    parts = [fd.shard(x, layout=layout, rank=r, world=W) for r in range(W)]
    assert all(p.flags.c_contiguous and p.shape == (2, 3, 4, 5) for p in parts)
    np.testing.assert_array_equal(fd.unshard(parts, layout=layout, world=W), x)
    t = torch.from_numpy(x)
    tparts = [fd.shard(t, layout=layout, rank=r, world=W, dim=2) for r in range(W)]
    for p, tp in zip(parts, tparts):
        np.testing.assert_array_equal(tp.numpy(), p)
    assert torch.equal(fd.unshard(tparts, layout=layout, world=W, dim=2), t)
    y = rng.standard_normal((12, 5))
    np.testing.assert_array_equal(fd.unshard([fd.shard(y, layout=layout, rank=r, world=W, dim=0) for r in range(W)],
                                             layout=layout, world=W, dim=0), y)


def test_layout_errors():
    with pytest.raises(ValueError, match=r"zigzag.*multiple of 6\); use N = 12 or 18"):
        positions(14, "zigzag", 0, 3)
    with pytest.raises(ValueError, match="use N = 6"):
        positions(4, "striped", 0, 6)
    with pytest.raises(ValueError, match="layout must be one of"):
        positions(8, "ring", 0, 2)
    with pytest.raises(ValueError, match="rank must be in 0..1"):
        positions(8, "contiguous", 2, 2)
    with pytest.raises(ValueError, match="one shard per rank"):
        fd.unshard([np.zeros((2, 3))], layout="contiguous", world=2)
    with pytest.raises(ValueError, match="dim = 3 is out of range"):
        fd.shard(np.zeros((4, 2)), layout="contiguous", rank=0, world=2, dim=3)


@pytest.mark.parametrize("W", [2, 3, 4])
@pytest.mark.parametrize("layout", fd.LAYOUTS)
def test_plan_computes_exactly_the_causal_pairs(W, layout):
    # the blocks, each full or bottom-right causal on a key prefix, cover the mask key <= query exactly once
    N = 4 * W
    for causal in (False, True):
        for r in range(W):
            qp = positions(N, layout, r, W)
            for s in range(W):
                kp = positions(N, layout, s, W)
                want = (kp[None, :] <= qp[:, None]) if causal else np.ones((qp.size, kp.size), dtype=bool)
                got = np.zeros_like(want, dtype=int)
                plan = blocks.plan(qp, kp, causal)
                for b in plan:
                    R, K = b.rows, b.keys
                    ok = np.ones((R, K), dtype=bool) if not b.causal else \
                        np.arange(K)[None, :] <= np.arange(R)[:, None] + (K - R)
                    got[b.row0:b.row1, :K] += ok
                    assert b.pairs == ok.sum() and (not b.causal or b.diag >= 0)
                np.testing.assert_array_equal(got, want.astype(int), err_msg=f"{layout} W={W} rank {r} src {s}")
                assert len(plan) <= (2 if layout == "zigzag" else 1)


def test_pair_formulas_and_imbalance():
    for W in (2, 3, 4, 8):
        for layout in fd.LAYOUTS:
            for causal in (False, True):
                N = 16 * W
                want = np.array([[_pairs_by_definition(layout, W, N, r, (r - t) % W, causal) for t in range(W)]
                                 for r in range(W)])
                np.testing.assert_array_equal(model.pairs_per_step(layout, W, N, causal), want)
                np.testing.assert_array_equal(model.brute_force_pairs(layout, W, N, causal), want)
        n = 4096                                     # long shards: the imbalance reaches its limit
        big = {layout: model.pairs_per_step(layout, W, n * W, True) for layout in fd.LAYOUTS}
        assert model.imbalance(big["contiguous"]) == pytest.approx((2 * W - 1) / W, rel=1e-3)
        assert model.step_imbalance(big["contiguous"]) == pytest.approx((2 * W - 1) / W, rel=1e-3)
        assert model.imbalance(big["zigzag"]) == 1.0 and model.step_imbalance(big["zigzag"]) == 1.0
        assert model.imbalance(big["striped"]) == pytest.approx(1.0, abs=1e-3)


def test_merge_is_the_softmax_of_the_union_and_never_nan(rng):
    # two blocks of keys for 5 rows; row 3 sees no key in block a, row 4 none in either
    d, Ka, Kb = 4, 3, 5
    s = rng.standard_normal((5, Ka + Kb))
    v = rng.standard_normal((Ka + Kb, d))
    seen = np.ones_like(s, dtype=bool)
    seen[3, :Ka] = False
    seen[4] = False

    def partial(cols):
        S = np.where(seen[:, cols], s[:, cols], -np.inf)
        lse = np.array([np.logaddexp.reduce(row) if np.isfinite(row).any() else -np.inf for row in S])
        P = np.where(np.isfinite(lse)[:, None], np.exp(S - np.where(np.isfinite(lse), lse, 0)[:, None]), 0.0)
        return torch.tensor(P @ v[cols], dtype=torch.float32), torch.tensor(lse, dtype=torch.float32)

    o, lse = blocks.merge(*partial(slice(0, Ka)), *partial(slice(Ka, None)))
    S = np.where(seen, s, -np.inf)
    want_lse = np.array([np.logaddexp.reduce(row) if np.isfinite(row).any() else -np.inf for row in S])
    P = np.where(np.isfinite(want_lse)[:, None], np.exp(S - np.where(np.isfinite(want_lse), want_lse, 0)[:, None]), 0)
    assert_close(o.numpy(), P @ v, atol=1e-6, rtol=1e-6, what="merged o")       # float32 rounding of O(1) values
    assert_close(lse.numpy(), want_lse, atol=1e-6, rtol=1e-6, what="merged lse")
    assert o[4].abs().max() == 0 and lse[4] == -np.inf


def test_exact_blocks_are_the_reference(rng):
    # Exact's forward, and its backward given the block's own (o, lse), against flashnb.reference (float64)
    for causal, Nq, Nk in ((False, 5, 7), (True, 6, 6), (True, 4, 9)):
        q = torch.tensor(rng.standard_normal((2, 4, Nq, 8)), dtype=torch.float32)
        k, v = (torch.tensor(rng.standard_normal((2, 2, Nk, 8)), dtype=torch.float32) for _ in range(2))
        do = torch.tensor(rng.standard_normal((2, 4, Nq, 8)), dtype=torch.float32)
        o, lse = fd.Exact().forward(q, k, v, causal=causal, scale=8 ** -0.5)
        a = [t.numpy().astype(np.float64) for t in (q, k, v, do)]
        o_ref, lse_ref = reference.attention_forward(*a[:3], causal=causal)
        assert_close(o.numpy(), o_ref, atol=1e-6, rtol=1e-6, what="Exact o")      # float64 rounded to float32
        assert_close(lse.numpy(), lse_ref, atol=1e-6, rtol=1e-6, what="Exact lse")
        grads = fd.Exact().backward(q, k, v, o, lse, do, causal=causal, scale=8 ** -0.5)
        for g, want, name in zip(grads, reference.attention_backward(*a, causal=causal), ("dq", "dk", "dv")):
            assert_close(g.numpy(), want, atol=1e-5, rtol=1e-5, what=f"Exact {name}")   # from float32 o, lse


def test_argument_errors_without_processes():
    q = torch.zeros(1, 1, 4, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        fd.ring_attention(q, q, q)
    with pytest.raises(TypeError, match="impl must be None"):
        blocks.resolve_impl(3)
    with pytest.raises(NotImplementedError, match="dropout_p"):
        fd.Kernels("fa2").forward(q, q, q, causal=False, scale=1.0, dropout=(0.1, 1))
