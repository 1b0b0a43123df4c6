"""Shared kernel mechanics, written once and reused by every stage.

* constants that stay float32 on a real GPU (``NEG_INF``, ``ZERO``: a bare ``0.0`` or ``-math.inf`` in a
  kernel silently makes it float64);
* device functions: bounded tile loads and stores (zero fill outside the matrix), the causal predicate;
* host helpers: ``cdiv``, poisoned (NaN-filled) device outputs, and :func:`launch`, through which every
  kernel launch in flashnb goes (it fixes scalar argument types to the guarded signature and names the
  launch for the traffic counter);
* half-precision *storage*: :data:`STORAGES`, the device conversions ``float32 <-> storage``
  (:func:`storage_conversions`) that a kernel applies at its global loads and stores, and their NumPy twins
  for bfloat16 (:func:`to_bfloat16`, :func:`from_bfloat16`).  Arithmetic stays float32 everywhere.
"""

from __future__ import annotations

import contextlib
import math
import threading
import warnings

import numpy as np

from . import runtime  # noqa: F401  (selects GPU or simulator before numba.cuda is imported)
from numba import cuda, float32, int32, uint16, uint32  # noqa: E402
from numba.core.types import float16  # noqa: E402  (numba exports no float16 at the top level)

from .reference import CAUSAL_ALIGNMENTS, causal_diag  # noqa: E402,F401  (pure NumPy; kernels' launchers use it)

__all__ = [
    "NEG_INF", "ZERO", "ONE", "cdiv", "causal_allowed", "load_tile", "load_rows", "load_rows_T", "store_rows",
    "load_vec", "store_vec",
    "empty", "poisoning", "to_device", "launch", "launch_rows", "row_index", "ROWS_PER_BLOCK", "current_label",
    "launch_hooks", "ShapeOnly", "dry_run", "SHARED_LIMIT_BYTES", "check_shared_fit",
    "SIM_OPTIN_LIMIT_BYTES", "shared_optin_limit", "allow_dynamic_shared", "opt_in_or_fall_back",
    "warn_fallback", "positive_int",
    "CAUSAL_ALIGNMENTS", "causal_diag", "on_stream", "current_stream", "MAX_GRID", "MAX_BLOCK",
    "MAX_THREADS_PER_BLOCK", "check_launch_dims", "OutOfMemory", "available_bytes",
    "STORAGES", "storage_dtype", "storage_array_type", "storage_conversions", "check_storage", "to_bfloat16",
    "from_bfloat16", "storage_of", "check_bfloat16_bits", "MAX_HEAD_DIM",
]

#: CUDA's launch limits (every compute capability flashnb targets): gridDim.x up to 2^31 - 1, gridDim.y and .z up
#: to 65,535; blockDim.x and .y up to 1,024, .z up to 64, and at most 1,024 threads in a block.
MAX_GRID = (2**31 - 1, 65535, 65535)
MAX_BLOCK = (1024, 1024, 64)
MAX_THREADS_PER_BLOCK = 1024


def check_launch_dims(name: str, grid: tuple, block: tuple) -> None:
    """Refuse a launch configuration a GPU would refuse (``CUDA_ERROR_INVALID_VALUE``), naming what is over."""
    axes = "xyz"
    for what, dims, limits in (("gridDim", grid, MAX_GRID), ("blockDim", block, MAX_BLOCK)):
        if len(dims) > 3:
            raise ValueError(f"launch {name!r}: {what} has {len(dims)} dimensions; CUDA has 3 (x, y, z)")
        for axis, n, limit in zip(axes, dims, limits):
            if n > limit:
                raise ValueError(f"launch {name!r}: {what}.{axis} = {n:,} is over CUDA's limit of {limit:,} "
                                 f"(grid {tuple(grid)}, block {tuple(block)})")
    threads = math.prod(block)
    if threads > MAX_THREADS_PER_BLOCK:
        raise ValueError(f"launch {name!r}: {threads:,} threads per block (block {tuple(block)}) is over CUDA's "
                         f"limit of {MAX_THREADS_PER_BLOCK:,}")


