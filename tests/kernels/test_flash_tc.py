"""impl="fa2-tc" (stage 7): FlashAttention-2 on tensor cores, on the simulator's twins of mma.sync, ldmatrix and
cp.async.

Half inputs are held to FlashAttention's own rule: against the float64 reference of the (upcast) half inputs,
fa2-tc's output error is at most 2x, and its gradients' errors at most 3x, those of the same attention computed by
PyTorch in the same half dtype (what a user of half precision accepts already).  float32 inputs run through TF32:
a stated tolerance below.  Also: the exact traffic model (cp.async copies and ldmatrix reads are counted through the
simulator's arrays), poisoned outputs fully written, the sanitizer's four tools, no bank conflicts on full tiles,
the sm_75 forward (m16n8k8, plain copies), and bad input.
"""

import numpy as np
import pytest
from conftest import assert_close
from half_rule import half_inputs, maxerr, torch_half, values
from numba import float32

import flashnb
from flashnb import common, flex, reference, sim
from flashnb.instruments import traffic
from flashnb.kernels import policies
from flashnb.kernels.launch import tensorcore as tc
from flashnb.kernels.models import tensorcore as tc_models
from flashnb.kernels.tensorcore import backward as tc_backward
from flashnb.kernels.tensorcore import forward as tc_forward
from flashnb.kernels.tensorcore import geometry, mma

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(flashnb.MODE != "sim", reason="simulator checks")

TILES = dict(Br=32, Bc=32, warps=2)      # several tiles of each loop at these sizes, two warps
CASES = [  # (storage, q's shape, Nk, causal): partial tiles, Nq != Nk, both alignments, padded d, a row with no key
    ("float16", (2, 40, 24), 56, True),
    ("bfloat16", (1, 48, 16), 32, "upper_left"),
    ("float16", (1, 33, 64), 40, False),
    ("bfloat16", (1, 40, 20), 24, True),          # Nq > Nk, bottom-right: the first 16 rows see no key
]


@pytest.mark.parametrize("storage, shape_q, Nk, causal", CASES)
def test_half_precision_within_flashattentions_rule(rng, storage, shape_q, Nk, causal):
    (q, k, v, do), exact, tensors = half_inputs(rng, storage, shape_q, Nk)
    d = shape_q[-1]
    scale = 1 / np.sqrt(d)
    o, lse = flashnb.attention_forward(q, k, v, causal=causal, impl="fa2-tc", storage=storage, **TILES)
    o_ref, lse_ref = reference.attention_forward(*exact[:3], causal=causal)
    pt = torch_half(*tensors, causal, scale)
    assert not np.isnan(values(o, storage)).any() and not np.isnan(lse).any()       # every element written
    # FlashAttention's rule: output error <= 2x PyTorch's in the same half dtype (both against float64)
    assert maxerr(values(o, storage), o_ref) <= 2 * maxerr(pt[0], o_ref), (maxerr(values(o, storage), o_ref),
                                                                             maxerr(pt[0], o_ref))
    # L is float32 from exact half inputs: float32 accumulation error only (measured <= 1e-6 here)
    assert_close(lse, lse_ref, atol=2e-5, rtol=2e-5, what=f"{storage} lse")
    grads = flashnb.attention_backward(q, k, v, o, lse, do, causal=causal, impl="fa2-tc", storage=storage, **TILES)
    refs = reference.attention_backward(*exact, causal=causal)
    for name, g, r, p in zip(("dq", "dk", "dv"), grads, refs, pt[1:]):
        got = values(g, storage)
        assert not np.isnan(got).any(), name
        # gradients: at most 3x PyTorch's half-precision error
        assert maxerr(got, r) <= 3 * maxerr(p, r), (name, maxerr(got, r), maxerr(p, r))


@pytest.mark.parametrize("storage, d, causal, Hkv", [("float16", 64, True, 2), ("bfloat16", 128, False, 1),
                                                   ("float16", 24, "upper_left", 1)])
def test_grouped_query_heads_within_flashattentions_rule(rng, storage, d, causal, Hkv):
    """GQA (two K/V heads for four query heads) and MQA (one): the forward reads K/V head ``z // G``, the backward's
    blocks loop over their K/V head's query heads (d = 64: two tile loops; d = 128: one) and sum dK_j, dV_j on chip.
    Against float64 with K/V repeated, by FlashAttention's rule; dK, dV have K/V's heads; the counted traffic equals
    the model, whose backward reads K, V once per K/V head."""
    BH, Nq, Nk = 4, 40, 48
    G = BH // Hkv
    (q, k, v, do), exact, tensors = half_inputs(rng, storage, (BH, Nq, d), Nk)
    k, v, exact[1], exact[2], tensors[1], tensors[2] = (a[:Hkv] for a in (k, v, exact[1], exact[2], tensors[1],
                                                                          tensors[2]))
    k, v = np.ascontiguousarray(k), np.ascontiguousarray(v)
    scale = 1 / np.sqrt(d)
    with traffic.count() as t:
        o, lse = flashnb.attention_forward(q, k, v, causal=causal, impl="fa2-tc", storage=storage, **TILES)
    assert t.summary() == tc_models.model_forward(BH, Nq, Nk, d, causal=causal, storage=storage, group=G, **TILES)
    o_ref, _ = reference.attention_forward(*exact[:3], causal=causal)
    pt = torch_half(*tensors, causal, scale, group=G)
    assert maxerr(values(o, storage), o_ref) <= 2 * maxerr(pt[0], o_ref)
    with traffic.count() as t:
        grads = flashnb.attention_backward(q, k, v, o, lse, do, causal=causal, impl="fa2-tc", storage=storage,
                                           **TILES)
    model = tc_models.model_backward(BH, Nq, Nk, d, causal=causal, storage=storage, group=G, **TILES)
    assert t.summary() == model
    assert model[1]["reads"]["K"] == Hkv * Nk * d                # K, V once per K/V head
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    refs = reference.attention_backward(*exact, causal=causal)
    for name, g, r, p in zip(("dq", "dk", "dv"), grads, refs, pt[1:]):
        got = values(g, storage)
        assert not np.isnan(got).any(), name                   # every element written
        assert maxerr(got, r) <= 3 * maxerr(p, r), (name, maxerr(got, r), maxerr(p, r))


