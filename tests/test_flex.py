"""Attention modifiers (flashnb.flex, issue #16) on the FA2 kernels: the gallery forward (and backward for some)
against the float64 reference with the same modifier in NumPy, a user's modifier the project has never seen,
Nq != Nk, grouped-/multi-query attention, counted traffic against the model at two mask densities, and the
errors for modifiers a GPU would refuse.  Small shapes, few distinct kernels: every configuration runs on the
simulator (one compile check per modifier, batched in one child process)."""

import numpy as np
import pytest
from conftest import FEATURE_IMPLS, MODULE_OF, assert_close, qkv
from numba import float32

import flashnb
from flashnb import flex, reference
from flashnb.flex import ModifierError
from flashnb.instruments import traffic

# As in test_fa2 / test_block_sparse: float32 sums of at most max(Nk, d) <= 64 O(1) products (~1e-5 relative in
# the worst case); a modifier adds one float32 rounding per score (|score| <= ~10 here: ~1e-6).  The backward chains
# four such products and sums dQ by atomics in any order.  A wrong modifier, mask or derivative changes outputs by
# O(0.01 - 1).
FWD = dict(atol=2e-5, rtol=2e-5)
BWD = dict(atol=1e-4, rtol=1e-4)
TILES = dict(Br=16, Bc=16, warps=1)   # small tiles: several tiles per row, some empty, some partial


def rel_bias(score, b, h, q_idx, kv_idx):
    """A modifier written as a user would: relative-position bias, different per head."""
    return score + float32(0.1) * float32(kv_idx - q_idx) - float32(h) * float32(0.05)


def rel_bias_grad(score, b, h, q_idx, kv_idx):
    return float32(1)


def band_mask(b, h, q_idx, kv_idx):
    """A user's mask with Python `and` (NumPy cannot broadcast it: the host evaluates it element by element)."""
    return kv_idx <= q_idx + 3 and q_idx - kv_idx < 20


TABLE = np.zeros((2, 32), dtype=np.float32)   # a module-level bias table a score_mod reads (a captured global)


def table_bias(score, b, h, q_idx, kv_idx):
    return score + TABLE[h, kv_idx]


def table_bias_grad(score, b, h, q_idx, kv_idx):
    return float32(1)


table_bias.grad = table_bias_grad
def head_window(b, h, q_idx, kv_idx):
    """Head 0 causal, head 1 also sees the 16 keys after it: a mask that differs between heads."""
    return kv_idx <= q_idx + 16 * h


def batch_prefix(b, h, q_idx, kv_idx):
    """Batch b sees the first 16·(b + 1) keys: a mask that differs between batches."""
    return kv_idx < 16 * (b + 1)


KEEP = np.ones(32, dtype=np.int32)            # a key-padding mask a mask_mod reads (1 = a real key)


def key_padding(b, h, q_idx, kv_idx):
    return KEEP[kv_idx] != 0


DOCS = np.repeat(np.arange(4), [10, 17, 5, 16])             # 48 positions, 4 packed documents
GALLERY = {                                               # name: (score_mod, mask_mod, Nq, Nk)
    "causal": (None, flex.causal(offset=16), 32, 48),     # bottom-right aligned for Nq != Nk
    "window+alibi": (flex.alibi(2), flex.sliding_window(12), 48, 48),
    "softcap": (flex.softcap(2.0), None, 40, 40),
    "document": (None, flex.document(DOCS), 48, 48),
    "prefix_lm": (None, flex.prefix_lm(20), 48, 48),
}