NEG_INF = float32(-math.inf)
ZERO = float32(0.0)
ONE = float32(1.0)


def cdiv(a: int, b: int) -> int:
    """Ceiling division: number of tiles of size ``b`` that cover ``a``."""
    return -(-a // b)


#: The largest head dim d the API accepts (every impl's kernels are built for 1 <= d <= 128).
MAX_HEAD_DIM = 128

#: Static shared memory one thread block may declare on every GPU flashnb targets (cc >= 2.0, sm_80, sm_90).
SHARED_LIMIT_BYTES = 48 * 1024


#: The opt-in limit :func:`shared_optin_limit` answers on the simulator: the A100's (sm_80) 163 KiB, the
#: smaller of the two architectures the PTX guard checks dynamic shared memory for (sm_90: 227 KiB).
SIM_OPTIN_LIMIT_BYTES = 163 * 1024


def check_shared_fit(impl: str, tiles: str, nbytes: int, hint: str = "choose smaller tiles", *,
                     optin: int | None = None) -> int:
    """The one shared-memory check every impl's option validation calls: ValueError naming the impl, its tiles
    and the bytes when a block would declare more than :data:`SHARED_LIMIT_BYTES` (48 KiB) -- a GPU refuses to
    compile such a kernel, and the simulator would run it for minutes.  Returns ``nbytes``.

    A kernel that takes its shared memory as *dynamic* shared memory passes ``optin``, the device's opt-in
    limit per block (:func:`shared_optin_limit`): up to that many bytes are accepted (the launcher then asks
    the driver for them, :func:`allow_dynamic_shared`), more is a ValueError naming the tiles and the limit."""
    if nbytes <= SHARED_LIMIT_BYTES:
        return nbytes
    if optin is None:
        raise ValueError(f"{impl}: tiles {tiles} need {nbytes:,} B of static shared memory per block, over the "
                         f"{SHARED_LIMIT_BYTES:,} B (48 KiB) a GPU thread block may declare; {hint}")
    if nbytes > optin:
        raise ValueError(f"{impl}: tiles {tiles} need {nbytes:,} B of shared memory per block, over this device's "
                         f"opt-in limit of {optin:,} B per block (dynamic shared memory); {hint}")
    return nbytes


def shared_optin_limit() -> int:
    """Shared memory one block may use after the driver opt-in, in bytes: the GPU's
    ``CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN`` (227 KiB on sm_90, 163 KiB on sm_80, 64 KiB on
    sm_75); on the simulator (which has no limit) :data:`SIM_OPTIN_LIMIT_BYTES`, so tiles that an A100 would
    refuse are refused here too."""
    if runtime.MODE != "gpu":
        return SIM_OPTIN_LIMIT_BYTES
    return int(cuda.get_current_device().MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)


def _set_max_dynamic_shared(kernel, signature: str, nbytes: int) -> None:
    """GPU only: compile ``kernel`` for ``signature`` (numba keeps the overload, the launch reuses it) and set
    ``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`` on it, as numba-cuda's own
    ``set_shared_memory_carveout`` sets an attribute (``cuKernelSetAttribute`` on the kernel's handle)."""
    from cuda.bindings import driver as binding
    from numba.cuda.cudadrv.driver import driver

    compiled = kernel.compile(signature)
    cufunc = compiled._codelibrary.get_cufunc()
    attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    driver.cuKernelSetAttribute(attr, int(nbytes), cufunc.handle, cufunc.device.id)


def allow_dynamic_shared(kernel, signature: str, nbytes: int) -> None:
    """Let ``kernel`` (compiled for ``signature``) launch with ``nbytes`` of dynamic shared memory: above
    48 KiB a GPU needs the per-kernel opt-in; nothing to do at or below it, or on the simulator.  Under
    :func:`flashnb.instruments.rehearsal.pretend_gpu` the request is recorded (``runtime.DYNAMIC_SHARED_REQUESTS``)
    instead of reaching a driver.  Raises what the driver raises (the caller decides whether to fall back)."""
    if nbytes <= SHARED_LIMIT_BYTES or runtime.MODE != "gpu":
        return
    if runtime.rehearsing():
        name = getattr(getattr(kernel, "py_func", kernel), "__name__", str(kernel))
        runtime.DYNAMIC_SHARED_REQUESTS.append((name, signature, int(nbytes)))
        return
    _set_max_dynamic_shared(kernel, signature, nbytes)


def opt_in_or_fall_back(impl: str, kernel, signature: str, nbytes: int, t: dict, d: int, given: bool,
                        ask=None) -> str | None:
    """Ask the driver for ``nbytes`` of dynamic shared memory for ``kernel`` (``ask``: :func:`allow_dynamic_shared`,
    or the launcher's module-level name for it, so a test can stand in for the driver).  ``None`` when granted.
    Refused: tiles the caller gave (``given``) are never changed behind its back, so a ``RuntimeError`` naming
    ``impl`` and the tiles ``t``; default tiles give the reason to fall back to the static ones (the launcher
    re-plans, then calls :func:`warn_fallback`)."""
    try:
        (ask or allow_dynamic_shared)(kernel, signature, nbytes)
    except Exception as exc:  # the driver's error type depends on the binding; the fallback is the same
        if given:
            raise RuntimeError(f"{impl}: the driver refused {nbytes:,} B of dynamic shared memory for tiles "
                               f"Br={t['Br']}, Bc={t['Bc']} at d={d}: {exc}") from exc
        return f"the opt-in call for {nbytes:,} B failed: {exc}"
    return None


def warn_fallback(impl: str, d: int, reason: str, t: dict) -> None:
    """The ``RuntimeWarning`` of a launch whose default tiles fell back to the static ones ``t`` (``reason``: the
    device's opt-in limit, or :func:`opt_in_or_fall_back`'s), pointing at the launcher's caller."""
    warnings.warn(f"{impl} at d={d}: default tiles need dynamic shared memory this device refuses ({reason}); "
                  f"falling back to the static tiles Br={t['Br']}, Bc={t['Bc']}, warps={t['warps']}",
                  RuntimeWarning, stacklevel=3)


def positive_int(name: str, n) -> int:
    """``int(n)`` for an int (numpy ints too, not bool) >= 1; TypeError/ValueError naming ``name`` otherwise."""
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"{name} must be a positive int, got {n!r}")
    if n < 1:
        raise ValueError(f"{name} must be a positive int, got {n!r}")
    return int(n)