@pytest.mark.parametrize("storage, shape_q, Nk, causal, Hkv, p", [
    ("float16", (2, 40, 16), 36, True, 2, 0.3),            # partial tiles, cp.async, several tiles of each loop
    ("bfloat16", (2, 33, 24), 40, "upper_left", 1, 0.5),   # MQA, odd Nq, the top-left alignment
    ("float16", (1, 40, 32), 24, True, 1, 0.1)])           # Nq > Nk: rows that see no key
def test_dropout_draws_the_product_kernels_mask(rng, storage, shape_q, Nk, causal, Hkv, p):
    """Attention dropout: the forward multiplies the P fragments by W = Z / (1-p) after l_i took the undropped P~,
    the backward regenerates Z (dV_j += (P ∘ W)ᵀ dO_i, dS = P ∘ (dP ∘ W - D)).  Against float64 with the mask of
    flashnb.rng's NumPy twin -- the mask impl="flash" draws -- by FlashAttention's rule, PyTorch's half attention
    given the same W; L is the undropped softmax's (float32 accumulation only); dropout adds no HBM traffic.  A
    wrong mask element moves an output by O(0.1 - 1), far above the half-precision errors (~1e-3 - 1e-2)."""
    from flashnb import rng as frng

    BH, Nq, d = shape_q
    G = BH // Hkv
    (q, k, v, do), exact, tensors = half_inputs(rng, storage, shape_q, Nk)
    k, v, exact[1], exact[2], tensors[1], tensors[2] = (a[:Hkv] for a in (k, v, exact[1], exact[2], tensors[1],
                                                                          tensors[2]))
    k, v = np.ascontiguousarray(k), np.ascontiguousarray(v)
    seed = int(rng.integers(0, 2**63))
    W = frng.dropout_scale_np(seed, p, BH, Nq, Nk).reshape(BH, Nq, Nk).astype(np.float64)
    scale = 1 / np.sqrt(d)
    opts = dict(causal=causal, impl="fa2-tc", storage=storage, dropout_p=p, seed=seed, **TILES)
    with traffic.count() as t:
        o, lse = flashnb.attention_forward(q, k, v, **opts)
    assert t.summary() == tc_models.model_forward(BH, Nq, Nk, d, causal=causal, storage=storage, group=G, **TILES)
    krep, vrep = (np.repeat(a, G, axis=0) for a in exact[1:3])
    o_ref, lse_ref = reference.attention_forward(exact[0], krep, vrep, causal=causal, dropout_mask=W)
    pt = torch_half(*tensors, causal, scale, group=G, W=W)
    assert not np.isnan(values(o, storage)).any()
    assert maxerr(values(o, storage), o_ref) <= 2 * maxerr(pt[0], o_ref), (maxerr(values(o, storage), o_ref),
                                                                             maxerr(pt[0], o_ref))
    assert_close(lse, lse_ref, atol=2e-5, rtol=2e-5, what=f"{storage} lse")        # as without dropout
    with traffic.count() as t:
        grads = flashnb.attention_backward(q, k, v, o, lse, do, **opts)
    assert t.summary() == tc_models.model_backward(BH, Nq, Nk, d, causal=causal, storage=storage, group=G, **TILES)
    refs = reference.attention_backward(exact[0], krep, vrep, exact[3], causal=causal, dropout_mask=W)
    refs = (refs[0], *(r.reshape(Hkv, G, Nk, d).sum(axis=1) for r in refs[1:]))   # K/V gradients sum per group
    for name, g, r, pg in zip(("dq", "dk", "dv"), grads, refs, pt[1:]):
        got = values(g, storage)
        assert not np.isnan(got).any(), name
        assert maxerr(got, r) <= 3 * maxerr(pg, r), (name, maxerr(got, r), maxerr(pg, r))


def test_dropout_through_flashnb_pytorch_draws_torchs_seed_and_the_product_kernels_mask():
    """flashnb.pytorch.attention draws the dropout seed from torch's generator and keeps it for the backward: with
    the generator reset, fa2-tc and impl="flash" drop the same weights.  Their outputs then differ only by fa2-tc's
    rounding of P to float16 (measured 2e-3 on these O(1) values); a weight dropped by one and kept by the other
    moves an output by O(0.1 - 1), so 1e-2 tells them apart."""
    from flashnb import pytorch as fp

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g).half().requires_grad_(True) for n in (24, 20, 20))
    outs = []
    for impl in ("fa2-tc", "flash"):
        torch.manual_seed(0)
        outs.append(fp.attention(q, k, v, causal=True, impl=impl, dropout_p=0.3))
    assert (outs[0].float() - outs[1].float()).abs().max().item() < 1e-2
    torch.manual_seed(1)
    other = fp.attention(q, k, v, causal=True, impl="fa2-tc", dropout_p=0.3)
    assert (other.float() - outs[0].float()).abs().max().item() > 0.1          # another seed, another mask
    outs[0].float().sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


