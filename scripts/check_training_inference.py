#!/usr/bin/env python
"""Notebook 11's features against the float64 reference on random shapes the test suite never uses.

    python scripts/check_training_inference.py [--seed 1] [--cases 6] [--impl flash]

* **float16 storage** (``--impl``: ``"flash"``, the product kernel, the impl with both features): inputs of large
  magnitude (q, k up to ~30, v up to ~300), Nq != Nk, causal or not, forward and backward, against the float64
  reference run on the same float16 values (a gradient beyond float16's 65504 must be refused with a ValueError).
* **dropout** (the same impl, ``dropout_p``, ``seed``): forward and backward against the reference with the mask
  reproduced in NumPy from the same Philox counters (``flashnb.rng.dropout_scale_np``), and the keep rate of every
  case within 5 standard deviations of ``1 - p``.
* **flash-decoding** (``flashnb.kernels.decode``): cache lengths, split counts, query counts (1..8), head groups and
causal
  alignments drawn at random, against the reference on the cache's first ``length`` keys.

Prints one line per case and exits 1 if any case is off.  About a minute on the simulator at the default size.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np

import flashnb
from flashnb import reference
from flashnb import rng as frng
from flashnb.kernels.launch import decode

IMPL = "flash"        # the impl the half-storage and dropout cases run (--impl)

HEAD_DIMS = (1, 5, 8, 16, 24, 33, 64)


def _fp16_forward_tol(q, k, v, scale):
    """float16 storage: o is rounded once (2^-11 relative to |o| <= max|v|); the float32 scores carry a relative
    error of about d·2^-24 of scale·Σ|q||k| (one rounding per product and per partial sum), which moves exp(s - m)
    by as much (relative): bound both with a factor 4."""
    d = q.shape[-1]
    score = abs(scale) * float(np.max(np.abs(q.astype(np.float64)) @ np.abs(k.astype(np.float64)).swapaxes(-1, -2)))
    vmax = float(np.abs(v).max())
    return 4 * vmax * (2.0 ** -11 + d * 2.0 ** -24 * (1 + score))


def _backward_with_stored_o(q, k, v, o, do, causal, scale):
    """float64 gradients with ``D = rowsum(do ∘ o)`` taken from the *stored* (float16-rounded) o, as every
    FlashAttention backward does: where the gradients are small against ``|do|·|v|`` (a peaked softmax), ``dP - D``
    cancels and o's rounding (2^-11 of |o|) is the whole answer, so the exact-o reference is not the right yardstick
    there.  Rows with no allowed key have P = 0."""
    Q, K, V, O, dO = (a.astype(np.float64) for a in (q, k, v, o, do))
    Nq, Nk = Q.shape[1], K.shape[1]
    S = scale * Q @ K.swapaxes(1, 2)
    if causal:
        S = np.where(np.arange(Nk)[None, :] > np.arange(Nq)[:, None] + Nk - Nq, -np.inf, S)
    m = S.max(axis=2, keepdims=True)
    P = np.where(np.isfinite(m), np.exp(S - np.where(np.isfinite(m), m, 0)), 0.0)
    P = P / np.maximum(P.sum(axis=2, keepdims=True), 1e-300)
    dP, D = dO @ V.swapaxes(1, 2), (dO * O).sum(axis=2, keepdims=True)
    dS = P * (dP - D)
    mass = P * (np.abs(dP) + np.abs(D))          # what a relative error of P turns into, per element of dS
    grads = scale * dS @ K, scale * dS.swapaxes(1, 2) @ Q, P.swapaxes(1, 2) @ dO
    return grads, (abs(scale) * float(np.abs(K).max()) * float(mass.sum(axis=2).max()),
                   abs(scale) * float(np.abs(Q).max()) * float(mass.sum(axis=1).max()), 0.0)


def check_half(rng, case) -> bool:
    BH, Nq, Nk, d = int(rng.integers(1, 3)), int(rng.integers(1, 90)), int(rng.integers(1, 90)), \
        int(rng.choice(HEAD_DIMS))
    causal = bool(rng.integers(0, 2))
    q, k = ((rng.standard_normal((BH, n, d)) * rng.uniform(1, 30)).astype(np.float16) for n in (Nq, Nk))
    v = (rng.standard_normal((BH, Nk, d)) * rng.uniform(1, 300)).astype(np.float16)
    do = (rng.standard_normal((BH, Nq, d)) * rng.uniform(0.01, 3)).astype(np.float16)
    scale = 1 / math.sqrt(d)
    o, lse = flashnb.attention_forward(q, k, v, impl=IMPL, causal=causal)
    f64 = [a.astype(np.float64) for a in (q, k, v, do)]
    o_ref, lse_ref = reference.attention_forward(*f64[:3], causal=causal)
    tol = _fp16_forward_tol(q, k, v, scale)
    ok = np.isfinite(lse_ref)
    err_o = float(np.abs(o.astype(np.float64) - o_ref).max())
    refs = reference.attention_backward(*f64[:3], f64[3], causal=causal)
    biggest = max(float(np.abs(r).max()) for r in refs)
    try:
        grads = flashnb.attention_backward(q, k, v, o, lse, do, impl=IMPL, causal=causal)
    except ValueError as exc:                    # a gradient beyond float16's range must be this error, never inf
        good = "overflows float16" in str(exc) and biggest > 65504 * (1 - 2.0 ** -8) and err_o <= tol
        print(f"half    {case}: BH={BH} Nq={Nq} Nk={Nk} d={d} causal={causal}: |o - ref| {err_o:.2e} "
              f"(bound {tol:.2e}); largest reference gradient {biggest:.3g}: backward refused ({str(exc)[:40]}...) -> "
              f"{'ok' if good else 'FAIL'}")
        return good
    # gradients against float64 with the stored o in D (see _backward_with_stored_o), measured against what the
    # float32 kernels do with the same values (float16 inputs and the stored o, widened): float16 storage may add
    # its own rounding of dq, dk, dv (2^-11 relative, one fp16 spacing for dq's atomics order) to float32's error,
    # nothing more.  Where a peaked softmax makes dP - D cancel, float32's error is the yardstick, not the size of
    # the gradients; a wrong index or mask gives errors of the gradients' own size.
    refs, _ = _backward_with_stored_o(q, k, v, o, do, causal, scale)
    f32 = flashnb.attention_backward(*(a.astype(np.float32) for a in (q, k, v, o)), lse, do.astype(np.float32),
                                     impl=IMPL, causal=causal, storage="float32", check_forward=False)
    # (+ 2^-24: float16's subnormal spacing, the absolute rounding of gradients below 6.1e-5)
    bounds = [2 * float(np.abs(g32 - r).max()) + 2.0 ** -10 * float(np.abs(r).max()) + 2.0 ** -24
              for g32, r in zip(f32, refs)]
    errs = [float(np.abs(g.astype(np.float64) - r).max()) / b for g, r, b in zip(grads, refs, bounds)]
    good = (o.dtype == np.float16 and err_o <= tol and all(e <= 1 for e in errs)
            and np.array_equal(np.isfinite(lse), ok))
    print(f"half    {case}: BH={BH} Nq={Nq} Nk={Nk} d={d} causal={causal}: |o - ref| {err_o:.2e} (bound {tol:.2e}), "
          f"grad errors / bound {', '.join(f'{e:.2f}' for e in errs)} -> {'ok' if good else 'FAIL'}")
    return good


def check_dropout(rng, case) -> bool:
    BH, Nq, Nk, d = int(rng.integers(1, 4)), int(rng.integers(1, 80)), int(rng.integers(1, 80)), \
        int(rng.choice(HEAD_DIMS))
    causal, p, seed = bool(rng.integers(0, 2)), float(rng.choice((0.1, 0.5, 0.9))), int(rng.integers(0, 2 ** 63))
    q, k, v, do = (rng.standard_normal((BH, n, d)) for n in (Nq, Nk, Nk, Nq))
    o, lse = flashnb.attention_forward(q, k, v, impl=IMPL, causal=causal, dropout_p=p, seed=seed)
    W = frng.dropout_scale_np(seed, p, BH, Nq, Nk)
    o_ref, _ = reference.attention_forward(q, k, v, causal=causal, dropout_mask=W)
    grads = flashnb.attention_backward(q, k, v, o, lse, do, impl=IMPL, causal=causal, dropout_p=p, seed=seed)
    refs = reference.attention_backward(q, k, v, do, causal=causal, dropout_mask=W)
    # float32 vs float64 with weights up to 1/(1-p): scripts/check_random_shapes.py's bounds times 1/(1-p)
    err_o = float(np.abs(o - o_ref).max())
    err_g = max(float(np.abs(g - r).max()) for g, r in zip(grads, refs))
    keep = frng.dropout_keep_np(seed, p, BH, Nq, Nk)
    n = keep.size
    z = abs(keep.sum() - n * (1 - p)) / math.sqrt(n * p * (1 - p))
    good = err_o <= 1e-4 / (1 - p) and err_g <= 1e-3 / (1 - p) and z <= 5
    print(f"dropout {case}: BH={BH} Nq={Nq} Nk={Nk} d={d} causal={causal} p={p}: |o - ref| {err_o:.1e}, "
          f"|grad - ref| {err_g:.1e}, keep rate {keep.mean():.3f} ({z:.1f} sigma from {1 - p:.2f}) -> "
          f"{'ok' if good else 'FAIL'}")
    return good


def check_decode(rng, case) -> bool:
    Hkv, G, Nq, d = int(rng.integers(1, 3)), int(rng.choice((1, 2, 4))), int(rng.integers(1, 9)), \
        int(rng.choice(HEAD_DIMS))
    length = int(rng.integers(1, 129))
    splits = int(rng.integers(1, 13))
    causal = [True, False, "upper_left"][int(rng.integers(0, 3))]
    q = rng.standard_normal((Hkv * G, Nq, d))
    k, v = (rng.standard_normal((Hkv, length, d)) for _ in range(2))
    cut = int(rng.integers(0, length + 1))          # two appends, at a random split point
    cache = decode.KVCache(Hkv, length + int(rng.integers(0, 40)), d)
    if cut:
        cache.append(k[:, :cut], v[:, :cut])
    if cut < length:
        cache.append(k[:, cut:], v[:, cut:])
    O, L = decode.decode(q, cache, causal=causal, num_splits=splits)
    O, L = O.copy_to_host(), L.copy_to_host()
    kq, vq = np.repeat(k, G, axis=0), np.repeat(v, G, axis=0)
    o_ref, lse_ref = reference.attention_forward(q, kq, vq, causal=causal)
    finite = np.isfinite(lse_ref)
    err_o = float(np.abs(O - o_ref).max())
    err_l = float(np.abs(L[finite] - lse_ref[finite]).max()) if finite.any() else 0.0
    good = err_o <= 1e-4 and err_l <= 1e-4 and np.array_equal(np.isfinite(L), finite)
    print(f"decode  {case}: H_kv={Hkv} G={G} Nq={Nq} d={d} length={length} splits={splits} causal={causal}: "
          f"|O - ref| {err_o:.1e}, |L - ref| {err_l:.1e} -> {'ok' if good else 'FAIL'}")
    return good


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--cases", type=int, default=6, help="cases of each kind")
    p.add_argument("--impl", default="flash", choices=("flash",), help="the impl of the half-storage and "
                   "dropout cases (default: flash, the product kernel)")
    args = p.parse_args(argv)
    global IMPL
    IMPL = args.impl
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    results = [check(rng, i) for check in (check_half, check_dropout, check_decode) for i in range(args.cases)]
    print(f"{sum(results)} of {len(results)} cases ok in {time.perf_counter() - t0:.0f} s (seed {args.seed})")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