# --------------------------------------------------------------------------- device functions


@cuda.jit(device=True, inline="always")
def row_index():
    """``(z, i)`` of a one-thread-per-row kernel launched by :func:`launch_rows`: head ``z``, row ``i``."""
    return cuda.blockIdx.y, cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x


@cuda.jit(device=True, inline="always")
def causal_allowed(i, j, diag):
    """May query row ``i`` attend to key ``j``?  ``j <= i + diag``: ``diag = Nk - Nq`` aligns the mask to the
    bottom-right corner (the default), ``diag = 0`` to the top-left (see :func:`causal_diag`)."""
    return j <= i + diag


@cuda.jit(device=True, inline="always")
def load_tile(src, z, r0, c0, tile, transposed):
    """One element per thread of a (T, T) block: ``tile[ty, tx] = op(src[z])[r0 + ty, c0 + tx]``.

    ``op`` is the transpose when ``transposed``; the thread then reads ``src[z, c0 + ty, r0 + tx]``
    and stores it at ``tile[tx, ty]`` so that neighbouring threads still read neighbouring addresses.
    Elements outside ``src`` are zero-filled in the tile (and are not global reads).
    """
    ty = cuda.threadIdx.y
    tx = cuda.threadIdx.x
    if transposed:
        r = c0 + ty
        c = r0 + tx
    else:
        r = r0 + ty
        c = c0 + tx
    value = float32(0.0)
    if r < src.shape[1] and c < src.shape[2]:
        value = src[z, r, c]
    if transposed:
        tile[tx, ty] = value
    else:
        tile[ty, tx] = value