def test_all_four_sanitizer_tools_with_dropout(rng):
    (q, k, v, do), _, _ = half_inputs(rng, "float16", (1, 40, 16), 36)
    with sim.sanitize() as report:
        o, lse = flashnb.attention_forward(q, k, v, causal=True, impl="fa2-tc", dropout_p=0.2, seed=3, **TILES)
        flashnb.attention_backward(q, k, v, o, lse, do, causal=True, impl="fa2-tc", dropout_p=0.2, seed=3, **TILES)
    assert report.launches == 4 and not report.findings


# TF32 keeps 10 of float32's 23 mantissa bits: Q, K, V (rounded when copied to shared memory) and P (when formed)
# carry a relative error of up to 2^-11 = 4.9e-4 each, and a score Σ_l q_l k_l up to ~2·2^-11·Σ|q||k|.  On these
# O(1) inputs the errors measured 2e-4 .. 1.5e-3 (o, lse, gradients); 5e-3 absolute plus 5e-3 relative is ~3x that,
# and far below what a wrong fragment or mask gives (O(1)).
TF32 = dict(atol=5e-3, rtol=5e-3)


@pytest.mark.parametrize("shape_q, Nk, causal, scale", [((1, 33, 20), 37, True, None), ((2, 16, 8), 24, False, -0.7),
                                                        ((1, 24, 16), 20, True, 0.0)])
def test_float32_inputs_through_tf32(rng, shape_q, Nk, causal, scale):
    q, k, v, do = (rng.standard_normal(s) for s in (shape_q, (*shape_q[:-2], Nk, shape_q[-1]),
                                                      (*shape_q[:-2], Nk, shape_q[-1]), shape_q))
    o, lse = flashnb.attention_forward(q, k, v, causal=causal, scale=scale, impl="fa2-tc", **TILES)
    assert o.dtype == np.float32
    o_ref, lse_ref = reference.attention_forward(q, k, v, causal=causal, scale=scale)
    assert_close(o, o_ref, **TF32, what="tf32 o")
    assert_close(lse, lse_ref, **TF32, what="tf32 lse")
    grads = flashnb.attention_backward(q, k, v, o, lse, do, causal=causal, scale=scale, impl="fa2-tc", **TILES)
    for name, g, r in zip(("dq", "dk", "dv"), grads, reference.attention_backward(q, k, v, do, causal=causal,
                                                                              scale=scale)):
        assert_close(g, r, **TF32, what=f"tf32 {name}")


def test_default_tiles_and_negative_scale_in_half(rng):
    # the default tiles (two m-tiles a warp, cp.async double buffering) on a problem smaller than one tile; a
    # negative scale (folded into Q's sign bits) against the same rule
    (q, k, v, do), exact, tensors = half_inputs(rng, "float16", (1, 20, 64), 70)
    o, lse = flashnb.attention_forward(q, k, v, causal=True, scale=-0.2, impl="fa2-tc")
    o_ref, _ = reference.attention_forward(*exact[:3], causal=True, scale=-0.2)
    pt = torch_half(*tensors, True, -0.2)
    assert maxerr(o, o_ref) <= 2 * maxerr(pt[0], o_ref)


# --------------------------------------------------------------------------- exact traffic


@pytest.mark.parametrize("storage, d, causal", [("float16", 64, True), ("bfloat16", 20, False),
                                                ("float32", 16, True)])
def test_traffic_equals_the_model(rng, storage, d, causal):
    BH, Nq, Nk = 1, 40, 72
    dt = {"float16": np.float16, "float32": np.float32}.get(storage)
    conv = common.to_bfloat16 if storage == "bfloat16" else (lambda a: a.astype(dt))
    q, k, v, do = (common.to_device(conv(rng.standard_normal((BH, n, d))), storage) for n in (Nq, Nk, Nk, Nq))
    scale = 1 / np.sqrt(d)
    with traffic.count() as t:
        o, lse = tc.forward(q, k, v, causal=causal, scale=scale, storage=storage, **TILES)
    t.check_model(tc_models.model_forward(BH, Nq, Nk, d, causal=causal, storage=storage, **TILES))
    with traffic.count() as t:
        tc.backward(q, k, v, o, lse, do, causal=causal, scale=scale, storage=storage, **TILES)
    t.check_model(tc_models.model_backward(BH, Nq, Nk, d, causal=causal, storage=storage, **TILES))
    from flashnb.kernels.models import model_bytes
    assert [lt.read_bytes for lt in t.launches] == [m["read_bytes"] for m in model_bytes(
        tc_models.model_backward(BH, Nq, Nk, d, causal=causal, storage=storage, **TILES), storage)]


# --------------------------------------------------------------------------- attention modifiers and block masks


def rel_bias(score, b, h, q_idx, kv_idx):
    """A user's relative-position bias, different per head (the kind of modifier the gallery does not have)."""
    return score + float32(0.1) * float32(kv_idx - q_idx) - float32(h) * float32(0.05)


def band(b, h, q_idx, kv_idx):
    """A user's band mask (Python ``and``: the host evaluates it element by element)."""
    return kv_idx <= q_idx + 3 and q_idx - kv_idx < 20


