"""numba's scalar typing for the threads simulator: each kernel and device function runs a rewritten copy of itself.

The threads simulator runs a kernel's own Python, whose operators follow Python's and NumPy's scalar rules.  Here
each ``a op b``, ``a op= b``, comparison, ``-x``, ``+x`` and ``~x`` of its source becomes a call of
:data:`flashnb.sim.arith.BINARY` / :data:`~flashnb.sim.arith.UNARY` (numba's rules), except where the operand
types make Python's operator compute numba's result already (``float32 * float32``): that pair runs the operator
itself, in the kernel's frame (:data:`flashnb.sim.arith.FAST`).  The copy is compiled under the kernel's file
name and line numbers and shares its globals and closure cells, so tracebacks, the sanitizer and the traffic
counter see the kernel's lines; nothing else changes.  A function whose source cannot be found (or does not match
its code) runs unchanged, after a one-line note (:func:`flashnb.sim.vector.notes`): there the threads simulator
keeps NumPy's rules.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import textwrap
import threading
import types
import weakref

from . import arith

__all__ = ["typed", "rewritten_source"]

_BIN = {ast.Add: "add", ast.Sub: "sub", ast.Mult: "mul", ast.Div: "truediv", ast.FloorDiv: "floordiv",
        ast.Mod: "mod", ast.Pow: "pow", ast.LShift: "lshift", ast.RShift: "rshift", ast.BitAnd: "and",
        ast.BitOr: "or", ast.BitXor: "xor"}
_CMP = {ast.Lt: "lt", ast.LtE: "le", ast.Gt: "gt", ast.GtE: "ge", ast.Eq: "eq", ast.NotEq: "ne"}
_UN = {ast.USub: "neg", ast.UAdd: "pos", ast.Invert: "invert"}

HELPERS = {"_nb_type": builtins.type}
HELPERS.update({f"_nb_b_{op}": fn for op, fn in arith.BINARY.items()})
HELPERS.update({f"_nb_f_{op}": d for op, d in arith.FAST.items()})
HELPERS.update({f"_nb_u_{op}": fn for op, fn in arith.UNARY.items()})
HELPERS["_nb_math"] = arith.math_call


def _N(name, store=False):
    return ast.Name(id=name, ctx=ast.Store() if store else ast.Load())


class _Rewrite(ast.NodeTransformer):
    def __init__(self):
        self.n = 0

    def tmp(self):
        self.n += 1
        return f"_nb_t{self.n}"

    def _op(self, op, left, right, node):
        """``left op right`` with numba's rules: Python's operator where the operand types allow it."""
        t1, t2 = self.tmp(), self.tmp()
        test = ast.Subscript(value=_N(f"_nb_f_{op}"), slice=ast.Tuple(elts=[
            ast.Call(func=_N("_nb_type"), args=[ast.NamedExpr(target=_N(t1, True), value=left)], keywords=[]),
            ast.Call(func=_N("_nb_type"), args=[ast.NamedExpr(target=_N(t2, True), value=right)], keywords=[])],
            ctx=ast.Load()), ctx=ast.Load())
        if op in _BIN.values():
            pyop = next(k for k, v in _BIN.items() if v == op)
            plain = ast.BinOp(left=_N(t1), op=pyop(), right=_N(t2))
        else:
            pyop = next(k for k, v in _CMP.items() if v == op)
            plain = ast.Compare(left=_N(t1), ops=[pyop()], comparators=[_N(t2)])
        slow = ast.Call(func=_N(f"_nb_b_{op}"), args=[_N(t1), _N(t2)], keywords=[])
        return ast.copy_location(ast.IfExp(test=test, body=plain, orelse=slow), node)

    # nested scopes keep Python's rules (the vectorised simulator does not run them either)
    def visit_Lambda(self, node):
        return node

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = visit_Lambda
    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = visit_Lambda

    def visit_Call(self, node):
        """``math.exp(x)`` (or ``exp(x)``): numba types it float32 for a float32 ``x``."""
        self.generic_visit(node)
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else (f.id if isinstance(f, ast.Name) else None)
        if name in arith.MATH_NAMES and len(node.args) == 1 and not node.keywords and \
                not isinstance(node.args[0], ast.Starred):
            return ast.copy_location(ast.Call(func=_N("_nb_math"), args=[f, node.args[0]], keywords=[]), node)
        return node

    def visit_BinOp(self, node):
        self.generic_visit(node)
        op = _BIN.get(type(node.op))
        if op is None:
            return node
        return self._op(op, node.left, node.right, node)

    def visit_UnaryOp(self, node):
        self.generic_visit(node)
        op = _UN.get(type(node.op))
        if op is None or (isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float)):
            return node
        return ast.copy_location(ast.Call(func=_N(f"_nb_u_{op}"), args=[node.operand], keywords=[]), node)

    def visit_Compare(self, node):
        self.generic_visit(node)
        if not all(type(o) in _CMP for o in node.ops):
            return node
        if len(node.ops) == 1:
            return self._op(_CMP[type(node.ops[0])], node.left, node.comparators[0], node)
        # a chain: each middle operand evaluated once, the comparisons stop at the first false one
        parts = []
        left = node.left
        for o, right in zip(node.ops, node.comparators):
            t = self.tmp()
            parts.append(ast.Call(func=_N(f"_nb_b_{_CMP[type(o)]}"),
                                  args=[left, ast.NamedExpr(target=_N(t, True), value=right)], keywords=[]))
            left = _N(t)
        return ast.copy_location(ast.BoolOp(op=ast.And(), values=parts), node)

    def visit_AugAssign(self, node):
        self.generic_visit(node)
        op = _BIN.get(type(node.op))
        if op is None:
            return node
        tgt = node.target
        if isinstance(tgt, ast.Name):
            new = ast.Assign(targets=[_N(tgt.id, True)], value=self._op(op, _N(tgt.id), node.value, node))
            return ast.copy_location(new, node)
        if isinstance(tgt, ast.Subscript):
            if any(isinstance(n, ast.Slice) for n in ast.walk(tgt.slice)):
                return node
            o, i = self.tmp(), self.tmp()
            pre = [ast.Assign(targets=[_N(o, True)], value=tgt.value),
                   ast.Assign(targets=[_N(i, True)], value=tgt.slice)]
            load = ast.Subscript(value=_N(o), slice=_N(i), ctx=ast.Load())
            store = ast.Subscript(value=_N(o), slice=_N(i), ctx=ast.Store())
        elif isinstance(tgt, ast.Attribute):
            o = self.tmp()
            pre = [ast.Assign(targets=[_N(o, True)], value=tgt.value)]
            load = ast.Attribute(value=_N(o), attr=tgt.attr, ctx=ast.Load())
            store = ast.Attribute(value=_N(o), attr=tgt.attr, ctx=ast.Store())
        else:
            return node
        out = pre + [ast.Assign(targets=[store], value=self._op(op, load, node.value, node))]
        return [ast.copy_location(s, node) for s in out]


def _parse(fn):
    code = fn.__code__
    if code.co_cellvars:
        return None
    try:
        src = inspect.getsource(fn)
        tree = ast.parse(textwrap.dedent(src))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None
    if not tree.body or not isinstance(tree.body[0], ast.FunctionDef):
        return None
    fdef = tree.body[0]
    params = [a.arg for a in fdef.args.args]
    if fdef.name != code.co_name or params != list(code.co_varnames[:code.co_argcount]):
        return None
    ast.increment_lineno(tree, code.co_firstlineno - 1)
    fdef.decorator_list = []
    return fdef


def _build(fn):
    fdef = _parse(fn)
    if fdef is None:
        return None
    code = fn.__code__
    for n in ast.walk(fdef):
        if isinstance(n, ast.Name) and n.id.startswith("_nb_"):
            return None
    _Rewrite().generic_visit(fdef)
    factory = ast.FunctionDef(name="_nb_factory", args=ast.arguments(
        posonlyargs=[], args=[ast.arg(arg=a) for a in list(HELPERS) + list(code.co_freevars)], vararg=None,
        kwonlyargs=[], kw_defaults=[], kwarg=None, defaults=[]),
        body=[fdef, ast.Return(value=_N(fdef.name))], decorator_list=[], returns=None)
    ast.copy_location(factory, fdef)
    mod = ast.Module(body=[factory], type_ignores=[])
    ast.fix_missing_locations(mod)
    compiled = compile(mod, code.co_filename, "exec")
    fcode = next(c for c in compiled.co_consts if isinstance(c, types.CodeType))
    inner = next(c for c in fcode.co_consts if isinstance(c, types.CodeType) and c.co_name == fdef.name)
    return inner


_cache = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def typed(fn):
    """The copy of ``fn`` (a kernel's or device function's Python function) that computes by numba's rules, or
    ``fn`` itself when its source cannot be rewritten."""
    got = _cache.get(fn)
    if got is not None:
        return got
    with _lock:                         # device functions are first called from many simulator threads at once
        got = _cache.get(fn)
        if got is not None:
            return got
        return _typed(fn)


def _typed(fn):
    inner = _build(fn)
    if inner is None:
        from .fallback import say

        say((fn.__qualname__, "numpy rules"), f"flashnb.sim: {fn.__qualname__} computes by NumPy's scalar rules on "
            "the threads simulator, not numba's (its source could not be read or rewritten)")
        _cache[fn] = fn
        return fn
    cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))
    closure = tuple(cells[name] if name in cells else types.CellType(HELPERS[name]) for name in inner.co_freevars)
    f = types.FunctionType(inner, fn.__globals__, fn.__name__, fn.__defaults__, closure)
    f.__kwdefaults__ = fn.__kwdefaults__
    f.__qualname__ = fn.__qualname__
    f.__module__ = fn.__module__
    f.__wrapped_numba_rules__ = fn
    _cache[fn] = f
    return f


def rewritten_source(fn) -> str:
    """The rewritten source of ``fn`` (for reading what the threads simulator runs)."""
    fdef = _parse(fn)
    if fdef is None:
        raise ValueError(f"the source of {fn!r} cannot be rewritten")
    _Rewrite().generic_visit(fdef)
    return ast.unparse(ast.fix_missing_locations(fdef))