@pytest.fixture(scope="module", autouse=True)
def checked():
    """Every modifier of this module compiled for a GPU once, in one batch (~3 s), before any test launches."""
    pairs = [(rel_bias, "score_mod"), (rel_bias_grad, "score_mod_grad"), (band_mask, "mask_mod"),
             (table_bias, "score_mod"), (table_bias_grad, "score_mod_grad"), (key_padding, "mask_mod"),
             (head_window, "mask_mod"), (batch_prefix, "mask_mod"),
             (flex.document(DOCS, causal=True), "mask_mod")]
    for sm, mm, _, _ in GALLERY.values():
        pairs += [(sm, "score_mod"), (sm.grad, "score_mod_grad")] if sm is not None else []
        pairs += [(mm, "mask_mod")] if mm is not None else []
    flex.check_many(pairs + [(f, role) for f, role in BAD], strict=False)


def _reference(q, k, v, do, score_mod, mask_mod, grad=None, causal=False):
    B, H, Nq = q.shape[0], q.shape[1], q.shape[2]
    Nk = k.shape[2]
    mask = None if mask_mod is None else flex.mask_array(mask_mod, B, H, Nq, Nk)
    sm = None if score_mod is None else flex.numpy_modifier(score_mod)
    g = None if score_mod is None else flex.numpy_modifier(grad or score_mod.grad)
    fwd = reference.attention_forward(q, k, v, mask=mask, score_mod=sm, causal=causal)
    bwd = None if do is None else reference.attention_backward(q, k, v, do, mask=mask, score_mod=sm,
                                                               score_mod_grad=g, causal=causal)
    return fwd, bwd


@pytest.mark.parametrize("name", list(GALLERY))
@pytest.mark.parametrize("impl", FEATURE_IMPLS)
def test_gallery_forward(rng, name, impl):
    score_mod, mask_mod, Nq, Nk = GALLERY[name]
    q, k, v = qkv(rng, (1, 2, Nq, 16), Nk)
    o, lse = flashnb.attention_forward(q, k, v, impl=impl, score_mod=score_mod, mask_mod=mask_mod, **TILES)
    (o_ref, lse_ref), _ = _reference(q, k, v, None, score_mod, mask_mod)
    assert_close(o, o_ref, **FWD, what="o")
    assert_close(lse, lse_ref, **FWD, what="lse")


@pytest.mark.parametrize("score_mod, mask_mod, causal", [
    (flex.alibi(2), None, True),                                    # ALiBi with the kernel's own causal mask
    (flex.softcap(2.0), flex.document(DOCS, causal=True), False),   # soft-capping, causal document mask
], ids=["causal+alibi", "softcap+document"])
@pytest.mark.parametrize("impl", FEATURE_IMPLS)
def test_gallery_backward(rng, score_mod, mask_mod, causal, impl):
    q, k, v, do = qkv(rng, (1, 2, 48, 16), 48, do=True)
    o, lse = flashnb.attention_forward(q, k, v, impl=impl, causal=causal, score_mod=score_mod, mask_mod=mask_mod,
                                       **TILES)
    grads = flashnb.attention_backward(q, k, v, o, lse, do, impl=impl, causal=causal, score_mod=score_mod,
                                       mask_mod=mask_mod, **TILES)
    _, ref = _reference(q, k, v, do, score_mod, mask_mod, causal=causal)
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, ref):
        assert_close(g, g_ref, **BWD, what=name)


@pytest.mark.parametrize("impl", FEATURE_IMPLS)
def test_user_modifier_never_seen_nq_ne_nk(rng, impl):
    """A relative-position bias and a band mask the gallery does not have, Nq != Nk, two batches; the
    derivative passed as score_mod_grad; the block mask built from mask_mod by the launcher."""
    q, k, v, do = qkv(rng, (2, 1, 24, 8), 40, do=True)
    opts = dict(score_mod=rel_bias, mask_mod=band_mask, **TILES)
    o, lse = flashnb.attention_forward(q, k, v, impl=impl, **opts)
    grads = flashnb.attention_backward(q, k, v, o, lse, do, impl=impl, score_mod_grad=rel_bias_grad, **opts)
    (o_ref, lse_ref), ref = _reference(q, k, v, do, rel_bias, band_mask, grad=rel_bias_grad)
    assert_close(o, o_ref, **FWD, what="o")
    assert_close(lse, lse_ref, **FWD, what="lse")
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, ref):
        assert_close(g, g_ref, **BWD, what=name)


