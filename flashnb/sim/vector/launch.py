"""One launch on the vectorised simulator, from ``kernel[grid, block](*args)`` to the traffic record.

1. the arguments are converted as the threads simulator converts them (host arrays are copied to the "device"
   and back after the launch, ``cuda.In``/``Out``/``InOut`` hints, argument extensions), then wrapped as the
   lanes see them (:class:`~flashnb.sim.vector.arrays.Arr`, named by parameter for the traffic counter);
2. the kernel (and, as they are called, its device functions) is translated (:mod:`.translate`; cached per code
   object) -- :class:`~.fallback.Unsupported` here means the threads simulator runs it;
3. the grid's blocks, in the threads simulator's order, are cut into chunks of at most :data:`CHUNK_LANES`
   lanes; each chunk runs the translated kernel once, every lane of every block of the chunk in lockstep;
4. deferred atomics are applied in the threads simulator's order, the race checker and profiler analyse their
   logs, the tools' findings are committed, the traffic record goes to every active counter.

If step 3 meets something lockstep cannot run (a divergent barrier or warp operation, values of different types
in different lanes ...), every array the attempt wrote is restored, a note says why, and the caller runs the
threads simulator.  A kernel error is raised as the threads simulator raises it, prefixed with the thread and
block of the first lane (in its start order) that raised it.
"""

from __future__ import annotations

import functools

import numpy as np

from ..fallback import KernelFault, Undo, Unsupported, note
from . import profile, race, tools, translate, values
from .arrays import Arr, set_fake_shape
from .warp import Geometry, VectorCuda, apply_deferred

__all__ = ["run", "CHUNK_LANES", "FELL_BACK"]

#: The most lanes (threads) one lockstep chunk runs; a grid with more is run in chunks of whole blocks.
CHUNK_LANES = 1 << 15

#: Launches so far: run by the vectorised simulator, handed to the threads simulator.
#: Globals this module's launches rebind or fill (the course grader's integrity check leaves them out).
_RUNTIME_STATE = ("COUNTS", "_THREAD_ERR")
COUNTS = {"vector": 0, "threads": 0}

from ..traffic import FELL_BACK  # noqa: E402


def _kernel_name(kernel):
    fn = kernel.fn
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn.__name__)}"


def _root_offset(nd):
    """Bytes from the start of the allocation that ``nd`` is a view of (the profiler's offsets)."""
    root = nd
    while isinstance(root.base, np.ndarray):
        root = root.base
    return nd.__array_interface__["data"][0] - root.__array_interface__["data"][0]


def _wrap_arg(val, name):
    from .._numba_adapter import sim

    FakeCUDAArray = sim("cudadrv.devicearray", "FakeCUDAArray")
    FakeWithinKernelCUDAArray = sim("cudadrv.devicearray", "FakeWithinKernelCUDAArray")

    if isinstance(val, FakeWithinKernelCUDAArray):
        val = val._item
    if isinstance(val, FakeCUDAArray):
        nd = val._ary
        if type(nd) is not np.ndarray or nd.dtype.fields is not None:
            raise Unsupported("a record (structured) array argument")
        if not nd.flags.c_contiguous:
            raise Unsupported("a non-contiguous array argument")
        base = nd.reshape(-1)
        n = 1
        st = []
        for s in reversed(nd.shape):
            st.append(n)
            n *= s
        arr = Arr(base, 0, nd.shape, tuple(reversed(st)), "global", name, (), nd, True, nd=nd)
        arr.addr0 = nd.__array_interface__["data"][0]
        arr.root_off = _root_offset(nd)
        return arr
    if isinstance(val, np.void):
        raise Unsupported("a record argument")
    return val


