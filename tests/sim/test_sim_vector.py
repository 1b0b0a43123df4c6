"""The vectorised simulator against the threads simulator: the same launches in both, byte-identical outputs and
equal traffic counts (``traffic.count().summary()``), and the vectorised run really vectorised (no launch
handed to the threads simulator).

CI runs every registered impl causal, forward and backward (ragged shapes: Nq = 24 > Nk = 20, d = 8, small tiles
so every loop runs several iterations with several warps), every fa2 option (half storages, dropout, modifiers,
block-sparse, grouped-query, top-left causal alignment), the tensor-core kernels in each storage (mma.sync,
ldmatrix, cp.async and the conversions: :mod:`flashnb.sim.vector.tensorcore`), the kernels no impl launches
(softmax variants, the stage-6 step kernels, the dropout mask, the KV-cache append) and hand-made kernels for the
constructs the library's kernels do not use (atomics in the threads simulator's order, shuffles and votes with
partial masks, 3-D grids and blocks, local arrays indexed per lane, dynamic shared memory, mixed types per lane,
a variable both branches of an if assign under a partial mask ...).
``-m slow`` adds the non-causal runs, every gallery modifier and larger shapes.
"""

import math

import numpy as np
import pytest
from numba import cuda, float32, int32, uint32

import flashnb
from flashnb import common, flex, rng, sim
from flashnb.instruments import traffic
from flashnb.registry import IMPLS
from flashnb.sim import vector
from flashnb.stages import fa2_fast_steps, softmax

pytestmark = pytest.mark.skipif(flashnb.MODE != "sim", reason="simulator-only")

FULL = 0xFFFFFFFF


def _host(x):
    if hasattr(x, "copy_to_host"):
        return x.copy_to_host()
    if isinstance(x, (tuple, list)):
        return type(x)(_host(e) for e in x)
    if isinstance(x, dict):
        return {k: _host(v) for k, v in x.items()}
    return x


def _run(mode, fn):
    with sim.simulating(mode):
        before = vector.counts()
        with traffic.count() as t:
            out = _host(fn())
        after = vector.counts()
    return out, t.summary(), {k: after[k] - before[k] for k in after}


def _same(a, b, path="out"):
    if isinstance(a, (tuple, list)):
        assert isinstance(b, type(a)) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _same(a[k], b[k], f"{path}[{k!r}]")
    else:
        x, y = np.asarray(a), np.asarray(b)
        assert x.dtype == y.dtype and x.shape == y.shape, f"{path}: {x.dtype}{x.shape} vs {y.dtype}{y.shape}"
        if x.tobytes() != y.tobytes():
            bad = np.flatnonzero(x.reshape(-1).view(np.uint8) != y.reshape(-1).view(np.uint8))
            e = bad[0] // x.itemsize
            raise AssertionError(f"{path}: {len(bad)} bytes differ (first at byte {bad[0]}): vector "
                                 f"{x.reshape(-1)[e]!r}, threads {y.reshape(-1)[e]!r}")


def differential(fn, *, launches=1, unordered=()):
    """Run ``fn`` on both simulators: the vectorised run must have run at least ``launches`` launches itself
    and none on the threads simulator; outputs byte for byte and traffic summaries must be equal.

    ``unordered``: indices of outputs that threads of one block sum into the same element with float atomics
    between two barriers.  The vectorised simulator applies those in thread order; the threads simulator in
    the order its Python threads happen to interleave, which changes from run to run (as on a GPU), so
    those outputs are compared to float32 rounding of a reordered sum instead of bytes."""
    out_v, sum_v, n_v = _run("vector", fn)
    out_t, sum_t, _ = _run("threads", fn)
    assert n_v["threads"] == 0, f"the vectorised run handed a launch to the threads simulator: {vector.notes()[-3:]}"
    assert n_v["vector"] >= launches
    for i in unordered:
        # at most Nk = 20 float32 terms of O(1) per element in another order: a few ulp of the largest
        np.testing.assert_allclose(out_v[i], out_t[i], rtol=0, atol=1e-6 * (1 + np.abs(out_t[i]).max()))
    out_v, out_t = ([x for i, x in enumerate(out) if i not in unordered] for out in (out_v, out_t))
    _same(out_v, out_t)
    assert sum_v == sum_t
    return out_v