DOCS = np.repeat(np.arange(4), [10, 17, 5, 16])           # 48 positions, 4 packed documents
SCORE_MODS = {  # name: (flashnb modifier, the same in torch on scaled scores s, with (h, q, k) index tensors)
    "alibi": lambda H: (flex.alibi(H), lambda s, h, q, k: s + torch.tensor(
        flex.alibi_slopes(H))[h].to(s.dtype) * (k - q).to(s.dtype)),
    "softcap": lambda H: (flex.softcap(2.0), lambda s, h, q, k: 2.0 * torch.tanh(s / 2.0)),
    "rel_bias": lambda H: (rel_bias, lambda s, h, q, k: s + (0.1 * (k - q) - 0.05 * h).to(s.dtype)),
}
MASK_MODS = {"window": flex.sliding_window(12), "document": flex.document(DOCS, causal=True), "band": band}
MOD_CASES = [  # storage, q (B, H, Nq, d), Nk, K/V heads, causal, score_mod, mask_mod, dropout p
    ("float16", (1, 2, 48, 16), 48, 2, False, None, "window", 0),            # EMPTY, PARTIAL and FULL tiles
    ("bfloat16", (1, 4, 40, 32), 40, 1, True, "alibi", None, 0),             # per-head bias, MQA, causal
    ("float16", (1, 2, 48, 64), 48, 2, False, "softcap", "document", 0),     # d = 64, both modifiers
    ("float16", (2, 1, 24, 16), 40, 1, "upper_left", "rel_bias", "band", 0),  # Nq != Nk, two batches, a user's own
    ("float16", (1, 4, 48, 16), 48, 2, True, "alibi", "window", 0.2),        # a block mask over GQA, with dropout
]


@pytest.fixture(scope="module")
def checked_modifiers():
    """The modifiers compiled for a GPU once, in one batch, before any launch (as the user surfaces require)."""
    pairs = [(MASK_MODS[n], "mask_mod") for n in MASK_MODS]
    for make in SCORE_MODS.values():
        sm = make(2)[0]
        pairs += [(sm, "score_mod")] + ([(sm.grad, "score_mod_grad")] if getattr(sm, "grad", None) else [])
    pairs += [(flex.alibi(4), "score_mod"), (flex.alibi(4).grad, "score_mod_grad")]
    flex.check_many(pairs, strict=False)


@pytest.mark.parametrize("storage, shape_q, Nk, Hkv, causal, score_name, mask_name, p", MOD_CASES)
def test_modifiers_and_block_masks_within_flashattentions_rule(rng, checked_modifiers, storage, shape_q, Nk, Hkv,
                                                               causal, score_name, mask_name, p):
    """score_mod on the S fragments (forward and the backward's recomputation, its derivative on dS) and mask_mod
    through its block mask (EMPTY tiles never loaded, PARTIAL ones masked element by element), the product
    kernel's policies: against float64 with the same modifiers in NumPy, by FlashAttention's rule (PyTorch's half
    attention with the same modifiers); the counted traffic equals the model with the block mask."""
    B, H, Nq, d = shape_q
    G = H // Hkv
    (q, k, v, do), exact, tensors = half_inputs(rng, storage, shape_q, Nk)
    k, v, exact[1], exact[2], tensors[1], tensors[2] = (np.ascontiguousarray(a[:, :Hkv]) if isinstance(a, np.ndarray)
                                                        else a[:, :Hkv] for a in (k, v, exact[1], exact[2],
                                                                                  tensors[1], tensors[2]))
    score_mod, score_fn = SCORE_MODS[score_name](H) if score_name else (None, None)
    mask_mod = MASK_MODS[mask_name] if mask_name else None
    mask = None if mask_mod is None else flex.mask_array(mask_mod, B, H, Nq, Nk)
    opts = dict(causal=causal, impl="fa2-tc", storage=storage, score_mod=score_mod, mask_mod=mask_mod, **TILES)
    W = None
    if p:
        from flashnb import rng as frng

        seed = int(rng.integers(0, 2**63))
        opts.update(dropout_p=p, seed=seed)
        W = frng.dropout_scale_np(seed, p, B * H, Nq, Nk).reshape(B, H, Nq, Nk).astype(np.float64)
    with traffic.count() as t:
        o, lse = flashnb.attention_forward(q, k, v, **opts)
    bm = None if mask_mod is None else flex.create_block_mask(mask_mod, B, H, Nq, Nk, Br=TILES["Br"], Bc=TILES["Bc"])
    if bm is not None:
        assert {0, 2} <= set(np.unique(bm.states)), "the case must have EMPTY and PARTIAL tiles"
    assert t.summary() == tc_models.model_forward(B * H, Nq, Nk, d, causal=causal, storage=storage, group=G,
                                                 block_mask=bm, **TILES)
    sm = None if score_mod is None else flex.numpy_modifier(score_mod)
    krep, vrep = (np.repeat(a, G, axis=1) for a in exact[1:3])
    o_ref, lse_ref = reference.attention_forward(exact[0], krep, vrep, causal=causal, mask=mask, score_mod=sm,
                                                 dropout_mask=W)
    pt = torch_half(*tensors, causal, 1 / np.sqrt(d), G, W, score_fn, mask)
    got = values(o, storage)
    assert not np.isnan(got).any() and not np.isnan(lse).any()                  # every element written
    assert maxerr(got, o_ref) <= 2 * maxerr(pt[0], o_ref), (maxerr(got, o_ref), maxerr(pt[0], o_ref))
    # L: float32 accumulation of exact half products, plus one float32 rounding per modified score
    assert_close(lse, lse_ref, atol=5e-5, rtol=5e-5, what=f"{storage} lse")
    with traffic.count() as t:
        grads = flashnb.attention_backward(q, k, v, o, lse, do, **opts)
    assert t.summary() == tc_models.model_backward(B * H, Nq, Nk, d, causal=causal, storage=storage, group=G,
                                                  block_mask=bm, **TILES)
    # the reference's derivative: the gallery's own, or (rel_bias, which the kernel derives from its source) 1
    g = None if score_mod is None else (flex.numpy_modifier(score_mod.grad) if hasattr(score_mod, "grad") else
                                        (lambda s, b, h, q, kv: np.ones(np.broadcast_shapes(*map(np.shape,
                                                                                                (s, b, h, q, kv))))))
    refs = reference.attention_backward(exact[0], krep, vrep, exact[3], causal=causal, mask=mask, score_mod=sm,
                                        score_mod_grad=g, dropout_mask=W)
    refs = (refs[0], *(r.reshape(B, Hkv, G, Nk, d).sum(axis=2) for r in refs[1:]))   # K/V gradients per group
    for name, gr, r, pg in zip(("dq", "dk", "dv"), grads, refs, pt[1:]):
        got = values(gr, storage)
        assert not np.isnan(got).any(), name
        assert maxerr(got, r) <= 3 * maxerr(pg, r), (name, maxerr(got, r), maxerr(pg, r))