@cuda.jit(device=True, inline="always")
def load_rows(src, z, r0, tile, tid, nthreads):
    """Cooperative load of rows ``r0 ..`` of ``src[z]`` into ``tile`` (shape (R, C), C at least src's width).

    Thread ``tid`` of ``nthreads`` copies elements ``tid, tid + nthreads, ...`` in row-major order, so
    consecutive threads read consecutive addresses (coalesced).  Rows past the end, and columns past ``src``'s
    width (a padded tile), are zero-filled.
    """
    R = tile.shape[0]
    C = tile.shape[1]
    for e in range(tid, R * C, nthreads):
        r = e // C
        c = e - r * C
        value = float32(0.0)
        if r0 + r < src.shape[1] and c < src.shape[2]:
            value = src[z, r0 + r, c]
        tile[r, c] = value


@cuda.jit(device=True, inline="always")
def load_rows_T(src, z, r0, rows, tileT, tid, nthreads):
    """:func:`load_rows`, transposed: ``tileT[c, r] = src[z, r0 + r, c]`` for ``r < rows`` and every row ``c`` of
    ``tileT`` (shape (C, ≥ rows)).  Elements are walked in ``src``'s row-major order, so consecutive threads
    still read consecutive addresses; rows past the end and columns past ``src``'s width are zero-filled."""
    C = tileT.shape[0]
    for e in range(tid, rows * C, nthreads):
        r = e // C
        c = e - r * C
        value = float32(0.0)
        if r0 + r < src.shape[1] and c < src.shape[2]:
            value = src[z, r0 + r, c]
        tileT[c, r] = value


@cuda.jit(device=True, inline="always")
def store_rows(tile, dst, z, r0, tid, nthreads):
    """Cooperative store of ``tile`` into rows ``r0 ..`` of ``dst[z]``; rows past the end are skipped."""
    R = tile.shape[0]
    C = tile.shape[1]
    nrows = dst.shape[1]
    for e in range(tid, R * C, nthreads):
        r = e // C
        c = e - r * C
        if r0 + r < nrows:
            dst[z, r0 + r, c] = tile[r, c]


@cuda.jit(device=True, inline="always")
def load_vec(src, z, r0, vec, tid, nthreads):
    """``vec[r] = src[z, r0 + r]`` (zero past the end), element ``r`` copied by thread ``r mod nthreads``."""
    for r in range(tid, vec.shape[0], nthreads):
        value = float32(0.0)
        if r0 + r < src.shape[1]:
            value = src[z, r0 + r]
        vec[r] = value


@cuda.jit(device=True, inline="always")
def store_vec(vec, dst, z, r0, tid, nthreads):
    """``dst[z, r0 + r] = vec[r]`` for rows inside ``dst``, with :func:`load_vec`'s thread mapping."""
    for r in range(tid, vec.shape[0], nthreads):
        if r0 + r < dst.shape[1]:
            dst[z, r0 + r] = vec[r]


# --------------------------------------------------------------------------- storage (half precision)

#: What a kernel may keep Q, K, V, O (and dO, dK, dV, dQ) in, in global memory.  Everything a kernel computes
#: -- shared tiles, registers, m_i, l_i, L, D, the dQ accumulator -- stays float32 (what FlashAttention does
#: with half inputs).  ``"bfloat16"`` arrays hold the 16-bit *patterns* as uint16: NumPy has no bfloat16 dtype,
#: and the Numba CUDA simulator has no bfloat16 type (``numba.cuda.bf16.bfloat16`` is None there), so the
#: kernels widen the bits themselves (:func:`bf16_to_f32`), which compiles for a GPU and runs on the simulator.
STORAGES = ("float32", "float16", "bfloat16")

_STORAGE_DTYPE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}
_STORAGE_TYPE = {"float32": "float32", "float16": "float16", "bfloat16": "uint16"}


def check_storage(storage) -> str:
    """``storage`` if it is one of :data:`STORAGES`, else ValueError naming the argument and the choices."""
    if not isinstance(storage, str) or storage not in STORAGES:
        raise ValueError(f"storage must be one of {list(STORAGES)}, got {storage!r}")
    return storage


