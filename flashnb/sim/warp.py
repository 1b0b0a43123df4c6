"""Warp-level intrinsics for the Numba CUDA simulator, with the signatures ``numba.cuda`` gives them on a GPU.

The stock simulator has no ``cuda.syncwarp``, ``cuda.shfl_*_sync``, ``cuda.ballot_sync``, ``cuda.all_sync``,
``cuda.any_sync``, ``cuda.eq_sync``, ``cuda.match_any_sync``, ``cuda.match_all_sync``, ``cuda.activemask``,
``cuda.lanemask_lt`` or ``cuda.nanosleep`` (0 ns here, which PTX allows); :func:`install` adds them to the
simulator's ``FakeCUDAModule`` (the object that stands in for ``cuda`` while a kernel runs), so a kernel that
uses them runs unchanged on both.

Semantics (CUDA C++ Programming Guide, "Warp Shuffle/Vote Functions"; PTX ISA ``shfl.sync``):

* a warp is 32 consecutive *linear* thread ids, ``tid = x + y*Dx + z*Dx*Dy``; lane = ``tid % 32``
  (the simulator's ``cuda.laneid`` already follows this).  The last warp of a block whose size is not a
  multiple of 32 simply has fewer lanes.
* ``mask`` names the participating lanes and must include the calling lane.  Every lane named in ``mask``
  that exists and has not returned must call the same intrinsic with the same mask; the call completes
  when all of them have arrived.  A mask naming a lane that has returned (early, or after a branch that skips
  the call) is an error (:data:`flashnb.sim.fastbarrier.STRICT_EXITED_LANES`; synccheck's finding under the
  sanitizer): the guide only waits for "non-exited threads", and what is read from the others is undefined;
  with ``STRICT_EXITED_LANES = False`` the simulator follows the guide.
  If the live lanes can never all arrive (e.g. some wait in ``syncthreads()`` or in a
  different intrinsic) a GPU hangs; the simulator raises :class:`~flashnb.sim.fastbarrier.SimulatorDeadlock`.
* shuffles (numba passes ``width=32``): ``shfl_sync`` reads lane ``src_lane & 31``; ``shfl_up_sync`` lane
  ``lane - delta`` and ``shfl_down_sync`` lane ``lane + delta`` (the caller's own value when that falls
  outside ``0..31``); ``shfl_xor_sync`` lane ``lane ^ (lane_mask & 31)``.  Reading a lane that does not take
  part (not in ``mask``, returned, or past the end of a partial warp) is *undefined* in CUDA: here a float
  reads as NaN and an integer as ``0xDEADBEEF`` (as int32, -559038737) so the mistake shows in results.
* result types as numba types them: ``ballot_sync``/``match_*`` give a signed int32 (bit 31 set -> negative),
  ``all/any/eq_sync`` a bool, ``activemask``/``lanemask_lt`` an unsigned 32-bit value.
  ``activemask()`` reports the lanes that *exist* in the warp: the simulator's threads are not converged
  (they run one after another), so which lanes have returned or sit in another branch at "the same time"
  is not defined here; a GPU would leave those out.
"""

from __future__ import annotations

import math
import threading

import numpy as np

from .fastbarrier import FastBlockThread

__all__ = ["FULL_MASK", "INT_POISON", "INTRINSICS", "install", "uninstall"]

FULL_MASK = 0xFFFFFFFF
INT_POISON = -559038737  # 0xDEADBEEF as int32: what an undefined integer shuffle reads as


def _int32(bits):
    return bits - (1 << 32) if bits >= 1 << 31 else bits


def _thread(name):
    t = threading.current_thread()
    if not isinstance(t, FastBlockThread):
        raise RuntimeError(f"cuda.{name}() can only be called from a kernel running on flashnb's simulator runtime")
    return t


def _check_mask(name, mask, t):
    if isinstance(mask, (bool, np.bool_)) or not isinstance(mask, (int, np.integer)):
        raise TypeError(f"cuda.{name}: mask must be an integer, got {type(mask).__name__}")
    mask = int(mask) & FULL_MASK
    lane = t.thread_id & 31
    if not (mask >> lane) & 1:
        raise RuntimeError(
            f"cuda.{name}: calling lane {lane} (tid={list(t.threadIdx)}) is not in mask {mask:#010x}; "
            "CUDA requires every calling lane to name itself in the mask (undefined behaviour otherwise)"
        )
    return mask


def _check_value(name, value):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"cuda.{name} only supports 32- and 64-bit ints and floats, got {type(value).__name__}")


def _check_predicate(name, predicate):
    if not isinstance(predicate, (bool, int, np.bool_, np.integer)):
        raise TypeError(f"cuda.{name}: predicate must be an integer or a boolean, got {type(predicate).__name__}")


def _poison(value):
    if isinstance(value, (float, np.floating)):
        return type(value)(math.nan)
    return type(value)(INT_POISON)