def test_block_mask_tiles_and_errors(rng):
    """A plain boolean block mask is read at the mask tiles (64 × 32 at d <= 64) and the default tiles shrink to
    divide them; given tiles that do not divide a mask's blocks, or a product kernel's prepared mask, are refused
    by name; the forward's EMPTY tiles are never loaded."""
    (q, k, v), exact, _ = half_inputs(rng, "float16", (1, 128, 16), 64, do=False)
    blocks = np.array([[True, False], [False, True]])            # 2 × 2 blocks of 64 × 32: a block diagonal
    with traffic.count() as t:
        o = flashnb.attention(q, k, v, impl="fa2-tc", block_mask=blocks)
    mask = reference.expand_block_mask(blocks, 128, 64, 64, 32)
    o_ref = reference.attention(*exact, mask=mask)
    assert_close(o.astype(np.float64), o_ref, atol=2e-3, rtol=2e-3, what="block-diagonal o")   # half o: 2^-11
    assert t.summary()[0]["reads"]["K"] == 64 * 16              # each Q block read its one K/V block, once
    with pytest.raises(ValueError, match=r"block_mask was built for tiles Br=64, Bc=32.*must divide"):
        flashnb.attention(q, k, v, impl="fa2-tc", block_mask=flex.create_block_mask(flex.causal(), 1, 1, 128, 64),
                          Br=128, Bc=32, warps=8)
    from flashnb.kernels import flash

    prepared = flash.prepare_block_mask(blocks, direction="forward", BH=1, Nq=128, Nk=64, d=16)
    with pytest.raises(TypeError, match="block_mask: fa2-tc takes a flashnb.masks.BlockMask"):
        tc.forward(*(common.to_device(a, "float16") for a in (q, k, v)), scale=0.25, block_mask=prepared)
    with pytest.raises(ValueError, match="mask_mod needs sparse=True"):
        tc_forward.make_forward(32, 32, 16, 2, False, mask_mod=band)


@pytest.mark.parametrize("Br, Bc, Nq, Nk", [(16, 80, 32, 100), (64, 48, 70, 96)])
def test_backward_fits_a_block_mask_with_fewer_warps(rng, Br, Bc, Nq, Nk):
    """A mask built for tiles whose key blocks only fewer warps divide (80 = 5 · 16 keys; 48 over three warps
    leaves no Br that is a multiple of 48 and divides 64): both directions find tiles that divide the mask's blocks,
    and agree with the reference; a mask no tile divides is refused with a whole sentence saying what to build."""
    (q, k, v, do), exact, _ = half_inputs(rng, "float16", (1, Nq, 16), Nk)
    bm = flex.create_block_mask(flex.causal(), 1, 1, Nq, Nk, Br=Br, Bc=Bc)
    o, lse = flashnb.attention_forward(q, k, v, impl="fa2-tc", block_mask=bm)
    grads = flashnb.attention_backward(q, k, v, o, lse, do, impl="fa2-tc", block_mask=bm)
    t = tc.last_backward
    assert Bc % t["Bc"] == 0 and Br % t["Br"] == 0 and t["Br"] % t["Bc"] == 0, t
    mask = flex.mask_array(flex.causal(), 1, 1, Nq, Nk)[0, 0]
    o_ref, _ = reference.attention_forward(*exact[:3], mask=mask)
    assert_close(values(o, "float16"), o_ref, atol=2e-3, rtol=2e-3, what="o")             # half o: 2^-11
    for name, g, r in zip(("dq", "dk", "dv"), grads, reference.attention_backward(*exact, mask=mask)):
        assert_close(values(g, "float16"), r, atol=1e-2, rtol=1e-2, what=name)   # as the block-mask test above
    odd = flex.create_block_mask(flex.causal(), 1, 1, Nq, Nk, Br=Br, Bc=20)
    with pytest.raises(ValueError, match=r"tiles that are multiples of 16, e\.g\. flashnb\.flex\.create_block_mask"
                                         r"\(\.\.\., Br=32, Bc=32\)$"):
        flashnb.attention_backward(q, k, v, o, lse, do, impl="fa2-tc", block_mask=odd, check_forward=False)


def test_modifiers_through_flashnb_pytorch_run_the_same_kernels(rng, checked_modifiers):
    """flashnb.pytorch passes the modifiers to fa2-tc (as handles through the custom operator): o and the
    gradients are those of the NumPy API's launches, bit for bit."""
    from flashnb import pytorch as fnb

    (q, k, v, do), _, _ = half_inputs(rng, "float16", (1, 2, 48, 16), 48)
    opts = dict(impl="fa2-tc", score_mod=SCORE_MODS["softcap"](2)[0], mask_mod=MASK_MODS["window"], **TILES)
    o, lse = flashnb.attention_forward(q, k, v, **opts)
    grads = flashnb.attention_backward(q, k, v, o, lse, do, **opts)
    qt, kt, vt = (torch.from_numpy(a).requires_grad_() for a in (q, k, v))
    ot = fnb.attention(qt, kt, vt, **opts)
    ot.backward(torch.from_numpy(do))
    assert np.array_equal(ot.detach().numpy(), o)
    for g, t in zip(grads, (qt, kt, vt)):
        assert np.array_equal(t.grad.numpy(), g)