def storage_dtype(storage: str) -> np.dtype:
    """The NumPy dtype of arrays in ``storage`` (bfloat16: uint16 bit patterns)."""
    return np.dtype(_STORAGE_DTYPE[check_storage(storage)])


def storage_array_type(storage: str, ndim: int = 3) -> str:
    """The numba type string of a C-contiguous ``ndim``-d array in ``storage``, for kernel signatures."""
    return f"{_STORAGE_TYPE[check_storage(storage)]}[{', '.join([':'] * (ndim - 1) + ['::1'])}]"


def check_bfloat16_bits(name: str, a, storage: str | None, *, half: bool = True) -> None:
    """uint16 is flashnb's bfloat16 container (:func:`to_bfloat16`), so an array of that dtype is read only as
    bfloat16 bit patterns, with ``storage="bfloat16"``: anywhere else it is a TypeError naming ``name`` (computed
    as integers, bit patterns of values near 0.5 would be numbers near 16,000).  ``half``: whether the caller can
    take ``storage="bfloat16"`` at all (the message says so).  Other integer dtypes are integer values, converted
    like any real input."""
    if np.dtype(getattr(a, "dtype", np.float64)) == np.uint16 and storage != "bfloat16":
        how = "pass storage='bfloat16' to an impl with half storage, or give" if half else "here give"
        raise TypeError(f"{name} has dtype uint16, which flashnb reads only as bfloat16 bit patterns "
                        f"(flashnb.common.to_bfloat16), with storage='bfloat16'; {how} the values: "
                        f"flashnb.common.from_bfloat16({name}) for bit patterns, {name}.astype(np.float32) for "
                        "integers")


def storage_of(a) -> str | None:
    """The storage a device (or NumPy) array's dtype stands for: float32, float16, uint16 -> bfloat16; else None."""
    dtype = np.dtype(getattr(a, "dtype", np.float64))
    return {np.dtype(v): k for k, v in _STORAGE_DTYPE.items()}.get(dtype)


# bfloat16 <-> float32 reinterprets bits.  On a GPU that is libdevice's ``__nv_int_as_float`` /
# ``__nv_float_as_int`` (a ``mov.b32``: no instruction, no local memory); the simulator runs no libdevice, so there
# the same two functions are NumPy bit views (the twins below, which the tests also check the kernels against).
# float32 -> float16 is numba's cast on a GPU; on the simulator a device function that gives the GPU's inf for what
# rounds past 65504 without NumPy's overflow warning (the float16 gradient check then reports it alone).
F16_OVERFLOW = 65520.0   # the smallest magnitude float16's round-to-nearest-even takes to inf (65504 + half an ulp)

if runtime.MODE == "gpu":
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline="always")
    def bf16_to_f32(bits):
        """bfloat16 bits (uint16) -> float32, exact: bfloat16 is the high half of a float32 (``shl`` + ``mov``)."""
        return libdevice.int_as_float(int32(uint32(bits) << uint32(16)))

    @cuda.jit(device=True, inline="always")
    def f32_to_bf16(x):
        """float32 -> bfloat16 bits, round to nearest even on the dropped 16 bits (NaN -> a quiet NaN)."""
        if x != x:
            return uint16(0x7FC0)
        u = uint32(libdevice.float_as_int(x))
        r = uint32(u + uint32(0x7FFF) + ((u >> uint32(16)) & uint32(1)))   # 32-bit: numba would widen to 64
        return uint16(r >> uint32(16))

    f32_to_f16 = float16                             # numba's cast, cvt.rn.f16.f32 (beyond 65504: inf)
