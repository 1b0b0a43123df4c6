"""Counter-based random numbers for attention dropout: Philox4x32-10, on the device and in NumPy.

Why counter-based.  FlashAttention never stores the N×N attention matrix, so it cannot store an N×N dropout
mask either (FA1, Alg. 2 and Alg. 4: the forward saves only the RNG *state*, the backward regenerates the
mask).  A counter-based generator makes that free: the random number of element ``(z, i, j)`` is a pure
function ``philox(counter, key)`` of its coordinates and the seed, so any thread, in any kernel, in any
order, gets the same number for the same element -- no state to carry, no sequence to replay.

Philox4x32-10 (Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as easy as 1, 2, 3", SC 2011): a
128-bit counter ``(c0, c1, c2, c3)`` and a 64-bit key ``(k0, k1)``, ten rounds of

    (c0, c1, c2, c3) <- (hi(M1·c2) ^ c1 ^ k0,  lo(M1·c2),  hi(M0·c0) ^ c3 ^ k1,  lo(M0·c0))
    (k0, k1)         <- (k0 + W0, k1 + W1)        (mod 2^32; the "Weyl" key schedule)

with ``M0 = 0xD2511F53``, ``M1 = 0xCD9E8D57``, ``W0 = 0x9E3779B9``, ``W1 = 0xBB67AE85``; ``hi``/``lo`` are the
upper and lower 32 bits of the 64-bit product.  The output is the final counter.

How flashnb maps an attention element to a keep/drop decision (this is the whole contract between the
forward, the backward and :func:`dropout_keep_np`; change it and every saved seed means another mask):

* counter = ``(j, i, z, 0)``: key column ``j``, query row ``i``, batch·head ``z`` (the *query* head under
  grouped-query attention), all as uint32;
* key = ``(seed mod 2^32, seed >> 32)``: the seed's low and high 32-bit halves (``0 <= seed < 2^64``);
* keep the element iff its first output word ``x0`` (all 32 bits, a uniform integer in ``[0, 2^32)``) is
  ``>= T = ceil(p · 2^32)`` (:func:`keep_threshold`, computed on the host from the float64 ``p``): an integer
  comparison, so the keep probability is ``1 - T / 2^32``, within ``2^-32`` of ``1 - p`` (below it by less than
  that) for every ``p``;
* a kept ``P_ij`` is multiplied by ``1/(1 - p)`` computed on the host in float64 and rounded once to float32
  (:func:`keep_scale`: relative error at most ``2^-24``), a dropped one by 0 (inverted dropout).  So the expected
  factor ``E[Z_ij / (1 - p)]`` is 1 within ``2^-32 / (1 - p) + 2^-24`` relative: ``2.4e-6`` at ``p = 0.9999``.

The keep decisions are the contract, bit for bit (the NumPy twin :func:`dropout_keep_np` makes the same integer
comparison); the reference (:func:`dropout_scale_np`) multiplies by the exact float64 ``1/(1 - p)``, the kernels
by its float32 rounding.  ``p`` is at most ``1 - 2^-32`` (:func:`check_dropout`), so ``T`` fits in 32 bits.

One Philox call per element, using one of its four output words: wasteful (a fast kernel would spend all four
on four neighbouring columns) but the simplest mapping to read.

The device functions use only unsigned integer arithmetic (uint64 products of 32-bit values, masks and
shifts with uint64 constants: a Python int literal mixed with a uint would make numba compute in float64),
so the PTX guard's no-``.f64`` rule holds (:func:`make_mask_kernel` is registered with it).  What it compiles to
(``cuda.compile_ptx`` of that kernel for sm_80): 64-bit integer instructions -- ``mul.lo.s64`` for the products,
``shr.u64`` / ``and.b64`` for their halves, ``xor.b64`` -- rather than the ``mul.hi.u32`` / ``mul.lo.u32`` pair a
hand-written CUDA Philox uses: numba does the arithmetic in 64 bits.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, uint32, uint64

from .common import ZERO, cdiv, empty, launch
from .registry import kernel_factory

__all__ = ["PHILOX_M0", "PHILOX_M1", "PHILOX_W0", "PHILOX_W1", "philox4x32_10", "dropout_word", "dropout_keep",
           "dropout_scale", "philox4x32_10_np", "dropout_word_np", "dropout_uniform_np", "dropout_keep_np",
           "dropout_scale_np", "keep_threshold", "keep_scale", "dropout_kernel_args", "split_seed", "check_dropout",
           "MAX_SEED", "MAX_P", "make_mask_kernel", "device_mask"]

# Philox4x32 constants (Salmon et al. 2011, Section 4.2 and Random123's philox.h)
PHILOX_M0 = uint64(0xD2511F53)      # multipliers
PHILOX_M1 = uint64(0xCD9E8D57)
PHILOX_W0 = uint64(0x9E3779B9)      # key schedule increments: golden ratio, sqrt(3) - 1 (fractional bits)
PHILOX_W1 = uint64(0xBB67AE85)
LO32 = uint64(0xFFFFFFFF)           # the low 32 bits of a uint64
SHIFT32 = uint64(32)
ROUNDS = 10

MAX_SEED = 2**64 - 1
MAX_P = 1.0 - 2.0**-32              # the largest dropout_p: ceil(p · 2^32) must fit in 32 bits


# --------------------------------------------------------------------------- device functions


@cuda.jit(device=True, inline="always")
def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 of the counter ``(c0, c1, c2, c3)`` under the key ``(k0, k1)`` (each a 32-bit value);
    returns the four 32-bit output words as uint64 values below 2^32.  See the module docstring."""
    c0 = uint64(c0)
    c1 = uint64(c1)
    c2 = uint64(c2)
    c3 = uint64(c3)
    k0 = uint64(k0)
    k1 = uint64(k1)
    for _ in range(ROUNDS):
        p0 = PHILOX_M0 * c0                          # 32 x 32 -> 64-bit products (PTX: mul.lo.s64, not mul.hi.u32)
        p1 = PHILOX_M1 * c2
        c0, c1, c2, c3 = (p1 >> SHIFT32) ^ c1 ^ k0, p1 & LO32, (p0 >> SHIFT32) ^ c3 ^ k1, p0 & LO32
        k0 = (k0 + PHILOX_W0) & LO32                 # bump the key (after the last round it is unused)
        k1 = (k1 + PHILOX_W1) & LO32
    return c0, c1, c2, c3


