"""Count the memory traffic of every kernel launch, on the Numba CUDA simulator, without touching kernels.

(The counter lives with the simulator it patches, so that the simulator's own tools -- racecheck, the sanitizer,
the memory profiler, the vectorised launch -- count through it without importing anything above the simulator;
users reach it as :mod:`flashnb.instruments.traffic`, which adds the roofline's modelled time of a count.)

::

    with flashnb.instruments.traffic.count() as t:
        flashnb.attention_forward(q, k, v, impl="naive")
    print(t)                                  # a table: launch, array, reads, writes, atomics, bytes
    t.summary() == flashnb.stages.naive.model_forward(BH, Nq, Nk, d)   # the model format of CONTRIBUTING.md

What is counted, per launch (grid, block, label from :func:`flashnb.common.launch` or the kernel's name):

* **global arrays**, by the kernel's parameter name: element reads (``x = A[i, j]``), element writes
  (``A[i, j] = x``) and atomics (``cuda.atomic.add(A, i, x)`` is *one* atomic and no read or write);
  indexing that yields a view (``A[z]``) is not an access, reads and writes through the view count for
  ``A``;
* **shared arrays** (``cuda.shared.array``), by the variable they are assigned to in the kernel source
  (``As = cuda.shared.array(...)`` is ``"As"``): element reads and writes (and atomics, reported apart);
* local arrays (``cuda.local.array``) and scalars are registers/local memory: not counted.

These are *program-level element accesses* -- what the kernel asks for -- not DRAM bytes: a real GPU
coalesces, caches and replays.  Bytes are elements × itemsize.

Mechanism (simulator only).  While a counter is active, a top-level launch of a simulated kernel
(``FakeCUDAKernel.__call__``) gets one extra argument extension whose ``prepare_args`` hands the kernel a
counting proxy for each array argument; ``FakeCUDAShared.array`` returns a counting proxy of the shared
allocation (keyed, like the simulator does, by the *kernel's* source file and line, so two shared arrays
never alias); ``FakeCUDAAtomic``'s functions count one atomic and then work on the unwrapped array.
Counters are per simulator thread (no lock on the hot path) and summed when the launch ends.  The
patches are installed on the first :func:`count` and stay installed, inert, when nothing is counting
(they then behave exactly like the simulator's own code).  Nothing else of the simulator is replaced, so
other patches (e.g. ``flashnb.sim``'s barrier and warp shuffles) compose with these.  On the vectorised
simulator (:mod:`flashnb.sim.vector`, the default) the launch is counted there instead, by the same rules: each
vectorised access adds its active lanes; a kernel it hands to the threads simulator is counted here.

Counting needs the simulator: in GPU mode :func:`count` raises :class:`TrafficError`.
"""

from __future__ import annotations

import html
import inspect
import linecache
import os
import re
import sys
import threading
from dataclasses import dataclass, field

import numpy as np

from .. import runtime
from ..common import current_label

__all__ = ["count", "Traffic", "LaunchTraffic", "TrafficError", "ModelMismatch", "RECORD_FIELDS"]


class TrafficError(RuntimeError):
    """Traffic counting is impossible here (GPU mode) or was misused (a counter entered twice)."""


class ModelMismatch(AssertionError):
    """Raised by :meth:`Traffic.check_model` when the counts differ from the model; ``differences`` lists
    each one (which launch, kernel, array and count)."""

    def __init__(self, message: str, differences: list[str]):
        super().__init__(message)
        self.differences = differences


#: Columns of :meth:`Traffic.to_records` / :meth:`Traffic.to_csv` (one row per launch and array).
RECORD_FIELDS = ("launch_index", "launch", "kernel", "grid", "block", "array", "kind", "itemsize", "reads",
                 "writes", "atomics", "read_bytes", "write_bytes", "atomic_bytes")


# --------------------------------------------------------------------------- per-launch recording