else:
    @cuda.jit(device=True, inline="always")
    def bf16_to_f32(bits):
        """bfloat16 bits (uint16) -> float32 (simulator: NumPy's bit view, :func:`from_bfloat16`)."""
        return from_bfloat16(np.uint16(bits))[()]

    @cuda.jit(device=True, inline="always")
    def f32_to_bf16(x):
        """float32 -> bfloat16 bits (simulator: :func:`to_bfloat16`)."""
        return to_bfloat16(x)[()]

    @cuda.jit(device=True, inline="always")
    def f32_to_f16(x):
        """float32 -> float16 (simulator: NumPy's cast), and at or beyond 65520 (what rounds past 65504) a signed
        inf as a GPU's ``cvt.rn.f16.f32`` gives -- without the RuntimeWarning NumPy's cast of it prints."""
        if abs(x) >= F16_OVERFLOW:
            return np.float16(np.copysign(np.inf, x))
        return np.float16(x)


# float32 storage: ``float32(x)`` of a float32 is no instruction (the float32 kernels' PTX is unchanged, and the
# simulator pays one NumPy cast, not a device-function call).  float16: numba's casts, ``cvt.f32.f16`` (exact)
# and ``cvt.rn.f16.f32`` (round to nearest even; beyond 65504 -> inf; f32_to_f16 above on the simulator).
# bfloat16: the functions above.
_CONVERSIONS = {"float32": (float32, float32), "float16": (float32, f32_to_f16),
                "bfloat16": (bf16_to_f32, f32_to_bf16)}


def storage_conversions(storage: str):
    """``(to_f32, from_f32)``: what a kernel applies to every global load and store of an array in ``storage``
    (numba casts for float32 and float16, device functions for bfloat16)."""
    return _CONVERSIONS[check_storage(storage)]


def to_bfloat16(x) -> np.ndarray:
    """NumPy twin of :func:`f32_to_bf16`: the bfloat16 bit patterns (uint16) of ``x`` (rounded to float32 first,
    then to bfloat16, to nearest even; NaN -> 0x7FC0)."""
    f = np.array(x, dtype=np.float32)              # a contiguous copy, 0-d for a scalar
    u = f.view(np.uint32).astype(np.uint64)
    bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(f), np.uint16(0x7FC0), bits)


def from_bfloat16(bits) -> np.ndarray:
    """NumPy twin of :func:`bf16_to_f32`: float32 values of bfloat16 bit patterns (uint16), exact."""
    b = np.array(bits)
    if b.dtype != np.uint16:
        raise TypeError(f"bfloat16 values are uint16 bit patterns, got dtype {b.dtype}")
    return (b.astype(np.uint32) << 16).view(np.float32)


# --------------------------------------------------------------------------- host helpers

# The two ways to align a causal mask when Nq != Nk, named as torch.nn.attention.bias names them
# (causal_lower_right / causal_upper_left).  True means "lower_right", the FlashAttention >= 2.1 convention.
def to_device(a: np.ndarray, storage: str = "float32"):
    """Copy a host array to the device as C-contiguous float32 (what every kernel signature expects), or in
    ``storage`` (:data:`STORAGES`; a bfloat16 array must already hold uint16 bit patterns, see
    :func:`to_bfloat16`)."""
    dtype = storage_dtype(storage)
    if storage == "bfloat16" and np.asarray(a).dtype != np.uint16:
        raise TypeError(f"storage='bfloat16' takes uint16 bit patterns (flashnb.common.to_bfloat16), got dtype "
                        f"{np.asarray(a).dtype}")
    return cuda.to_device(np.ascontiguousarray(a, dtype=dtype), stream=current_stream())


_stream = threading.local()


def current_stream():
    """The stream :func:`launch` and :func:`empty` use in this thread: 0 (the default stream) unless inside
    :func:`on_stream`."""
    return getattr(_stream, "stream", 0)


@contextlib.contextmanager
def on_stream(stream):
    """Launch kernels (and allocate/fill outputs) on ``stream`` in this thread, e.g. torch's current stream
    wrapped by ``numba.cuda.external_stream`` (see :mod:`flashnb.pytorch`)."""
    previous = current_stream()
    _stream.stream = stream
    try:
        yield stream
    finally:
        _stream.stream = previous


_poison = threading.local()


