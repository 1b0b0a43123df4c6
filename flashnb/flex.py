"""Attention modifiers: ``score_mod`` and ``mask_mod`` compiled into the FA2 kernels, FlexAttention-style.

A modifier is a plain Python function the user writes::

    def score_mod(score, b, h, q_idx, kv_idx):   # -> float32: the new (scaled) score
        return score + float32(0.1) * float32(kv_idx - q_idx)

    def mask_mod(b, h, q_idx, kv_idx):           # -> bool: may query q_idx see key kv_idx?
        return q_idx >= kv_idx

``flashnb.attention(q, k, v, score_mod=..., mask_mod=...)`` compiles them (``numba.cuda.jit(device=True)``) into
the product kernel (:func:`flashnb.kernels.simt.forward.make_forward` / ``make_backward``) as compile-time options, so a
kernel is compiled once per distinct function and tile configuration, and memoised like every other configuration;
``None`` is the unchanged kernel.  ``b``, ``h`` come from
``z = blockIdx.y = b·H + h`` (``H`` = q's heads), ``q_idx``, ``kv_idx`` are the element's row and column; all four
are int32.

How it works:

* ``score_mod`` is applied to the scaled score ``scale · q·k`` of every computed element, before masking.
* ``mask_mod`` becomes a *block mask* (:func:`create_block_mask`, evaluated on the host at the kernel's tiles)
  with three states per tile: **empty** (no element allowed: the tile is skipped -- never loaded, never
  computed, exactly as stage 5's block-sparse kernels), **full** (every element allowed: no per-element work),
  **partial** (``mask_mod`` is called per element).  Counted traffic therefore falls with the mask's density
  (:func:`flashnb.kernels.models.simt.model_forward` / ``model_backward`` take the block mask and equal the counter).
* The backward needs ``d score_mod / d score``.  flashnb **derives it from the modifier's source**
  (:func:`derivative`, :mod:`flashnb.flex_grad`: forward mode, source to source, over a stated subset --
  arithmetic, comparisons, conditional expressions, ``math.exp/log/tanh/sqrt``, ``abs``, ``min``/``max``,
  float32 casts, captured arrays indexed by the four indices), and compiles the derivative as another device
  function, checked for a GPU like the modifier; a modifier outside the subset is refused (when a backward needs
  its derivative) with a :class:`NotDifferentiable` naming the construct and its line.  A hand-written
  derivative still takes precedence: ``score_mod_grad`` (same arguments, returns float32), or
  ``score_mod.grad``; every gallery score modifier carries one, and the tests check the derived derivatives
  against them.  Why not finite differences: two more modifier calls per element and about half the float32
  digits lost; the derived derivative is exact up to float32 rounding.  ``mask_mod`` needs no derivative
  (masked elements have ``P = 0``).
* Every modifier is checked before any launch (:func:`check_modifiers`): compiled alone for a GPU
  (``numba.cuda.compile_ptx(fn, (float32, int32, int32, int32, int32), device=True, cc=(8, 0))``, in a child
  process on the simulator, once per function; the verdict is kept on disk beside NVVM's PTX cache, so a later
  process skips it), refusing a compile error (an unsupported call), ``.f64`` in its
  PTX (a Python float literal, or an int32 index times a float32, which numba promotes to float64), a wrong
  number of arguments, or a result that is not float32 (``score_mod``) / a boolean (``mask_mod``).  The error
  names the modifier and says how to fix it.  The simulator would run any of them (as Python); a GPU would
  not, or would run them in float64.

Data a modifier needs (ALiBi slopes, document ids) is *captured*: a modifier built by a factory closing over a
small NumPy array (or a number).  numba freezes captured arrays into the kernel as constants (constant memory on
a GPU; nothing the traffic counter sees, since they are no kernel arguments).  Why not an extra ``aux`` array
argument: it would change every kernel's signature (the default PTX and the readable kernel), and
FlexAttention's own design is captured tensors; the price is one compile per distinct captured array -- fine for
per-model data such as slopes, while document ids that change every batch recompile the kernel per batch
(documented limitation; an ``aux`` argument would be the next step for them).

**Captured values may change between calls; each call uses their values at that call.**  At every launch
flashnb takes a :func:`snapshot` of each modifier: a BLAKE2 digest of every array it captures (closure cells,
the globals its code reads, its defaults, its ``.numpy`` twin and ``.grad``), and, once per distinct content, a
copy of the function that sees read-only copies of those arrays.  The block mask is built, the kernel compiled
(on a GPU, with those constants) and both cached by the code and that content -- so an array changed in place
gives the new mask or bias at the next call, and changing it back reuses the earlier kernel.  Kernels are kept in
a bounded cache (:data:`flashnb.registry.KERNEL_CACHE_SIZE` per factory, least recently used dropped), so a
training loop with a new ``document(ids)`` per batch does not grow it without end.  The GPU compile check
(:func:`check_modifiers`) depends only on the code and the *types* of the captured values (array dtype and rank,
numbers with their values), so a new closure of the same factory is checked once, not per batch.  A block mask
made by :func:`create_block_mask` is itself a snapshot: passing it after an array its ``mask_mod`` captures
changed is a ValueError (rebuild it, or pass ``mask_mod=`` alone).  ``flashnb.pytorch`` takes the snapshot at the
forward, so the backward uses the forward's values whatever happens to the arrays in between.  Content changes
the snapshot sees: NumPy arrays and numbers; an object a modifier captures (a dict, a class instance) is keyed
by identity only.

The gallery (each returns a modifier with its NumPy twin ``.numpy`` for the float64 reference and, for score
modifiers, its derivative ``.grad``): :func:`causal`, :func:`sliding_window`, :func:`alibi`, :func:`softcap`,
:func:`document`, :func:`prefix_lm`.  A user's modifier without a twin is evaluated on the host by
:func:`numpy_modifier` (vectorised through NumPy broadcasting when the function allows, checked on sample
points, else element by element).

Where flashnb departs from FlexAttention, or from the simplest design, and why:

* The GQA backward sums dK, dV over the group *on chip* (its grid runs over the K/V heads and each block loops
  over its group's query heads) rather than per-query-head dK/dV plus a reduction kernel, or atomics: K and V
  are then read, and dK, dV written, once per K/V head (the counted saving), deterministically.  The forward's
  counted K/V reads do not change with GQA (each query head's blocks stream their K/V tiles); what sharing
  saves there is the K/V size (and DRAM traffic when L2 serves the group), which the element counter does not
  model.
* ``causal()`` in the gallery is top-left aligned by default (``q_idx >= kv_idx``, as FlexAttention and SDPA);
  ``causal(offset=Nk - Nq)`` is flashnb's bottom-right ``causal=True``.  ``causal=`` and ``mask_mod`` combine by AND.
* ``impl="flash"`` (the product kernel, the default: :mod:`flashnb.kernels.launch.flash`) takes modifiers and GQA; the
  stages' impls (``fa2``, ``fa2-fast``, ...) refuse them with an error naming the impl.  The product
  kernel calls back into this module only to derive a missing ``score_mod_grad``:
  :func:`flashnb.api.attention_forward` and :mod:`flashnb.pytorch` check its modifiers and build a ``mask_mod``'s
  block mask for it.
"""