_stack: list["Traffic"] = []     # active counters, outermost first: every launch is recorded in all of them
_current: "_Recorder | None" = None  # the launch being counted (the simulator runs one launch at a time)
# observer_factory(label, kernel_name) -> an object with index(op, proxy, idx), access(op, proxy, idx), finish() and
# an optional ``locals`` flag; set by flashnb.sim.racecheck, flashnb.sim.sanitize and flashnb.sim.profile: while
# it is set, every access of a counted launch is also shown to it (local arrays too when ``locals`` is True)
observer_factory = None
# vector_launch(kernel, args) runs a top-level launch on flashnb.sim's vectorised simulator and returns None, or
# FELL_BACK when the threads simulator must run it (set by flashnb.sim while the vectorised simulator is chosen)
vector_launch = None
FELL_BACK = object()
_install_lock = threading.Lock()
_installed = False


class _Recorder:
    """Counts of one launch in progress: one dict per simulator thread, summed by :meth:`finish`."""

    def __init__(self):
        self.tls = threading.local()
        self.per_thread: list[dict] = []
        self.lock = threading.Lock()
        self.itemsize: dict[str, int] = {}
        self.shared_names: dict[tuple, str] = {}
        self.observer = None

    def new_thread(self) -> dict:
        c: dict = {}
        self.tls.c = c
        with self.lock:
            self.per_thread.append(c)
        return c

    def shared_name(self, key) -> str:
        name = self.shared_names.get(key)
        if name is None:
            with self.lock:
                name = self.shared_names.get(key)
                if name is None:
                    name = _shared_var_name(*key)
                    if name in self.shared_names.values():  # same variable name at another line: disambiguate
                        name = f"{name}@{os.path.basename(key[0])}:{key[1]}"
                    self.shared_names[key] = name
        return name

    def totals(self) -> dict:
        out: dict = {}
        for c in self.per_thread:
            for k, v in c.items():
                out[k] = out.get(k, 0) + v
        return out


def _bump(rec: _Recorder, key, n: int) -> None:
    try:
        c = rec.tls.c
    except AttributeError:
        c = rec.new_thread()
    c[key] = c.get(key, 0) + n


class _Counted:
    """A counting stand-in for an array inside a simulated kernel.

    Scalar element reads/writes bump this thread's counters under the array's name; indexing that yields
    a sub-array returns a view proxy sharing the name (and so the counts).
    """

    __slots__ = ("_a", "_rec", "_kr", "_kw", "_ka", "shape", "ndim", "size", "dtype", "_fake_shape", "_pre")

    def __init__(self, a: np.ndarray, rec: _Recorder, keys: tuple, fake_shape: bool, pre: tuple = ()):
        self._a = a
        self._rec = rec
        self._kr, self._kw, self._ka = keys
        self._fake_shape = fake_shape
        self._pre = pre   # the indices that made this view, one tuple per indexing (A[z] -> ((z,),)), for messages
        self.shape = _FakeShape(a.shape) if fake_shape else a.shape
        self.ndim = a.ndim
        self.size = a.size
        self.dtype = a.dtype

    def _view(self, sub, idx=()):
        pre = self._pre + ((idx if type(idx) is tuple else (idx,)),)
        return type(self)(sub, self._rec, (self._kr, self._kw, self._ka), self._fake_shape, pre)

    def __getitem__(self, idx):
        r = self._a[idx]
        if type(r) is np.ndarray:
            return self._view(r, idx)
        try:
            c = self._rec.tls.c
        except AttributeError:
            c = self._rec.new_thread()
        k = self._kr
        c[k] = c.get(k, 0) + 1
        return r

    def __setitem__(self, idx, value):
        a = self._a
        if isinstance(value, _Counted):  # copying from another counted array: the whole right side is read
            _bump(value._rec, value._kr, value._a.size)
            value = value._a
        a[idx] = value
        n = 1  # one element, unless the index selects a sub-array (a slice, Ellipsis, None, fewer indices)
        if type(idx) is tuple:
            if len(idx) != a.ndim:
                n = np.size(a[idx])
            else:
                for i in idx:
                    if type(i) is slice or i is Ellipsis or i is None:
                        n = np.size(a[idx])
                        break
        elif a.ndim != 1 or type(idx) is slice or idx is Ellipsis or idx is None:
            n = np.size(a[idx])
        try:
            c = self._rec.tls.c
        except AttributeError:
            c = self._rec.new_thread()
        k = self._kw
        c[k] = c.get(k, 0) + n

    def __len__(self):
        return len(self._a)

    def __getattr__(self, name):  # strides, itemsize, nbytes, ... (only reached for names not above)
        return getattr(self._a, name)

    def __repr__(self):
        return f"<counted {self._kr[1]!r} {self.dtype}{tuple(self.shape)}>"