def _inputs(seed=0, BH=2, Nq=24, Nk=20, d=8, kv_heads=None):
    r = np.random.default_rng(seed)
    hk = BH if kv_heads is None else kv_heads
    q, do = r.standard_normal((1, BH, Nq, d)), r.standard_normal((1, BH, Nq, d))
    k, v = r.standard_normal((1, hk, Nk, d)), r.standard_normal((1, hk, Nk, d))
    return q, k, v, do


# small tiles so loops iterate with several warps (as the sanitizer's every-impl test)
OPTIONS = {"fa1": dict(Br=8, Bc=16, warps=2), "fa2": dict(Br=16, Bc=16, warps=2),
           "fa2-rows": dict(Br=64, Bc=16), "fa2-splitq": dict(Br=64, Bc=64, warps=2),
           "fa2-fast": dict(Br=8, Bc=8, warps=2), "naive": dict(tile=8), "onepass": dict(tile=4),
           "fa2-tc": dict(Br=32, Bc=32, warps=2)}


# outputs (o, lse, dq, dk, dv) that threads of one block add into the same element: fa2-rows' backward adds every
# key row's term of dQ itself (its lesson: step (b) sums the block's terms first, one atomic per element)
UNORDERED = {"fa2-rows": (2,)}


def _fwd_bwd(name, causal, **opts):
    q, k, v, do = _inputs(BH=1)

    def run():
        o, lse = flashnb.attention_forward(q, k, v, causal=causal, impl=name, **opts)
        out = [o, lse]
        if IMPLS[name].backward is not None:
            out += list(flashnb.attention_backward(q, k, v, o, lse, do, causal=causal, impl=name, **opts))
        return tuple(out)
    return run