def _shuffle_compute(mode):
    def compute(rnd, lanes_in_warp, participants):
        out = {}
        for lane, (value, b) in rnd.args.items():
            b = int(b) & 31
            if mode == "idx":
                j = b
            elif mode == "up":
                j = lane - b if lane - b >= 0 else lane
            elif mode == "down":
                j = lane + b if lane + b <= 31 else lane
            else:
                j = lane ^ b
            out[lane] = rnd.args[j][0] if j in rnd.args else _poison(value)
        return out

    return compute


def _shuffle(name, mode):
    compute = _shuffle_compute(mode)

    def intrinsic(self, mask, value, operand):
        t = _thread(name)
        mask = _check_mask(name, mask, t)
        _check_value(name, value)
        if isinstance(operand, (bool, np.bool_)) or not isinstance(operand, (int, np.integer)):
            raise TypeError(f"cuda.{name}: lane operand must be an integer, got {type(operand).__name__}")
        return t.warp_collective(name, mask, value, operand, compute)

    intrinsic.__name__ = name
    return intrinsic


def _same_for_all(f):
    def compute(rnd, lanes_in_warp, participants):
        result = f(rnd)
        return {lane: result for lane in rnd.args}

    return compute


def _vote(name, reduce):
    compute = _same_for_all(lambda rnd: reduce([bool(p) for p, _ in rnd.args.values()], rnd))

    def intrinsic(self, mask, predicate):
        t = _thread(name)
        mask = _check_mask(name, mask, t)
        _check_predicate(name, predicate)
        return t.warp_collective(name, mask, predicate, None, compute)

    intrinsic.__name__ = name
    return intrinsic


def _ballot(preds, rnd):
    return _int32(sum(1 << lane for lane, (p, _) in rnd.args.items() if p))


def _key(value):
    a = np.asarray(value)
    return a.dtype.itemsize, a.tobytes()  # match_* compare bit patterns


def _match_any(rnd, lanes_in_warp, participants):
    keys = {lane: _key(v) for lane, (v, _) in rnd.args.items()}
    return {lane: _int32(sum(1 << other for other, k2 in keys.items() if k2 == k)) for lane, k in keys.items()}


def _match_all(rnd, lanes_in_warp, participants):
    same = len({_key(v) for v, _ in rnd.args.values()}) == 1
    result = (_int32(rnd.mask) if same else 0, same)
    return {lane: result for lane in rnd.args}


def _match(name, compute):
    def intrinsic(self, mask, value):
        t = _thread(name)
        mask = _check_mask(name, mask, t)
        _check_value(name, value)
        return t.warp_collective(name, mask, value, None, compute)

    intrinsic.__name__ = name
    return intrinsic


_sync_compute = _same_for_all(lambda rnd: None)


def syncwarp(self, mask=FULL_MASK):
    t = _thread("syncwarp")
    t.warp_collective("syncwarp", _check_mask("syncwarp", mask, t), None, None, _sync_compute)


def activemask(self):
    t = _thread("activemask")
    return (1 << t._manager.lanes_in_warp(t.thread_id >> 5)) - 1


def lanemask_lt(self):
    t = _thread("lanemask_lt")
    return (1 << (t.thread_id & 31)) - 1


def nanosleep(self, ns):
    """``cuda.nanosleep(ns)``: PTX lets ``nanosleep`` suspend for any time in [0, 2·ns]; here it is 0 (the
    simulator has no clock a kernel could be waiting on).  Checked like the GPU's: a uint32 duration."""
    if isinstance(ns, bool) or not isinstance(ns, (int, np.integer)) or not 0 <= int(ns) < 2 ** 32:
        raise TypeError(f"cuda.nanosleep takes a uint32 number of nanoseconds, got {ns!r}")


INTRINSICS = {
    "syncwarp": syncwarp,
    "shfl_sync": _shuffle("shfl_sync", "idx"),
    "shfl_up_sync": _shuffle("shfl_up_sync", "up"),
    "shfl_down_sync": _shuffle("shfl_down_sync", "down"),
    "shfl_xor_sync": _shuffle("shfl_xor_sync", "bfly"),
    "ballot_sync": _vote("ballot_sync", _ballot),
    "all_sync": _vote("all_sync", lambda preds, rnd: all(preds)),
    "any_sync": _vote("any_sync", lambda preds, rnd: any(preds)),
    "eq_sync": _vote("eq_sync", lambda preds, rnd: len(set(preds)) == 1),
    "match_any_sync": _match("match_any_sync", _match_any),
    "match_all_sync": _match("match_all_sync", _match_all),
    "activemask": activemask,
    "lanemask_lt": lanemask_lt,
    "nanosleep": nanosleep,
}


def install(fake_cuda_module_class):
    for name, fn in INTRINSICS.items():
        setattr(fake_cuda_module_class, name, fn)


def uninstall(fake_cuda_module_class):
    for name in INTRINSICS:
        if name in vars(fake_cuda_module_class):
            delattr(fake_cuda_module_class, name)
