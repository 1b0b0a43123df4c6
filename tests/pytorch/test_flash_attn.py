"""flashnb.pytorch.flash_attn: flash-attn 2.x's functions checked against an independent float64 reference.

The reference (:func:`_ref`) is plain torch float64 math written here from flash-attn's documented semantics:
scores ``scale·q kᵀ``, then ``softcap·tanh(s/softcap)``, then ALiBi's ``-slope·|i + Sk - Sq - j|``, masked by the
bottom-right causal mask and the window ``i + Sk - Sq - left <= j <= i + Sk - Sq + right``, softmax (a row with
no key gives 0), dropout's keep mask scaled by ``1/(1-p)``, times v; K/V heads repeated for GQA.  Gradients are
float64 autograd through it.

Shapes are flash-attn's test shapes scaled down to simulator sizes: its ``(seqlen_q, seqlen_k)`` pairs
(113, 203), (128, 217), (108, 256), (512, 256), (1023, 1024), (1024, 1023) and (1, 147) become about 1/8 of
them, so Sq != Sk both ways, odd lengths and 1-token sequences; head dims 8, 16 and odd ones (7, 9, like its 59).

Tolerance.  flashnb computes in float32 (u = 2^-24 ≈ 6e-8) on float32 inputs; the reference computes in float64
on the same values, so the difference is flashnb's float32 rounding.  Every output or gradient element is a few
chained sums of at most max(Sq, Sk, d) <= 32 products of O(1) numbers (standard-normal inputs, softmax weights
<= 1; softcap's tanh and ALiBi's bias are O(1)-conditioned): n·u·sum|terms| ≈ 2e-6 per sum.  TOL = 2e-5 covers a
chain of several; the measured errors are below 1e-6, while a wrong mask, offset or missing term gives 0.1-1.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from flashnb import runtime  # noqa: E402
from flashnb.pytorch import _draw_seed  # noqa: E402
from flashnb.pytorch.flash_attn import (  # noqa: E402
    flash_attn_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
)
from flashnb.rng import dropout_keep_np  # noqa: E402

TOL = 2e-5
SMALL = dict(Br=16, Bc=16, warps=1)   # one-warp tiles: 32 simulator threads per block


def _ref(q, k, v, *, causal=False, window=(-1, -1), softcap=0.0, slopes=None, scale=None, keep=None, p=0.0):
    """flash-attn's semantics in float64: q ``(B, Sq, H, d)``, k, v ``(B, Sk, Hk, d)`` -> ``(B, Sq, H, d)``."""
    q, k, v = (t.double() for t in (q, k, v))
    B, Sq, H, d = q.shape
    Sk, Hk = k.shape[1], k.shape[2]
    k, v = k.repeat_interleave(H // Hk, dim=2), v.repeat_interleave(H // Hk, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * (d ** -0.5 if scale is None else scale)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i, j = torch.arange(Sq)[:, None], torch.arange(Sk)[None, :]
    if slopes is not None:
        sl = slopes.double().expand(B, H)
        s = s - sl[:, :, None, None] * (i + Sk - Sq - j).abs()
    left, right = window
    if causal:
        right = 0
    ok = torch.ones(Sq, Sk, dtype=torch.bool)
    if left >= 0:
        ok &= j >= i + Sk - Sq - left
    if right >= 0:
        ok &= j <= i + Sk - Sq + right
    s = s.masked_fill(~ok, float("-inf"))
    P = torch.softmax(s, dim=-1).nan_to_num(0.0)        # a row without a key: 0 (flash-attn's convention)
    if keep is not None:
        P = P * keep / (1.0 - p)
    return torch.einsum("bhqk,bkhd->bqhd", P, v)


def _inputs(seed, B, Sq, Sk, H, Hk, d, dtype=torch.float32, grad=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Sq, H, d, generator=g).to(dtype)
    k = torch.randn(B, Sk, Hk, d, generator=g).to(dtype)
    v = torch.randn(B, Sk, Hk, d, generator=g).to(dtype)
    return [t.requires_grad_(grad) for t in (q, k, v)]


def _close(actual, expected, what, tol=TOL):
    actual, expected = actual.detach().double(), expected.detach().double()
    assert actual.shape == expected.shape, what
    assert torch.isfinite(actual).all(), f"{what}: NaN or inf (an element not written?)"
    err = (actual - expected).abs().max().item()
    assert torch.allclose(actual, expected, atol=tol, rtol=tol), f"{what}: max abs error {err:.2e}"


def _check_grads(out, inputs, ref_fn, what, tol=TOL):
    """``out`` against ``ref_fn(*float64 copies)``, and the gradients of ``<out, do>`` against float64 autograd."""
    ref_inputs = [t.detach().double().requires_grad_() for t in inputs]
    expected = ref_fn(*ref_inputs)
    _close(out, expected, f"{what}: out", tol)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.dtype)
    out.backward(do)
    expected.backward(do.double())
    for name, t, r in zip("qkv", inputs, ref_inputs):
        _close(t.grad, r.grad, f"{what}: d{name}", tol)