def _convert_args(kernel, args, retr):
    """The threads simulator's argument conversion (``FakeCUDAKernel.__call__``'s ``fake_arg``)."""
    from .._numba_adapter import sim

    ArgHint, InOut = sim("args", "ArgHint"), sim("args", "InOut")

    FakeCUDAArray = sim("cudadrv.devicearray", "FakeCUDAArray")
    FakeWithinKernelCUDAArray = sim("cudadrv.devicearray", "FakeWithinKernelCUDAArray")

    out = []
    for arg in args:
        _, arg = functools.reduce(lambda ty_val, ext: ext.prepare_args(*ty_val, stream=0, retr=retr),
                                  kernel.extensions, (None, arg))
        if isinstance(arg, np.ndarray) and arg.ndim > 0:
            ret = InOut(arg).to_device(retr)
        elif isinstance(arg, ArgHint):
            ret = arg.to_device(retr)
        elif isinstance(arg, np.void):
            ret = FakeCUDAArray(arg)
        else:
            ret = arg
        if isinstance(ret, FakeCUDAArray):
            ret = FakeWithinKernelCUDAArray(ret)
        out.append(ret)
    return out


def _blocks(grid):
    return list(np.ndindex(*grid))


def _message(exc, geo, lane):
    ti, bi = geo.lane_name(lane)
    tid = "tid=%s" % list(ti)
    ctaid = "ctaid=%s" % list(bi)
    return f"{tid} {ctaid}" if str(exc) == "" else f"{tid} {ctaid}: {exc}"


def _lane_of_frame(tb):
    """The first active lane of the innermost translated frame of a traceback (where a uniform operation
    raised: every active lane would have raised it)."""
    lane = 0
    gen = values.now.generated
    while tb is not None:
        if tb.tb_frame.f_code in gen:
            m = tb.tb_frame.f_locals.get("_vm", None)
            if m is not False:
                lane = values.first_lane(m)
        tb = tb.tb_next
    return lane


def _internal(tb):
    """Whether an exception was raised by the vectorised simulator's own code (its innermost frame is here)."""
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    last = None
    while tb is not None:
        last = tb.tb_frame.f_code.co_filename
        tb = tb.tb_next
    return last is not None and os.path.dirname(os.path.abspath(last)) == here


def _where_of(tb):
    """``file:line (function)`` of the innermost translated frame of a traceback."""
    import os

    where = None
    gen = values.now.generated
    while tb is not None:
        f = tb.tb_frame
        if f.f_code in gen:
            where = f"{os.path.basename(f.f_code.co_filename)}:{tb.tb_lineno} ({f.f_code.co_name})"
        tb = tb.tb_next
    return where


def _retype(exc, msg):
    try:
        return type(exc)(msg)
    except Exception:   # an exception class that does not take one message
        return RuntimeError(msg)


