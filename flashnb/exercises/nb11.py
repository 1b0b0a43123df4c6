"""Exercises of notebook 11 (what training and inference need: half-precision storage, dropout with a regenerated
mask, flash-decoding)."""

from __future__ import annotations

import numpy as np

from . import Wrong, exercise, require

# --------------------------------------------------------------------------- 11.1

TILES = dict(Br=64, Bc=32, warps=4)   # the tiles 11.1 names (the product kernel's own defaults vary with d)


def _counted_forward_bytes(BH, Nq, Nk, d, storage):
    """HBM bytes the product kernel's forward moves at the tiles ``TILES``, counted on the simulator (the ground
    truth)."""
    from .. import api
    from ..instruments import traffic

    rng = np.random.default_rng(111)
    q = rng.standard_normal((BH, Nq, d)).astype(np.float16)
    k, v = (rng.standard_normal((BH, Nk, d)).astype(np.float16) for _ in range(2))
    with traffic.count() as t:
        api.attention_forward(q, k, v, impl="flash", storage=storage, **TILES)
    return t.global_read_bytes + t.global_write_bytes


@exercise("11.1", "the bytes of a half-precision forward", level=1, minutes=10,
          hint="""At tiles Br = 64, Bc = 32 the product kernel's forward reads Q_i once per block, K and V once per
          Q block (Tr = ceil(Nq / Br) times each), writes O once, and writes L (float32, 4 bytes) once per row.
          Multiply each count of elements by its bytes: 2 for float16 storage, 4 for float32.""",
          explain="""Half storage halves every term but one: L stays float32 (it is a statistic, and its precision
          matters for the backward's exp(S - L)). The K/V term dominates (it is read Tr times), so the total falls by
          almost exactly 2x. On a GPU the kernel is memory-bound at small d, so this is close to a 2x speed-up there;
          at large d the FLOPs dominate and half storage helps through tensor cores instead (which the product
          kernel's FP32 arithmetic does not use; notebook 12's impl="fa2-tc" does).""")
def check_11_1(forward_bytes):
    """forward_bytes(BH, Nq, Nk, d, itemsize) -> HBM bytes (reads + writes) of the product kernel's forward at tiles
    Br = 64, Bc = 32 (no causal mask), with Q, K, V and O stored at ``itemsize`` bytes per element (L is
    float32)."""
    require(callable(forward_bytes), "forward_bytes must be a function (BH, Nq, Nk, d, itemsize) -> bytes")
    for BH, Nq, Nk, d in ((1, 40, 24, 8), (1, 70, 17, 4)):
        for storage, itemsize in (("float16", 2), ("float32", 4)):
            want = _counted_forward_bytes(BH, Nq, Nk, d, storage)
            got = forward_bytes(BH, Nq, Nk, d, itemsize)
            if got != want:
                raise Wrong(f"at BH = {BH}, Nq = {Nq}, Nk = {Nk}, d = {d}, itemsize = {itemsize}: you say {got!r} "
                            f"bytes, the traffic counter counted {'more' if want > got else 'fewer'}")