# --------------------------------------------------------------------------- flash_attn_func

CASES = [   # (B, Sq, Sk, H, Hk, d, options): flash-attn's seqlen pairs / 8, GQA and MQA, odd d
    (2, 14, 25, 2, 2, 8, dict(causal=True)),                          # (113, 203)
    (1, 16, 27, 4, 2, 7, dict()),                                     # (128, 217), odd d
    (2, 32, 16, 2, 1, 8, dict(causal=True)),                          # (512, 256): 16 rows see no key
    (1, 1, 18, 4, 1, 16, dict(causal=True)),                          # (1, 147): one query, MQA
    (1, 13, 32, 2, 2, 9, dict(window_size=(5, 3))),                   # (108, 256), a window both sides
    (1, 16, 15, 2, 1, 8, dict(window_size=(4, 0))),                   # (1024, 1023): a causal window
    (1, 15, 16, 2, 2, 8, dict(window_size=(-1, 2))),                  # (1023, 1024): right side only
    (2, 14, 25, 2, 1, 8, dict(softcap=1.5, causal=True)),
    (1, 14, 25, 4, 2, 16, dict(alibi=(4,))),                          # slopes (heads,)
    (2, 13, 19, 2, 1, 7, dict(alibi=(2, 2), softcap=2.0, window_size=(6, -1), causal=True,
                              softmax_scale=0.3)),                    # slopes (batch, heads), everything
]


@pytest.mark.parametrize("B,Sq,Sk,H,Hk,d,opts", CASES)
def test_func_matches_reference(B, Sq, Sk, H, Hk, d, opts):
    q, k, v = _inputs(B * 100 + Sq, B, Sq, Sk, H, Hk, d)
    opts = dict(opts)
    slopes = None
    if "alibi" in opts:
        slopes = torch.rand(opts.pop("alibi"), generator=torch.Generator().manual_seed(3)) * 0.5
        opts["alibi_slopes"] = slopes
    out = flash_attn_func(q, k, v, **opts, **SMALL)
    assert out.shape == (B, Sq, H, d) and out.dtype == q.dtype and out.is_contiguous()

    def ref(q, k, v):
        return _ref(q, k, v, causal=opts.get("causal", False), window=opts.get("window_size", (-1, -1)),
                    softcap=opts.get("softcap", 0.0), slopes=slopes, scale=opts.get("softmax_scale"))

    _check_grads(out, (q, k, v), ref, f"{opts}")
    if opts.get("causal") and Sq > Sk:             # rows that see no key: exactly 0, as flash-attn's
        assert (out[:, :Sq - Sk] == 0).all()


def test_func_dropout_matches_reference_with_flashnb_mask():
    """Dropout's mask is flashnb's Philox mask, its seed drawn from torch's generator: replayed here."""
    B, Sq, Sk, H, Hk, d, p = 1, 14, 25, 2, 1, 8, 0.25
    q, k, v = _inputs(5, B, Sq, Sk, H, Hk, d)
    torch.manual_seed(11)
    seed = _draw_seed()
    keep = torch.from_numpy(dropout_keep_np(seed, p, B * H, Sq, Sk)).reshape(B, H, Sq, Sk)
    torch.manual_seed(11)
    out = flash_attn_func(q, k, v, dropout_p=p, causal=True, **SMALL)
    _check_grads(out, (q, k, v), lambda q, k, v: _ref(q, k, v, causal=True, keep=keep, p=p), "dropout")


