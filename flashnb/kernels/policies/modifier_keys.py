"""The host side of the modifiers policy: a modifier as a value -- what ``score_mod`` / ``mask_mod`` captured
(:class:`Snapshot`, the key kernels, device functions and block masks are cached by), its source as the GPU check
and the derivative read it (:func:`_describe`), the error type of both (:class:`ModifierError`) -- and the check
every impl that takes modifiers makes at launch (:func:`launch_modifiers`).  The device side:
:mod:`flashnb.kernels.policies.modifiers`.

:mod:`flashnb.flex` builds on this module and re-exports its public names; :mod:`flashnb.flex_grad` reads
modifiers through it.  (Its old name, ``flashnb.modifiers``, still imports.)
"""

from __future__ import annotations

import inspect as std_inspect

import numpy as np
from numba import cuda

from ...common import positive_int
from .modifiers import python_modifier

__all__ = ["ModifierError", "name_of", "Snapshot", "snapshot", "check_current", "launch_modifiers", "ARGS"]


class ModifierError(TypeError):
    """A ``score_mod`` / ``mask_mod`` that would not compile for a GPU (or not as float32)."""


def name_of(fn) -> str:
    fn = python_modifier(fn)
    return getattr(fn, "__name__", None) or repr(fn)


# --------------------------------------------------------------------------- what a modifier captured
# A modifier is a function *and* the values it captured (closure cells, the globals its code loads, defaults, and
# the functions it carries as attributes: ``.numpy``, ``.grad``).  numba freezes those values into a compiled
# kernel, and the host evaluates the block mask from them, so flashnb takes a modifier as it is at each call: a
# :class:`Snapshot` with read-only copies of its arrays and a key of its code and captured contents.  Kernels,
# device functions and block masks are cached by that key, never by the function object alone.


def _captured(fn):
    """``[(name, value)]``: what the compiled kernel and the host twin see of ``fn`` besides its code."""
    from ...instruments.shipping import _loaded_names

    out = [(f"default {i}", v) for i, v in enumerate(fn.__defaults__ or ())]
    out += [(f"kwdefault {n}", v) for n, v in sorted((fn.__kwdefaults__ or {}).items())]
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        try:
            out.append((name, cell.cell_contents))
        except ValueError:                       # a cell not set yet
            out.append((name, _UNSET))
    g = fn.__globals__
    out += [(name, g[name]) for name in sorted(_loaded_names(fn.__code__)) if name in g]
    out += [(f".{name}", v) for name, v in sorted(vars(fn).items()) if callable(v)]
    return out


_UNSET = object()


def _value_key(value, content: bool, seen: dict):
    """A hashable key of one captured value: arrays by dtype, ndim and layout (what numba types) plus, with
    ``content``, their shape and a BLAKE2 digest of their bytes; numbers by type and value (numba may fold them
    into the code); functions recursively; anything else by identity."""
    import hashlib
    import types as py_types

    if isinstance(value, np.ndarray):
        layout = "C" if value.flags.c_contiguous else "F" if value.flags.f_contiguous else "A"
        key = ("array", value.dtype.str, value.ndim, layout)
        if content:
            digest = hashlib.blake2b(np.ascontiguousarray(value).view(np.uint8).reshape(-1), digest_size=16)
            key += (value.shape, digest.digest())
        return key
    if isinstance(value, np.generic):
        return ("scalar", value.dtype.str, value.tobytes())
    if isinstance(value, (bool, int, float, complex, str, bytes, type(None))):
        return (type(value).__name__, repr(value))
    if isinstance(value, (tuple, list)):
        return (type(value).__name__,) + tuple(_value_key(v, content, seen) for v in value)
    if isinstance(value, py_types.ModuleType):
        return ("module", value.__name__)
    if isinstance(value, Snapshot):
        return value.key if content else value.types
    py = getattr(value, "py_func", value)
    if isinstance(py, py_types.FunctionType):
        return ("function", _function_key(py, content, seen))
    try:
        hash(value)
        return ("object", value)                 # numba types (float32, int32), classes, ...
    except TypeError:
        return ("id", id(value))


def _function_key(fn, content: bool, seen: dict):
    if id(fn) in seen:                           # a function that reaches itself (recursion through a global)
        return ("recursive", fn.__qualname__)
    seen[id(fn)] = fn
    try:
        return (fn.__code__,) + tuple((name, _value_key(v, content, seen)) for name, v in _captured(fn))
    finally:
        del seen[id(fn)]


def _holds_arrays(value, seen=None) -> bool:
    """Does ``value`` (a captured value) hold a NumPy array, itself or through a function it captures?"""
    import types as py_types

    seen = set() if seen is None else seen
    if isinstance(value, np.ndarray):
        return True
    if isinstance(value, (tuple, list)):
        return any(_holds_arrays(v, seen) for v in value)
    py = getattr(value, "py_func", value)
    if isinstance(py, py_types.FunctionType) and id(py) not in seen:
        seen.add(id(py))
        return any(_holds_arrays(v, seen) for _, v in _captured(py))
    return False


