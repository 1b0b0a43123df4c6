"""Stage 5 -- block-sparse FlashAttention (FA1 paper, Algorithm 5 and Proposition 4) on the FA2 kernels.

A *block mask* ``M`` of shape ``(ceil(Nq/Br), ceil(Nk/Bc))`` says which ``(Q block i, K/V block j)`` pairs are
computed: Algorithm 5 is Algorithm 2 with ``if M_ij != 0`` around the body of the inner loop, so a block
with ``M_ij = 0`` is never loaded and never computed, and the attention is restricted to the allowed blocks:
``S_ij = -inf`` wherever ``M = 0``.  Its HBM traffic is Θ(Nd + N²d²s/M) (Proposition 4), ``s`` the fraction
of nonzero blocks: the tile term shrinks with ``s``, the ``Nd`` term (Q read, O written once) does not.

There is no second kernel here: :mod:`flashnb.stages.fa2`'s kernel factories take a compile-time ``sparse`` flag
(``if sparse and M[z, i, j] == 0: continue``), and ``impl="fa2"`` takes ``block_mask=`` -- a
:class:`BlockMask` (the boolean array *and* the tiles it was built for) or a plain boolean array read at the
forward's tiles.  :func:`flashnb.stages.fa2.block_tiles` explains how the mask maps onto the forward's and the
backward's (smaller) tiles.

Patterns (each returns a :class:`BlockMask`; on the *block* grid, aligned like the causal mask to the
bottom-right corner: the rows of query block ``I`` have their diagonal keys in key blocks
``J_lo(I) .. J_hi(I)``, one block when ``Br <= Bc`` and the block grid is aligned):

* :func:`causal` -- the blocks the causal mask needs (exactly the tiles fa2's causal skipping visits);
* :func:`local` -- a sliding window of ``window`` key blocks ending at the diagonal (or around it);
* :func:`strided`, :func:`fixed` -- the two factorised patterns of Sparse Transformers (Child et al. 2019),
  at block granularity: strided = local window of ``stride`` blocks + every ``stride``-th block behind;
  fixed = the blocks of the query's own chunk of ``stride`` blocks + the last ``c`` blocks of every chunk;
* :func:`butterfly` -- the flat block butterfly the FA1 paper uses: block ``(I, J)`` when ``J`` and the
  diagonal block differ in at most one bit;
* :func:`random` -- exactly ``round(density · Tr · Tc)`` blocks, seeded.

A query row whose blocks are all zero has no key: ``O = 0``, ``LSE = -inf``, zero gradients (not NaN).
"""

from __future__ import annotations

import functools

import numpy as np

from ..common import cdiv, positive_int
from ..registry import register_impl
from . import fa2
from .fa2 import BlockMask

__all__ = ["BlockMask", "causal", "local", "strided", "fixed", "butterfly", "random", "dense", "PATTERNS",
           "forward", "backward"]


# --------------------------------------------------------------------------- patterns


def _grid(Nq, Nk, Br, Bc):
    """Block indices ``I`` (column) and ``J`` (row), and the key blocks ``J_lo(I) .. J_hi(I)`` holding the
    diagonal keys ``i + Nk - Nq`` of block I's first and last rows (negative: before the first key)."""
    for name, n in (("Nq", Nq), ("Nk", Nk), ("Br", Br), ("Bc", Bc)):
        positive_int(name, n)
    Tr, Tc = cdiv(Nq, Br), cdiv(Nk, Bc)
    I = np.arange(Tr)[:, None]
    J = np.arange(Tc)[None, :]
    diag = Nk - Nq
    lo = np.floor_divide(I * Br + diag, Bc)
    hi = np.floor_divide(np.minimum((I + 1) * Br, Nq) - 1 + diag, Bc)
    return I, J, lo, hi


def _make(allowed, Br, Bc):
    return BlockMask(np.ascontiguousarray(allowed, dtype=bool), Br, Bc)


def dense(Nq, Nk, Br, Bc) -> BlockMask:
    """Every block (s = 1): dense attention through the block-sparse kernels."""
    return _make(np.ones((cdiv(Nq, Br), cdiv(Nk, Bc)), dtype=bool), Br, Bc)


def causal(Nq, Nk, Br, Bc) -> BlockMask:
    """The blocks holding at least one key ``j <= i + Nk - Nq`` (bottom-right causal): with ``causal=True``
    exact causal attention; alone, the diagonal blocks are computed in full."""
    I, J, lo, hi = _grid(Nq, Nk, Br, Bc)
    return _make(J <= hi, Br, Bc)