@pytest.mark.parametrize("impl", FEATURE_IMPLS)
def test_block_mask_states_and_reuse(rng, impl):
    """create_block_mask: empty / full / partial tiles as mask_mod says; passed as block_mask= it carries mask_mod."""
    bm = flex.create_block_mask(flex.sliding_window(16), 1, 1, 64, 64, Br=16, Bc=16)
    st = bm.states[0, 0]
    assert st.tolist() == [[2, 0, 0, 0], [2, 2, 0, 0], [0, 2, 2, 0], [0, 0, 2, 2]]
    full = flex.create_block_mask(flex.causal(), 1, 1, 64, 64, Br=16, Bc=16).states[0, 0]
    assert full.tolist() == [[2, 0, 0, 0], [1, 2, 0, 0], [1, 1, 2, 0], [1, 1, 1, 2]]
    # at finer tiles a block mask is recomputed from its mask_mod (the backward's tiles may be smaller)
    assert bm.at_tiles(8, 8, 64, 64, 1)[0].tolist()[1][:3] == [1, 2, 0]
    with pytest.raises(ValueError, match="block_mask was not made from mask_mod"):
        q, k, v = qkv(rng, (1, 64, 8), 64)
        flashnb.attention(q, k, v, impl=impl, mask_mod=GALLERY["prefix_lm"][1], block_mask=bm, **TILES)