@cuda.jit(device=True, inline="always")
def dropout_word(seed_lo, seed_hi, z, row, col):
    """The random word of attention element ``(z, row, col)``: the first Philox output word of counter
    ``(col, row, z, 0)`` under key ``(seed_lo, seed_hi)``, a uint64 value below 2^32."""
    x0, x1, x2, x3 = philox4x32_10(col, row, z, 0, seed_lo, seed_hi)
    return x0


@cuda.jit(device=True, inline="always")
def dropout_keep(seed_lo, seed_hi, z, row, col, threshold):
    """Is element ``(z, row, col)`` kept?  Its word ``>= threshold`` (:func:`keep_threshold` of ``p``, a uint32):
    an unsigned integer comparison of all 32 bits."""
    return dropout_word(seed_lo, seed_hi, z, row, col) >= uint64(threshold)


@cuda.jit(device=True, inline="always")
def dropout_scale(seed_lo, seed_hi, z, row, col, threshold, inv_keep):
    """``Z_ij / (1 - p)`` of element ``(z, row, col)``: ``inv_keep`` (:func:`keep_scale`, float32) if kept, else 0."""
    return inv_keep if dropout_keep(seed_lo, seed_hi, z, row, col, threshold) else ZERO


# --------------------------------------------------------------------------- the NumPy twin