def local(Nq, Nk, Br, Bc, window: int = 2, *, causal: bool = True) -> BlockMask:
    """Sliding window: ``window`` key blocks ending at the diagonal block (``causal``), or ``window - 1``
    blocks on each side of the diagonal blocks (not causal).  ``window = 1``: the diagonal blocks only."""
    window = positive_int("window", window)
    I, J, lo, hi = _grid(Nq, Nk, Br, Bc)
    if causal:
        return _make((J > lo - window) & (J <= hi), Br, Bc)
    return _make((J > lo - window) & (J < hi + window), Br, Bc)


def strided(Nq, Nk, Br, Bc, stride: int = 2, *, causal: bool = True) -> BlockMask:
    """Sparse Transformers' strided pattern in blocks: the local window of ``stride`` blocks, and every
    ``stride``-th key block counted back from the diagonal block."""
    stride = positive_int("stride", stride)
    I, J, lo, hi = _grid(Nq, Nk, Br, Bc)
    every = (lo - J) % stride == 0
    if causal:
        every &= J <= hi
    return _make(every | local(Nq, Nk, Br, Bc, stride, causal=causal).mask, Br, Bc)


def fixed(Nq, Nk, Br, Bc, stride: int = 4, c: int = 1, *, causal: bool = True) -> BlockMask:
    """Sparse Transformers' fixed pattern in blocks: the key blocks of the query's own chunk of ``stride``
    blocks, and the last ``c`` blocks of every chunk ("summary" blocks)."""
    stride = positive_int("stride", stride)
    c = positive_int("c", c)
    if c > stride:
        raise ValueError(f"c must be <= stride, got c={c}, stride={stride}")
    I, J, lo, hi = _grid(Nq, Nk, Br, Bc)
    own = (J // stride >= np.maximum(lo, 0) // stride) & (J // stride <= np.maximum(hi, 0) // stride)
    summary = np.broadcast_to(J % stride >= stride - c, own.shape)
    allowed = own | summary
    if causal:
        allowed &= J <= hi
    return _make(allowed, Br, Bc)


def butterfly(Nq, Nk, Br, Bc, *, causal: bool = False) -> BlockMask:
    """Flat block butterfly: block ``(I, J)`` when ``J`` and a diagonal block ``J_lo(I) .. J_hi(I)`` differ in
    at most one bit (``J xor J_diag`` is 0 or a power of two): ``~log2(Tc) + 1`` blocks per block row."""
    I, J, lo, hi = _grid(Nq, Nk, Br, Bc)
    allowed = np.zeros(np.broadcast_shapes(I.shape, J.shape), dtype=bool)
    for r in range(allowed.shape[0]):
        for jd in range(max(lo[r, 0], 0), max(hi[r, 0], 0) + 1):
            x = J[0] ^ jd
            allowed[r] |= (x & (x - 1)) == 0
    if causal:
        allowed &= J <= hi
    return _make(allowed, Br, Bc)


def random(Nq, Nk, Br, Bc, density: float = 0.5, *, seed: int = 0, lead: tuple = ()) -> BlockMask:
    """Exactly ``round(density · Tr · Tc)`` nonzero blocks (per leading problem), chosen uniformly; seeded."""
    if isinstance(density, (bool, np.bool_)) or not isinstance(density, (int, float, np.integer, np.floating)) \
            or not 0 <= density <= 1:
        raise ValueError(f"density must be a number in [0, 1], got {density!r}")
    Tr, Tc = cdiv(Nq, Br), cdiv(Nk, Bc)
    rng = np.random.default_rng(seed)
    n = int(round(density * Tr * Tc))
    out = np.zeros((int(np.prod(lead, dtype=np.int64)), Tr * Tc), dtype=bool)
    for row in out:
        row[rng.choice(Tr * Tc, size=n, replace=False)] = True
    return _make(out.reshape(tuple(lead) + (Tr, Tc)), Br, Bc)


PATTERNS = {"causal": causal, "local": local, "strided": strided, "fixed": fixed, "butterfly": butterfly,
            "random": random}


# --------------------------------------------------------------------------- impl="fa2-sparse"


WINDOW = 1   # fa2-sparse's default: each query block sees only its diagonal key block(s)
BLOCK = 16   # fa2-sparse's default mask blocks (Br = Bc): small, so the sparsity shows at tour sizes


def _window_block_mask(Nq, Nk, d, causal_, window, Br, Bc):
    return local(Nq, Nk, BLOCK if Br is None else Br, BLOCK if Bc is None else Bc, window, causal=causal_)


def reference_mask(Nq, Nk, d, causal, *, window=WINDOW, Br=None, Bc=None, warps=None):
    """The element mask ``impl="fa2-sparse"`` applies (for ``reference.attention_forward(..., mask=)``)."""
    return _window_block_mask(Nq, Nk, d, causal, window, Br, Bc).expand(Nq, Nk)


@functools.lru_cache(maxsize=64)
def _prepared(direction, BH, Nq, Nk, d, causal_, window, Br, Bc, warps):
    """The window mask mapped onto the launch's tiles and copied to the device, once per problem shape."""
    bm = _window_block_mask(Nq, Nk, d, causal_, window, Br, Bc)
    return fa2.prepare_block_mask(bm, direction=direction, BH=BH, Nq=Nq, Nk=Nk, d=d, Br=Br, Bc=Bc, warps=warps)


def model_forward(BH, Nq, Nk, d, *, causal=False, window=WINDOW, Br=None, Bc=None, warps=None):
    """Element accesses of ``impl="fa2-sparse"``'s forward: fa2's model with the window mask."""
    bm = _window_block_mask(Nq, Nk, d, causal, window, Br, Bc)
    return fa2.model_forward(BH, Nq, Nk, d, causal=causal, Br=Br, Bc=Bc, warps=warps, block_mask=bm)


def model_backward(BH, Nq, Nk, d, *, causal=False, window=WINDOW, Br=None, Bc=None, warps=None):
    """Element accesses of ``impl="fa2-sparse"``'s backward: fa2's model with the window mask."""
    bm = _window_block_mask(Nq, Nk, d, causal, window, Br, Bc)
    return fa2.model_backward(BH, Nq, Nk, d, causal=causal, Br=Br, Bc=Bc, warps=warps, block_mask=bm)


def _lower_right_only(causal, Nq, Nk):
    """fa2-sparse's window follows the bottom-right diagonal; a top-left causal mask differs when Nq != Nk."""
    if causal == "upper_left" and Nq != Nk:
        raise ValueError(f"impl 'fa2-sparse' aligns its window and causal mask bottom-right; causal='upper_left' "
                         f"needs Nq == Nk (got Nq={Nq}, Nk={Nk}): use impl='fa2' with block_mask= instead")


def forward(q, k, v, *, causal=False, scale, window=WINDOW, Br=None, Bc=None, warps=None):
    """``impl="fa2-sparse"``: local attention -- fa2 with a sliding-window block mask of ``window`` key blocks
    (:func:`local`) of ``Br x Bc`` elements (default ``BLOCK x BLOCK``).  It is *not* dense attention: check
    it against the reference with :func:`reference_mask`.  Pass ``block_mask=`` to ``impl="fa2"`` for any
    other pattern."""
    _lower_right_only(causal, q.shape[1], k.shape[1])
    pm = _prepared("forward", q.shape[0], q.shape[1], k.shape[1], q.shape[2], bool(causal), window, Br, Bc, warps)
    return fa2.forward(q, k, v, causal=causal, scale=scale, block_mask=pm)


def backward(q, k, v, o, lse, do, *, causal=False, scale, window=WINDOW, Br=None, Bc=None, warps=None):
    """The backward of :func:`forward`: the same window mask, skipped on the backward's tiles."""
    _lower_right_only(causal, q.shape[1], k.shape[1])
    pm = _prepared("backward", q.shape[0], q.shape[1], k.shape[1], q.shape[2], bool(causal), window, Br, Bc, warps)
    return fa2.backward(q, k, v, o, lse, do, causal=causal, scale=scale, block_mask=pm)


register_impl("fa2-sparse", stage="5",
              description="block-sparse FA2 (FA1 Alg. 5): local attention, K/V tiles outside a sliding window "
                          f"of `window` (default {WINDOW}) key blocks are never loaded",
              forward=forward, backward=backward, options=("window", "Br", "Bc", "warps"),
              reference_mask=reference_mask)


#: Names that moved out of this lesson, by their old name: its GPU measurement lives with the instruments
#: (:mod:`flashnb.instruments.measure.block_sparse`), which build on the stages; ``block_sparse.measure_gpu`` still
#: reaches it.
MOVED = {"measure_gpu": "flashnb.instruments.measure.block_sparse"}


def __getattr__(attr):
    if attr in MOVED:
        import importlib

        return getattr(importlib.import_module(MOVED[attr]), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
