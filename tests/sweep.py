"""The head-dim sweep's machinery: which head dims each impl's index arithmetic changes at, and which cases a CI run
takes.

A kernel is compiled for one head dim ``d`` at a time, and what it computes from ``d`` -- padded widths, register
micro-tiles, how many parts dQ_i is cut into, whether K_j's fragments stay in registers, the default tiles -- is
its *geometry*.  :func:`geometry_key` asks the library's own geometry functions for it; a *boundary* is a head dim
whose geometry differs from its neighbour's (both sides are kept: ``d - 1`` and ``d``).  A wrong part count or an
out-of-bounds register index shows at such a boundary, not at the favourite sizes 32, 64 and 128.

The exhaustive sweep (every ``d`` in 1..128, every storage, causal and not) is marked ``slow``; a CI run takes every
boundary of the tensor-core backward's dQ parts and of each default-tile class, plus a rotating sample of the
rest: the rotation is seeded by the checked-out commit (``FLASHNB_SWEEP_SEED`` overrides it), so a given commit
always runs the same cases and successive commits cover different ones.
"""

from __future__ import annotations

import os
import subprocess
import zlib
from pathlib import Path

import numpy as np

D_MAX = 128


def _items(g: dict, drop=("d",)) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in g.items() if k not in drop))


def _try(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except ValueError as e:                    # a head dim this direction or storage refuses
        return ("refused", str(e).split(",")[0])


def geometry_key(impl: str, d: int, storage: str = "float32") -> tuple:
    """What ``impl``'s kernels compute from the head dim ``d`` (in ``storage``): the default tiles and the
    geometry derived from them, forward and backward, as the library's own functions give them."""
    from flashnb.kernels import blocks, decode, tiles
    from flashnb.kernels.launch import decode as decode_host
    from flashnb.kernels.tensorcore import geometry as tc_geometry
    from flashnb.stages import fa1, fa2, fa2_fast

    if impl == "fa2-tc":
        def fwd():
            t = tc_geometry.default_tiles(d, storage)
            return _items(t) + _items(tc_geometry.geometry(storage, d, **t))

        def bwd():
            t = tc_geometry.bwd_default_tiles(d, storage)
            return _items(t) + _items(tc_geometry.bwd_geometry(storage, d, **t))
        return (_try(fwd), _try(bwd))
    if impl in ("flash", "fa2-fast"):
        fwd_t = tiles.default_tiles(d) if impl == "flash" else fa2_fast.default_tiles(d)
        bwd_t = tiles.bwd_default_tiles(d) if impl == "flash" else fa2_fast.bwd_default_tiles(d)
        return (_items(fwd_t), _items(blocks.geometry(d=d, **fwd_t)), _items(bwd_t),
                _items(blocks.bwd_geometry(d=d, **bwd_t)))
    if impl in ("fa2", "fa2-rows", "fa2-splitq", "fa2-sparse"):
        out = []
        for direction in ("forward", "backward"):
            t = fa2.default_tiles(d, direction)
            out += [_items(t), _items(fa2.geometry(t["Br"], t["Bc"], d, t["warps"])),
                    _items(fa2.geometry(t["Bc"], t["Br"], d, t["warps"]))]
        return tuple(out)
    if impl == "fa1":
        return _items(fa1.tiles(d), drop=("d", "shared_bytes_forward", "shared_bytes_backward"))
    if impl == "flash-decoding":
        return (decode_host.default_warps(d), -(-d // decode.WARP))
    return ()                                   # naive, onepass: nothing but d itself


def boundaries(impl: str, storage: str = "float32") -> list[int]:
    """Every head dim whose geometry differs from its neighbour's (both of them), and 1 and 128."""
    keys = [geometry_key(impl, d, storage) for d in range(1, D_MAX + 1)]
    out = {1, D_MAX}
    for d in range(2, D_MAX + 1):
        if keys[d - 1] != keys[d - 2]:
            out |= {d - 1, d}
    return sorted(out)


def rotation_seed() -> int:
    """``FLASHNB_SWEEP_SEED``, else a hash of the checked-out commit, else 0 (outside a git checkout)."""
    if os.environ.get("FLASHNB_SWEEP_SEED"):
        return int(os.environ["FLASHNB_SWEEP_SEED"])
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        head = ""
    return zlib.crc32(head.encode()) if head else 0


def sample(cases: list, k: int, salt: str) -> list:
    """``k`` of ``cases``, chosen by the rotation seed and ``salt`` (deterministic for a commit)."""
    if len(cases) <= k:
        return list(cases)
    rng = np.random.default_rng([rotation_seed(), zlib.crc32(salt.encode())])
    return [cases[i] for i in sorted(rng.choice(len(cases), size=k, replace=False))]


def cases(impls_storages, *, boundary_k=16, other_k=2) -> tuple[list, list]:
    """``(ci, exhaustive)`` pytest params ``(impl, storage, d, causal)`` for ``[(impl, [storages])]``: every head dim,
    causal and not, in the exhaustive list; in the CI list a rotating sample of ``boundary_k`` boundaries and
    ``other_k`` other head dims per impl and storage, each with one causal setting (rotating too)."""
    ci, full = [], []
    for impl, storages in impls_storages:
        for storage in storages:
            b = boundaries(impl, storage)
            rest = [d for d in range(1, D_MAX + 1) if d not in b]
            picked = sample(b, boundary_k, f"{impl}/{storage}/b") + sample(rest, other_k, f"{impl}/{storage}/o")
            flip = np.random.default_rng([rotation_seed(), zlib.crc32(f"{impl}/{storage}/c".encode())])
            for d in sorted(picked):
                ci.append((impl, storage, d, bool(flip.integers(2))))
            full += [(impl, storage, d, c) for d in range(1, D_MAX + 1) for c in (False, True)]
    return ci, full


# float32 impls: float32 accumulation of O(1) terms over at most 128 head-dim columns and 36 keys (errors measured
# ~1e-7 .. 1e-6 against float64); the same bounds as the stage tests (tests/stages/test_fa2.py), far below what a
# dropped column or a wrong tile gives (O(0.1)).
FWD = dict(atol=2e-5, rtol=2e-5)
BWD = dict(atol=1e-4, rtol=1e-4)
# TF32 (fa2-tc's float32 path): 10 of float32's 23 mantissa bits, see tests/kernels/test_flash_tc.py
TF32 = dict(atol=5e-3, rtol=5e-3)


def check_head_dim(rng, impl: str, storage: str, d: int, causal: bool, Nq: int = 20, Nk: int = 36) -> None:
    """``impl`` at head dim ``d`` in ``storage``, forward and (where it has one) backward, against the float64
    reference: every element written, within the tolerance of its precision (FlashAttention's rule for halves).
    An impl that refuses ``d`` must say so with a ValueError naming the head dim."""
    import pytest
    from conftest import assert_close

    import flashnb
    from flashnb import reference, registry

    entry = registry.IMPLS[impl]
    if impl == "flash-decoding":
        Nq = 3                                     # a few queries against the cache
    opts = {"storage": storage} if "storage" in entry.options else {}
    mask = entry.mask_for(Nq, Nk, d, causal)
    if storage == "float32":
        q, k, v, do = (rng.standard_normal(s) for s in ((1, Nq, d), (1, Nk, d), (1, Nk, d), (1, Nq, d)))
        exact = (q, k, v, do)
    else:
        from half_rule import half_inputs, maxerr, torch_half, values
        (q, k, v, do), exact, tensors = half_inputs(rng, storage, (1, Nq, d), Nk)
    try:
        o, lse = flashnb.attention_forward(q, k, v, causal=causal, impl=impl, **opts)
    except ValueError as e:
        assert "head dim" in str(e) and str(d) in str(e), e    # refused by name, never silently
        pytest.skip(f"{impl} refuses d={d} in {storage}: {e}")
    o_ref, lse_ref = reference.attention_forward(*exact[:3], causal=causal, mask=mask)
    tf32 = storage == "float32" and entry.precision == "tf32"
    if storage == "float32":
        assert_close(o, o_ref, **(TF32 if tf32 else FWD), what=f"{impl} d={d} o")
        assert_close(lse, lse_ref, **(TF32 if tf32 else FWD), what=f"{impl} d={d} lse")
    else:
        pt = torch_half(*tensors, causal, 1 / np.sqrt(d))
        got = values(o, storage)
        assert not np.isnan(got).any() and not np.isnan(lse).any(), "an output element was never written"
        assert maxerr(got, o_ref) <= 2 * maxerr(pt[0], o_ref), (d, maxerr(got, o_ref), maxerr(pt[0], o_ref))
    if entry.backward is None:
        return
    try:
        grads = flashnb.attention_backward(q, k, v, o, lse, do, causal=causal, impl=impl, **opts)
    except ValueError as e:
        assert "head dim" in str(e) and str(d) in str(e), e
        pytest.skip(f"{impl}'s backward refuses d={d} in {storage}: {e}")
    refs = reference.attention_backward(*exact, causal=causal, mask=mask)
    for name, g, r, i in zip(("dq", "dk", "dv"), grads, refs, range(3)):
        if storage == "float32":
            assert_close(g, r, **(TF32 if tf32 else BWD), what=f"{impl} d={d} {name}")
        else:
            got = values(g, storage)
            assert not np.isnan(got).any(), f"{name}: an element was never written"
            assert maxerr(got, r) <= 3 * maxerr(pt[1 + i], r), (name, d, maxerr(got, r), maxerr(pt[1 + i], r))