def test_a_block_mask_with_gaps_pipelines_the_visited_tiles(rng):
    """A random block mask over 16 × 16 tiles (every Q row keeps at least one tile; gaps between visited ones): the
    forward prefetches the next visited tile into the other buffer, skipping the EMPTY ones between; against
    float64 with the expanded mask (half output and P: 2e-3 is ~4x the measured error), forward and backward, with
    the sanitizer's four tools on and traffic equal to the model."""
    from flashnb.masks import BlockMask

    (q, k, v, do), exact, _ = half_inputs(rng, "float16", (2, 64, 16), 96)
    blocks = rng.random((2, 4, 6)) < 0.45
    blocks[:, :, 0] |= ~blocks.any(axis=-1)                      # no Q tile left without a key
    bm = BlockMask(blocks, Br=16, Bc=16)
    mask = reference.expand_block_mask(blocks, 64, 96, 16, 16)
    with sim.sanitize() as report, traffic.count() as t:
        o, lse = flashnb.attention_forward(q, k, v, impl="fa2-tc", block_mask=bm)
        grads = flashnb.attention_backward(q, k, v, o, lse, do, impl="fa2-tc", block_mask=bm)
    assert not report.findings
    model = (tc_models.model_forward(2, 64, 96, 16, block_mask=bm)
             + tc_models.model_backward(2, 64, 96, 16, block_mask=bm))
    assert t.summary() == model
    o_ref, _ = reference.attention_forward(*exact[:3], mask=mask)
    assert_close(values(o, "float16"), o_ref, atol=2e-3, rtol=2e-3, what="o")
    # gradients: float16 results of float32 sums over <= 96 keys (2^-11 relative, |g| <= ~5): 1e-2
    for name, g, r in zip(("dq", "dk", "dv"), grads, reference.attention_backward(*exact, mask=mask)):
        assert_close(values(g, "float16"), r, atol=1e-2, rtol=1e-2, what=name)


def test_all_four_sanitizer_tools_with_a_block_mask_and_modifiers(rng, checked_modifiers):
    # the block mask's path copies each visited tile alone (cp.async, then wait): no race, nothing uninitialised
    (q, k, v, do), _, _ = half_inputs(rng, "float16", (1, 2, 48, 16), 48)
    opts = dict(impl="fa2-tc", score_mod=SCORE_MODS["alibi"](2)[0], mask_mod=MASK_MODS["window"], **TILES)
    with sim.sanitize() as report:
        o, lse = flashnb.attention_forward(q, k, v, **opts)
        flashnb.attention_backward(q, k, v, o, lse, do, **opts)
    assert report.launches == 4 and not report.findings


# --------------------------------------------------------------------------- tools


def test_all_four_sanitizer_tools_on_the_async_path(rng):
    # float16 at d = 16: cp.async double buffering (the float64 inputs of the every-impl sanitizer test take the
    # float32 path, plain copies); partial tiles, a causal mask, several K/V and Q tiles per block
    (q, k, v, do), _, _ = half_inputs(rng, "float16", (1, 40, 16), 36)
    with sim.sanitize() as report:
        o, lse = flashnb.attention_forward(q, k, v, causal=True, impl="fa2-tc", **TILES)
        flashnb.attention_backward(q, k, v, o, lse, do, causal=True, impl="fa2-tc", **TILES)
    assert report.launches == 4 and not report.findings          # forward; D, backward, dQ -> float16


def test_all_four_sanitizer_tools_across_a_gqa_group(rng):
    # two query heads per K/V head: the backward's block prefetches the next query head's first Q tile while it
    # finishes the last of the current one (cp.async, d = 16), and sums dK_j, dV_j over both heads
    (q, k, v, do), _, _ = half_inputs(rng, "float16", (2, 40, 16), 36)
    k, v = k[:1], v[:1]
    with sim.sanitize() as report:
        o, lse = flashnb.attention_forward(q, k, v, causal=True, impl="fa2-tc", **TILES)
        flashnb.attention_backward(q, k, v, o, lse, do, causal=True, impl="fa2-tc", **TILES)
    assert report.launches == 4 and not report.findings


def test_no_bank_conflicts_on_full_tiles(rng):
    # d = 64 halves: rows of 128 bytes, the case a plain layout makes 8-way conflicted (tests/kernels/test_mma.py);
    # every shared access of both passes -- ldmatrix phases, cp.async chunks, dS stores, L/D -- conflict-free
    (q, k, v, do), _, _ = half_inputs(rng, "float16", (1, 64, 64), 64)
    with sim.profile() as fwd:
        o, lse = flashnb.attention_forward(q, k, v, impl="fa2-tc", **TILES)
    with sim.profile() as bwd:
        flashnb.attention_backward(q, k, v, o, lse, do, impl="fa2-tc", **TILES)
    for name, prof in (("forward", fwd), ("backward", bwd)):
        shared = prof.total(memory="shared")
        assert shared["requests"] > 0 and shared["bank_conflicts"] == 0, f"{name}:\n{prof.table(prof.worst(5))}"
    ldsm = [s for s in fwd.select(memory="shared", op="ld") if s.array == "sm"]
    assert ldsm and all(s.ideal == s.requests for s in ldsm)    # one wavefront per 8x8 matrix, as ideal