def philox4x32_10_np(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 on NumPy arrays (broadcast together): the same rounds as :func:`philox4x32_10`, in
    uint64 arithmetic on values below 2^32; returns four uint64 arrays of 32-bit words."""
    c0, c1, c2, c3, k0, k1 = (np.asarray(x, dtype=np.uint64) for x in (c0, c1, c2, c3, k0, k1))
    c0, c1, c2, c3, k0, k1 = np.broadcast_arrays(c0, c1, c2, c3, k0, k1)
    mask, shift = np.uint64(0xFFFFFFFF), np.uint64(32)
    for _ in range(ROUNDS):
        p0 = np.uint64(0xD2511F53) * c0
        p1 = np.uint64(0xCD9E8D57) * c2
        c0, c1, c2, c3 = (p1 >> shift) ^ c1 ^ k0, p1 & mask, (p0 >> shift) ^ c3 ^ k1, p0 & mask
        k0 = (k0 + np.uint64(0x9E3779B9)) & mask
        k1 = (k1 + np.uint64(0xBB67AE85)) & mask
    return c0, c1, c2, c3


def dropout_word_np(seed: int, z, row, col) -> np.ndarray:
    """:func:`dropout_word` for arrays of ``z``, ``row``, ``col`` (broadcast): uint64 words below 2^32."""
    lo, hi = split_seed(seed)
    return philox4x32_10_np(col, row, z, 0, lo, hi)[0]


def dropout_uniform_np(seed: int, z, row, col) -> np.ndarray:
    """The words of :func:`dropout_word_np` as uniform numbers on ``[0, 1)``: ``x0 · 2^-32`` in float64 (exact).
    Element ``(z, row, col)`` is kept iff this is ``>= keep_threshold(p) · 2^-32``, i.e. ``>= p`` up to 2^-32."""
    return dropout_word_np(seed, z, row, col).astype(np.float64) * 2.0 ** -32


def _grid(BH, Nq, Nk):
    return (np.arange(BH, dtype=np.uint64)[:, None, None], np.arange(Nq, dtype=np.uint64)[None, :, None],
            np.arange(Nk, dtype=np.uint64)[None, None, :])


def dropout_keep_np(seed: int, p: float, BH: int, Nq: int, Nk: int) -> np.ndarray:
    """The whole boolean keep mask ``(BH, Nq, Nk)`` the kernels use for ``(seed, p)``: word ``>=``
    :func:`keep_threshold` ``(p)``, the integer comparison the device makes."""
    p = check_dropout(p, seed)
    z, i, j = _grid(BH, Nq, Nk)
    return dropout_word_np(seed, z, i, j) >= np.uint64(keep_threshold(p))


def dropout_scale_np(seed: int, p: float, BH: int, Nq: int, Nk: int) -> np.ndarray:
    """float64 ``(BH, Nq, Nk)``: the factor each ``P_ij`` is multiplied by, ``1/(1-p)`` kept, ``0`` dropped --
    what :func:`flashnb.reference.attention_forward` takes as ``dropout_mask``."""
    keep = dropout_keep_np(seed, p, BH, Nq, Nk)
    return keep / (1.0 - p)


def keep_threshold(p: float) -> np.uint32:
    """``T = ceil(p · 2^32)`` as a uint32, computed exactly from the float64 ``p`` (``p · 2^32`` is exact): an
    element is kept iff its 32-bit word is ``>= T``, with probability ``1 - T / 2^32 ∈ (1 - p - 2^-32, 1 - p]``.
    ``p = 0`` gives 0 (every element kept)."""
    p = check_dropout(p, 0)
    return np.uint32(math.ceil(p * 2.0**32))


def keep_scale(p: float) -> np.float32:
    """The factor of a kept element, ``1 / (1 - p)`` computed in float64 and rounded once to float32 (relative
    error at most 2^-24): 1000.0 at ``p = 0.999``, 10000.0 at ``p = 0.9999``."""
    p = check_dropout(p, 0)
    return np.float32(1.0 / (1.0 - p))


def dropout_kernel_args(p: float, seed: int) -> tuple:
    """What a dropout kernel takes after its arrays: ``(threshold, inv_keep, seed_lo, seed_hi)`` -- uint32,
    float32, uint32, uint32 (:func:`keep_threshold`, :func:`keep_scale`, :func:`split_seed`)."""
    p = check_dropout(p, seed)
    return (keep_threshold(p), keep_scale(p), *split_seed(seed))


# --------------------------------------------------------------------------- arguments


def split_seed(seed) -> tuple:
    """``(np.uint32 low half, np.uint32 high half)`` of a seed ``0 <= seed < 2^64`` (the Philox key)."""
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be an int in [0, 2**64), got {seed!r}")
    if not 0 <= int(seed) <= MAX_SEED:
        raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
    s = int(seed)
    return np.uint32(s & 0xFFFFFFFF), np.uint32(s >> 32)


def check_dropout(dropout_p, seed) -> float:
    """``float(dropout_p)`` after checking it and ``seed``: ``dropout_p`` a real number with ``0 <= p <=``
    :data:`MAX_P` ``= 1 - 2^-32`` (the keep test compares a 32-bit word with ``ceil(p · 2^32)``, which must fit
    in 32 bits), and, when ``p > 0``, ``seed`` an int in ``[0, 2^64)`` (the backward needs the forward's seed to
    regenerate its mask, so there is no default).  TypeError/ValueError naming the argument otherwise."""
    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, (int, float, np.integer, np.floating)):
        raise TypeError(f"dropout_p must be a real number in [0, 1), got {dropout_p!r}")
    p = float(dropout_p)
    if not (0.0 <= p <= MAX_P):
        raise ValueError(f"dropout_p must be in [0, 1) and at most 1 - 2**-32 (the keep test compares a 32-bit word "
                         f"with ceil(p·2^32)), got {dropout_p!r}")
    if p > 0 and seed is None:
        raise ValueError(f"dropout_p={dropout_p!r} needs a seed (an int in [0, 2**64)): the backward regenerates "
                         "the forward's mask from it, so pass the same seed to both")
    if seed is not None:
        split_seed(seed)
    return p


# --------------------------------------------------------------------------- a kernel that writes the mask


@kernel_factory("rng.dropout_mask", stage="4", signature="void(uint32[:, :, ::1], float32[:, :, ::1], uint32, "
                "float32, uint32, uint32)", threads=32)
def make_mask_kernel():
    """One thread per element ``(z, i, j)`` (grid ``(ceil(Nk/32), Nq, BH)``, 32 threads): ``W[z, i, j]`` its word
    and ``Zs[z, i, j] = Z_ij / (1 - p)``, from the same device functions the FA2 kernels call -- for comparing
    them with the NumPy twin, and for pictures of the mask.  Never part of attention itself."""

    @cuda.jit
    def dropout_mask(W, Zs, threshold, inv_keep, seed_lo, seed_hi):
        z = cuda.blockIdx.z
        i = cuda.blockIdx.y
        j = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if j < W.shape[2]:
            W[z, i, j] = uint32(dropout_word(seed_lo, seed_hi, z, i, j))
            Zs[z, i, j] = dropout_scale(seed_lo, seed_hi, z, i, j, threshold, inv_keep)

    return dropout_mask


def device_mask(seed: int, p: float, BH: int, Nq: int, Nk: int):
    """``(W, Zs)`` as :func:`make_mask_kernel` writes them on the device (host arrays ``(BH, Nq, Nk)``: the uint32
    words, the float32 factors)."""
    W = cuda.to_device(np.zeros((BH, Nq, Nk), np.uint32))   # (every word is checked against the twin's)
    Zs = empty((BH, Nq, Nk))
    launch(make_mask_kernel(), (cdiv(Nk, 32), Nq, BH), 32, W, Zs, *dropout_kernel_args(p, seed), label="dropout mask")
    return W.copy_to_host(), Zs.copy_to_host()