from __future__ import annotations

import functools
import inspect as std_inspect
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from numba import cuda, float32

from .common import cdiv, positive_int
from .kernels.policies import python_modifier
from .kernels.policies.modifier_keys import (  # noqa: F401  (flex's names: a modifier as a value, kernels.policies)
    _UNSET,
    ARGS,
    ModifierError,
    Snapshot,
    _captured,
    _describe,
    _freeze,
    _frozen,
    _function_key,
    _holds_arrays,
    _lambda_source,
    _value_key,
    check_current,
    name_of,
    snapshot,
)
from .masks import BlockMask
from .stages import fa2

__all__ = ["ModifierError", "check_modifiers", "check_many", "create_block_mask", "mask_array", "numpy_modifier",
           "name_of", "Snapshot", "snapshot", "check_current", "check_heads",
           "causal", "sliding_window", "alibi", "alibi_slopes", "softcap", "document", "prefix_lm",
           "GALLERY", "derivative", "derivative_source", "score_mod_grad_of", "NotDifferentiable"]


# --------------------------------------------------------------------------- checking a modifier

_CHECKED: dict = {}    # (code and captured types, role) -> None (fine) or the error message


def _compile_one(fn, role):
    """(ok, message) for one Python function compiled as a device function for sm_80 (GPU mode only)."""
    from numba import int32, types

    sig = (float32, int32, int32, int32, int32) if role != "mask_mod" else (int32, int32, int32, int32)
    try:
        ptx, resty = cuda.compile_ptx(fn, sig, device=True, cc=(8, 0))
    except Exception as exc:   # numba's TypingError, LoweringError, ...
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        detail = next((ln for ln in lines if not ln.startswith("Failed in")), lines[0] if lines else "")
        return ("compile", f"{type(exc).__name__}: {detail}")
    f64 = sum(".f64" in ln for ln in ptx.splitlines())
    if f64:
        return ("f64", str(f64))
    if role == "mask_mod":
        ok = isinstance(resty, types.Boolean) or (isinstance(resty, types.Literal) and
                                                   isinstance(resty.literal_value, (bool, np.bool_)))
    else:
        ok = resty == float32
    return None if ok else ("return", str(resty))