@check_11_1.solves
def _():
    def forward_bytes(BH, Nq, Nk, d, itemsize):
        Br = 64
        Tr = -(-Nq // Br)
        return BH * (itemsize * (Nq * d + 2 * Tr * Nk * d + Nq * d) + 4 * Nq)

    return dict(forward_bytes=forward_bytes)


@check_11_1.fails
def _():
    def forward_bytes(BH, Nq, Nk, d, itemsize):      # L counted at the storage's size too
        Tr = -(-Nq // 64)
        return BH * itemsize * (Nq * d + 2 * Tr * Nk * d + Nq * d + Nq)

    return dict(forward_bytes=forward_bytes)


# --------------------------------------------------------------------------- 11.2


def _dropout_case(seed):
    from .. import rng as frng

    r = np.random.default_rng(112 + seed)
    Nq, Nk, d, p = 12, 20, 8, 0.25
    q, k, v = r.standard_normal((Nq, d)), r.standard_normal((Nk, d)), r.standard_normal((Nk, d))
    keep = frng.dropout_keep_np(seed, p, 1, Nq, Nk)[0]
    return q, k, v, keep, p


@exercise("11.2", "dropout in the forward, in NumPy", level=2, minutes=15,
          hint="""Compute P = softmax(scale·q kᵀ) from *all* scores (the softmax statistics m, l come from the
          undropped scores), then zero the dropped entries and divide the kept ones by (1 - p): O = (P ∘ Z / (1-p)) V.
          Do not re-normalise the rows after dropping.""",
          explain="""The kernel computes m_i and l_i from the undropped P~ (so L is the plain log-sum-exp and the
          backward rebuilds the plain P from it), and only the P~ V_j product sees the mask. Inverted dropout keeps
          E[O] unchanged: each kept weight is scaled by 1/(1-p). A row of O no longer is a convex combination of V's
          rows; re-normalising would give a different (biased) estimator and a backward that no longer matches.""")
def check_11_2(dropout_forward):
    """dropout_forward(q, k, v, keep, p) -> o: one head, ``q`` (Nq, d), ``k``, ``v`` (Nk, d), ``keep`` a boolean
    (Nq, Nk) array (True = kept), ``p`` the drop probability; scale 1/sqrt(d), no causal mask."""
    from .. import reference

    require(callable(dropout_forward), "dropout_forward must be a function (q, k, v, keep, p) -> o")
    for seed in (3, 4):
        q, k, v, keep, p = _dropout_case(seed)
        want = reference.attention_forward(q, k, v, dropout_mask=keep / (1.0 - p))[0]
        got = np.asarray(dropout_forward(q, k, v, keep, p), dtype=np.float64)
        require(got.shape == want.shape, f"o must have shape {want.shape}, got {got.shape}")
        err = float(np.abs(got - want).max())
        # float64 throughout on both sides: any real mistake is O(0.1), rounding is O(1e-15)
        if not err <= 1e-9:
            raise Wrong(f"o differs from the float64 reference with the same mask by up to {err:.3g} (seed {seed})")


@check_11_2.solves
def _():
    def dropout_forward(q, k, v, keep, p):
        s = q @ k.T / np.sqrt(q.shape[-1])
        P = np.exp(s - s.max(axis=1, keepdims=True))
        P /= P.sum(axis=1, keepdims=True)
        return (P * keep / (1 - p)) @ v

    return dict(dropout_forward=dropout_forward)


@check_11_2.fails
def _():
    def dropout_forward(q, k, v, keep, p):          # softmax over the kept entries only (re-normalised)
        s = q @ k.T / np.sqrt(q.shape[-1])
        P = np.exp(s - s.max(axis=1, keepdims=True)) * keep
        return (P / P.sum(axis=1, keepdims=True)) @ v

    return dict(dropout_forward=dropout_forward)


@check_11_2.fails
def _():
    def dropout_forward(q, k, v, keep, p):          # the 1/(1-p) forgotten
        s = q @ k.T / np.sqrt(q.shape[-1])
        P = np.exp(s - s.max(axis=1, keepdims=True))
        return (P / P.sum(axis=1, keepdims=True) * keep) @ v

    return dict(dropout_forward=dropout_forward)


# --------------------------------------------------------------------------- 11.3


@exercise("11.3", "merging split-KV partials", level=1, minutes=10,
          hint="""Each split s gives O_s (normalised over its own keys) and L_s = log Σ_{j in s} exp(s_j). The whole
          row has L = log Σ_s exp(L_s) (a log-sum-exp: subtract the max first), and O = Σ_s exp(L_s - L) O_s. A split
          that saw no allowed key has L_s = -inf and weight 0.""",
          explain="""This is stage 2's merge operator [m, l] ⊕ [m', l'] written with L = m + log l: the weights
          exp(L_s - L) are each split's share of the row's softmax mass. Flash-decoding's merge kernel does exactly
          this, one warp per query row, after the split kernel wrote (O_s, L_s) for every split.""")
def check_11_3(merge):
    """merge(O_parts, L_parts) -> (O, L): ``O_parts`` (S, Nq, d) and ``L_parts`` (S, Nq) of S splits of the keys
    (a split with no key for a row has L = -inf and any O); returns the whole rows' O (Nq, d) and L (Nq,)."""
    from .. import reference

    require(callable(merge), "merge must be a function (O_parts, L_parts) -> (O, L)")
    r = np.random.default_rng(113)
    Nq, Nk, d = 3, 40, 8
    q, k, v = r.standard_normal((Nq, d)) * 2, r.standard_normal((Nk, d)) * 2, r.standard_normal((Nk, d))
    bounds = [0, 7, 7, 25, 40]                          # the second split is empty
    O_parts, L_parts = [], []
    for a, b in zip(bounds, bounds[1:]):
        if a == b:
            O_parts.append(np.full((Nq, d), np.nan))     # nothing computed there: any O, and L = -inf
            L_parts.append(np.full(Nq, -np.inf))
            continue
        o, lse = reference.attention_forward(q, k[a:b], v[a:b], scale=1 / np.sqrt(d))
        O_parts.append(o)
        L_parts.append(lse)
    O_want, L_want = reference.attention_forward(q, k, v, scale=1 / np.sqrt(d))
    out = merge(np.array(O_parts), np.array(L_parts))
    require(isinstance(out, tuple) and len(out) == 2, "merge must return a pair (O, L)")
    O, L = (np.asarray(x, dtype=np.float64) for x in out)
    require(O.shape == O_want.shape and L.shape == L_want.shape,
            f"O must have shape {O_want.shape} and L {L_want.shape}, got {O.shape} and {L.shape}")
    # float64 throughout: rounding is ~1e-15, a wrong weighting is O(0.1)
    if not np.all(np.isfinite(O)):
        raise Wrong("O has NaN or inf: a split with L = -inf must get weight 0 (and its O must not be used)")
    if np.abs(L - L_want).max() > 1e-9:
        raise Wrong("L is not the log-sum-exp of the whole row")
    if np.abs(O - O_want).max() > 1e-9:
        raise Wrong("O is not attention over all the keys: check the weights exp(L_s - L)")


@check_11_3.solves
def _():
    def merge(O_parts, L_parts):
        m = L_parts.max(axis=0)
        w = np.exp(L_parts - m)                         # exp(-inf) = 0: empty splits drop out
        L = m + np.log(w.sum(axis=0))
        w = w / w.sum(axis=0)
        return np.einsum("sq,sqd->qd", w, np.nan_to_num(O_parts)), L

    return dict(merge=merge)


@check_11_3.fails
def _():
    def merge(O_parts, L_parts):                        # the plain mean of the non-empty splits
        ok = np.isfinite(L_parts)
        O = np.nansum(np.where(ok[..., None], O_parts, 0), axis=0) / ok.sum(axis=0)[:, None]
        return O, np.log(np.exp(L_parts).sum(axis=0))

    return dict(merge=merge)