@contextlib.contextmanager
def poisoning(enabled: bool):
    """Turn NaN-poisoning of new outputs on or off in this thread (benchmarks time kernels, not the fill)."""
    previous = getattr(_poison, "enabled", True)
    _poison.enabled = bool(enabled)
    try:
        yield
    finally:
        _poison.enabled = previous


class OutOfMemory(MemoryError):
    """An output that does not fit in the memory left (raised before anything is allocated)."""


def available_bytes() -> int | None:
    """Memory an output can still take: the GPU's free device memory, or on the simulator (whose device
    arrays are host arrays) the host's available memory; None when it cannot be told."""
    import os

    try:
        if runtime.MODE == "gpu":
            if not runtime.rehearsing():
                return int(cuda.current_context().get_memory_info().free)
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError, NotImplementedError):
        return None


def _human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def empty(shape, *, poison: bool | None = None, storage: str = "float32"):
    """A float32 device array for a kernel's output (``storage``: a float16 array, or uint16 bfloat16 bits).

    By default it is filled with NaN, so an element the kernel forgets to write cannot pass a test.  Inside
    ``with poisoning(False):`` (and with ``poison=False``) it is a plain uninitialised device allocation.
    On a GPU the NaN fill is a device memset (bytes 0xFF: every float32 0xFFFFFFFF is a NaN, and 0xFFFF is one in
    float16 and bfloat16), so no host buffer the size of the output is ever made.  An output larger than the
    memory left raises :class:`OutOfMemory` first, with both sizes (the naive path's N×N score matrix is the usual one).
    """
    if poison is None:
        poison = getattr(_poison, "enabled", True)
    dims = tuple(int(n) for n in (shape if isinstance(shape, (tuple, list)) else (shape,)))
    dtype = storage_dtype(storage)
    nbytes = dtype.itemsize * math.prod(dims)
    free = available_bytes()
    if free is not None and nbytes > free:
        raise OutOfMemory(f"an output of shape {dims} ({storage}) needs {_human(nbytes)}, but only {_human(free)} "
                          f"{'of device memory is free' if runtime.MODE == 'gpu' else 'of memory is available'}; "
                          "use smaller inputs (the naive impl stores the whole N_q x N_k score matrix, twice)")
    if not poison:
        return cuda.device_array(dims, dtype=dtype, stream=current_stream())
    if runtime.MODE == "gpu" and not runtime.rehearsing():
        from numba.cuda.cudadrv.driver import device_memset

        out = cuda.device_array(dims, dtype=dtype, stream=current_stream())
        device_memset(out, 0xFF, nbytes, stream=current_stream())
    else:
        out = cuda.to_device(np.full(dims, 0xFFFF, dtype=np.uint16) if storage == "bfloat16"
                             else np.full(dims, np.nan, dtype=dtype), stream=current_stream())
    for hook in poison_hooks:
        hook(out)
    return out


poison_hooks: list = []  # callables(device array) told of every poisoned output; the sanitizer's initcheck uses it


_state = threading.local()
launch_hooks: list = []  # callables(label, kernel, grid, block, args) -> context manager; used by counters


def current_label() -> str | None:
    """The label of the launch in progress (set by :func:`launch`), or None."""
    return getattr(_state, "label", None)


def _scalar(x):
    if isinstance(x, (bool, np.bool_, np.unsignedinteger)):
        return x                                 # a NumPy unsigned int (e.g. a uint32 seed half) keeps its type
    if isinstance(x, (int, np.integer)):
        return np.int32(x)
    if isinstance(x, (float, np.floating)):
        return np.float32(x)
    return x


def _check_array_arg(kernel, position, a):
    """Float arrays must be float32 (or float16, half storage) and C-contiguous: anything else would make Numba
    compile (on a GPU) a specialisation the PTX guard never checked -- float64 code, or strided loads."""
    dtype = getattr(a, "dtype", None)
    if dtype is None or not hasattr(a, "shape"):
        return
    name = getattr(getattr(kernel, "py_func", kernel), "__name__", "kernel")
    if np.dtype(dtype).kind == "f" and np.dtype(dtype) not in (np.float32, np.float16):
        raise TypeError(f"{name}: array argument {position} has dtype {dtype}; flashnb kernels take float32 "
                        "(float16 for half storage; use common.to_device / common.empty)")
    flags = getattr(a, "flags", None)
    contiguous = flags["C_CONTIGUOUS"] if flags is not None else getattr(a, "is_c_contiguous", lambda: True)()
    if not contiguous:
        raise TypeError(f"{name}: array argument {position} is not C-contiguous (use common.to_device)")