class _Observed(_Counted):
    """A :class:`_Counted` that also shows every access to the launch's observer (the sanitizer tools and the
    memory profiler of :mod:`flashnb.sim`): ``observer.index(op, proxy, idx)`` *before* any indexing (so a bounds
    check runs before NumPy would wrap a negative index), ``observer.access(op, proxy, idx)`` after each element
    read (``"r"``) or write (``"w"``)."""

    __slots__ = ()

    def __getitem__(self, idx):
        obs = self._rec.observer
        obs.index("r", self, idx)
        r = _Counted.__getitem__(self, idx)
        if type(r) is not _Observed:  # an element, not a view
            obs.access("r", self, idx)
        return r

    def __setitem__(self, idx, value):
        obs = self._rec.observer
        obs.index("w", self, idx)
        _Counted.__setitem__(self, idx, value)
        obs.access("w", self, idx)


def _proxy(a, rec, keys, fake_shape):
    return (_Counted if rec.observer is None else _Observed)(a, rec, keys, fake_shape)


def memory_of(proxy) -> str:
    """``"global"``, ``"shared"`` or ``"local"``: where the array behind a counting proxy lives."""
    return {"r": "global", "sr": "shared", "lr": "local"}[proxy._kr[0]]


def _shared_var_name(filename: str, lineno: int) -> str:
    line = linecache.getline(filename, lineno)
    m = re.match(r"\s*([A-Za-z_]\w*)\s*(?::[^=]*)?=(?!=)", line)
    if m:
        return m.group(1)
    return f"shared@{os.path.basename(filename)}:{lineno}"


# --------------------------------------------------------------------------- simulator patches


class _ArgExtension:
    """Argument extension (the simulator's ``prepare_args`` protocol): arrays become counting proxies."""

    def __init__(self, rec: _Recorder, names: list[str]):
        self.rec = rec
        self.names = names
        self.position = 0

    def prepare_args(self, ty, val, stream=0, retr=None):
        from ._numba_adapter import sim

        ArgHint, InOut = sim("args", "ArgHint"), sim("args", "InOut")
        FakeCUDAArray = sim("cudadrv.devicearray", "FakeCUDAArray")
        FakeWithinKernelCUDAArray = sim("cudadrv.devicearray", "FakeWithinKernelCUDAArray")

        i = self.position
        self.position += 1
        name = self.names[i] if i < len(self.names) else f"arg{i}"
        retr = [] if retr is None else retr
        # the same conversions the simulator applies after the extensions, so semantics are unchanged
        if isinstance(val, np.ndarray) and val.ndim > 0:
            val = InOut(val).to_device(retr)
        elif isinstance(val, ArgHint):
            val = val.to_device(retr)
        if isinstance(val, FakeWithinKernelCUDAArray):
            val = val._item
        if isinstance(val, FakeCUDAArray) and type(val._ary) is np.ndarray and val._ary.dtype.fields is None:
            a = val._ary
            self.rec.itemsize[name] = a.dtype.itemsize
            keys = (("r", name), ("w", name), ("a", name))
            return ty, _proxy(a, self.rec, keys, fake_shape=True)
        return ty, val


_param_names_cache: dict = {}