@pytest.mark.parametrize("impl", FEATURE_IMPLS)
def test_gqa_and_mqa(rng, impl):
    """K/V with fewer heads than Q: forward and backward (dK, dV summed over each group) against the reference
    with K/V repeated; the backward reads K, V once per K/V head (counted), the forward once per query head."""
    q, k, v, do = qkv(rng, (1, 4, 16, 8), 24, do=True)
    for Hkv in (2, 1):                                         # grouped-query, multi-query
        kk, vv = k[:, :Hkv], v[:, :Hkv]
        o, lse = flashnb.attention_forward(q, kk, vv, impl=impl, causal=True, **TILES)
        with traffic.count() as t:
            grads = flashnb.attention_backward(q, kk, vv, o, lse, do, impl=impl, causal=True, **TILES)
        o_ref, lse_ref = reference.attention_forward(q, kk, vv, causal=True)
        assert_close(o, o_ref, **FWD, what=f"o (H_kv={Hkv})")
        for name, g, g_ref in zip(("dq", "dk", "dv"), grads, reference.attention_backward(q, kk, vv, do, causal=True)):
            assert_close(g, g_ref, **BWD, what=f"{name} (H_kv={Hkv})")
        assert grads[1].shape == kk.shape
        model = MODULE_OF[impl].model_backward(4, 16, 24, 8, causal=True, group=4 // Hkv, **TILES)
        assert t.summary() == model
        dense = MODULE_OF[impl].model_backward(4, 16, 24, 8, causal=True, **TILES)[1]
        assert model[1]["reads"]["K"] * (4 // Hkv) == dense["reads"]["K"] == 4 * 24 * 8
    with pytest.raises(ValueError, match=r"q's heads \(4.*k's and v's heads \(3"):
        flashnb.attention(q, k[:, :3], v[:, :3], impl=impl)
    with pytest.raises(ValueError, match="impl 'fa1' does not support grouped-query"):
        flashnb.attention(q, k[:, :2], v[:, :2], impl="fa1")


@pytest.mark.parametrize("impl", FEATURE_IMPLS)
@pytest.mark.parametrize("window", [8, 40])
def test_traffic_equals_model_and_falls_with_density(rng, window, impl):
    """Counted traffic == the model, forward and backward, at two densities of a sliding window."""
    mm = flex.sliding_window(window)
    q, k, v, do = qkv(rng, (1, 1, 64, 8), 64, do=True)
    with traffic.count() as t:
        o, lse = flashnb.attention_forward(q, k, v, impl=impl, mask_mod=mm, **TILES)
        flashnb.attention_backward(q, k, v, o, lse, do, impl=impl, mask_mod=mm, check_forward=False, **TILES)
    bm = flex.create_block_mask(mm, 1, 1, 64, 64, Br=16, Bc=16)
    mod = MODULE_OF[impl]
    model = (mod.model_forward(1, 64, 64, 8, block_mask=bm, **TILES)
             + mod.model_backward(1, 64, 64, 8, block_mask=bm, **TILES))
    assert t.summary() == model
    dense = mod.model_forward(1, 64, 64, 8, **TILES)[0]["reads"]["K"]
    assert model[0]["reads"]["K"] == round(bm.density * dense)       # K/V traffic ∝ density of the block mask
    assert bm.density == {8: 7 / 16, 40: 10 / 16}[window]


# --------------------------------------------------------------------------- modifiers a GPU would refuse


def float_literal(score, b, h, q_idx, kv_idx):
    return score * 0.5                      # a Python float: float64 on a GPU


def unsupported_call(score, b, h, q_idx, kv_idx):
    return np.linalg.norm(score)            # no NumPy functions in a kernel


def int_mask(b, h, q_idx, kv_idx):
    return q_idx - kv_idx                   # an int, not a boolean


BAD = [(float_literal, "score_mod"), (unsupported_call, "score_mod"), (int_mask, "mask_mod")]


@pytest.mark.parametrize("fn, kind, match", [
    (float_literal, "score_mod", r"score_mod 'float_literal' computes in float64.*float32\(0\.5\)"),
    (unsupported_call, "score_mod", r"score_mod 'unsupported_call' does not compile for a GPU"),
    (int_mask, "mask_mod", r"mask_mod 'int_mask' returns int64; it must return a boolean"),
    (lambda b, h, q_idx: True, "mask_mod", r"mask_mod '<lambda>' takes \(b, h, q_idx\); it must take 4"),
], ids=["float-literal", "unsupported-call", "int-mask", "signature"])
@pytest.mark.parametrize("impl", FEATURE_IMPLS)
def test_bad_modifier_refused_before_launch(rng, fn, kind, match, impl):
    q, k, v = qkv(rng, (1, 16, 8), 16)
    with traffic.count() as t, pytest.raises(ModifierError, match=match):
        flashnb.attention(q, k, v, impl=impl, **{kind: fn})
    assert t.summary() == []                  # refused before any launch


@pytest.mark.parametrize("impl", FEATURE_IMPLS)
def test_bad_combinations(rng, impl):
    q, k, v, do = qkv(rng, (1, 16, 8), 16, do=True)
    with pytest.raises(TypeError, match="impl 'fa1' does not take attention modifiers"):
        flashnb.attention(q, k, v, impl="fa1", score_mod=rel_bias)
    o, lse = reference.attention_forward(q, k, v, score_mod=flex.numpy_modifier(halving_loop))
    with traffic.count() as t, pytest.raises(flex.NotDifferentiable, match=r"score_mod 'halving_loop' cannot be "
                                             r"differentiated automatically: a loop \(`while`\), at line \d+"):
        flashnb.attention_backward(q, k, v, o, lse, do, impl=impl, score_mod=halving_loop, check_forward=False)
    assert t.summary() == []                  # refused before any launch


def halving_loop(score, b, h, q_idx, kv_idx):
    """A modifier whose derivative flashnb does not derive (a loop): its backward needs score_mod_grad."""
    while score > float32(1):
        score = score * float32(0.5)
    return score


@pytest.mark.parametrize("impl", FEATURE_IMPLS)
def test_torch_passes_modifiers_and_gqa(rng, impl):
    """flashnb.pytorch.attention takes the same arguments: modifiers (b, h from q's (B, H) although it flattens q)
    and K/V with fewer heads; gradients against the reference."""
    torch = pytest.importorskip("torch")
    import flashnb.pytorch as ft

    q, k, v, do = qkv(rng, (2, 2, 24, 8), 24, do=True)
    k, v = k[:, :1], v[:, :1]                                   # multi-query: one K/V head per batch
    sm, mm = flex.alibi(2), flex.sliding_window(10)
    qt, kt, vt = (torch.tensor(a, dtype=torch.float32, requires_grad=True) for a in (q, k, v))
    o = ft.attention(qt, kt, vt, score_mod=sm, mask_mod=mm, impl=impl, **TILES)
    o.backward(torch.tensor(do, dtype=torch.float32))
    (o_ref, _), ref = _reference(q, k, v, do, sm, mm)
    assert_close(o.detach().numpy(), o_ref, **FWD, what="o")
    for name, t, g_ref in zip(("dq", "dk", "dv"), (qt, kt, vt), ref):
        assert_close(t.grad.numpy(), g_ref, **BWD, what=name)


# --------------------------------------------------------------------------- captured values that change, heads


def _doc_mask(ids):
    """The document mask computed here, independently of flex: (1, 1, N, N)."""
    return (ids[:, None] == ids[None, :])[None, None]


@pytest.mark.parametrize("impl", FEATURE_IMPLS)
def test_captured_array_changed_in_place_is_seen(rng, impl):
    """Before: the block mask of flex.document(ids) was cached on the function, so after ids changed in place the
    kernel skipped tiles of the old documents and the output was off by ~1 (silently).  Now each call takes the
    modifier with what it captures then: forward and backward follow the ids, and a block mask made before the
    change is refused by name."""
    ids = np.repeat(np.arange(2, dtype=np.int32), 16)           # two documents: the off-diagonal tiles are empty
    mm = flex.document(ids)
    q, k, v, do = qkv(rng, (1, 1, 32, 8), 32, do=True)
    bm = flex.create_block_mask(mm, 1, 1, 32, 32, Br=16, Bc=16)
    for new in (ids.copy(), np.zeros(32, np.int32)):            # then one document: every tile full
        ids[:] = new
        o, lse = flashnb.attention_forward(q, k, v, impl=impl, mask_mod=mm, **TILES)
        mask = _doc_mask(ids)
        assert_close(o, reference.attention_forward(q, k, v, mask=mask)[0], **FWD, what="o")
        grads = flashnb.attention_backward(q, k, v, o, lse, do, impl=impl, mask_mod=mm, **TILES)
        for name, g, g_ref in zip(("dq", "dk", "dv"), grads, reference.attention_backward(q, k, v, do, mask=mask)):
            assert_close(g, g_ref, **BWD, what=name)
    with pytest.raises(ValueError, match="block_mask was made by create_block_mask from mask_mod 'document_mask' "
                                         "when the arrays it captures held other values"):
        flashnb.attention(q, k, v, impl=impl, block_mask=bm, **TILES)


def test_snapshot_keeps_the_values_of_its_call():
    """What a GPU compiles is a snapshot's frozen copy: read-only copies of the captured arrays, unchanged when the
    original changes; snapshots are equal exactly when code and captured contents are (the kernels' cache key),
    whatever the function object."""
    ids = np.repeat(np.arange(2, dtype=np.int32), 8)
    mm = flex.document(ids)
    first = flex.snapshot(mm)
    assert first == flex.snapshot(flex.document(ids.copy())) and first.current()
    ids[:] = 0
    assert flex.snapshot(mm) != first and not first.current()
    frozen = [c.cell_contents for c in first.py_func.__closure__ if isinstance(c.cell_contents, np.ndarray)]
    assert frozen and all(a.tolist() == [0] * 8 + [1] * 8 and not a.flags.writeable for a in frozen)
    assert first.py_func.numpy(0, 0, np.arange(16)[:, None], np.arange(16)[None]).sum() == 2 * 64   # the twin too


@pytest.mark.parametrize("impl", FEATURE_IMPLS)
def test_captured_globals_changed_in_place_are_seen(rng, impl):
    """The variant: other captured arrays, read as globals rather than closure cells -- a key-padding mask_mod and a
    per-head bias table score_mod -- changed in place between calls (before: the padded keys' tile stayed "full"
    in the cached block mask and was attended to).  Forward and backward against the reference with each call's
    values."""
    q, k, v, do = qkv(rng, (1, 2, 24, 8), 32, do=True)
    for fill, padded in ((0.0, 32), (1.5, 13)):
        TABLE[:] = fill * rng.standard_normal(TABLE.shape)
        KEEP[:] = np.arange(32) < padded
        opts = dict(impl=impl, score_mod=table_bias, mask_mod=key_padding, **TILES)
        o, lse = flashnb.attention_forward(q, k, v, **opts)
        t64, keep = TABLE.astype(np.float64), np.broadcast_to(KEEP.astype(bool), (1, 2, 24, 32))
        sm = lambda s, b, h, i, j: s + t64[h, j]                              # noqa: E731
        one = lambda s, b, h, i, j: np.ones(np.broadcast_shapes(*map(np.shape, (s, b, h, i, j))))   # noqa: E731
        assert_close(o, reference.attention_forward(q, k, v, mask=keep, score_mod=sm)[0], **FWD, what=f"o ({padded})")
        grads = flashnb.attention_backward(q, k, v, o, lse, do, **opts)
        ref = reference.attention_backward(q, k, v, do, mask=keep, score_mod=sm, score_mod_grad=one)
        for name, g, g_ref in zip(("dq", "dk", "dv"), grads, ref):
            assert_close(g, g_ref, **BWD, what=f"{name} ({padded} keys)")


def test_torch_backward_uses_the_forwards_captured_values(rng):
    """flashnb.pytorch snapshots the modifiers at the forward: ids changed between forward and backward (before: the
    backward's mask_mod read the new ids) leave the gradients those of the forward's mask."""
    torch = pytest.importorskip("torch")
    import flashnb.pytorch as ft

    ids = np.repeat(np.arange(2, dtype=np.int32), [5, 11])
    q, k, v, do = qkv(rng, (1, 1, 16, 8), 16, do=True)
    qt, kt, vt = (torch.tensor(a, dtype=torch.float32, requires_grad=True) for a in (q, k, v))
    o = ft.attention(qt, kt, vt, mask_mod=flex.document(ids), **TILES)
    mask = _doc_mask(ids.copy())
    ids[:] = 0
    o.backward(torch.tensor(do, dtype=torch.float32))
    for name, t, g_ref in zip(("dq", "dk", "dv"), (qt, kt, vt), reference.attention_backward(q, k, v, do, mask=mask)):
        assert_close(t.grad.numpy(), g_ref, **BWD, what=name)


@pytest.mark.parametrize("impl", FEATURE_IMPLS)
def test_block_mask_for_one_head_is_refused_for_a_mask_that_differs_by_head(rng, impl):
    """Before: create_block_mask(mask_mod, B=None, H=None) evaluated a head-dependent mask_mod at h = 0 only, and
    head 1 got head 0's empty tiles (output error ~1.9, silently).  Now the launch checks mask_mod at its own
    (B, H) and names the argument; with H given the result is right.  Variants: B=None with a mask that differs
    by batch, a (B, H) that does not match the call's, and a mask the same for all heads (accepted)."""
    q, k, v = qkv(rng, (1, 2, 32, 8), 32)
    bm = flex.create_block_mask(head_window, None, None, 32, 32, Br=16, Bc=16)
    with pytest.raises(ValueError, match=r"with H=None .*mask_mod 'head_window' differs .*pass H=2 to create_block"):
        flashnb.attention(q, k, v, impl=impl, block_mask=bm, **TILES)
    o = flashnb.attention(q, k, v, impl=impl, block_mask=flex.create_block_mask(head_window, 1, 2, 32, 32, Br=16,
                                                                                  Bc=16), **TILES)
    assert_close(o, reference.attention(q, k, v, mask=flex.mask_array(head_window, 1, 2, 32, 32)), **FWD, what="o")
    qb, kb, vb = qkv(rng, (2, 1, 32, 8), 32)
    with pytest.raises(ValueError, match=r"with B=None .*pass B=2 to create_block_mask"):
        flashnb.attention(qb, kb, vb, impl=impl, block_mask=flex.create_block_mask(batch_prefix, None, 1, 32, 32,
                                                                                     Br=16, Bc=16), **TILES)
    with pytest.raises(ValueError, match=r"made by create_block_mask for \(B, H\) = \(2, 1\).*has \(B, H\) = \(1, 2\)"):
        flashnb.attention(q, k, v, impl=impl, block_mask=flex.create_block_mask(batch_prefix, 2, 1, 32, 32, Br=16,
                                                                                  Bc=16), **TILES)
    same = flex.create_block_mask(batch_prefix, None, None, 32, 32, Br=16, Bc=16)   # differs by b, not by h
    o = flashnb.attention(q, k, v, impl=impl, block_mask=same, **TILES)
    assert_close(o, reference.attention(q, k, v, mask=flex.mask_array(batch_prefix, 1, 2, 32, 32)), **FWD, what="o")


def _bias_of(table):
    def captured_bias(score, b, h, q_idx, kv_idx):
        return score + table[kv_idx]
    return captured_bias


def test_compile_check_is_cached_by_code_and_captured_types(rng, monkeypatch, tmp_path):
    """Before: every new modifier closure paid a compile check in a child process (~2.5 s), e.g. a new
    flex.document(ids) per training batch.  The check depends on the code and the captured values' types: new
    document ids launch with no check at all, a float32 table is checked once for any values, and a float64
    table -- another type, float64 arithmetic on a GPU -- is checked (and refused) on its own."""
    monkeypatch.setenv("FLASHNB_PTX_CACHE", str(tmp_path / "ptx"))   # no verdicts kept by an earlier run
    batches = []
    real = flex._compile_many
    monkeypatch.setattr(flex, "_compile_many", lambda items: batches.append(len(items)) or real(items))
    q, k, v = qkv(rng, (1, 1, 16, 8), 16)
    for n in (3, 5):                                           # two new packings (the fixture checked document's)
        o = flashnb.attention(q, k, v, impl="flash", mask_mod=flex.document(np.arange(16) // n), **TILES)
        assert_close(o, reference.attention(q, k, v, mask=_doc_mask(np.arange(16) // n)), **FWD, what="o")
    assert batches == []
    f32, f64 = _bias_of(np.zeros(16, np.float32)), _bias_of(np.zeros(16))
    flex.check_many([(f32, "score_mod"), (f64, "score_mod")], strict=False)
    assert batches == [2]
    flex.check_modifiers(score_mod=_bias_of(np.ones(16, np.float32)))
    with pytest.raises(ModifierError, match="captured_bias' computes in float64"):
        flex.check_modifiers(score_mod=_bias_of(np.ones(16)))
    assert batches == [2]


def _tilted(slope):
    def tilted(score, b, h, q_idx, kv_idx):
        return score + slope * float32(kv_idx - q_idx)
    return tilted


def _tilted_f64(score, b, h, q_idx, kv_idx):
    return score * 0.5                           # a Python float literal: float64 on a GPU


def test_compile_check_verdicts_outlive_the_process(monkeypatch, tmp_path, capfd):
    """Before: every process paid the GPU compile check of each modifier again (a child process, seconds each), and
    said nothing while it ran.  A check that compiles says so on stderr; its verdicts, fine or refused, are kept on
    disk, so a process that has forgotten them (an empty in-memory cache) gets them with no compile; a captured
    value it has not seen (another slope) is compiled, never served from another value's verdict."""
    monkeypatch.setenv("FLASHNB_PTX_CACHE", str(tmp_path / "ptx"))
    monkeypatch.delenv("FLASHNB_SIM_QUIET", raising=False)
    monkeypatch.setattr(flex, "_CHECKED", {})
    fine, refused = _tilted(float32(0.3)), _tilted_f64
    flex.check_many([(fine, "score_mod"), (refused, "score_mod")], strict=False)
    err = capfd.readouterr().err
    assert "checking that score_mod 'tilted', score_mod '_tilted_f64' compile for a GPU" in err, err
    assert len(list((tmp_path / "verdicts").glob("*.json"))) == 2

    def no_compile(items):
        raise AssertionError(f"compiled again: {items}")

    monkeypatch.setattr(flex, "_CHECKED", {})                 # as a new process starts
    monkeypatch.setattr(flex, "_compile_many", no_compile)
    flex.check_modifiers(score_mod=_tilted(float32(0.3)))
    with pytest.raises(ModifierError, match="'_tilted_f64' computes in float64"):
        flex.check_modifiers(score_mod=refused)
    assert "checking" not in capfd.readouterr().err
    with pytest.raises(AssertionError, match="compiled again"):
        flex.check_modifiers(score_mod=_tilted(float32(0.7)))


def test_kernel_cache_is_bounded():
    """Before: every distinct modifier kept its kernel for the life of the process.  Each factory keeps the
    KERNEL_CACHE_SIZE most recently used (and so do the frozen modifier copies and their device functions); an
    evicted kernel is freed."""
    import gc
    import weakref

    from flashnb import modifiers, registry
    from flashnb.kernels import flash, policies

    n = registry.KERNEL_CACHE_SIZE
    assert flash.make_forward.cache_info().maxsize == n
    first = None
    for i in range(n + 3):
        kernel = flash.make_forward(16, 16, 8, 1, False, sparse=True,
                                    mask_mod=flex.snapshot(flex.document(np.full(32, i))))
        first = first or weakref.ref(kernel)
    del kernel
    gc.collect()
    assert flash.make_forward.cache_info().currsize == n and first() is None
    assert len(modifiers._FROZEN) <= n and len(policies._DEVICE_FNS) <= n


def test_equal_modifiers_made_anew_for_every_call(rng):
    """Before: the second attention(..., mask_mod=flex.causal()) of a process was refused ("block_mask was not made
    from mask_mod"): each call of flex.causal() makes a new function, equal snapshots are shared, and the block mask
    the API built carried the first call's function.  A mask_mod with the same code and captured values is the
    same mask; one with other values (another window) still needs its own block mask."""
    q, k, v, do = qkv(rng, (1, 2, 40, 8), 40, do=True)
    want = reference.attention_forward(q, k, v, mask=flex.mask_array(flex.causal(), 1, 2, 40, 40))
    for _ in range(3):
        o, lse = flashnb.attention_forward(q, k, v, mask_mod=flex.causal(), score_mod=flex.alibi(2), **TILES)
        flashnb.attention_backward(q, k, v, o, lse, do, mask_mod=flex.causal(), score_mod=flex.alibi(2), **TILES)
        o, lse = flashnb.attention_forward(q, k, v, mask_mod=flex.causal(), **TILES)
        assert_close(o, want[0], **FWD, what="o")
    bm = flex.create_block_mask(flex.sliding_window(16), 1, 2, 40, 40, Br=16, Bc=16)
    with pytest.raises(ValueError, match="block_mask was not made from mask_mod"):
        flashnb.attention_forward(q, k, v, mask_mod=flex.sliding_window(8), block_mask=bm, **TILES)
