"""The product kernels' features as small policies: device functions the fast loop calls, compiled away when off.

Each policy is made by a factory of its compile-time switches and returns the device functions the loops of
:mod:`flashnb.kernels.simt` (and the tensor-core kernels) call at fixed places; with the feature off they are
constants or the identity, which inline to nothing (``x * 1``, ``s`` unchanged, a constant ``FULL`` tile state),
so the kernel compiles to stage 6's code.  Every function is ``inline="always"``: its per-lane values stay in registers.

One file per policy.

============  =============================================================  ===========================================
policy        what the loop calls                                            off
============  =============================================================  ===========================================
storage       ``to_f32(x)`` at every global load, ``from_f32(x)`` at every    ``float32(x)``: no instruction
              store (:func:`storage`: float32, float16, bfloat16 bits)
block mask    ``state(M, z, i, j, lane)`` per tile: ``EMPTY`` (skipped:      the constant ``FULL``
              never loaded), ``FULL`` (no per-element work), ``PARTIAL``
              (``mask_mod`` per element) (:func:`tile_state`)
modifiers     ``score(s, ...)`` per element (``score_mod``), ``grad`` in the  ``s``; all ones; 1
              backward; ``allowed_bits(...)`` per tile: ``mask_mod`` of a
              lane's elements on a ``PARTIAL`` tile (:func:`modifiers`)
dropout       ``state(p, seed_lo, seed_hi)`` once; ``keep_bits(...)`` per     the constant 1
              tile: a lane's ``Z``; ``factor(bits, e, st)`` per element,
              ``Z / (1-p)`` (:func:`dropout`)
GQA / MQA     ``kv_head(z, Q, K)``: the K/V head of query head ``z``; the     ``z``; 1
              backward's ``group(Q, K)`` query heads per K/V head (:func:`gqa`)
K/V rows      ``kv_tile(kz, j0)``: where K/V tile ``j0`` of K/V head ``kz``  ``(kz, j0)``
              is stored (:func:`kv_rows`: a paged KV cache goes here)
tiles         the K/V tiles a Q block visits (``kv_tile_count``), the Q      (:mod:`.tiles`)
              tiles a K/V block visits (``q_tile_range``), heavy-first
              Q blocks (``heavy_first``), the host's ``tiles_visited``
edge          ``visible(row, col, Nk, diag)`` on tiles that cross an edge:    (:func:`flashnb.kernels.simt.blocks.
              keys beyond ``Nk``, the causal diagonal in both alignments      make_visible`)
============  =============================================================  ===========================================

Why masks come as bits.  The register tiles stay registers only if every loop that indexes them is unrolled, and
the compiler unrolls a loop nest only while its code stays small: 32 elements per lane each with Philox's ten rounds
(or a long ``mask_mod``) is far past that, and the tile would go to local memory.  So the policies whose per-element
answer is one bit (``mask_mod``, dropout's ``Z``) run in a loop of their own, which may stay a loop, over a lane's
elements, and hand the tile loop a 64-bit mask; what the unrolled code does per element is one bit test.
``score_mod`` changes the score itself, so it is inlined per element: a long one (``tanh`` soft-capping) is given
tiles with fewer elements per lane by the launchers (:func:`flashnb.kernels.launch.fit.default_tiles`).

Nothing here imports a user surface: ``score_mod`` / ``mask_mod`` arrive as Python functions (or ``"module:attr"``
names, as the PTX guard's configs carry them) and are compiled here as inlined device functions; the block mask's
tile states arrive as a kernel argument (``M``, uint8), computed on the host from the
:class:`~flashnb.stages.fa2.BlockMask` the caller passes.
"""

from __future__ import annotations

from .block_mask import EMPTY, FULL, FULL_MASK, PARTIAL, tile_state  # noqa: F401
from .dropout import DROPOUT_SIG, NO_DROPOUT, SAME_POSITIONS, check_dropout_at, dropout, dropout_args
from .gqa import gqa, gqa_group
from .kv_rows import kv_rows
from .modifiers import (  # noqa: F401  (the guard configs name "flashnb.kernels.policies:GUARD_...")
    _DEVICE_FNS,
    ALL,
    GUARD_ALIBI,
    GUARD_DOCUMENT,
    GUARD_SOFTCAP,
    GUARD_WINDOW,
    MAX_ELEMENTS,
    _alibi_grad,
    _softcap_grad,
    check_features,
    device_modifier,
    is_set,
    modifiers,
    python_modifier,
    score_mod_grad_of,
)
from .storage import storage

__all__ = ["EMPTY", "FULL", "PARTIAL", "ALL", "MAX_ELEMENTS", "storage", "tile_state", "modifiers", "is_set",
           "check_features",
           "dropout", "dropout_args", "gqa", "gqa_group", "kv_rows",
           "python_modifier", "device_modifier", "DROPOUT_SIG", "NO_DROPOUT", "SAME_POSITIONS",
           "check_dropout_at", "GUARD_ALIBI", "GUARD_WINDOW",
           "GUARD_SOFTCAP", "GUARD_DOCUMENT"]