def test_func_half_precision():
    """float16 / bfloat16 tensors (flash-attn's own dtypes) stay in their dtype; error against float64 of order
    the dtype's rounding (2^-11 / 2^-8 relative) of O(1) values."""
    for dtype, tol in ((torch.float16, 4e-3), (torch.bfloat16, 3e-2)):
        q, k, v = _inputs(9, 1, 14, 25, 2, 1, 8, dtype=dtype, grad=False)
        out = flash_attn_func(q, k, v, causal=True, softcap=2.0, **SMALL)
        assert out.dtype == dtype
        _close(out, _ref(q, k, v, causal=True, softcap=2.0), f"{dtype}", tol)


def test_deterministic_on_the_simulator_bitwise():
    """The simulator applies dQ's atomics in a fixed order: deterministic=True is allowed there, and two
    backwards give the same bits."""
    grads = []
    for _ in range(2):
        q, k, v = _inputs(2, 1, 14, 25, 2, 1, 8)
        flash_attn_func(q, k, v, causal=True, deterministic=True, **SMALL).sum().backward()
        grads.append([t.grad.clone() for t in (q, k, v)])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_deterministic_refused_on_a_gpu(monkeypatch):
    q, k, v = _inputs(2, 1, 4, 4, 1, 1, 8)
    monkeypatch.setattr(runtime, "MODE", "gpu")
    with pytest.raises(ValueError, match="deterministic=True: .*atomics"):
        flash_attn_func(q, k, v, deterministic=True)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(sinks=torch.zeros(2)), ValueError, "sinks: .*not supported yet"),
    (dict(return_attn_probs=True), ValueError, "return_attn_probs=True is not supported"),
    (dict(window_size=(-2, 0)), ValueError, "window_size must be"),
    (dict(window_size=3), TypeError, "window_size must be a pair"),
    (dict(softcap=-1.0), ValueError, "softcap must be"),
    (dict(alibi_slopes=torch.zeros(2, dtype=torch.float64)), TypeError, "alibi_slopes must be float32"),
    (dict(alibi_slopes=torch.zeros(3)), ValueError, r"alibi_slopes must have shape \(heads,\) = \(2,\)"),
])
def test_func_bad_options(kwargs, exc, match):
    q, k, v = _inputs(1, 1, 4, 4, 2, 1, 8)
    with pytest.raises(exc, match=match):
        flash_attn_func(q, k, v, **kwargs)


def test_func_bad_tensors():
    q, k, v = _inputs(1, 1, 4, 5, 4, 2, 8)
    with pytest.raises(ValueError, match="v: a value head dim different"):
        flash_attn_func(q, k, v[..., :4])
    with pytest.raises(ValueError, match=r"heads in q \(4\) must be a multiple of k's and v's \(3\)"):
        flash_attn_func(q, torch.randn(1, 5, 3, 8), torch.randn(1, 5, 3, 8))
    with pytest.raises(ValueError, match=r"q must have shape \(batch, seqlen, heads, d\)"):
        flash_attn_func(q[0], k, v)
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        flash_attn_func(q, np.zeros((1, 5, 2, 8)), v)
    with pytest.raises(ValueError, match="one batch size"):
        flash_attn_func(q.expand(2, -1, -1, -1), k, v)


# --------------------------------------------------------------------------- flash_attn_varlen_func

def _packed(seed, lens_q, lens_k, H, Hk, d):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), H, d, generator=g).requires_grad_()
    k = torch.randn(sum(lens_k), Hk, d, generator=g).requires_grad_()
    v = torch.randn(sum(lens_k), Hk, d, generator=g).requires_grad_()
    cu = [torch.tensor(np.concatenate([[0], np.cumsum(n)]), dtype=torch.int32) for n in (lens_q, lens_k)]
    return q, k, v, cu[0], cu[1]


VARLEN = [   # per-sequence (Sq, Sk): flash-attn's pairs / 8 packed together, a 1-token one, an empty one
    ([14, 1, 16, 9], [25, 18, 16, 9], dict(causal=True)),
    ([13, 32, 1], [32, 16, 1], dict(causal=True, window_size=(4, 1), softcap=1.5)),
    ([7, 0, 15], [11, 5, 16], dict(alibi=True, window_size=(-1, 3))),
]