def run(kernel, args):
    """Run a top-level launch of ``kernel`` (a simulator ``FakeCUDAKernel``) on the vectorised simulator.
    Returns None when it ran, :data:`FELL_BACK` when the threads simulator must run it (after a note)."""
    from numba.cuda.errors import normalize_kernel_dimensions

    from .._numba_adapter import sim

    FakeShape = sim("cudadrv.devicearray", "FakeShape")

    from ...common import current_label
    from .. import traffic

    set_fake_shape(FakeShape)
    fn = kernel.fn
    grid, block = normalize_kernel_dimensions(kernel.grid_dim, kernel.block_dim)
    name = _kernel_name(kernel)
    factory = traffic.observer_factory
    spec = None
    try:
        translate.translate(fn, True)
        if factory is not None:
            vs = getattr(factory, "vector_spec", None)
            if vs is None:
                raise Unsupported("an access observer the vectorised simulator does not know")
            label0 = current_label() or fn.__name__
            spec = vs(label0, fn.__name__)
    except Unsupported as exc:
        note(name, exc)
        COUNTS["threads"] += 1
        return FELL_BACK

    counting = bool(traffic._stack)
    label = current_label() or fn.__name__
    rec = traffic._Recorder()
    retr = []
    converted = _convert_args(kernel, args, retr)
    params = traffic._param_names(fn)
    wrapped = []
    try:
        for i, a in enumerate(converted):
            pname = params[i] if i < len(params) else f"arg{i}"
            w = _wrap_arg(a, pname)
            if isinstance(w, Arr):
                rec.itemsize[pname] = w.dtype.itemsize
            wrapped.append(w)
    except Unsupported as exc:
        note(name, exc)
        COUNTS["threads"] += 1
        return FELL_BACK
    undo = Undo()
    T = tools.LaunchTools(label, fn.__name__, counting, spec, undo)
    T.grid, T.tpb = grid, block[0] * block[1] * block[2]
    T.apply_deferred = apply_deferred
    vcuda = VectorCuda(grid, block, kernel.dynshared_size, lambda f, l: rec.shared_name((f, l)))
    user_err = dict(_thread_err())
    if kernel._debug:
        user_err["divide"] = "raise"          # the threads simulator's debug mode: np.seterr(divide="raise")
    values.now.user_err = user_err
    old_call = np.seterrcall(values._fp_callback)
    old_err = np.seterr(**values.fp_settings(user_err))
    tools.begin(T)
    translate.reset_instances(vcuda)
    blocks = _blocks(grid)
    T_per = block[0] * block[1] * block[2]
    per_chunk = max(1, CHUNK_LANES // max(1, T_per))
    geo = None
    try:
        try:
            kfn = translate.instance(fn, kernel=True)
            for start in range(0, len(blocks), per_chunk):
                geo = Geometry(grid, block, blocks[start:start + per_chunk], start)
                values.now.L = geo.L
                values.now.rank = geo.rank
                values.now.lane_name = geo.lane_name
                T.new_chunk(geo)
                vcuda.new_chunk(geo)
                kfn(None, *wrapped)
                T.flush_atomics()       # its blocks come before the next chunk's: the threads simulator's order
            T.flush_atomics()
        except Unsupported as exc:
            undo.restore()
            if exc.where is None:
                exc = Unsupported(exc.reason, _where_of(exc.__traceback__))
            note(name, exc)
            COUNTS["threads"] += 1
            return FELL_BACK
        except KernelFault as fault:
            _commit(T, spec)
            exc = fault.exc
            if fault.raw:
                raise exc.with_traceback(fault.__traceback__) from None
            raise _retype(exc, _message(exc, geo, fault.lane)).with_traceback(fault.__traceback__) from None
        except Exception as exc:
            if geo is None or _internal(exc.__traceback__):
                raise                   # the simulator's own error: shown as it is
            # an operation every active lane ran alike raised (a missing global, a uniform division by zero, a
            # Python function the kernel calls ...): the threads simulator's first thread raises it
            _commit(T, spec)
            lane = _lane_of_frame(exc.__traceback__)
            raise _retype(exc, _message(exc, geo, lane)).with_traceback(exc.__traceback__) from None
        if T.race:
            race.analyse(T.race_log, spec["race_sink"], label, fn.__name__, grid, T.tpb)
        if T.profile:
            profile.summarise(T.prof_log, spec["profile_sink"], label, fn.__name__)
        _commit(T, spec)
    finally:
        tools.end()
        np.seterr(**old_err)
        np.seterrcall(old_call)
        translate.reset_instances(None)
    for wb in retr:
        wb()
    if counting:
        rec.per_thread.append(T.totals())
        record = traffic.LaunchTraffic._from_recorder(
            rec, label=label, kernel=fn.__name__, grid=tuple(kernel.grid_dim), block=tuple(kernel.block_dim),
            source=getattr(getattr(fn, "__code__", None), "co_filename", ""))
        for t in list(traffic._stack):
            t.launches.append(record)
    return None


_THREAD_ERR: list = []


def _thread_err() -> dict:
    """NumPy's error settings in a thread the threads simulator starts (NumPy keeps them per thread, and a new
    thread has the defaults: the caller's ``np.errstate`` does not reach the simulated threads)."""
    if not _THREAD_ERR:
        import threading

        t = threading.Thread(target=lambda: _THREAD_ERR.append(np.geterr()))
        t.start()
        t.join()
    return _THREAD_ERR[0]


def _commit(T, spec):
    """The launch counts for its tools (a launch memcheck aborts too) and their findings are theirs."""
    COUNTS["vector"] += 1
    if spec is not None and spec.get("on_launch"):
        spec["on_launch"]()
    T.commit()
