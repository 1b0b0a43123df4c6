"""One step of ring attention on one rank: which (query rows, keys) blocks to compute, how, and the merge.

At step ``t`` rank ``r`` holds its queries (global positions ``q_pos``) and the K/V shard of rank
``src = (r − t) mod W`` (positions ``k_pos``).  The causal mask is a mask of *global* positions,
``key ≤ query``; both position lists are increasing, so query row ``i`` sees a prefix of the keys, of length

    c_i = #{j : k_pos[j] ≤ q_pos[i]}       (nondecreasing in i).

:func:`plan` cuts the rows into runs that a kernel computes with the mask it already has:

* ``c`` constant over the rows (= ``m``): every row sees keys ``0 … m−1``: a **full** block (non-causal) on the
  first ``m`` keys; ``m = 0``: the rows see nothing at this step and are **skipped** (no compute; the merge
  leaves them as they are, which is merging ``o = 0``, ``L = −∞``).
* ``c`` rising by exactly one per row: a **diagonal** block.  With ``R`` rows and the first ``K = c_last`` keys,
  row ``ρ`` of the run sees keys ``j ≤ ρ + (K − R)``: flashnb's ``causal=True`` (bottom-right aligned,
  ``diag = Nk − Nq``, :func:`flashnb.common.causal_diag`) on exactly those keys.  Cutting K/V to the keys the
  last row sees is what sets the diagonal, so the kernels need no new argument.

For the layouts of :mod:`flashnb.distributed.layouts` this gives at most one block per step for contiguous
shards, one or two for zigzag (the whole shard on the diagonal at step 0), and one for striped (a diagonal at
offset 0 or −1).  Partials are merged in float32 with notebook 02's operator in log form (:func:`merge`).

The block computation is an object with ``forward`` and ``backward`` (:class:`Kernels`: flashnb's kernels,
the default; :class:`Exact`: float64 in torch, for tests and notebooks).  Both return float32.  Their backward
is FA2's (Alg. 2): it is given the *merged* output ``O`` and log-sum-exp ``L`` of the whole forward, rebuilds
``P = exp(S − L)`` and ``D = rowsum(dO ∘ O)`` from them, and so returns this block's exact share of dQ, dK, dV.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from .. import api
from .layouts import positions

__all__ = ["Block", "plan", "plan_for", "visible_prefix", "merge", "Kernels", "Exact", "resolve_impl", "dropout_at"]


@dataclass(frozen=True)
class Block:
    """Query rows ``row0 … row1 − 1`` of the local shard against keys ``0 … keys − 1`` of the K/V shard held:
    ``causal=False`` every pair visible, ``causal=True`` bottom-right aligned (diag ``keys − rows``)."""

    row0: int
    row1: int
    keys: int
    causal: bool
    pairs: int          # visible (query, key) pairs of one batch·head

    @property
    def rows(self) -> int:
        return self.row1 - self.row0

    @property
    def diag(self) -> int:
        """Key ``j`` is visible to block row ``ρ`` when ``j ≤ ρ + diag`` (causal blocks)."""
        return self.keys - self.rows


def visible_prefix(q_pos, k_pos, causal: bool) -> np.ndarray:
    """``c_i``: how many keys of ``k_pos`` query ``q_pos[i]`` sees (all of them without a causal mask)."""
    q_pos, k_pos = np.asarray(q_pos), np.asarray(k_pos)
    if not causal:
        return np.full(len(q_pos), len(k_pos), dtype=np.int64)
    return np.searchsorted(k_pos, q_pos, side="right").astype(np.int64)


def plan(q_pos, k_pos, causal: bool) -> tuple[Block, ...]:
    """The blocks that compute exactly the pairs ``k_pos[j] ≤ q_pos[i]`` (every pair without ``causal``);
    both position lists must be increasing.  Rows that see no key get no block."""
    c = visible_prefix(q_pos, k_pos, causal)
    n_q = len(c)
    if not causal:
        return (Block(0, n_q, int(c[0]), False, int(c.sum())),) if n_q else ()
    out, a = [], 0
    while a < n_q:
        if c[a] == 0:                          # rows that see nothing at this step: skipped
            a += 1
            continue
        flat = a + 1
        while flat < n_q and c[flat] == c[a]:
            flat += 1
        rise = a + 1
        while rise < n_q and c[rise] == c[rise - 1] + 1:
            rise += 1
        if flat - a >= rise - a:               # a full block: c constant (ties: no mask is cheaper)
            out.append(Block(a, flat, int(c[a]), False, int(c[a]) * (flat - a)))
            a = flat
        else:                                  # a diagonal: c rises by one per row
            out.append(Block(a, rise, int(c[rise - 1]), True, int(c[a:rise].sum())))
            a = rise
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def plan_for(N: int, layout: str, world: int, rank: int, src: int, causal: bool) -> tuple[Block, ...]:
    """:func:`plan` of rank ``rank``'s queries against rank ``src``'s keys (memoised: a ring repeats them)."""
    return plan(positions(N, layout, rank, world), positions(N, layout, src, world), causal)


def merge(o, lse, o_b, lse_b):
    """The online-softmax merge (notebook 02's ``[m, d] ⊕ [m', d']``) in log form, in float32:
    ``L = logaddexp(L_a, L_b)``, ``o = o_a·e^(L_a − L) + o_b·e^(L_b − L)``.  A row with ``L_a = L_b = −∞`` (it saw
    no key in either) stays ``o = 0``, ``L = −∞``: the exponents are taken against 0 there, never
    ``−∞ − (−∞)`` (NaN)."""
    L = torch.logaddexp(lse, lse_b)
    ref = torch.where(torch.isfinite(L), L, torch.zeros_like(L))
    o_new = o * torch.exp(lse - ref).unsqueeze(-1) + o_b * torch.exp(lse_b - ref).unsqueeze(-1)
    return o_new, L


# --------------------------------------------------------------------------- block computations


class Kernels:
    """flashnb's kernels as the block computation: ``Kernels("flash", Br=16, Bc=16, warps=1)`` runs
    ``impl="flash"`` with those options.  CPU tensors go through :func:`flashnb.attention_forward` /
    :func:`flashnb.attention_backward` (the simulator, or the GPU when flashnb runs on one); CUDA tensors stay on
    the GPU (:mod:`flashnb.pytorch`'s zero-copy path).  float32 in, float32 out.

    Dropout (``dropout=(p, seed)``) needs an impl that keys its Philox counter by global positions (the product
    kernel, ``"flash"``, through its ``dropout_at`` option: :func:`dropout_at` of the block's rows and keys), so a
    ring draws exactly the single-device mask; other impls refuse it (NotImplementedError)."""

    def __init__(self, name: str = "flash", **options):
        if not isinstance(name, str):
            raise TypeError(f"impl must be a registered flashnb impl name (e.g. 'flash'), got {name!r}")
        self.name, self.options = name, dict(options)

    def __repr__(self) -> str:
        opts = "".join(f", {k}={v!r}" for k, v in sorted(self.options.items()))
        return f"Kernels({self.name!r}{opts})"

    @property
    def dropout(self) -> bool:
        """Can this impl draw dropout by global row and column (does it take ``dropout_at``)?"""
        from ..registry import IMPLS

        entry = IMPLS.get(self.name)
        return entry is not None and "dropout_at" in entry.options

    def check(self, *, grouped: bool) -> None:
        """ValueError unless the impl exists, has a backward and (``grouped``) takes K/V with fewer heads."""
        entry = api._check_impl(self.name, need_backward=True)
        if grouped and not entry.gqa:
            raise ValueError(f"impl {self.name!r} does not take K/V with fewer heads than Q (grouped-query "
                             "attention); use impl='flash'")

    @staticmethod
    def _flat(t):
        return t.reshape((-1,) + tuple(t.shape[-2:])).contiguous()

    def _options(self, rows, keys, dropout):
        if dropout is None:
            return self.options
        if not self.dropout:
            raise NotImplementedError(f"dropout_p > 0 with {self!r}: its kernels key the dropout mask by the "
                                      "block's local row and column, so a ring would draw another mask than one "
                                      "device; use impl='flash' (its dropout_at option), impl=Exact(), or "
                                      "dropout_p=0")
        p, seed = dropout
        return dict(self.options, dropout_p=p, seed=seed, dropout_at=(dropout_at(rows, "rows"),
                                                                      dropout_at(keys, "keys")))

    def forward(self, q, k, v, *, causal, scale, rows=None, keys=None, dropout=None):
        from .. import pytorch as ftorch

        options = self._options(rows, keys, dropout)
        B, H = q.shape[:2]
        o, lse = ftorch._forward3(*(self._flat(t) for t in (q, k, v)), causal, scale, self.name, options)
        return o.reshape(q.shape), lse.reshape(B, H, q.shape[2])

    def backward(self, q, k, v, o, lse, do, *, causal, scale, rows=None, keys=None, dropout=None):
        from .. import pytorch as ftorch

        options = self._options(rows, keys, dropout)
        flat = [self._flat(t) for t in (q, k, v, o)] + [lse.reshape(-1, lse.shape[-1]).contiguous(), self._flat(do)]
        if ftorch._on_device_path(flat[0]):
            grads = ftorch._backward3(*flat, causal, scale, self.name, options)
        else:   # o and lse are the merged forward's, not this block's: the API's check_forward must not apply
            grads = [torch.from_numpy(g) for g in api.attention_backward(
                *(t.detach().numpy() for t in flat), causal=causal, scale=scale, impl=self.name, check_forward=False,
                **options)]
        return tuple(g.reshape(t.shape) for g, t in zip(grads, (q, k, v)))


def dropout_at(pos, what: str = "positions") -> tuple:
    """``(base, step, split, jump)`` with ``pos[i] = base + step·i + jump·(i >= split)`` for every ``i``: the form
    the product kernel's ``dropout_at`` takes (:func:`flashnb.kernels.policies.check_dropout_at`).  Every block
    of every layout has it (contiguous: step 1; zigzag: two runs, the jump; striped: step W); anything else is a
    ValueError naming ``what``."""
    pos = np.asarray(pos, dtype=np.int64).reshape(-1)
    if pos.size == 0:
        raise ValueError(f"{what}: no positions")
    base = int(pos[0])
    step = int(pos[1] - pos[0]) if pos.size > 1 else 1
    gaps = np.flatnonzero(np.diff(pos) != step)
    split = int(gaps[0]) + 1 if gaps.size else pos.size
    jump = int(pos[split] - (base + step * split)) if split < pos.size else 0
    i = np.arange(pos.size)
    if step < 1 or not np.array_equal(pos, base + step * i + jump * (i >= split)):
        raise ValueError(f"{what}: positions {pos.tolist()[:8]}... are not base + step·i + jump·(i >= split) "
                         "(one arithmetic run, or two of one step)")
    return base, step, split, jump


class Exact:
    """The block computation in float64 (torch), from the definition: for tests and notebooks, where the
    simulator's kernels would be slow.  Dropout (``dropout=(p, seed)``) multiplies ``P_ij`` by
    ``Z_ij/(1 − p)`` with ``Z`` from :func:`flashnb.rng.dropout_uniform_np` keyed by ``(seed, batch·head,
    global row, global column)``: the mask one device draws for the whole sequence."""

    dropout = True

    def __repr__(self) -> str:
        return "Exact()"

    def check(self, *, grouped: bool) -> None:
        return None

    @staticmethod
    def _scores(q, k, v, causal, scale):
        q64, k64, v64 = (t.detach().to(torch.float64) for t in (q, k, v))
        G = q.shape[1] // k.shape[1]
        k64, v64 = k64.repeat_interleave(G, dim=1), v64.repeat_interleave(G, dim=1)
        S = scale * q64 @ k64.transpose(-1, -2)
        R, K = S.shape[-2:]
        ok = torch.ones(R, K, dtype=torch.bool)
        if causal:       # bottom-right aligned: j <= i + K - R
            ok = torch.arange(K)[None, :] <= torch.arange(R)[:, None] + (K - R)
        return q64, k64, v64, S.masked_fill(~ok, float("-inf")), G

    @staticmethod
    def _weights(shape, rows, keys, dropout):
        """``Z/(1 − p)`` of the block (float64 ``(B, H, R, K)``), or None without dropout."""
        if dropout is None:
            return None
        from ..rng import dropout_uniform_np

        p, seed = dropout
        B, H, R, K = shape
        z = np.arange(B * H, dtype=np.uint64).reshape(B, H, 1, 1)
        u = dropout_uniform_np(seed, z, np.asarray(rows, dtype=np.uint64).reshape(1, 1, R, 1),
                               np.asarray(keys, dtype=np.uint64).reshape(1, 1, 1, K))
        return torch.from_numpy((u >= float(np.float32(p))) / (1.0 - p))

    def forward(self, q, k, v, *, causal, scale, rows=None, keys=None, dropout=None):
        _, _, v64, S, _ = self._scores(q, k, v, causal, scale)
        m = S.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))     # a row with no key: no (-inf) - (-inf)
        E = torch.exp(S - m)
        l = E.sum(dim=-1, keepdim=True)
        P = E / torch.where(l > 0, l, torch.ones_like(l))
        lse = torch.where(l > 0, m + torch.log(torch.where(l > 0, l, torch.ones_like(l))), float("-inf"))[..., 0]
        Wd = self._weights(S.shape, rows, keys, dropout)
        o = (P if Wd is None else P * Wd) @ v64
        return o.to(torch.float32), lse.to(torch.float32)

    def backward(self, q, k, v, o, lse, do, *, causal, scale, rows=None, keys=None, dropout=None):
        q64, k64, v64, S, G = self._scores(q, k, v, causal, scale)
        L = lse.detach().to(torch.float64).unsqueeze(-1)
        P = torch.where(torch.isfinite(L), torch.exp(S - torch.where(torch.isfinite(L), L, 0.0)), 0.0)  # FA2 Alg. 2
        do64, o64 = do.detach().to(torch.float64), o.detach().to(torch.float64)
        Wd = self._weights(S.shape, rows, keys, dropout)
        A = P if Wd is None else P * Wd
        dv = A.transpose(-1, -2) @ do64
        dP = do64 @ v64.transpose(-1, -2)
        if Wd is not None:
            dP = dP * Wd
        D = (do64 * o64).sum(dim=-1, keepdim=True)                   # D = rowsum(dO ∘ O), the merged O
        dS = P * (dP - D)
        dq = scale * dS @ k64
        dk = scale * dS.transpose(-1, -2) @ q64

        def ungroup(g):
            B, Hq = g.shape[:2]
            return g.reshape(B, Hq // G, G, *g.shape[2:]).sum(dim=2)

        return dq.to(torch.float32), ungroup(dk).to(torch.float32), ungroup(dv).to(torch.float32)


def resolve_impl(impl):
    """``None`` -> ``Kernels("flash")`` (the product kernel); ``"exact"`` -> ``Exact()``; another name ->
    ``Kernels(name)``; an object with ``forward`` and ``backward`` (:class:`Kernels`, :class:`Exact`, or your own
    with their signatures) as it is."""
    if impl is None:
        return Kernels("flash")
    if impl == "exact":
        return Exact()
    if isinstance(impl, str):
        return Kernels(impl)
    if callable(getattr(impl, "forward", None)) and callable(getattr(impl, "backward", None)):
        return impl
    raise TypeError(f"impl must be None, a flashnb impl name (e.g. 'flash'), or a block computation with forward and "
                    f"backward (flashnb.distributed.Kernels, flashnb.distributed.Exact), got {impl!r}")