def _worker() -> None:
    """Child-process entry point (``FLASHNB_DEVICE=gpu``): JSON [(desc, role)] on stdin, results on stdout."""
    import flashnb  # noqa: F401
    from flashnb.instruments import shipping

    out = []
    for desc, role in json.load(sys.stdin):
        try:
            fn = shipping._rebuild_function(desc)
        except Exception as exc:
            out.append(("compile", f"{type(exc).__name__}: {exc}"))
            continue
        out.append(_compile_one(fn, role))
    sys.stdout.write("\n@@FLASHNB-FLEX@@\n" + json.dumps(out))


def _compile_many(items):
    """``[(fn, role)] -> [problem or None]``: in this process on a GPU build, else in one child process."""
    from . import runtime

    if not runtime.is_simulator():
        from numba import cuda

        if cuda.compile_ptx is not None:
            return [_compile_one(fn, role) for fn, role in items]
    payload = json.dumps([(_describe(fn, role), role) for fn, role in items])
    env = dict(os.environ, FLASHNB_DEVICE="gpu")
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run([sys.executable, "-c", "from flashnb.flex import _worker; _worker()"], input=payload,
                          capture_output=True, text=True, env=env, timeout=600)
    marker = "\n@@FLASHNB-FLEX@@\n"
    if proc.returncode != 0 or marker not in proc.stdout:
        raise RuntimeError(f"modifier compile subprocess failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return [tuple(r) if r else None for r in json.loads(proc.stdout.split(marker, 1)[1])]


_MISSING = object()


def _verdict_dir():
    """Where the GPU compile check's verdicts are kept across processes: ``verdicts/`` beside NVVM's PTX cache
    (:func:`flashnb.instruments.ptx_cache_dir`; ``FLASHNB_PTX_CACHE=off`` turns both off)."""
    from .instruments.ptx_cache import ptx_cache_dir

    folder = ptx_cache_dir()
    return None if folder is None else folder.parent / "verdicts"


def _verdict_key(py, role) -> str | None:
    """The on-disk key of one check: the modifier's full description as the compile child receives it (its source
    and every captured value, arrays by content), the role, the sources the check runs (the package digest) and
    the toolchain's versions.  None (not kept) when it loads a name from a module outside flashnb, numba, numpy and
    the math modules (the key could not see that module change) or cannot be described."""
    import hashlib

    from .instruments import ptx_cache

    try:
        desc = _describe(py, role)
    except ModifierError:
        return None
    if not ptx_cache._portable(desc):
        return None
    text = json.dumps([desc, role, ptx_cache.package_digest(), ptx_cache.toolchain_versions()], sort_keys=True,
                      default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _stored_verdict(py, role):
    """``(disk key, verdict)``: the verdict a process stored for this modifier (None: fine; a problem pair), or
    ``_MISSING``."""
    folder = _verdict_dir()
    key = None if folder is None else _verdict_key(py, role)
    if key is not None:
        try:
            got = json.loads((folder / f"{key}.json").read_text())
            return key, (None if got is None else tuple(got))
        except (OSError, ValueError, TypeError):
            pass
    return key, _MISSING


def _store_verdict(key, problem) -> None:
    folder = _verdict_dir()
    if key is None or folder is None:
        return
    try:                                  # a read-only or full disk only costs the next process the check
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f"{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(problem))
        os.replace(tmp, folder / f"{key}.json")
    except OSError:
        pass


def _say_checking(items) -> None:
    """One line on stderr before the check compiles anything on the simulator (a child process, several seconds):
    what runs, and that the verdict is kept.  ``FLASHNB_SIM_QUIET=1`` keeps it quiet."""
    from . import runtime

    if not runtime.is_simulator() or os.environ.get("FLASHNB_SIM_QUIET", "") not in ("", "0"):
        return
    names = ", ".join(f"{role} {name_of(py)!r}" for py, role in items)
    folder = _verdict_dir()
    kept = f"the verdict is kept in {folder} for later runs" if folder is not None else "not kept (cache off)"
    print(f"flashnb: checking that {names} compile{'s' if len(items) == 1 else ''} for a GPU (numba in a child "
          f"process, a few seconds, once per modifier; {kept})", file=sys.stderr)


def _message(role, fn, problem):
    kind, detail = problem
    name = name_of(fn)
    want = "a boolean (e.g. q_idx >= kv_idx)" if role == "mask_mod" else "float32 (wrap it: float32(...))"
    if kind == "f64":
        return (f"{role} {name!r} computes in float64 ({detail} .f64 PTX instructions), which a GPU runs up to 64x "
                "slower and flashnb's kernels never do: a Python float literal (write float32(0.5), not 0.5), an "
                "int32 index mixed with a float32 (numba promotes int32·float32 to float64: write "
                "float32(kv_idx - q_idx)), or a float64 captured value (capture np.float32 / float32 arrays)")
    if kind == "return":
        return f"{role} {name!r} returns {detail}; it must return {want}"
    return (f"{role} {name!r} does not compile for a GPU ({detail}); a modifier may use arithmetic, comparisons, "
            "`math` functions on float32 (math.tanh, math.exp, ...), float32(...) and int32(...) conversions and "
            "captured NumPy arrays indexed by its int32 arguments -- no NumPy functions, strings or Python objects")


def _check_signature(fn, role):
    params = ARGS[role]
    try:
        sig = std_inspect.signature(fn)
    except (TypeError, ValueError):
        raise ModifierError(f"{role} must be a Python function, got {fn!r}") from None
    n = len(sig.parameters)
    if n != len(params) or any(p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                               for p in sig.parameters.values()):
        raise ModifierError(f"{role} {name_of(fn)!r} takes ({', '.join(sig.parameters)}); it must take "
                            f"{len(params)} positional arguments ({', '.join(params)})")


def check_modifiers(*, score_mod=None, mask_mod=None, score_mod_grad=None) -> None:
    """Raise :class:`ModifierError` unless each given modifier compiles alone for a GPU as float32 code with the
    right result type (see the module docstring).  Results are cached per function, in this process and on disk
    (``verdicts/`` beside :func:`flashnb.instruments.ptx_cache_dir`, keyed by the modifier's source and captured
    values, flashnb's sources and the toolchain); all the unchecked ones of one call compile in one batch (one
    child process on the simulator, several seconds, announced by a line on stderr)."""
    given = [(fn, role) for fn, role in ((score_mod, "score_mod"), (mask_mod, "mask_mod"),
                                         (score_mod_grad, "score_mod_grad")) if fn is not None]
    if score_mod is not None and score_mod_grad is None:
        g = getattr(python_modifier(score_mod), "grad", None)
        if g is not None:
            given.append((g, "score_mod_grad"))
    check_many(given)


def check_many(given, *, strict: bool = True) -> None:
    """:func:`check_modifiers` for a list of ``(function, role)`` pairs (role ``"score_mod"``, ``"mask_mod"`` or
    ``"score_mod_grad"``), compiled in one batch; raises for the first that fails (``strict=False``: only checks
    and caches the verdicts, which a later launch then raises).  A verdict is cached by what it depends on: the
    function's code and the *types* of what it captures (array dtypes and ranks, numbers with their values), so a
    new closure of the same factory -- ``flex.document(ids)`` for every batch -- is checked once, not per batch."""
    todo, keys = {}, []
    for fn, role in given:
        if not callable(fn) and not isinstance(fn, str):
            raise ModifierError(f"{role} must be a Python function, got {type(fn).__name__}")
        py = python_modifier(fn)
        _check_signature(py, role)
        key = (fn.types if isinstance(fn, Snapshot) else _function_key(py, False, {}), role)
        keys.append(key)
        if key not in _CHECKED:
            todo.setdefault(key, (py, role))
    if todo:
        stored = {key: _stored_verdict(*item) for key, item in todo.items()}
        missing = [key for key, (disk_key, found) in stored.items() if found is _MISSING]
        if missing:
            _say_checking([todo[key] for key in missing])
            for key, problem in zip(missing, _compile_many([todo[key] for key in missing])):
                _store_verdict(stored[key][0], problem)
                stored[key] = (stored[key][0], problem)
        for key, (_, problem) in stored.items():
            py, role = todo[key]
            _CHECKED[key] = None if problem is None else _message(role, py, problem)
    for key in keys if strict else ():
        if _CHECKED[key]:
            raise ModifierError(_CHECKED[key])


# --------------------------------------------------------------------------- host evaluation (NumPy)


def _scalar_loop(fn, shape, args):
    """``fn`` called element by element over the broadcast ``args`` (Python scalars)."""
    arrays = np.broadcast_arrays(*args)
    out = np.empty(shape, dtype=np.float64)
    flat = [a.reshape(-1) for a in arrays]
    res = out.reshape(-1)
    for n in range(res.size):
        res[n] = fn(*(a[n].item() for a in flat))
    return out


def numpy_modifier(fn):
    """A NumPy version of a scalar modifier: called with broadcast index arrays (and a float64 score array),
    returns an array.  Uses ``fn.numpy`` (the gallery's twins) when present; else tries ``fn`` on the arrays
    (arithmetic and comparisons broadcast) and keeps that only if it agrees with element-by-element calls on
    sample points; else loops over the elements."""
    fn = python_modifier(fn)
    twin = getattr(fn, "numpy", None)
    if twin is not None:
        return twin

    def run(*args):
        shape = np.broadcast_shapes(*(np.shape(a) for a in args))
        try:
            with np.errstate(all="ignore"):
                out = np.broadcast_to(np.asarray(fn(*args)), shape)
            if out.dtype == object:
                raise TypeError
            rng = np.random.default_rng(0)
            arrays = np.broadcast_arrays(*args)
            for n in rng.integers(0, int(np.prod(shape)), size=min(64, int(np.prod(shape)))):
                idx = np.unravel_index(n, shape)
                want = fn(*(a[idx].item() for a in arrays))
                got = out[idx]
                if not (got == want or (np.isnan(float(got)) and np.isnan(float(want))) or
                        abs(float(got) - float(want)) <= 1e-6 * (1 + abs(float(want)))):
                    raise ValueError
            return out
        except Exception:
            return _scalar_loop(fn, shape, args)

    return run


def mask_array(mask_mod, B, H, Nq, Nk) -> np.ndarray:
    """``mask_mod`` on every element: boolean ``(B, H, Nq, Nk)`` (True = allowed), evaluated on the host with the
    values it captures now (cached by them: :func:`snapshot`)."""
    return _mask_array(snapshot(mask_mod), B, H, Nq, Nk)


def _evaluate_mask(mask_mod, B, H, Nq, Nk) -> np.ndarray:
    b = np.arange(B, dtype=np.int64).reshape(B, 1, 1, 1)
    h = np.arange(H, dtype=np.int64).reshape(1, H, 1, 1)
    qi = np.arange(Nq, dtype=np.int64).reshape(1, 1, Nq, 1)
    ki = np.arange(Nk, dtype=np.int64).reshape(1, 1, 1, Nk)
    return np.broadcast_to(np.asarray(numpy_modifier(mask_mod)(b, h, qi, ki)), (B, H, Nq, Nk)).astype(bool)


@functools.lru_cache(maxsize=64)
def _mask_array(mask_mod: "Snapshot", B, H, Nq, Nk) -> np.ndarray:
    out = _evaluate_mask(mask_mod, B, H, Nq, Nk)
    out.setflags(write=False)
    return out


@functools.lru_cache(maxsize=64)
def _block_mask(mask_mod: "Snapshot", B, H, Nq, Nk, Br, Bc) -> BlockMask:
    allowed = _mask_array(mask_mod, B, H, Nq, Nk)
    Tr, Tc = cdiv(Nq, Br), cdiv(Nk, Bc)
    # pad to whole tiles; outside Nq x Nk counts as "allowed" for 'all' (the kernel masks it itself) and as
    # "not allowed" for 'any'
    pad = ((0, 0), (0, 0), (0, Tr * Br - Nq), (0, Tc * Bc - Nk))
    tiles = lambda a: a.reshape(B, H, Tr, Br, Tc, Bc)
    any_ = tiles(np.pad(allowed, pad, constant_values=False)).any(axis=(3, 5))
    all_ = tiles(np.pad(allowed, pad, constant_values=True)).all(axis=(3, 5))
    return BlockMask(any_, Br, Bc, partial=any_ & ~all_, mask_mod=mask_mod,   # recomputed exactly at finer tiles:
                     retile=functools.partial(_block_mask, mask_mod), elements=functools.partial(_mask_array, mask_mod))


def create_block_mask(mask_mod, B, H, Nq, Nk, *, Br=None, Bc=None, d=64) -> BlockMask:
    """The block mask of ``mask_mod`` (FlexAttention's ``create_block_mask``): ``(B, H, Tr, Tc)`` at tiles
    ``Br × Bc`` (default: FA2's forward tiles for head dim ``d``); a tile is empty (no element allowed: never
    loaded), full (all allowed: no per-element work) or partial (``mask_mod`` per element).  Pass it as
    ``block_mask=`` (it keeps a :func:`snapshot` of ``mask_mod``: no ``mask_mod=`` needed; a launch refuses it once
    an array ``mask_mod`` captures has changed).  ``B``/``H`` None: 1 (the mask is the same for every batch /
    head, and ``mask_mod`` is evaluated at ``b = 0`` / ``h = 0``; a launch checks that on the host at its own
    ``(B, H)`` and refuses the mask, naming ``B`` or ``H``, when ``mask_mod`` depends on them:
    :func:`check_heads`).  Cached by ``mask_mod``'s code and captured contents."""
    fwd = fa2.default_tiles(d)
    B = 1 if B is None else positive_int("B", B)
    H = 1 if H is None else positive_int("H", H)
    Br = fwd["Br"] if Br is None else positive_int("Br", Br)
    Bc = fwd["Bc"] if Bc is None else positive_int("Bc", Bc)
    if not callable(mask_mod):
        raise ModifierError(f"mask_mod must be a Python function, got {type(mask_mod).__name__}")
    _check_signature(python_modifier(mask_mod), "mask_mod")
    return _block_mask(snapshot(mask_mod), B, H, positive_int("Nq", Nq), positive_int("Nk", Nk), Br, Bc)


def check_heads(mask_mod, lead, B, H, Nq, Nk) -> None:
    """ValueError unless a block mask whose ``mask_mod`` was evaluated at leading axes ``lead`` (its ``(B, H)``;
    1 where :func:`create_block_mask` got ``None``) serves a launch over ``B`` batches and ``H`` heads: ``lead`` is
    ``(B, H)``, or 1 on an axis where ``mask_mod`` is the same for every ``b`` (``h``) -- checked on the host at
    the launch's own ``(B, H)``, once per mask_mod and shape.  A head-dependent mask read at ``h = 0`` for every
    head would skip or keep the wrong tiles of the other heads."""
    lead = tuple(int(n) for n in lead) or (1, 1)
    if lead == (B, H):
        return
    if len(lead) != 2 or lead[0] not in (1, B) or lead[1] not in (1, H):
        raise ValueError(f"block_mask was made by create_block_mask for (B, H) = {lead}, but this call has (B, H) = "
                         f"({B}, {H}) (q's leading axes): pass B={B}, H={H} to create_block_mask")
    if not _same_for_all(snapshot(mask_mod), lead, B, H, Nq, Nk):
        axes = [(a, n) for a, n, m in (("B", B, lead[0]), ("H", H, lead[1])) if m == 1 and n > 1]
        raise ValueError(f"block_mask was made by create_block_mask with {' and '.join(f'{a}=None' for a, _ in axes)} "
                         f"(mask_mod evaluated at b = 0, h = 0 only), but mask_mod {name_of(mask_mod)!r} differs "
                         "between the batches or heads of this call: pass "
                         f"{', '.join(f'{a}={n}' for a, n in axes)} to create_block_mask")


@functools.lru_cache(maxsize=64)
def _same_for_all(mask_mod: Snapshot, lead, B, H, Nq, Nk) -> bool:
    full = _evaluate_mask(mask_mod, B, H, Nq, Nk)
    return bool(np.array_equal(full, np.broadcast_to(full[:lead[0], :lead[1]], full.shape)))


# --------------------------------------------------------------------------- the gallery
# Each entry is a factory returning a plain Python function (what a user would write), with ``.numpy`` (its
# float64 NumPy twin on broadcast arrays) and, for score modifiers, ``.grad`` (d score_mod / d score, itself with
# ``.numpy``).  Captured values are NumPy float32/int32 arrays or numbers: constants of the compiled kernel.


def _twin(fn, numpy, grad=None, name=None):
    fn.numpy = numpy
    if grad is not None:
        fn.grad = grad
    if name:
        fn.__name__ = fn.__qualname__ = name
    return fn


def causal(offset: int = 0):
    """``q_idx + offset >= kv_idx``: top-left aligned (offset 0, SDPA's ``is_causal``); ``offset = Nk - Nq`` is
    flashnb's ``causal=True`` (bottom-right)."""
    off = int(offset)

    def causal_mask(b, h, q_idx, kv_idx):
        return q_idx + off >= kv_idx

    return _twin(causal_mask, lambda b, h, q, kv: q + off >= kv)


def sliding_window(window: int, offset: int = 0):
    """Causal sliding window: query ``i`` sees the ``window`` keys ``i + offset - window < j <= i + offset``."""
    w = positive_int("window", window)
    off = int(offset)

    def sliding_window_mask(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + off and q_idx + off - kv_idx < w

    return _twin(sliding_window_mask, lambda b, h, q, kv: (kv <= q + off) & (q + off - kv < w))


def alibi_slopes(H: int) -> np.ndarray:
    """ALiBi's head slopes ``2^(-8(h+1)/H)`` (Press et al. 2022), float32."""
    H = positive_int("H", H)
    return (2.0 ** (-8.0 * np.arange(1, H + 1) / H)).astype(np.float32)


def alibi(H: int):
    """ALiBi: ``score + slope_h · (kv_idx - q_idx)`` with the captured slopes of :func:`alibi_slopes` (a linear
    penalty on distance, negative for earlier keys; use it with a causal mask).  Derivative 1."""
    slopes = alibi_slopes(H)

    def alibi_bias(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * float32(kv_idx - q_idx)

    def alibi_grad(score, b, h, q_idx, kv_idx):
        return float32(1)

    _twin(alibi_grad, lambda s, b, h, q, kv: np.ones(np.broadcast_shapes(*map(np.shape, (s, b, h, q, kv)))))
    return _twin(alibi_bias, lambda s, b, h, q, kv: s + slopes.astype(np.float64)[h] * (kv - q), alibi_grad)


def softcap(cap: float):
    """tanh soft-capping (Gemma 2, Grok): ``cap · tanh(score / cap)``; derivative ``1 - tanh²(score / cap)``."""
    if not (isinstance(cap, (int, float, np.integer, np.floating)) and cap > 0):
        raise ValueError(f"cap must be a positive number, got {cap!r}")
    c = np.float32(cap)
    c64 = float(c)

    def softcap_score(score, b, h, q_idx, kv_idx):
        return c * float32(math.tanh(score / c))

    def softcap_grad(score, b, h, q_idx, kv_idx):
        t = float32(math.tanh(score / c))
        return float32(1) - t * t

    _twin(softcap_grad, lambda s, b, h, q, kv: 1.0 - np.tanh(s / c64) ** 2)
    return _twin(softcap_score, lambda s, b, h, q, kv: c64 * np.tanh(s / c64), softcap_grad)


def document(doc_ids, kv_doc_ids=None, *, causal: bool = False):
    """Document masking for packed sequences: query ``i`` sees key ``j`` only within its own document
    (``doc_ids[i] == kv_doc_ids[j]``; ``kv_doc_ids`` defaults to ``doc_ids``), and only ``j <= i`` when
    ``causal``.  The ids are captured (int32 arrays): one kernel per distinct packing."""
    qd = np.ascontiguousarray(doc_ids, dtype=np.int32)
    kd = qd if kv_doc_ids is None else np.ascontiguousarray(kv_doc_ids, dtype=np.int32)
    if qd.ndim != 1 or kd.ndim != 1:
        raise ValueError("doc_ids and kv_doc_ids must be 1-D (one document id per position)")
    if causal:
        def document_causal_mask(b, h, q_idx, kv_idx):
            return qd[q_idx] == kd[kv_idx] and kv_idx <= q_idx

        return _twin(document_causal_mask, lambda b, h, q, kv: (qd[q] == kd[kv]) & (kv <= q))

    def document_mask(b, h, q_idx, kv_idx):
        return qd[q_idx] == kd[kv_idx]

    return _twin(document_mask, lambda b, h, q, kv: qd[q] == kd[kv])


def prefix_lm(prefix: int):
    """Prefix-LM: the first ``prefix`` keys are seen by every query (bidirectional prefix), the rest causally."""
    n = int(prefix)
    if n < 0:
        raise ValueError(f"prefix must be >= 0, got {prefix!r}")

    def prefix_lm_mask(b, h, q_idx, kv_idx):
        return kv_idx < n or kv_idx <= q_idx

    return _twin(prefix_lm_mask, lambda b, h, q, kv: (kv < n) | (kv <= q))


GALLERY = {"causal": causal, "sliding_window": sliding_window, "alibi": alibi, "softcap": softcap,
           "document": document, "prefix_lm": prefix_lm}

from .flex_grad import NotDifferentiable, derivative, derivative_source, score_mod_grad_of  # noqa: E402  (builds on this module)