def _frozen(value, memo: dict):
    """``value`` with every array it holds replaced by a read-only copy (functions: :func:`_freeze`)."""
    import types as py_types

    if isinstance(value, np.ndarray):
        a = np.array(value, copy=True, order="K")
        a.setflags(write=False)
        return a
    if not _holds_arrays(value):
        return value
    if isinstance(value, (tuple, list)):
        return type(value)(_frozen(v, memo) for v in value)
    if isinstance(value, py_types.FunctionType):
        return _freeze(value, memo)
    return cuda.jit(device=True)(_freeze(value.py_func, memo))   # a device function holding arrays: jit its copy


def _freeze(fn, memo: dict | None = None):
    """A copy of the Python function ``fn`` that sees read-only copies of the arrays it captured (closure cells,
    globals its code loads -- in a copy of its globals, made only when one of them holds an array --, defaults,
    and its ``.numpy`` / ``.grad`` functions, copied the same way)."""
    import types as py_types

    from ...instruments.shipping import _loaded_names

    memo = {} if memo is None else memo
    if id(fn) in memo:
        return memo[id(fn)]
    cells = None
    if fn.__closure__:
        cells = []
        for cell in fn.__closure__:
            try:
                cells.append(py_types.CellType(_frozen(cell.cell_contents, memo)))
            except ValueError:
                cells.append(cell)
        cells = tuple(cells)
    g = fn.__globals__
    changed = {n: g[n] for n in _loaded_names(fn.__code__) if n in g and _holds_arrays(g[n])}
    if changed:
        g = dict(g)
    copy = py_types.FunctionType(fn.__code__, g, fn.__name__, None, cells)
    memo[id(fn)] = copy                          # before the globals: a function may reach itself through them
    g.update({n: _frozen(v, memo) for n, v in changed.items()})
    copy.__defaults__ = None if fn.__defaults__ is None else tuple(_frozen(v, memo) for v in fn.__defaults__)
    copy.__kwdefaults__ = None if fn.__kwdefaults__ is None else \
        {n: _frozen(v, memo) for n, v in fn.__kwdefaults__.items()}
    copy.__qualname__, copy.__module__, copy.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    copy.__dict__.update({n: _freeze(v, memo) if isinstance(v, py_types.FunctionType) else _frozen(v, memo)
                          for n, v in vars(fn).items()})       # .grad, .numpy: copies of their own
    return copy


class Snapshot:
    """A modifier as it was at one call (see :func:`snapshot`): ``py_func`` is the copy the kernels compile and the
    host evaluates (its arrays read-only copies), ``key`` its code and captured contents (equal snapshots compile
    to the same kernel), ``types`` its code and captured types (what the GPU compile check depends on), ``origin``
    the user's function."""

    __slots__ = ("py_func", "key", "types", "origin", "_hash")

    def __init__(self, py_func, key, types, origin):
        self.py_func, self.key, self.types, self.origin = py_func, key, types, origin
        self._hash = hash(key)

    def __eq__(self, other):
        return isinstance(other, Snapshot) and self._hash == other._hash and self.key == other.key

    def __hash__(self):
        return self._hash

    @property
    def __name__(self):
        return self.py_func.__name__

    def __call__(self, *args):
        return self.py_func(*args)

    def current(self) -> bool:
        """Do the values ``origin`` captures still equal the snapshot's?"""
        return _function_key(self.origin, True, {}) == self.key

    def __repr__(self):
        return f"Snapshot({self.__name__})"


_FROZEN = None   # an OrderedDict: key -> frozen copy, least recently used first (bounded: KERNEL_CACHE_SIZE)


def snapshot(fn) -> Snapshot:
    """``fn`` (a modifier: a function, its ``cuda.jit`` device function, a gallery ``"module:attr"`` name, or a
    snapshot) as it is now: a :class:`Snapshot` keyed by its code and the contents of what it captured.  A
    digest of the captured arrays per call (BLAKE2 over their bytes); the frozen copy is made once per distinct
    content and kept in a bounded cache."""
    from collections import OrderedDict

    from ...registry import KERNEL_CACHE_SIZE

    global _FROZEN
    if isinstance(fn, Snapshot):
        return fn
    py = python_modifier(fn)
    key = _function_key(py, True, {})
    if _FROZEN is None:
        _FROZEN = OrderedDict()
    frozen = _FROZEN.get(key)
    if frozen is None:
        # a function object of its own per content, even without arrays: numba compiles a device function once
        # (per signature) and keeps the global numbers it read then, so each content gets its own
        frozen = _FROZEN[key] = _freeze(py)
        while len(_FROZEN) > KERNEL_CACHE_SIZE:
            _FROZEN.popitem(last=False)
    else:
        _FROZEN.move_to_end(key)
    return Snapshot(frozen, key, _function_key(py, False, {}), py)