def _param_names(fn) -> list[str]:
    names = _param_names_cache.get(fn)
    if names is None:
        try:
            names = [p.name for p in inspect.signature(fn).parameters.values()
                     if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        except (TypeError, ValueError):
            names = []
        _param_names_cache[fn] = names
    return names


def _install() -> None:
    """Patch three simulator entry points, once; the patches are inert while nothing is counting."""
    global _installed, _FakeShape
    with _install_lock:
        if _installed:
            return
        from numba.cuda import types as nb_types
        from numba.cuda.np import numpy_support

        from ._numba_adapter import sim

        sim_kernel, kernelapi = sim("kernel"), sim("kernelapi")
        FakeShape = sim("cudadrv.devicearray", "FakeShape")

        _FakeShape = FakeShape
        call = sim_kernel.FakeCUDAKernel.__call__

        def __call__(self, *args):
            global _current
            if self._device or sim_kernel._kernel_context is not None or _current is not None:
                return call(self, *args)
            if vector_launch is not None and vector_launch(self, args) is not FELL_BACK:
                return None          # the vectorised simulator ran it (and recorded its traffic)
            if not _stack:
                return call(self, *args)
            rec = _Recorder()
            label = current_label() or self.fn.__name__
            if observer_factory is not None:
                rec.observer = observer_factory(label, self.fn.__name__)
            ext = _ArgExtension(rec, _param_names(self.fn))
            self.extensions.append(ext)
            _current = rec
            try:
                result = call(self, *args)
            finally:
                _current = None
                self.extensions.remove(ext)
            if rec.observer is not None:
                rec.observer.finish()
            record = LaunchTraffic._from_recorder(
                rec, label=label, kernel=self.fn.__name__,
                grid=tuple(self.grid_dim), block=tuple(self.block_dim),
                source=getattr(getattr(self.fn, "__code__", None), "co_filename", ""))
            for t in list(_stack):
                t.launches.append(record)
            return result

        __call__.__wrapped__ = call
        sim_kernel.FakeCUDAKernel.__call__ = __call__

        shared_array = kernelapi.FakeCUDAShared.array

        def array(self, shape, dtype, alignment=None):
            if alignment is not None or (not isinstance(shape, tuple) and shape == 0):
                res = shared_array(self, shape, dtype, alignment)  # dynamic shared: not keyed by caller
                frame = sys._getframe(1)
            else:
                # The simulator's own logic, but keyed by *our* caller's (file, line): calling through
                # would key every allocation by this line and alias all shared arrays of a kernel.
                if isinstance(dtype, nb_types.Type):
                    dtype = numpy_support.as_dtype(dtype)
                frame = sys._getframe(1)
                caller = (frame.f_code.co_filename, frame.f_lineno)
                res = self._allocations.get(caller)
                if res is None:
                    res = np.empty(shape, dtype)
                    self._allocations[caller] = res
            rec = _current
            if rec is None:
                return res
            name = rec.shared_name((frame.f_code.co_filename, frame.f_lineno))
            keys = (("sr", name), ("sw", name), ("sa", name))
            return _proxy(res, rec, keys, fake_shape=False)

        array.__wrapped__ = shared_array
        kernelapi.FakeCUDAShared.array = array

        local_array = kernelapi.FakeCUDALocal.array

        def local(self, shape, dtype, alignment=None):
            # Local arrays are per-thread registers/local memory: never counted, but an observer that asks for
            # them (the sanitizer's memcheck and initcheck, ``observer.locals``) sees their accesses.
            res = local_array(self, shape, dtype, alignment)
            rec = _current
            if rec is None or rec.observer is None or not getattr(rec.observer, "locals", False):
                return res
            frame = sys._getframe(1)
            name = rec.shared_name((frame.f_code.co_filename, frame.f_lineno))
            proxy = _Observed(res, rec, (("lr", name), ("lw", name), ("la", name)), False)
            rec.observer.new_local(proxy)
            return proxy

        local.__wrapped__ = local_array
        kernelapi.FakeCUDALocal.array = local

        def wrap_atomic(fn):
            def atomic(self, array, *args):
                if isinstance(array, _Counted):
                    obs = array._rec.observer
                    if obs is not None:
                        obs.index("a", array, args[0])
                    _bump(array._rec, array._ka, 1)
                    if obs is not None:
                        obs.access("a", array, args[0])
                    array = array._a  # the simulator's read-modify-write on the raw array: not counted
                return fn(self, array, *args)

            atomic.__wrapped__ = fn
            atomic.__name__ = fn.__name__
            return atomic

        for attr, fn in list(vars(kernelapi.FakeCUDAAtomic).items()):
            if not attr.startswith("__") and callable(fn):
                setattr(kernelapi.FakeCUDAAtomic, attr, wrap_atomic(fn))
        _installed = True


_FakeShape = tuple  # replaced by the simulator's FakeShape (no negative indexing) on install


# --------------------------------------------------------------------------- results


def _nonzero(d: dict) -> dict:
    return {k: v for k, v in d.items() if v}


@dataclass
class LaunchTraffic:
    """The counts of one kernel launch (elements unless the name says bytes)."""

    label: str
    kernel: str
    grid: tuple
    block: tuple
    reads: dict = field(default_factory=dict)          # global param -> elements read
    writes: dict = field(default_factory=dict)         # global param -> elements written
    atomics: dict = field(default_factory=dict)        # global param -> atomic operations
    shared_reads: dict = field(default_factory=dict)   # shared array -> elements read
    shared_writes: dict = field(default_factory=dict)  # shared array -> elements written
    shared_atomics: dict = field(default_factory=dict)  # shared array -> atomic operations
    itemsize: dict = field(default_factory=dict)       # global param -> bytes per element
    source: str = ""   # the file that defined the kernel (its code's co_filename): who wrote what ran

    @classmethod
    def _from_recorder(cls, rec: _Recorder, **meta) -> "LaunchTraffic":
        out = cls(**meta, itemsize=dict(rec.itemsize))
        slot = dict(r=out.reads, w=out.writes, a=out.atomics, sr=out.shared_reads, sw=out.shared_writes,
                    sa=out.shared_atomics)
        for (kind, name), n in sorted(rec.totals().items()):
            if n and kind in slot:   # local arrays (seen only by an observer) are not traffic
                slot[kind][name] = n
        return out

    @property
    def read_bytes(self) -> int:
        return sum(n * self.itemsize.get(k, 4) for k, n in self.reads.items())

    @property
    def write_bytes(self) -> int:
        return sum(n * self.itemsize.get(k, 4) for k, n in self.writes.items())

    def summary(self) -> dict:
        """This launch in the traffic-model format of CONTRIBUTING.md."""
        out = dict(launch=self.label, reads=_nonzero(self.reads), writes=_nonzero(self.writes),
                   atomics=_nonzero(self.atomics), shared_reads=sum(self.shared_reads.values()),
                   shared_writes=sum(self.shared_writes.values()))
        if any(self.shared_atomics.values()):   # a seventh key only where there are any (no library kernel has)
            out["shared_atomics"] = sum(self.shared_atomics.values())
        return out

    def rows(self):
        """(array, kind, reads, writes, atomics, read bytes, written bytes) per array of this launch."""
        seen = list(self.itemsize)  # parameter order
        for name in sorted(set(self.reads) | set(self.writes) | set(self.atomics),
                           key=lambda n: (seen.index(n) if n in seen else len(seen), n)):
            size = self.itemsize.get(name, 4)
            r, w = self.reads.get(name, 0), self.writes.get(name, 0)
            yield name, "global", r, w, self.atomics.get(name, 0), r * size, w * size
        for name in dict.fromkeys([*self.shared_writes, *self.shared_reads, *self.shared_atomics]):
            yield (name, "shared", self.shared_reads.get(name, 0), self.shared_writes.get(name, 0),
                   self.shared_atomics.get(name, 0), None, None)


#: The keys of one launch's traffic model (CONTRIBUTING.md); ``shared_atomics`` is optional (default 0).
MODEL_KEYS = ("launch", "reads", "writes", "atomics", "shared_reads", "shared_writes", "shared_atomics")


class Traffic:
    """Counts of every launch made while the ``with`` block ran; see the module docstring.

    ``launches`` is a list of :class:`LaunchTraffic` in launch order.  Nested counters each see the
    launches made while they are active; one ``Traffic`` cannot be entered twice.
    """

    def __init__(self):
        self.launches: list[LaunchTraffic] = []
        self._state = "new"

    # -- context manager
    def __enter__(self) -> "Traffic":
        _check_simulator()
        if self._state != "new":
            raise TrafficError("this traffic counter was already used; make a new one with "
                               "flashnb.instruments.traffic.count()")
        if _current is not None:
            raise TrafficError("cannot start counting inside a kernel launch")
        _install()
        self._state = "active"
        _stack.append(self)
        return self

    def __exit__(self, *exc) -> None:
        if self in _stack:
            _stack.remove(self)
        self._state = "done"

    # -- totals (global: elements × itemsize; shared: elements)
    @property
    def global_reads(self) -> int:
        return sum(sum(lt.reads.values()) for lt in self.launches)

    @property
    def global_writes(self) -> int:
        return sum(sum(lt.writes.values()) for lt in self.launches)

    @property
    def global_read_bytes(self) -> int:
        return sum(lt.read_bytes for lt in self.launches)

    @property
    def global_write_bytes(self) -> int:
        return sum(lt.write_bytes for lt in self.launches)

    @property
    def atomics(self) -> int:
        """Atomic operations on global arrays (not included in the read/write counts)."""
        return sum(sum(lt.atomics.values()) for lt in self.launches)

    @property
    def shared_reads(self) -> int:
        return sum(sum(lt.shared_reads.values()) for lt in self.launches)

    @property
    def shared_writes(self) -> int:
        return sum(sum(lt.shared_writes.values()) for lt in self.launches)

    @property
    def shared_atomics(self) -> int:
        return sum(sum(lt.shared_atomics.values()) for lt in self.launches)

    def summary(self) -> list[dict]:
        """One dict per launch in the model format of CONTRIBUTING.md (compare with ``model_*`` exactly)."""
        return [lt.summary() for lt in self.launches]

    def totals_by_array(self) -> dict:
        """Counts summed over launches per array name: ``{name: dict(kind, reads, writes, atomics,
        read_bytes, write_bytes)}``; global arrays by parameter name (``A`` of two launches of the same
        kernel add up), shared arrays as ``"shared:NAME"`` (bytes are None for shared arrays)."""
        out: dict = {}
        for lt in self.launches:
            for name, kind, r, w, a, rb, wb in lt.rows():
                key = name if kind == "global" else f"shared:{name}"
                e = out.setdefault(key, dict(kind=kind, reads=0, writes=0, atomics=0,
                                             read_bytes=0 if kind == "global" else None,
                                             write_bytes=0 if kind == "global" else None))
                e["reads"] += r
                e["writes"] += w
                e["atomics"] += a
                if kind == "global":
                    e["read_bytes"] += rb
                    e["write_bytes"] += wb
        return out

    def totals_by_launch(self) -> dict:
        """``{label: dict(read_bytes, write_bytes, atomics, shared_reads, shared_writes)}`` summed over
        launches with the same label."""
        out: dict = {}
        for lt in self.launches:
            e = out.setdefault(lt.label, dict(read_bytes=0, write_bytes=0, atomics=0, shared_reads=0,
                                              shared_writes=0))
            e["read_bytes"] += lt.read_bytes
            e["write_bytes"] += lt.write_bytes
            e["atomics"] += sum(lt.atomics.values())
            e["shared_reads"] += sum(lt.shared_reads.values())
            e["shared_writes"] += sum(lt.shared_writes.values())
        return out

    @property
    def global_bytes(self) -> int:
        """Bytes to and from global memory: read + written + one element per atomic (as ``flashnb tour``'s
        modelled time counts them)."""
        return self.global_read_bytes + self.global_write_bytes + sum(
            n * lt.itemsize.get(k, 4) for lt in self.launches for k, n in lt.atomics.items())

    # -- comparing with a model
    def check_model(self, model, *, budget: float | None = None, raise_on_mismatch: bool = True) -> list[str]:
        """Compare these counts with a model in the format of CONTRIBUTING.md (a list with one dict per launch,
        ``dict(launch=, reads={array: elements}, writes=, atomics=, shared_reads=, shared_writes=)``, or one
        such dict for a single launch).

        ``budget=None`` asks for equality; ``budget=0.1`` lets every count be within 10 % of the model's
        (``|counted - model| <= budget * model``).  Returns the list of differences, each naming the launch,
        its kernel, the array and both counts; raises :class:`ModelMismatch` with that list unless
        ``raise_on_mismatch=False``.
        """
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float))
                                   or not budget >= 0):
            raise ValueError(f"budget must be None (exact) or a fraction >= 0 (0.1 = within 10 %), got {budget!r}")
        if isinstance(model, dict):
            model = [model]
        model = list(model)
        for i, m in enumerate(model):
            if not isinstance(m, dict) or "launch" not in m:
                raise ValueError(f"model[{i}] must be a dict with a 'launch' label (model format of CONTRIBUTING.md),"
                                 f" got {m!r}")
            unknown = [k for k in m if k not in MODEL_KEYS]
            if unknown:   # a misspelt key would otherwise be a count the model silently does not check
                raise ValueError(f"model[{i}] ({m['launch']!r}) has unknown key(s) {unknown}; a launch's model "
                                 f"has the keys {list(MODEL_KEYS)}")

        def off(counted, modelled) -> bool:
            if budget is None:
                return counted != modelled
            return abs(counted - modelled) > budget * abs(modelled)

        def pct(counted, modelled) -> str:
            return f"{(counted - modelled) / modelled:+.1%}" if modelled else "model 0"

        diffs = []
        if len(model) != len(self.launches):
            diffs.append(f"{len(self.launches)} launches counted {[lt.label for lt in self.launches]}, "
                         f"{len(model)} in the model {[m['launch'] for m in model]}")
        for i, (lt, m) in enumerate(zip(self.launches, model)):
            where = f"launch {i} {lt.label!r} (kernel {lt.kernel})"
            if lt.label != m["launch"]:
                diffs.append(f"{where}: the model's launch {i} is {m['launch']!r}")
            for what in ("reads", "writes", "atomics"):
                counted, modelled = getattr(lt, what), m.get(what, {}) or {}
                for array in dict.fromkeys([*counted, *modelled]):
                    c, mo = counted.get(array, 0), modelled.get(array, 0)
                    if off(c, mo):
                        diffs.append(f"{where}: {what} of {array!r}: counted {c:,}, model {mo:,} ({pct(c, mo)})")
            for what in ("shared_reads", "shared_writes", "shared_atomics"):
                c, mo = sum(getattr(lt, what).values()), m.get(what, 0)
                if off(c, mo):
                    per = ", ".join(f"{k} {v:,}" for k, v in getattr(lt, what).items())
                    diffs.append(f"{where}: {what}: counted {c:,} ({per or 'none'}), model {mo:,} ({pct(c, mo)})")
        if diffs and raise_on_mismatch:
            rule = "exactly" if budget is None else f"within {budget:.0%}"
            raise ModelMismatch(f"counted traffic does not match the model {rule}:\n  " + "\n  ".join(diffs), diffs)
        return diffs

    # -- export
    def to_records(self) -> list[dict]:
        """One dict per (launch, array) with the fields of :data:`RECORD_FIELDS`: exact element counts and
        bytes (bytes are None for shared arrays, whose counts are elements)."""
        out = []
        for i, lt in enumerate(self.launches):
            for name, kind, r, w, a, rb, wb in lt.rows():
                size = lt.itemsize.get(name, 4) if kind == "global" else None
                out.append(dict(launch_index=i, launch=lt.label, kernel=lt.kernel, grid=_dim(lt.grid),
                                block=_dim(lt.block), array=name, kind=kind, itemsize=size, reads=r, writes=w,
                                atomics=a, read_bytes=rb, write_bytes=wb,
                                atomic_bytes=None if size is None else a * size))
        return out

    def to_csv(self, path=None) -> str:
        """The records as CSV text (header: :data:`RECORD_FIELDS`); also written to ``path`` when given."""
        import csv
        import io

        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=RECORD_FIELDS, lineterminator="\n")
        writer.writeheader()
        for row in self.to_records():
            writer.writerow({k: "" if v is None else v for k, v in row.items()})
        text = buf.getvalue()
        if path is not None:
            with open(path, "w", newline="") as f:
                f.write(text)
        return text

    def to_dataframe(self):
        """The records as a pandas DataFrame (pandas is optional: ``pip install pandas``)."""
        try:
            import pandas as pd
        except ImportError:
            raise ImportError("Traffic.to_dataframe() needs pandas (pip install pandas); to_records() and "
                              "to_csv() give the same rows without it") from None
        return pd.DataFrame(self.to_records(), columns=list(RECORD_FIELDS))

    # -- roofline (its modelled time of these bytes: flashnb.instruments.traffic.Traffic.modelled_time)
    def roofline_point(self, flops: float, label: str = "counted") -> dict:
        """``dict(label, flops, bytes)`` of this count, ready for :func:`flashnb.instruments.roofline.roofline_plot`
        (its arithmetic intensity is ``flops / bytes``, bytes = :attr:`global_bytes`)."""
        if isinstance(flops, bool) or not isinstance(flops, (int, float)) or not flops >= 0:
            raise ValueError(f"flops must be a number >= 0, got {flops!r}")
        return dict(label=label, flops=float(flops), bytes=float(self.global_bytes))

    # -- rendering
    _HEAD = ("launch", "kernel", "grid", "block", "array", "reads", "writes", "atomics", "read B", "written B")

    def _table(self) -> list[tuple]:
        rows = []
        for lt in self.launches:
            first = True
            arrays = list(lt.rows()) or [("-", "global", 0, 0, 0, 0, 0)]
            for name, kind, r, w, a, rb, wb in arrays:
                meta = (lt.label, lt.kernel, _dim(lt.grid), _dim(lt.block)) if first else ("", "", "", "")
                first = False
                rows.append((*meta, name if kind == "global" else f"{name} (shared)", f"{r:,}", f"{w:,}",
                             f"{a:,}", "" if rb is None else f"{rb:,}", "" if wb is None else f"{wb:,}"))
        return rows

    def _headline(self) -> str:
        return (f"{len(self.launches)} launch{'es' if len(self.launches) != 1 else ''}: global "
                f"{_bytes(self.global_read_bytes)} read, {_bytes(self.global_write_bytes)} written, "
                f"{self.atomics:,} atomics; shared {self.shared_reads:,} element reads, "
                f"{self.shared_writes:,} element writes"
                + (f", {self.shared_atomics:,} atomics" if self.shared_atomics else ""))

    def __str__(self) -> str:
        rows = [self._HEAD] + self._table()
        widths = [max(len(r[i]) for r in rows) for i in range(len(self._HEAD))]
        right = {5, 6, 7, 8, 9}
        lines = [self._headline()]
        for j, r in enumerate(rows):
            lines.append("  ".join(c.rjust(w) if i in right else c.ljust(w)
                                   for i, (c, w) in enumerate(zip(r, widths))).rstrip())
            if j == 0:
                lines.append("  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<flashnb.instruments.traffic.Traffic {self._state}, {self._headline()}>"

    def _repr_html_(self) -> str:
        e = html.escape
        head = "".join(f"<th>{e(h)}</th>" for h in self._HEAD)
        body = "".join("<tr>" + "".join(f"<td style='text-align:{'right' if i >= 5 else 'left'}'>{e(c)}</td>"
                                        for i, c in enumerate(r)) + "</tr>" for r in self._table())
        return (f"<div><p>{e(self._headline())}</p><table><thead><tr>{head}</tr></thead>"
                f"<tbody>{body}</tbody></table></div>")


def _dim(t: tuple) -> str:
    t = tuple(t)
    while len(t) > 1 and t[-1] == 1:
        t = t[:-1]
    return "(" + ", ".join(str(x) for x in t) + ")"


def _bytes(n: int) -> str:
    """Exact bytes, with a rounded binary unit beside them when that helps: ``1,664 B (1.6 KiB)``."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n:,} B ({n / size:.1f} {unit})"
    return f"{n:,} B"


def _check_simulator() -> None:
    if runtime.MODE != "sim":
        raise TrafficError(
            "flashnb.instruments.traffic.count() needs the Numba CUDA simulator, but this process runs kernels on a "
            "GPU (flashnb.MODE == 'gpu'). Start a fresh process with FLASHNB_DEVICE=sim (the mode is fixed when "
            "numba.cuda is first imported) to count element accesses; on a GPU use Nsight Compute for bytes.")


def count() -> Traffic:
    """A new traffic counter: ``with flashnb.instruments.traffic.count() as t: ...``; raises :class:`TrafficError` in
    GPU mode."""
    _check_simulator()
    return Traffic()
