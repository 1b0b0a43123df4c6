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
from flashnb import flex, reference, traffic
from flashnb.flex import ModifierError

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
    no_grad = flex.softcap(3.0)
    del no_grad.grad
    o, lse = reference.attention_forward(q, k, v, score_mod=no_grad.numpy)
    with pytest.raises(ValueError, match="score_mod 'softcap_score' has no derivative"):
        flashnb.attention_backward(q, k, v, o, lse, do, impl=impl, score_mod=no_grad, check_forward=False)


@pytest.mark.parametrize("impl", FEATURE_IMPLS)
def test_torch_passes_modifiers_and_gqa(rng, impl):
    """flashnb.torch.attention takes the same arguments: modifiers (b, h from q's (B, H) although it flattens q)
    and K/V with fewer heads; gradients against the reference."""
    torch = pytest.importorskip("torch")
    import flashnb.torch as ft

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