def check_current(mask_snapshot, what: str = "block_mask") -> None:
    """ValueError naming ``what`` when the ``mask_mod`` a block mask was made from has changed what it captured
    since (an array changed in place): the block mask's empty/full tiles would be stale."""
    if mask_snapshot is not None and not mask_snapshot.current():
        raise ValueError(f"{what} was made by create_block_mask from mask_mod {mask_snapshot.__name__!r} when the "
                         "arrays it captures held other values (one was changed in place since): its empty and full "
                         "tiles would be wrong; rebuild it with flashnb.flex.create_block_mask, or pass mask_mod= "
                         "alone (the launcher then builds the block mask from the values of each call)")


# --------------------------------------------------------------------------- a modifier's source

ARGS = {"score_mod": ("score", "b", "h", "q_idx", "kv_idx"), "mask_mod": ("b", "h", "q_idx", "kv_idx"),
        "score_mod_grad": ("score", "b", "h", "q_idx", "kv_idx")}


# --------------------------------------------------------------------------- modifiers at launch


def _origin(fn):
    """The user's function behind a modifier: a snapshot's ``origin`` (the user surfaces pass snapshots of the
    modifiers as they were at the call), else the Python function itself."""
    return getattr(fn, "origin", None) or python_modifier(fn)


def _made_from(bm_mod, mask_mod) -> bool:
    """Is ``bm_mod`` (the snapshot a block mask carries) what ``mask_mod`` is now: the same function, or one with the
    same code and captured values (each call of ``flex.causal()`` makes a new, equal function, and equal snapshots
    are shared, so the mask may carry the first one's)."""
    if bm_mod == mask_mod or _origin(bm_mod) is _origin(mask_mod):
        return True
    return bm_mod == (mask_mod if isinstance(mask_mod, Snapshot) else snapshot(mask_mod))


def launch_modifiers(score_mod, mask_mod, score_mod_grad, block_mask, heads, BH):
    """``(mask_mod, H)`` of a launch with attention modifiers, checked against the block mask: ``mask_mod`` reaches
    the kernel through its block mask (:func:`flashnb.flex.create_block_mask`; the user surfaces build it), which
    carries it.  The modifiers themselves are checked for a GPU by the user surfaces (:func:`flashnb.flex.
    check_modifiers`), before any launch.  Every impl that takes modifiers (``flash``, ``fa2-tc``) calls this."""
    bm_mod = getattr(block_mask, "mask_mod", None)
    if score_mod is None and mask_mod is None and bm_mod is None:
        if score_mod_grad is not None:
            raise ValueError("score_mod_grad is given without a score_mod")
        return None, 1
    H = positive_int("heads", heads)
    if BH % H:
        raise ValueError(f"heads={H} must divide batch·heads = {BH} (q's leading axes)")
    if mask_mod is not None:
        if block_mask is None:
            raise ValueError("mask_mod reaches the flash kernels through its block mask: pass block_mask="
                             "flashnb.flex.create_block_mask(mask_mod, ...) (flashnb.attention and flashnb.pytorch "
                             "build it for you)")
        if bm_mod is None or not _made_from(bm_mod, mask_mod):
            raise ValueError(f"block_mask was not made from mask_mod {getattr(mask_mod, '__name__', mask_mod)!r}: "
                             "pass block_mask=flashnb.flex.create_block_mask(mask_mod, ...) or leave block_mask out")
    return bm_mod, H


def _lambda_source(fn, desc: dict) -> dict:
    """A lambda's desc rewritten as ``def lambda_(...): return <body>`` (the compile process parses a def)."""
    import ast

    path = std_inspect.getsourcefile(fn)
    import linecache

    text = "".join(linecache.getlines(path))
    tree = ast.parse(text)
    code = fn.__code__
    names = list(code.co_varnames[:code.co_argcount])
    for node in ast.walk(tree):
        if isinstance(node, ast.Lambda) and node.lineno == code.co_firstlineno and \
                [a.arg for a in node.args.args] == names:
            body = ast.get_source_segment(text, node.body)
            return dict(desc, source=f"def lambda_({', '.join(names)}):\n    return ({body})\n",
                        firstlineno=node.lineno, name="lambda_")
    raise ModifierError(f"the source of lambda at {path}:{code.co_firstlineno} could not be found; define the "
                        "modifier with def")


def _describe(fn, role):
    from ...instruments import shipping

    name = name_of(fn)
    try:
        desc = shipping._describe_function(fn)
        if fn.__name__ == "<lambda>":
            desc = _lambda_source(fn, desc)
    except (TypeError, OSError, SyntaxError) as exc:
        raise ModifierError(f"{role} {name!r} cannot be checked for a GPU: {exc}") from None
    return desc