def test_the_profile_is_the_same_on_both_simulators(rng):
    # d = 64 halves (the swizzled layout): every line's requests, wavefronts and sectors -- ldmatrix's 8-row
    # phases, the cp.async copies, the dS stores -- on the vectorised simulator are the threads simulator's
    # (the forward with two warps; the backward, the threads simulator's slowest, with one warp on 16 rows)
    (q, k, v, do), _, _ = half_inputs(rng, "float16", (1, 32, 64), 32)
    one = dict(Br=16, Bc=16, warps=1)
    profs = {}
    for mode in ("vector", "threads"):
        with sim.simulating(mode), sim.profile() as prof:
            flashnb.attention_forward(q, k, v, causal=True, impl="fa2-tc", **TILES)
            q1, k1, v1, do1 = (x[:, :16] for x in (q, k, v, do))
            o, lse = flashnb.attention_forward(q1, k1, v1, causal=True, impl="fa2-tc", **one)
            flashnb.attention_backward(q1, k1, v1, o, lse, do1, causal=True, impl="fa2-tc", **one)
        profs[mode] = prof
    assert len(profs["vector"].launches) == 5 and profs["vector"].lines == profs["threads"].lines, \
        f"vector:\n{profs['vector'].table()}\nthreads:\n{profs['threads'].table()}"
    assert profs["vector"].total(memory="shared")["bank_conflicts"] == 0


def test_sm75_forward_on_the_simulator(rng):
    # the T4 kernel: m16n8k8 (two per k-step), plain copies into one buffer; launched by hand (the simulator is
    # an sm_80 to the launcher)
    (q, k, v), exact, _ = half_inputs(rng, "float16", (1, 40, 32), 48, do=False)
    kernel = tc_forward.make_forward(32, 32, 32, 2, True, "float16", 75)
    O = common.empty((1, 40, 32), storage="float16")
    L = common.empty((1, 40))
    dev = [common.to_device(a, "float16") for a in (q, k, v)]
    common.launch(kernel, (2, 1), 64, *dev, O, L, 1 / np.sqrt(32), common.causal_diag(True, 40, 48),
                  common.to_device(np.zeros((1, 1, 1), np.uint8)), *policies.NO_DROPOUT)   # M: no block mask
    o_ref, lse_ref = reference.attention_forward(*exact, causal=True)
    # half output (one rounding of |o| <= 1: 2^-11) plus P's rounding: 2e-3 is ~4x the measured 5e-4
    assert_close(O.copy_to_host(), o_ref, atol=2e-3, rtol=2e-3, what="sm_75 o")
    assert_close(L.copy_to_host(), lse_ref, atol=2e-5, rtol=2e-5, what="sm_75 lse")


# --------------------------------------------------------------------------- dynamic shared memory (d = 128 backward)


@pytest.mark.parametrize("storage, shape_q, Nk, causal", [("float16", (1, 40, 128), 100, True),
                                                          ("bfloat16", (1, 24, 128), 72, "upper_left"),
                                                          ("float16", (2, 33, 128), 20, False)])
def test_backward_default_tiles_at_d128(rng, storage, shape_q, Nk, causal):
    """d = 128's default backward tiles: Bc = 128 keys over eight warps, 77,824 B of tiles in dynamic shared memory
    (the launch's opt-in passes on the simulator).  Partial K/V and Q tiles, both alignments, one block seeing fewer
    keys than a warp owns (Nk = 20): FlashAttention's rule, every element written, traffic equal to the model."""
    (q, k, v, do), exact, tensors = half_inputs(rng, storage, shape_q, Nk)
    d = shape_q[-1]
    o, lse = flashnb.attention_forward(q, k, v, causal=causal, impl="fa2-tc", storage=storage)
    with traffic.count() as t:
        grads = flashnb.attention_backward(q, k, v, o, lse, do, causal=causal, impl="fa2-tc", storage=storage)
    assert tc.last_backward == dict(d=128, Br=16, Bc=128, warps=8, dynamic=True, shared_bytes=77_952,
                                          fallback=None)
    assert t.summary() == tc_models.model_backward(shape_q[0], shape_q[1], Nk, d, causal=causal, storage=storage)
    refs = reference.attention_backward(*exact, causal=causal)
    pt = torch_half(*tensors, causal, 1 / np.sqrt(d))
    for name, g, r, p in zip(("dq", "dk", "dv"), grads, refs, pt[1:]):
        got = values(g, storage)
        assert not np.isnan(got).any(), name                   # every element written
        assert maxerr(got, r) <= 3 * maxerr(p, r), (name, maxerr(got, r), maxerr(p, r))


def test_all_four_sanitizer_tools_on_the_dynamic_backward(rng):
    """The dynamic build at d = 128 under memcheck, racecheck, initcheck and synccheck: eight warps' dSᵀ exchange,
    the next Q tile's cp.async during dQ, a partial K/V tile, two query heads of one K/V head (GQA)."""
    (q, k, v, do), _, _ = half_inputs(rng, "float16", (2, 40, 128), 50)
    k, v = k[:1], v[:1]
    o, lse = flashnb.attention_forward(q, k, v, causal=True, impl="fa2-tc")
    with sim.sanitize() as report:
        flashnb.attention_backward(q, k, v, o, lse, do, causal=True, impl="fa2-tc")
    assert tc.last_backward["dynamic"]
    assert report.launches == 3 and not report.findings          # D, the backward, dQ -> float16