@pytest.mark.parametrize("lens_q,lens_k,opts", VARLEN)
def test_varlen_matches_reference_per_sequence(lens_q, lens_k, opts):
    H, Hk, d = 4, 2, 8
    q, k, v, cu_q, cu_k = _packed(sum(lens_q), lens_q, lens_k, H, Hk, d)
    opts = dict(opts)
    slopes = None
    if opts.pop("alibi", False):
        slopes = torch.rand(len(lens_q), H, generator=torch.Generator().manual_seed(4)) * 0.5
        opts["alibi_slopes"] = slopes
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), **opts, **SMALL)
    assert out.shape == q.shape

    def ref(q, k, v):
        outs = []
        for b in range(len(lens_q)):
            qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            outs.append(_ref(q[None, qs], k[None, ks], v[None, ks], causal=opts.get("causal", False),
                             window=opts.get("window_size", (-1, -1)), softcap=opts.get("softcap", 0.0),
                             slopes=None if slopes is None else slopes[b])[0])
        return torch.cat(outs)

    _check_grads(out, (q, k, v), ref, f"varlen {lens_q} {lens_k} {opts}")


def test_varlen_traffic_is_the_real_tokens():
    """One launch per sequence: the counted HBM bytes of the packed call (forward and backward) equal the sum of
    each sequence run alone, and are less than the padded batch's (batch · max_seqlen)."""
    from flashnb.instruments import traffic

    lens = [5, 16, 3]
    H, d = 2, 8
    q, k, v, cu_q, cu_k = _packed(1, lens, lens, H, H, d)

    def counted(fn):
        with traffic.count() as t:
            fn()
        return t.global_read_bytes + t.global_write_bytes + 4 * t.atomics

    packed = counted(lambda: flash_attn_varlen_func(q, k, v, cu_q, cu_k, 16, 16, causal=True, **SMALL).sum()
                     .backward())
    alone = 0
    for b in range(len(lens)):
        s = slice(cu_q[b], cu_q[b + 1])
        qb, kb, vb = (t.detach()[None, s].requires_grad_() for t in (q, k, v))
        alone += counted(lambda: flash_attn_func(qb, kb, vb, causal=True, **SMALL).sum().backward())
    assert packed == alone
    padded = [torch.zeros(len(lens), 16, H, d, requires_grad=True) for _ in range(3)]
    assert packed < counted(lambda: flash_attn_func(*padded, causal=True, **SMALL).sum().backward())


def _cu(values):
    return torch.tensor(values, dtype=torch.int32)


@pytest.mark.parametrize("change,exc,match", [
    (dict(cu_seqlens_q=_cu([0, 3, 5]).long()), TypeError, "cu_seqlens_q must have dtype torch.int32"),
    (dict(cu_seqlens_k=_cu([[0, 3, 5]])), ValueError, "cu_seqlens_k must be 1-D"),
    (dict(cu_seqlens_q=_cu([0, 4, 3, 5])), ValueError, "cu_seqlens_q must be non-decreasing"),
    (dict(cu_seqlens_q=_cu([1, 3, 5])), ValueError, "cu_seqlens_q must start at 0"),
    (dict(cu_seqlens_k=_cu([0, 3, 4])), ValueError, r"cu_seqlens_k must end at .* k.shape\[0\] = 5"),
    (dict(cu_seqlens_k=_cu([0, 5])), ValueError, "one length"),
    (dict(max_seqlen_q=2), ValueError, "max_seqlen_q = 2 is smaller than sequence 0's length 3"),
    (dict(max_seqlen_k=3.0), TypeError, "max_seqlen_k must be an int"),
    (dict(block_table=_cu([[0]])), ValueError, "block_table: a paged K/V cache is not supported"),
    (dict(sinks=torch.zeros(2)), ValueError, "sinks"),
])
def test_varlen_bad_input(change, exc, match):
    q, k, v, cu_q, cu_k = _packed(0, [3, 2], [3, 2], 2, 2, 8)
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=3, max_seqlen_k=3)
    args.update(change)
    with pytest.raises(exc, match=match):
        flash_attn_varlen_func(**args)


# --------------------------------------------------------------------------- flash_attn_with_kvcache

def _cache(seed, B, S, Hk, d):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, S, Hk, d, generator=g), torch.randn(B, S, Hk, d, generator=g)