ROWS_PER_BLOCK = 32  # one-thread-per-row kernels: 32 rows (one warp) per thread block


def launch_rows(kernel, BH: int, rows: int, *args, label: str | None = None):
    """Launch a one-thread-per-row kernel over ``rows`` rows of ``BH`` heads (grid ``(⌈rows/32⌉, BH)``)."""
    launch(kernel, (cdiv(rows, ROWS_PER_BLOCK), BH), ROWS_PER_BLOCK, *args, label=label)


def launch(kernel, grid, block, *args, label: str | None = None, shared: int = 0):
    """Launch ``kernel[grid, block](*args)`` (``kernel[grid, block, stream, shared](*args)`` with ``shared``
    bytes of dynamic shared memory: above 48 KiB call :func:`allow_dynamic_shared` first).

    Python ints and floats become ``int32`` / ``float32`` so a GPU compiles exactly the signature the PTX
    guard checked (a Python float would otherwise specialise the kernel on float64).  ``label`` names the
    launch (e.g. ``"S = QK^T"``) in traffic counts and benchmarks.
    """
    args = tuple(_scalar(a) for a in args)
    for position, a in enumerate(args):
        _check_array_arg(kernel, position, a)
    grid = tuple(int(g) for g in (grid if isinstance(grid, tuple) else (grid,)))
    block = tuple(int(b) for b in (block if isinstance(block, tuple) else (block,)))
    if any(g <= 0 for g in grid):
        return  # nothing to do (an empty grid is a no-op, not a CUDA error)
    name = label or kernel.py_func.__name__
    check_launch_dims(name, grid, block)
    previous = getattr(_state, "label", None)
    _state.label = name
    try:
        with contextlib.ExitStack() as stack:
            for hook in list(launch_hooks):
                stack.enter_context(hook(name, kernel, grid, block, args))
            stream = current_stream()
            default = isinstance(stream, int) and stream == 0
            if shared:
                kernel[grid, block, stream, int(shared)](*args)
            else:
                (kernel[grid, block] if default else kernel[grid, block, stream])(*args)
    finally:
        _state.label = previous


# --------------------------------------------------------------------------- dry runs


class ShapeOnly:
    """A stand-in for a float32 device array: a shape and a dtype, no storage (see :func:`dry_run`)."""

    def __init__(self, shape, dtype=np.float32):
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __repr__(self):
        return f"ShapeOnly({self.shape})"


def dry_run(fn, *args, **kwargs) -> list:
    """Run a stage's host launcher ``fn`` without a device: every ``empty(...)`` it calls returns a
    :class:`ShapeOnly` and every ``launch(...)`` does nothing.  Returns the list of arrays ``fn``
    allocated, in order -- its own allocations, for shapes far too big to simulate.

    Pass :class:`ShapeOnly` for the array arguments.  Patches ``empty``/``launch`` in ``fn``'s module for
    the duration of the call (not thread-safe; meant for notebooks and tests).
    """
    g = fn.__globals__
    allocated = []

    def fake_empty(shape, *, poison=True, storage="float32"):
        a = ShapeOnly(shape, storage_dtype(storage))
        allocated.append(a)
        return a

    names = ("empty", "launch", "launch_rows")
    saved = {name: g[name] for name in names if name in g}
    g["empty"] = fake_empty
    g["launch"] = g["launch_rows"] = lambda *a, **k: None
    try:
        fn(*args, **kwargs)
    finally:
        for name in names:
            if name in saved:
                g[name] = saved[name]
            else:
                g.pop(name, None)
    return allocated