@pytest.mark.parametrize("storage, Bc, warps", [("float16", 32, 2), ("bfloat16", 64, 4)])
def test_backward_falls_back_to_static_tiles_when_the_device_refuses(rng, monkeypatch, storage, Bc, warps):
    """A device whose opt-in limit is below the d = 128 defaults' bytes (a faked limit here), or whose opt-in call
    fails: the launch falls back to the static tiles (float16: Bc = 32, two warps; bfloat16: Bc = 64, four), warns,
    says so in last_backward, and the gradients are the same as those tiles give when asked for.  Tiles given
    explicitly are never changed behind the caller's back: there the refusal is an error."""
    (q, k, v, do), _, _ = half_inputs(rng, storage, (1, 24, 128), 40)
    opts = dict(impl="fa2-tc", storage=storage)
    o, lse = flashnb.attention_forward(q, k, v, **opts)
    static = flashnb.attention_backward(q, k, v, o, lse, do, Br=16, Bc=Bc, warps=warps, **opts)
    monkeypatch.setattr(tc, "shared_optin_limit", lambda: 48 * 1024 + 512)
    with pytest.warns(RuntimeWarning, match=f"falling back to the static tiles Br=16, Bc={Bc}, warps={warps}"):
        grads = flashnb.attention_backward(q, k, v, o, lse, do, **opts)
    assert tc.last_backward["dynamic"] is False and tc.last_backward["Bc"] == Bc
    assert "opt-in limit of 49,664 B" in tc.last_backward["fallback"]
    for g, s in zip(grads, static):
        np.testing.assert_array_equal(g, s)
    if storage == "bfloat16":
        return                                                   # the opt-in call's refusal: once is enough
    monkeypatch.undo()

    def refuse(kernel, signature, nbytes):
        raise RuntimeError("CUDA_ERROR_INVALID_VALUE (faked)")

    monkeypatch.setattr(tc, "allow_dynamic_shared", refuse)
    with pytest.warns(RuntimeWarning, match="opt-in call for 77,824 B failed"):
        grads = flashnb.attention_backward(q, k, v, o, lse, do, impl="fa2-tc")
    assert tc.last_backward["Bc"] == 32 and "faked" in tc.last_backward["fallback"]
    for g, s in zip(grads, static):
        np.testing.assert_array_equal(g, s)
    with pytest.raises(RuntimeError, match="refused 77,824 B of dynamic shared memory for tiles Br=16, Bc=128"):
        flashnb.attention_backward(q, k, v, o, lse, do, impl="fa2-tc", Br=16, Bc=128, warps=8)


def test_rehearsed_gpu_backward_asks_the_driver_for_the_dynamic_bytes(rng):
    """Under pretend_gpu (GPU branches taken, kernels on the simulator): the opt-in request is made for exactly
    the dynamic bytes the launch gives (the tiles; L_i and D_i stay a static array)."""
    from flashnb.instruments import rehearsal

    (q, k, v, do), _, _ = half_inputs(rng, "float16", (1, 8, 128), 8)
    before = len(rehearsal.dynamic_shared_requests)
    with rehearsal.pretend_gpu():
        dq, dk, dv = (common.to_device(a, "float16") for a in (q, k, v))
        o, lse = tc.forward(dq, dk, dv, scale=0.1)
        tc.backward(dq, dk, dv, o, lse, common.to_device(do, "float16"), scale=0.1)
    assert rehearsal.dynamic_shared_requests[before:] == [("fa2_tc_backward", tc_backward._bwd_sig("float16"), 77_824)]
    assert tc.last_backward["dynamic"] and tc.last_backward["fallback"] is None


# --------------------------------------------------------------------------- bad input


def test_bad_input_names_the_argument(rng):
    x = rng.standard_normal((8, 16)).astype(np.float16)
    with pytest.raises(ValueError, match=r"head dim d .* must be in 1\.\.128"):
        flashnb.attention(np.zeros((4, 130), np.float16), np.zeros((4, 130), np.float16),
                          np.zeros((4, 130), np.float16), impl="fa2-tc")
    with pytest.raises(ValueError, match="Bc=24 must be a multiple of 16"):
        flashnb.attention(x, x, x, impl="fa2-tc", Br=32, Bc=24, warps=2)
    with pytest.raises(ValueError, match=r"Br=24 must be a multiple of 16·warps = 32"):
        flashnb.attention(x, x, x, impl="fa2-tc", Br=24, Bc=32, warps=2)
    with pytest.raises(TypeError, match="fa2-tc: k must be float16"):
        tc.forward(*(common.to_device(a, s) for a, s in ((x, "float16"), (x.astype(np.float32), "float32"),
                                                                 (x, "float16"))), scale=1.0)
    with pytest.raises(ValueError, match=r"fa2-tc needs tensor-core instructions this GPU \(sm_70\) does not have: "
                                         r"it runs on sm_75 and newer"):
        mma.check_arch("fa2-tc", ((7, 5),), cc=(7, 0))
    with pytest.raises(ValueError, match=r"fa2-tc backward needs .* \(sm_75\) .* sm_80, sm_90 and newer"):
        mma.check_arch("fa2-tc backward", geometry.ARCHS[80], cc=(7, 5))
    with pytest.raises(ValueError, match=r"head dim d must be <= 64 .* forward with float32 \(TF32\)"):
        flashnb.attention_forward(*(rng.standard_normal((1, 8, 72)) for _ in range(3)), impl="fa2-tc")
    with pytest.raises(ValueError, match=r"head dim d must be <= 32 .* backward with float32 \(TF32\)"):
        geometry.bwd_default_tiles(40, "float32")
    with pytest.raises(ValueError, match="on sm_75 takes float16 only"):
        geometry.geometry("bfloat16", 64, 64, 32, 4, arch=75)