@pytest.mark.parametrize("causal", [True, pytest.param(False, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", list(IMPLS))
def test_every_impl_forward_and_backward(name, causal):
    differential(_fwd_bwd(name, causal, **OPTIONS.get(name, {})), unordered=UNORDERED.get(name, ()))


# fa2-tc in each storage (float64 inputs above take the float32 path, TF32): (storage, (BH, Nq, d), Nk, causal[,
# K/V heads])
TC_CASES = {
    "float16-async": ("float16", (1, 40, 16), 36, True),          # cp.async double buffering, partial tiles
    "bfloat16-odd-d": ("bfloat16", (1, 24, 20), 40, "upper_left"),  # d = 20: plain copies, padded to 32; top-left
    "tf32-no-key-rows": ("float32", (1, 33, 8), 20, True),        # Nq > Nk bottom-right: rows that see no key
    "float16-gqa": ("float16", (2, 40, 16), 20, True, 1),         # two query heads on one K/V head (MQA)
    "float16-full": pytest.param(("float16", (2, 20, 64), 70, False), marks=pytest.mark.slow),  # default tiles
}


@pytest.mark.parametrize("case", list(TC_CASES.values()), ids=list(TC_CASES))
def test_tensor_core_kernels_run_vectorised(case):
    """fa2-tc's forward and backward call the tensor-core twins (mma.sync, ldmatrix, cp.async, the conversions):
    the vectorised simulator runs them itself -- no launch handed to the threads simulator, no note -- with the
    threads simulator's bytes and counts."""
    storage, (BH, Nq, d), Nk, causal, *kv_heads = case
    Hkv = kv_heads[0] if kv_heads else BH                             # (fewer: grouped K/V heads)
    r = np.random.default_rng(Nq * 131 + d)
    arrays = [r.standard_normal(s) for s in ((BH, Nq, d), (Hkv, Nk, d), (Hkv, Nk, d), (BH, Nq, d))]
    if storage == "bfloat16":
        q, k, v, do = (common.to_bfloat16(a) for a in arrays)
    else:
        q, k, v, do = (a.astype(storage) for a in arrays)
    tiles = OPTIONS["fa2-tc"] if d < 64 else {}
    notes = len(vector.notes())

    def run():
        o, lse = flashnb.attention_forward(q, k, v, causal=causal, impl="fa2-tc", storage=storage, **tiles)
        return (o, lse) + tuple(flashnb.attention_backward(q, k, v, o, lse, do, causal=causal, impl="fa2-tc",
                                                           storage=storage, **tiles))
    differential(run, launches=3)
    assert not any("tensorcore" in note for note in vector.notes()[notes:]), vector.notes()[notes:]


@pytest.mark.parametrize("opts", [
    dict(storage="float16"), dict(dropout_p=0.3, seed=7), dict(causal_align="upper_left"),
    dict(score_mod=flex.alibi(2), mask_mod=flex.sliding_window(6), heads=2),
    dict(score_mod=flex.softcap(2.0)), dict(mask_mod=flex.document(np.repeat(np.arange(3), [9, 8, 7])))],
    ids=["float16", "dropout", "upper-left", "alibi+window", "softcap", "document"])
def test_product_kernel_options(opts):
    opts = dict(opts)
    causal = opts.pop("causal_align", True)
    BH = opts.get("heads", 1)
    if "mask_mod" in opts and "document" in str(opts["mask_mod"]):
        q, k, v, do = _inputs(BH=BH, Nk=24)
    else:
        q, k, v, do = _inputs(BH=BH)
    if opts.get("storage") == "float16":
        q, k, v, do = (x.astype(np.float16) for x in (q, k, v, do))

    def run():
        o, lse = flashnb.attention_forward(q, k, v, causal=causal, impl="flash", Br=16, Bc=16, warps=2, **opts)
        return (o, lse) + tuple(flashnb.attention_backward(q, k, v, o, lse, do, causal=causal, impl="flash", Br=16,
                                                           Bc=16, warps=2, **opts))
    differential(run, launches=3)


def test_product_kernel_bfloat16_gqa_and_stage5_block_sparse():
    q, k, v, do = _inputs(Nq=20, Nk=17, kv_heads=1)
    qb, kb, vb, dob = (common.to_bfloat16(x.astype(np.float32)) for x in (q, k, v, do))
    tiles = dict(Br=16, Bc=16, warps=2)

    def run():
        o, lse = flashnb.attention_forward(qb, kb, vb, causal=True, impl="flash", storage="bfloat16", **tiles)
        g = flashnb.attention_backward(qb, kb, vb, o, lse, dob, causal=True, impl="flash", storage="bfloat16", **tiles)
        o2, lse2 = flashnb.attention_forward(q[:, :1], k, v, causal=False, impl="fa2-sparse", window=1, Br=16,
                                             Bc=16, warps=2)
        return (o, lse, *g, o2, lse2)
    differential(run, launches=5)


def test_softmax_kernels_step_kernels_dropout_mask_and_cache():
    x = np.random.default_rng(3).standard_normal((3, 50))
    q, k, v = (np.random.default_rng(4).standard_normal(s) for s in ((5, 8), (37, 8), (37, 8)))

    from flashnb.kernels.launch import decode as decode_host

    def run():
        out = [softmax.softmax(x, method, reduce=reduce, threads=64)
               for method in softmax.METHODS for reduce in softmax.REDUCTIONS]
        out.append(softmax.online_partials(x, 3, threads=32))
        out.append(softmax.attention_rows(q, k, v, causal=True, tile=None))
        out.append(softmax.attention_rows(q, k, v, causal=True, tile=4))
        out += [fa2_fast_steps.run(f, 32)[0] for _, _, f in fa2_fast_steps.STEPS]
        out += list(rng.device_mask(5, 0.25, 2, 7, 40))
        cache = decode_host.KVCache(2, 12, 8)
        r = np.random.default_rng(5)
        cache.append(r.standard_normal((2, 5, 8)), r.standard_normal((2, 5, 8)))
        out += [cache.K, cache.V]
        out += list(decode_host.decode(r.standard_normal((2, 1, 8)), cache, num_splits=2))
        return tuple(out)
    differential(run, launches=10)


# --------------------------------------------------------------------------- hand-made kernels


@cuda.jit
def float_atomics(x, total, per_block):
    """Float adds whose rounding depends on their order (the threads simulator's: block after block)."""
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    for r in range(3):
        cuda.atomic.add(total, 0, x[i] * float32(r + 1))
        cuda.atomic.add(per_block, cuda.blockIdx.x % 2, x[i])
    old = cuda.atomic.max(per_block, 2, x[i])
    per_block[3 + i % 4] = old * float32(0)


@cuda.jit
def warp_ops(x, out):
    t = cuda.threadIdx.x + cuda.blockDim.x * (cuda.threadIdx.y + cuda.blockDim.y * cuda.threadIdx.z)
    lane = t % 32
    v = x[cuda.blockIdx.x, t]
    if lane < 16:
        a = cuda.shfl_xor_sync(0x0000FFFF, v, 1)
        b = cuda.shfl_down_sync(0x0000FFFF, v, 8)          # lanes 8..15 read lanes not in the mask: poison
    else:
        a = cuda.shfl_sync(0xFFFF0000, v, 16)
        b = cuda.shfl_up_sync(0xFFFF0000, v, 3)
    out[cuda.blockIdx.x, t, 0] = a
    out[cuda.blockIdx.x, t, 1] = b
    out[cuda.blockIdx.x, t, 2] = cuda.ballot_sync(FULL, v > float32(0))
    out[cuda.blockIdx.x, t, 3] = cuda.match_any_sync(FULL, int32(v > float32(0)))
    out[cuda.blockIdx.x, t, 4] = cuda.syncthreads_count(int32(v > float32(0.5)))
    out[cuda.blockIdx.x, t, 5] = cuda.all_sync(FULL, v > float32(-3)) + cuda.any_sync(FULL, v > float32(2))
    r = cuda.match_all_sync(FULL, t // 64)
    out[cuda.blockIdx.x, t, 6] = r[0] + r[1]
    out[cuda.blockIdx.x, t, 7] = cuda.activemask() + cuda.lanemask_lt() + cuda.laneid


@cuda.jit
def control_flow(x, out, n):
    """Loops with per-lane bounds, break/continue, an early return, local arrays indexed per lane, a Python int
    on some lanes and an int32 on others, a guarded read past the end."""
    i, j, kk = cuda.grid(3)
    lin = (i * 9 + j) * 4 + kk
    acc = cuda.local.array(5, float32)
    for e in range(5):
        acc[e] = float32(e)
    if lin >= n:
        return
    s = float32(0)
    c = 0
    for e in range(lin % 7, 20, 3):
        if e == 13:
            continue
        if e > 17:
            break
        s += x[e] * acc[e % 5]
        c += 1
    w = 0
    while w < lin % 5:
        acc[w] += s
        w += 1
    lim = min(lin, int32(n // 3)) if lin % 2 else lin // 2     # int on some lanes, int32 on others
    v = x[lin + 100] if lin + 100 < x.shape[0] else float32(math.exp(float32(-1.5)))
    out[lin, 0] = s + acc[lin % 5]
    out[lin, 1] = float32(c) + float32(lim) + v
    out[lin, 2] = float32(math.log(float32(1) + s * s)) if s != float32(0) else float32(math.sqrt(float32(2)))


@cuda.jit
def shared_dynamic(x, out):
    """Dynamic shared memory (two dtypes viewing it), a static tile, a uint32 index, a constant table."""
    buf = cuda.shared.array(0, float32)
    tile = cuda.shared.array((4, 33), float32)
    t = cuda.threadIdx.x
    b = cuda.blockIdx.x
    buf[t] = x[b * 32 + t]
    tile[t % 4, t // 4] = x[b * 32 + (t * 7) % 32]
    cuda.syncthreads()
    table = cuda.const.array_like(TABLE)
    u = uint32(t)
    out[b * 32 + t] = buf[(u + uint32(1)) % uint32(32)] + tile[(t + 1) % 4, t // 4] * table[t % 5]


TABLE = np.array([1.5, -2.0, 0.25, 3.0, -0.5], np.float32)


@cuda.jit(device=True)
def _both_branches(x, t):
    """Each branch assigns ``p`` (unassigned before): after the if it is assigned on every lane that runs."""
    if x > float32(0):
        p = x
    else:
        p = float32(-2) * x
    return p + float32(t)


@cuda.jit
def assigned_in_both_branches(x, out):
    """A fresh variable assigned by both branches of an if under a mask that is not every lane's: after an early
    return, and in a device function called from a loop whose bounds differ per lane."""
    t = cuda.threadIdx.x
    if t >= 24:
        return
    v = x[t]
    if v > float32(0.5):
        p = v
    else:
        p = v * float32(3)
    acc = p
    for j in range(t % 3, 3):
        acc += _both_branches(x[j * 8 + t % 8], j)
    out[t] = acc


def test_atomics_apply_in_the_threads_simulators_order():
    x = np.random.default_rng(0).standard_normal(96).astype(np.float32) * np.float32(1e3)

    def run():
        total = common.to_device(np.zeros(1, np.float32))
        per = common.to_device(np.full(8, -np.inf, np.float32))
        per_h = per.copy_to_host()
        per_h[:3] = 0
        per = common.to_device(per_h)
        float_atomics[3, 32](common.to_device(x), total, per)
        return total, per
    differential(run)


def test_warp_operations_multi_dimensional_blocks():
    x = np.random.default_rng(1).standard_normal((2, 128)).astype(np.float32)

    def run():
        out = common.to_device(np.zeros((2, 128, 8), np.float32))
        warp_ops[2, (8, 4, 4)](common.to_device(x), out)
        return out
    differential(run)


def test_control_flow_3d_grid():
    x = np.random.default_rng(2).standard_normal(130).astype(np.float32)

    def run():
        out = common.to_device(np.full((300, 3), np.nan, np.float32))
        control_flow[(3, 3, 1), (4, 2, 2)](common.to_device(x), out, np.int32(140))
        return out
    differential(run)


def test_a_variable_both_branches_assign_under_a_partial_mask():
    x = np.random.default_rng(4).standard_normal(32).astype(np.float32)

    def run():
        out = common.to_device(np.full(32, np.nan, np.float32))
        assigned_in_both_branches[1, 32](common.to_device(x), out)
        return out
    differential(run)


def test_dynamic_shared_memory():
    x = np.random.default_rng(3).standard_normal(96).astype(np.float32)

    def run():
        out = common.to_device(np.full(96, np.nan, np.float32))
        shared_dynamic[3, 32, 0, 32 * 4](common.to_device(x), out)
        return out
    differential(run)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(flex.GALLERY))
def test_every_gallery_modifier(name):
    args = {"causal": (), "sliding_window": (8,), "alibi": (2,), "softcap": (3.0,),
            "document": (np.repeat(np.arange(4), 6),), "prefix_lm": (5,)}[name]
    mod = flex.GALLERY[name](*args)
    role = "mask_mod" if name in ("causal", "sliding_window", "document", "prefix_lm") else "score_mod"
    q, k, v, do = _inputs(Nk=24)

    def run():
        kw = {role: mod, "heads": 2}
        o, lse = flashnb.attention_forward(q, k, v, impl="flash", Br=16, Bc=16, warps=2, **kw)
        return (o, lse) + tuple(flashnb.attention_backward(q, k, v, o, lse, do, impl="flash", Br=16, Bc=16, warps=2,
                                                           **kw))
    differential(run, launches=3)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(IMPLS))
def test_every_impl_at_64(name):
    q, k, v, do = _inputs(BH=2, Nq=64, Nk=64, d=16)

    def run():
        o, lse = flashnb.attention_forward(q, k, v, causal=True, impl=name)
        out = [o, lse]
        if IMPLS[name].backward is not None:
            out += list(flashnb.attention_backward(q, k, v, o, lse, do, causal=True, impl=name))
        return tuple(out)
    differential(run)