@pytest.mark.parametrize("Sq,H,Hk,d,paged,opts", [
    (1, 4, 2, 8, False, dict(causal=True)),                   # decoding one token: flash-decoding
    (2, 4, 1, 7, True, dict(causal=True)),                    # two tokens, MQA, odd d, a paged cache
    (3, 2, 2, 8, True, dict(causal=True, softcap=1.5, window_size=(5, -1), alibi=True)),   # the product kernel
])
def test_kvcache_appends_in_place_and_matches_reference(Sq, H, Hk, d, paged, opts):
    B, S, page = 3, 24, 8
    lengths = [5, 0, 17]                  # keys cached before the call; Sq new ones are appended
    k_cache, v_cache = _cache(1, B, S, Hk, d)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(B, Sq, H, d, generator=g)
    k_new, v_new = torch.randn(B, Sq, Hk, d, generator=g), torch.randn(B, Sq, Hk, d, generator=g)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for b, n in enumerate(lengths):
        expected_k[b, n:n + Sq], expected_v[b, n:n + Sq] = k_new[b], v_new[b]
    opts = dict(opts)
    slopes = torch.rand(H, generator=g) * 0.5 if opts.pop("alibi", False) else None
    call = dict(k=k_new, v=v_new, cache_seqlens=torch.tensor(lengths, dtype=torch.int32), alibi_slopes=slopes,
                **opts)
    if paged:                              # the same cache cut into pages, scattered in a pool
        perm = torch.randperm(B * S // page, generator=g)
        pool_k = torch.zeros(B * S // page + 2, page, Hk, d)
        pool_v = torch.zeros_like(pool_k)
        pool_k[perm], pool_v[perm] = (c.reshape(-1, page, Hk, d) for c in (k_cache, v_cache))
        table = perm.reshape(B, S // page).to(torch.int32)
        out = flash_attn_with_kvcache(q, pool_k, pool_v, block_table=table, **call)
        got_k, got_v = (p[table.long()].reshape(B, S, Hk, d) for p in (pool_k, pool_v))
    else:
        out = flash_attn_with_kvcache(q, k_cache, v_cache, **call)
        got_k, got_v = k_cache, v_cache
    assert torch.equal(got_k, expected_k) and torch.equal(got_v, expected_v)     # appended in place
    assert out.shape == q.shape and torch.isfinite(out).all()
    for b, n in enumerate(lengths):
        r = _ref(q[b:b + 1], expected_k[b:b + 1, :n + Sq], expected_v[b:b + 1, :n + Sq],
                 causal=opts.get("causal", False), window=opts.get("window_size", (-1, -1)),
                 softcap=opts.get("softcap", 0.0), slopes=slopes)
        _close(out[b:b + 1], r, f"kvcache sequence {b}")


def test_kvcache_picks_flash_decoding_and_num_splits():
    from flashnb.instruments import traffic

    k_cache, v_cache = _cache(3, 2, 40, 2, 8)
    q = torch.randn(2, 1, 4, 8)
    with traffic.count() as t:
        out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=33, num_splits=3, warps=1)
    labels = [lt.label for lt in t.launches]
    assert labels == ["split-KV partials", "merge splits"] * 2, labels        # flash-decoding, per sequence
    assert t.launches[0].writes["L_part"] == 4 * 3                            # 4 heads × num_splits = 3
    _close(out, _ref(q, k_cache[:, :33], v_cache[:, :33]), "flash-decoding")


@pytest.mark.parametrize("change,exc,match", [
    (dict(cache_seqlens=torch.tensor([20, 23], dtype=torch.int32)), ValueError,
     r"cache_seqlens\[1\] = 23: with 2 new keys .*capacity of 24"),
    (dict(cache_seqlens=torch.tensor([1, 2])), TypeError, "cache_seqlens must have dtype torch.int32"),
    (dict(cache_seqlens=None), ValueError, "cache_seqlens must be given with new k, v"),
    (dict(block_table=torch.tensor([[0, 1, 2], [3, 4, 9]], dtype=torch.int32),
          cache_seqlens=torch.tensor([3, 17], dtype=torch.int32)), ValueError,
     r"block_table\[1, 2\] = 9 is outside the cache's 6 pages"),        # 19 positions: 3 pages used
    (dict(block_table=torch.tensor([[0, 1, 2]], dtype=torch.int32)), ValueError,
     r"block_table must have shape \(batch, max_blocks\) with batch = q.shape\[0\] = 2"),
    (dict(k=torch.zeros(2, 2, 2, 8, dtype=torch.float64)), TypeError, "k, v must have the cache's dtype"),
    (dict(k=torch.zeros(2, 2, 1, 8)), ValueError, r"k, v must have shape \(batch, seqlen_new, heads_k, d\)"),
    (dict(v=None), ValueError, "pass both new keys and values"),
    (dict(q=torch.zeros(2, 2, 4, 8, dtype=torch.float16)), TypeError, "q, k_cache, v_cache must have one dtype"),
    (dict(rotary_cos=torch.zeros(4, 4)), ValueError, "rotary_cos, rotary_sin: rotary embeddings"),
    (dict(return_softmax_lse=True), ValueError, "return_softmax_lse=True is not supported"),
    (dict(sinks=torch.zeros(4)), ValueError, "sinks"),
    (dict(cache_batch_idx=torch.tensor([0, 5], dtype=torch.int32)), ValueError, "cache_batch_idx must be"),
])
def test_kvcache_bad_input_writes_nothing(change, exc, match):
    k_cache, v_cache = _cache(4, 2, 24, 2, 8)
    before = k_cache.clone(), v_cache.clone()
    args = dict(q=torch.zeros(2, 2, 4, 8), k_cache=k_cache, v_cache=v_cache, k=torch.ones(2, 2, 2, 8),
                v=torch.ones(2, 2, 2, 8), cache_seqlens=torch.tensor([3, 4], dtype=torch.int32))
    if "block_table" in change:            # the same storage seen as 6 pages of 8
        args.update(k_cache=k_cache.view(6, 8, 2, 8), v_cache=v_cache.view(6, 8, 2, 8))
    args.update(change)
    with pytest.raises(exc, match=match):
        flash_attn_with_kvcache(**args)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


def test_kvcache_batch_idx_and_leftpad():
    """cache_batch_idx picks each sequence's cache row; cache_leftpad its first valid key (the new keys still go
    to cache_seqlens, counted from position 0)."""
    k_cache, v_cache = _cache(6, 3, 16, 1, 8)
    g = torch.Generator().manual_seed(8)
    q, k_new, v_new = torch.randn(2, 1, 2, 8, generator=g), torch.randn(2, 1, 1, 8, generator=g), \
        torch.randn(2, 1, 1, 8, generator=g)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    rows, lengths, pads = [2, 0], [9, 4], [3, 0]
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new,
                                  cache_seqlens=torch.tensor(lengths, dtype=torch.int32),
                                  cache_batch_idx=torch.tensor(rows, dtype=torch.int32),
                                  cache_leftpad=torch.tensor(pads, dtype=torch.int32), causal=True)
    for b, (r, n, p) in enumerate(zip(rows, lengths, pads)):
        before_k[r, n], before_v[r, n] = k_new[b, 0], v_new[b, 0]
        _close(out[b:b + 1], _ref(q[b:b + 1], before_k[r:r + 1, p:n + 1], before_v[r:r + 1, p:n + 1], causal=True),
               f"sequence {b}")
    assert torch.equal(k_cache, before_k) and torch.equal(v_cache, before_v)   # row 1 untouched


def test_the_cuda_tensor_path_rehearsed():
    """The path CUDA tensors take (zero-copy views, launches on a stream), rehearsed on the simulator with CPU
    tensors: the three functions give the NumPy path's results."""
    import flashnb.pytorch as ft
    from flashnb.instruments.rehearsal import pretend_gpu

    q, k, v = _inputs(12, 1, 9, 17, 2, 1, 8)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 8, 17], dtype=torch.int32)
    k_cache, v_cache = _cache(13, 1, 24, 1, 8)

    def run():
        o = flash_attn_func(q, k, v, causal=True, softcap=2.0, **SMALL)
        o.sum().backward()
        o2 = flash_attn_varlen_func(q[0], k[0], v[0], cu, cu_k, 5, 9, window_size=(3, 3), **SMALL)
        o3 = flash_attn_with_kvcache(q[:, :1].detach(), k_cache.clone(), v_cache.clone(), cache_seqlens=20)
        grads = [t.grad.clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        return [o, o2, o3, *grads]

    expected = run()
    with pretend_gpu(), ft.rehearse_cuda() as bridge:
        got = run()
    assert bridge.streams                                   # the device path ran
    for a, b in zip(got, expected):
        _close(a, b, "rehearsed", tol=1e-6)
