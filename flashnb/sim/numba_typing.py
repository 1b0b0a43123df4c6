"""Numba's typing of scalar arithmetic on a GPU, as a table both simulators compute by.

In a compiled kernel, numba decides the type of every operation from the types of its operands, and its rules
are not NumPy's: ``int32 * int32`` is an ``int64`` (no wrap at 32 bits), ``float32 * 0.1`` is a ``float64`` (a
Python float is a float64) rounded once where it is stored into a float32 array, ``uint32 + uint32`` is a
``uint64``, ``-x`` of an ``int32`` is an ``int64``.  The simulator runs a kernel's Python, whose operators follow
NumPy's scalar rules; so both simulators (the vectorised one and ``FLASHNB_SIM=threads``) compute every binary
and unary operator that involves a NumPy number by this table instead: the operands are converted to the types
of numba's signature, the operation is done in those types, and the result has numba's result type.

:data:`TABLE` is numba-cuda's own typing (its CUDA typing context, which runs without a GPU), written by
``python -m flashnb.sim.numba_typing --write`` into :mod:`._numba_typing_table`; ``tests/sim/test_sim_fidelity.py``
derives it again and compares.  A Python ``int`` is typed as numba types it (``int64``; ``uint64`` when only that
holds it), a Python ``float`` as ``float64``, a ``bool`` as ``boolean``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

__all__ = ["NAMES", "OPS", "UNARY", "TABLE", "UNARY_TABLE", "derive", "lookup", "lookup_unary"]

#: the numba scalar types the table covers, by their NumPy names (``bool`` is numba's ``boolean``)
NAMES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32",
         "float64")
#: binary operators, by the simulator's names, and the ``operator`` function numba types
OPS = {"add": "add", "sub": "sub", "mul": "mul", "truediv": "truediv", "floordiv": "floordiv", "mod": "mod",
       "pow": "pow", "lshift": "lshift", "rshift": "rshift", "and": "and_", "or": "or_", "xor": "xor",
       "lt": "lt", "le": "le", "gt": "gt", "ge": "ge", "eq": "eq", "ne": "ne"}
UNARY = {"neg": "neg", "pos": "pos", "invert": "invert"}

_DERIVE = r"""
import json, operator, os, sys
os.environ["NUMBA_ENABLE_CUDASIM"] = "0"
from numba.cuda.descriptor import cuda_target
from numba.cuda import types
names, ops, unary = json.loads(sys.argv[1])
ctx = cuda_target.typing_context
ctx.refresh()
ty = {n: getattr(types, "boolean" if n == "bool" else n) for n in names}
def name(t):
    s = str(t)
    return "bool" if s == "bool" else s
def sig(fn, args):
    try:
        s = ctx.resolve_function_type(fn, args, {})
    except Exception:
        return None
    if s is None:
        return None
    out = [name(a) for a in s.args] + [name(s.return_type)]
    return out if all(x in ty for x in out) else None
binary = {}
for op, fname in ops.items():
    fn = getattr(operator, fname)
    for a in names:
        for b in names:
            binary[f"{op} {a} {b}"] = sig(fn, (ty[a], ty[b]))
un = {}
for op, fname in unary.items():
    fn = getattr(operator, fname)
    for a in names:
        un[f"{op} {a}"] = sig(fn, (ty[a],))
print(json.dumps({"binary": binary, "unary": un}))
"""


def derive() -> dict:
    """numba-cuda's typing of every operator on every pair of :data:`NAMES`, from its CUDA typing context (run in
    a subprocess: the simulator's process has numba's simulator in place of the CUDA target):
    ``{"binary": {"op a b": [arg_a, arg_b, result] or None}, "unary": {"op a": [arg, result] or None}}``."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    out = subprocess.run([sys.executable, "-c", _DERIVE, json.dumps([NAMES, OPS, UNARY])], env=env,
                         capture_output=True, text=True, check=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _write(path: str) -> None:
    table = derive()
    lines = ['"""numba-cuda\'s typing of scalar operators (written by ``python -m flashnb.sim.numba_typing --write``;',
             'do not edit).  ``"op a b": (arg_a, arg_b, result)``, None where numba has no signature."""', "",
             "BINARY = {"]
    for k, v in table["binary"].items():
        lines.append(f"    {k!r}: {tuple(v) if v else None!r},")
    lines += ["}", "", "UNARY = {"]
    for k, v in table["unary"].items():
        lines.append(f"    {k!r}: {tuple(v) if v else None!r},")
    lines += ["}", ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def _load():
    from . import _numba_typing_table as t

    return t.BINARY, t.UNARY


TABLE, UNARY_TABLE = _load()


def lookup(op: str, a: str, b: str):
    """``(arg_a, arg_b, result)`` numba's signature of ``a op b`` (NumPy type names), or None."""
    return TABLE.get(f"{op} {a} {b}")


def lookup_unary(op: str, a: str):
    return UNARY_TABLE.get(f"{op} {a}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        _write(os.path.join(os.path.dirname(__file__), "_numba_typing_table.py"))
    else:
        print(json.dumps(derive(), indent=1))
