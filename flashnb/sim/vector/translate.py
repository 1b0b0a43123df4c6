"""Translation of a kernel's (or device function's) Python source into a function that runs every lane at once.

The source comes from :func:`inspect.getsource` (a module, a notebook cell, a :func:`flashnb.registry.variant`'s
``linecache`` entry); the result is compiled under the kernel's own file name with the kernel's line numbers,
so tracebacks and the tools name the kernel's lines.  What changes, statement by statement:

* every operation goes through :mod:`.values` (``a + b`` is ``add(a, b, mask)``), every subscript through
  :mod:`.calls` (``A[i]`` is ``load(A, i, mask, site)``), every call through :func:`.calls.call`;
* ``if c:`` evaluates ``c``; when it is the same on every active lane the taken branch runs as in Python,
  else both branches run, each under its mask (a local variable one branch assigns and that is read after
  the ``if`` -- live at its end -- is merged: its old value is kept on the other lanes; one that is not read
  afterwards needs no merge);
* ``and``/``or``/``x if c else y`` evaluate their second part only for the lanes that need it (a guarded read
  past the end of an array never runs);
* loops run until no lane is left in them (a ``for`` over a ``range`` whose bounds are the same for every lane
  and whose body has no ``break``/``continue``/``return`` is a plain Python loop); ``return``, ``break`` and
  ``continue`` take their lanes out of the mask for the rest of the function, loop or iteration;
* a local variable that some lanes may read before they assign it is checked where it is read (Python's
  ``UnboundLocalError``, as in the threads simulator).

Not translated (the launch falls back to the threads simulator with a note naming the construct and its line):
``with``, ``try``, a bare ``raise``, ``del``, ``global``/``nonlocal``, nested functions and classes, lambdas,
comprehensions, generators, ``for``/``while`` with ``else``, starred assignments, attribute assignments, and
functions whose source cannot be found or does not match their code.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import types

from ..fallback import Unsupported
from . import calls, tools, values

__all__ = ["translate", "instance", "reset_instances", "HELPERS"]

_NOT_TRANSLATED = {
    ast.With: "a `with` statement", ast.AsyncWith: "an `async with` statement", ast.Try: "a `try` statement",
    ast.Delete: "a `del` statement", ast.Global: "a `global` statement",
    ast.Nonlocal: "a `nonlocal` statement", ast.FunctionDef: "a nested function",
    ast.AsyncFunctionDef: "a nested function", ast.ClassDef: "a nested class", ast.Import: "an import",
    ast.ImportFrom: "an import", ast.AsyncFor: "an `async for` loop",
}
if hasattr(ast, "TryStar"):
    _NOT_TRANSLATED[ast.TryStar] = "a `try` statement"
if hasattr(ast, "Match"):
    _NOT_TRANSLATED[ast.Match] = "a `match` statement"

_BAD_EXPR = {
    ast.Lambda: "a lambda", ast.ListComp: "a list comprehension", ast.SetComp: "a set comprehension",
    ast.DictComp: "a dict comprehension", ast.GeneratorExp: "a generator expression", ast.Await: "await",
    ast.Yield: "yield", ast.YieldFrom: "yield", ast.NamedExpr: "an assignment expression (:=)",
    ast.JoinedStr: "an f-string", ast.Set: "a set display", ast.Dict: "a dict display",
}

_BINOP = {ast.Add: "add", ast.Sub: "sub", ast.Mult: "mul", ast.Div: "truediv", ast.FloorDiv: "floordiv",
          ast.Mod: "mod", ast.Pow: "pow", ast.LShift: "lshift", ast.RShift: "rshift", ast.BitAnd: "and",
          ast.BitOr: "or", ast.BitXor: "xor"}
_CMP = {ast.Lt: "lt", ast.LtE: "le", ast.Gt: "gt", ast.GtE: "ge", ast.Eq: "eq", ast.NotEq: "ne",
        ast.Is: "is", ast.IsNot: "isnot", ast.In: "in", ast.NotIn: "notin"}
_UNARY = {ast.USub: "_v_neg", ast.UAdd: "_v_pos", ast.Invert: "_v_inv", ast.Not: "_v_not"}


def _not_in(a, b, m):
    r = values.contains(a, b, m)
    return not r


HELPERS = {
    **{f"_v_{name}": fn for name, fn in values.BINOPS.items()},
    "_v_is": values.identity_is, "_v_isnot": values.identity_is_not, "_v_in": lambda a, b, m: values.contains(b, a, m),
    "_v_notin": lambda a, b, m: not values.contains(b, a, m),
    "_v_neg": values.u_neg, "_v_pos": values.u_pos, "_v_inv": values.u_invert, "_v_not": values.u_not,
    "_v_split": values.split, "_v_merge": values.merge, "_v_select": values.select, "_v_U": values.U,
    "_v_chk": values.check_defined, "_v_val": values.settled, "_v_ld": calls.load, "_v_st": calls.store,
    "_v_call": calls.call,
    "_v_f32m": calls.f32_math, "_v_loop": calls.LoopState, "_v_ret": calls.RetState,
    "_v_range": calls.range_iter, "_v_iter": calls.iter_values, "_v_restore": calls.restore,
    "_v_andnot": values.m_andnot, "_v_retval": calls.retval, "_v_slice": slice, "_v_assert": calls.assert_,
    "_v_raise": calls.raise_, "_v_raise_call": calls.raise_call,
    "_v_need_and": lambda a, m: values.m_and(m, a), "_v_need_or": lambda a, m: _need_or(a, m),
    "_v_pick": lambda mb, msv, b, a: b if mb is msv else values.merge(mb, b, a),
}


def _need_or(a, m):
    t = values.truth(a)
    if type(t) is bool:
        return False if t else m
    import numpy as np

    if m is None:
        r = ~t
        return None if r.all() else (r if r.any() else False)
    r = m & ~t
    if np.array_equal(r, m):
        return m
    return r if r.any() else False


# --------------------------------------------------------------------------- small AST builders


def _N(name):
    return ast.Name(id=name, ctx=ast.Load())


def _S(name):
    return ast.Name(id=name, ctx=ast.Store())


def _C(value):
    return ast.Constant(value=value)


def _call(fn, *args, keywords=None):
    return ast.Call(func=_N(fn) if isinstance(fn, str) else fn, args=list(args), keywords=keywords or [])


def _assign(name, value):
    return ast.Assign(targets=[_S(name) if isinstance(name, str) else name], value=value)


def _is(a, b):
    return ast.Compare(left=a, ops=[ast.Is()], comparators=[b])


def _is_not(a, b):
    return ast.Compare(left=a, ops=[ast.IsNot()], comparators=[b])


def _if(test, body, orelse=None):
    return ast.If(test=test, body=body or [ast.Pass()], orelse=orelse or [])


def _attr(obj, name):
    return ast.Attribute(value=obj if not isinstance(obj, str) else _N(obj), attr=name, ctx=ast.Load())


# --------------------------------------------------------------------------- analysis


def _assigned_names(target):
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, (ast.Tuple, ast.List)):
        out = set()
        for e in target.elts:
            out |= _assigned_names(e)
        return out
    return set()


def _loads(node):
    """Names loaded by an expression (or the expression parts of a simple statement)."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
            out.add(n.id)
    return out


def _target_loads(target):
    """Names a store target reads (``A[i] = ...`` reads A and i)."""
    out = set()
    if isinstance(target, ast.Subscript):
        out |= _loads(target.value) | _loads(target.slice)
    elif isinstance(target, ast.Attribute):
        out |= _loads(target.value)
    elif isinstance(target, (ast.Tuple, ast.List)):
        for e in target.elts:
            out |= _target_loads(e)
    return out


class _LoopCtx:
    __slots__ = ("cont", "brk")

    def __init__(self, cont, brk):
        self.cont = cont
        self.brk = brk


class Analysis:
    """Liveness (which assignments inside a masked region must merge) and definite assignment (which loads may
    see an unassigned variable)."""

    def __init__(self, fdef, params):
        self.after = {}
        self.header = {}
        self.merges = set()           # (id(stmt), name)
        self.targets = set()          # names that are merged somewhere
        self.checks = set()           # id(Name node) loads to check
        self.params = set(params)
        self.live_block(fdef.body, frozenset(), None)
        self.annotate(fdef.body, None)
        self.defs_block(fdef.body, frozenset(self.params))

    # -- liveness (backward)
    def live_block(self, stmts, out, ctx):
        live = out
        for s in reversed(stmts):
            self.after[id(s)] = live
            live = self.live_stmt(s, live, ctx)
        return live

    def live_stmt(self, s, out, ctx):
        if isinstance(s, ast.Assign):
            defs = set()
            uses = _loads(s.value)
            for t in s.targets:
                defs |= _assigned_names(t)
                uses |= _target_loads(t)
            return frozenset((out - defs) | uses)
        if isinstance(s, ast.AnnAssign):
            if s.value is None:
                return out
            return frozenset((out - _assigned_names(s.target)) | _loads(s.value) | _target_loads(s.target))
        if isinstance(s, ast.AugAssign):
            return frozenset(out | _loads(s.value) | _target_loads(s.target) | _assigned_names(s.target))
        if isinstance(s, (ast.Expr, ast.Assert)):
            return frozenset(out | _loads(s))
        if isinstance(s, ast.Return):
            return frozenset(_loads(s.value) if s.value is not None else ())
        if isinstance(s, ast.Break):
            return ctx.brk if ctx is not None else frozenset()
        if isinstance(s, ast.Continue):
            return ctx.cont if ctx is not None else frozenset()
        if isinstance(s, ast.Pass):
            return out
        if isinstance(s, ast.If):
            return frozenset(_loads(s.test) | self.live_block(s.body, out, ctx) | self.live_block(s.orelse, out, ctx))
        if isinstance(s, ast.For):
            tgt = _assigned_names(s.target)
            H = frozenset(out)
            for _ in range(100):
                body_in = self.live_block(s.body, H, _LoopCtx(H, out))
                newH = frozenset(out | (body_in - tgt) | _target_loads(s.target))
                if newH == H:
                    break
                H = newH
            self.header[id(s)] = H
            return frozenset(_loads(s.iter) | H)
        if isinstance(s, ast.While):
            test = _loads(s.test)
            H = frozenset(out | test)
            for _ in range(100):
                body_in = self.live_block(s.body, H, _LoopCtx(H, out))
                newH = frozenset(out | test | body_in)
                if newH == H:
                    break
                H = newH
            self.header[id(s)] = H
            return H
        return frozenset(out | _loads(s))

    # -- merges
    def _mark(self, s, names, region):
        if region is None:
            return
        for n in names:
            if n in region:
                self.merges.add((id(s), n))
                self.targets.add(n)

    def annotate(self, stmts, region):
        for s in stmts:
            if isinstance(s, ast.Assign):
                for t in s.targets:
                    self._mark(s, _assigned_names(t), region)
            elif isinstance(s, (ast.AnnAssign, ast.AugAssign)):
                self._mark(s, _assigned_names(s.target), region)
            elif isinstance(s, ast.If):
                self.annotate(s.body, self.after[id(s)])
                self.annotate(s.orelse, self.after[id(s)])
            elif isinstance(s, ast.For):
                H = self.header[id(s)]
                self._mark(s, _assigned_names(s.target), H)
                self.annotate(s.body, H)
            elif isinstance(s, ast.While):
                self.annotate(s.body, self.header[id(s)])

    # -- definite assignment (forward)
    ALL = None

    def _check_loads(self, node, D):
        if D is None:
            return
        for n in ast.walk(node):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id in self.targets and n.id not in D:
                self.checks.add(id(n))

    def defs_block(self, stmts, D):
        for s in stmts:
            D = self.defs_stmt(s, D)
        return D

    def defs_stmt(self, s, D):
        if D is None:
            return None
        if isinstance(s, ast.Assign):
            self._check_loads(s.value, D)
            for t in s.targets:
                self._check_target(t, D)
            for t in s.targets:
                D = D | _assigned_names(t)
            return D
        if isinstance(s, ast.AnnAssign):
            if s.value is not None:
                self._check_loads(s.value, D)
                self._check_target(s.target, D)
                D = D | _assigned_names(s.target)
            return D
        if isinstance(s, ast.AugAssign):
            self._check_target(s.target, D)
            self._check_loads(s.value, D)
            if isinstance(s.target, ast.Name) and s.target.id in self.targets and s.target.id not in D:
                self.checks.add(id(s.target))
            return D | _assigned_names(s.target)
        if isinstance(s, (ast.Expr, ast.Assert)):
            self._check_loads(s, D)
            return D
        if isinstance(s, ast.Return):
            if s.value is not None:
                self._check_loads(s.value, D)
            return None
        if isinstance(s, (ast.Break, ast.Continue)):
            return None
        if isinstance(s, ast.If):
            self._check_loads(s.test, D)
            a = self.defs_block(s.body, D)
            b = self.defs_block(s.orelse, D)
            if a is None:
                return b
            if b is None:
                return a
            return a & b
        if isinstance(s, ast.For):
            self._check_loads(s.iter, D)
            self.defs_block(s.body, D | _assigned_names(s.target))
            return D
        if isinstance(s, ast.While):
            self._check_loads(s.test, D)
            self.defs_block(s.body, D)
            return D
        self._check_loads(s, D)
        return D

    def _check_target(self, t, D):
        if isinstance(t, ast.Subscript):
            self._check_loads(t.value, D)
            self._check_loads(t.slice, D)
        elif isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                self._check_target(e, D)


def _disables(stmts, in_loop=False):
    """Whether running ``stmts`` can take lanes out of the mask of what follows them: a ``return`` anywhere, a
    ``break``/``continue`` not inside a loop of their own."""
    for s in stmts:
        for n in _walk_stmts(s, in_loop=False):
            if isinstance(n, ast.Return):
                return True
            if isinstance(n, (ast.Break, ast.Continue)) and not n._v_nested:
                return True
    return False


def _walk_stmts(s, in_loop):
    """Statements inside ``s``, each marked ``_v_nested`` when it is inside a loop within ``s``."""
    stack = [(s, in_loop)]
    while stack:
        n, nested = stack.pop()
        n._v_nested = nested
        yield n
        if isinstance(n, (ast.For, ast.While)):
            for c in n.body:
                stack.append((c, True))
            for c in n.orelse:
                stack.append((c, nested))
        elif isinstance(n, ast.If):
            for c in n.body + n.orelse:
                stack.append((c, nested))


def _has_return(stmts):
    for s in stmts:
        for n in ast.walk(s):
            if isinstance(n, ast.Return):
                return True
    return False


# --------------------------------------------------------------------------- code generation


class _Gen:
    def __init__(self, fdef, analysis, filename, kernel):
        self.fdef = fdef
        self.an = analysis
        self.filename = filename
        self.fname = fdef.name
        self.kernel = kernel
        self.n = 0
        self.loops = []                # names of the LoopState variables, innermost last
        self.final_return = None
        body = fdef.body
        rets = [n for s in body for n in ast.walk(s) if isinstance(n, ast.Return)]
        if rets and isinstance(body[-1], ast.Return) and len(rets) == 1:
            self.final_return = body[-1]       # one return, the last statement: no merging of results
        self.need_rs = bool(rets) and self.final_return is None

    def tmp(self, what="t"):
        self.n += 1
        return f"_v{what}{self.n}"

    def site(self, node):
        return _C(tools.register_site(self.filename, getattr(node, "lineno", self.fdef.lineno), self.fname))

    def fail(self, what, node):
        line = getattr(node, "lineno", self.fdef.lineno)
        import os
        raise Unsupported(what, f"{os.path.basename(self.filename)}:{line} ({self.fname})")

    # -- function
    def function(self):
        a = self.fdef.args
        if a.vararg or a.kwarg or a.kwonlyargs or getattr(a, "posonlyargs", None):
            self.fail("*args, **kwargs or keyword-only parameters", self.fdef)
        body = [_assign("_vm0", _N("_vm"))]
        for name in sorted(self.an.targets - self.an.params):
            body.append(_assign(name, _N("_v_U")))
        if self.need_rs:
            body.append(_assign("_vrs", _call("_v_ret", _C(self.kernel))))
            body.append(_assign("_vrv", _N("_v_U")))
        elif self.kernel and any(isinstance(n, ast.Return) for s in self.fdef.body for n in ast.walk(s)):
            body.append(_assign("_vrs", _call("_v_ret", _C(True))))
        body += self.block(self.fdef.body)
        if self.need_rs:
            body.append(ast.Return(value=_N("_vrv")))
        args = ast.arguments(posonlyargs=[], args=[ast.arg(arg="_vm")] + [ast.arg(arg=x.arg) for x in a.args],
                             vararg=None, kwonlyargs=[], kw_defaults=[], kwarg=None, defaults=[])
        f = ast.FunctionDef(name=self.fname, args=args, body=body, decorator_list=[], returns=None, type_comment=None)
        if hasattr(ast, "TypeVar"):   # Python 3.12+
            f.type_params = []
        ast.copy_location(f, self.fdef)
        return f

    def block(self, stmts):
        out = []
        for k, s in enumerate(stmts):
            gen = self.stmt(s)
            for g in gen:
                if not hasattr(g, "lineno"):
                    ast.copy_location(g, s)
            out += gen
            if isinstance(s, (ast.Return, ast.Break, ast.Continue, ast.Raise)):
                return out                       # the rest is unreachable (Python: dead code)
            if k + 1 < len(stmts) and self._may_disable(s):
                rest = self.block(stmts[k + 1:])
                guard = _if(_is_not(_N("_vm"), _C(False)), rest)
                ast.copy_location(guard, stmts[k + 1])
                out.append(guard)
                return out
        return out

    def _may_disable(self, s):
        if not isinstance(s, (ast.If, ast.For, ast.While)):
            return False
        if isinstance(s, ast.If):
            return _disables(s.body) or _disables(s.orelse)
        return _has_return(s.body)          # a loop's own break/continue end inside it

    # -- statements
    def stmt(self, s):
        t = type(s)
        if t in _NOT_TRANSLATED:
            self.fail(_NOT_TRANSLATED[t], s)
        if t is ast.Expr:
            if isinstance(s.value, ast.Constant):
                return []                          # a docstring or a bare constant
            pre = []
            if isinstance(s.value, ast.Call):
                e = self.call(s.value, pre, used=False)
            else:
                e = self.expr(s.value, pre)
            return pre + [ast.Expr(value=e)]
        if t is ast.Pass:
            return []
        if t is ast.Assign:
            pre = []
            v = self.expr(s.value, pre)
            if len(s.targets) == 1 and isinstance(s.targets[0], ast.Name) and (id(s), s.targets[0].id) not in \
                    self.an.merges:
                return pre + [ast.copy_location(_assign(s.targets[0].id, v), s)]
            tv = self.tmp()
            pre.append(_assign(tv, v))
            for target in s.targets:
                pre += self.store(target, _N(tv), s)
            return pre
        if t is ast.AnnAssign:
            if s.value is None:
                return []
            pre = []
            v = self.expr(s.value, pre)
            tv = self.tmp()
            pre.append(_assign(tv, v))
            return pre + self.store(s.target, _N(tv), s)
        if t is ast.AugAssign:
            return self.augassign(s)
        if t is ast.If:
            return self.if_(s)
        if t is ast.For:
            return self.for_(s)
        if t is ast.While:
            return self.while_(s)
        if t is ast.Return:
            return self.return_(s)
        if t is ast.Break:
            if not self.loops:
                self.fail("`break` outside a loop", s)
            return [ast.Expr(value=_call(_attr(self.loops[-1], "brk"), _N("_vm"))), _assign("_vm", _C(False))]
        if t is ast.Continue:
            if not self.loops:
                self.fail("`continue` outside a loop", s)
            return [ast.Expr(value=_call(_attr(self.loops[-1], "kontinue"), _N("_vm"))), _assign("_vm", _C(False))]
        if t is ast.Raise:
            if s.exc is None:
                self.fail("a bare `raise`", s)
            pre = []
            cause = self.expr(s.cause, pre) if s.cause is not None else _C(None)
            if isinstance(s.exc, ast.Call) and not s.exc.keywords and not any(isinstance(a, ast.Starred)
                                                                             for a in s.exc.args):
                f = self.expr(s.exc.func, pre)
                args = self.exprs(s.exc.args, pre)
                call = _call("_v_raise_call", f, ast.Tuple(elts=args, ctx=ast.Load()), cause, _N("_vm"))
            else:
                call = _call("_v_raise", self.expr(s.exc, pre), cause, _N("_vm"))
            return pre + [ast.Expr(value=call)]
        if t is ast.Assert:
            pre = []
            test = self.expr(s.test, pre)
            if s.msg is None:
                return pre + [ast.Expr(value=_call("_v_assert", test, _C(None), _N("_vm"), self.site(s)))]
            tt = self.tmp()
            pre.append(_assign(tt, test))
            bad = self.tmp("b")
            pre.append(_assign(bad, _call("_v_need_or", _N(tt), _N("_vm"))))
            sv = self.tmp("sv")
            inner = [_assign(sv, _N("_vm")), _assign("_vm", _N(bad))]
            mp = []
            msg = self.expr(s.msg, mp)
            inner += mp + [ast.Expr(value=_call("_v_assert", _N(tt), msg, _N("_vm"), self.site(s))),
                           _assign("_vm", _N(sv))]
            pre.append(_if(_is_not(_N(bad), _C(False)), inner))
            return pre
        self.fail(f"a {t.__name__} statement", s)

    def store(self, target, value, s):
        """Assign ``value`` (an expression without side effects: a temporary) to ``target``."""
        if isinstance(target, ast.Name):
            name = target.id
            if (id(s), name) in self.an.merges:
                merged = ast.IfExp(test=_is(_N("_vm"), _N("_vm0")), body=value,
                                   orelse=_call("_v_merge", _N("_vm"), value, _N(name)))
                return [ast.copy_location(_assign(name, merged), target)]
            return [ast.copy_location(_assign(name, value), target)]
        if isinstance(target, (ast.Tuple, ast.List)):
            if any(isinstance(e, ast.Starred) for e in target.elts):
                self.fail("a starred assignment", target)
            names = [self.tmp() for _ in target.elts]
            out = [ast.copy_location(ast.Assign(targets=[ast.Tuple(elts=[_S(n) for n in names], ctx=ast.Store())],
                                                value=value), target)]
            for e, n in zip(target.elts, names):
                out += self.store(e, _N(n), s)
            return out
        if isinstance(target, ast.Subscript):
            pre = []
            obj = self.expr(target.value, pre)
            idx = self.slice_(target.slice, pre)
            call = _call("_v_st", obj, idx, value, _N("_vm"), self.site(target))
            return pre + [ast.copy_location(ast.Expr(value=call), target)]
        if isinstance(target, ast.Starred):
            self.fail("a starred assignment", target)
        self.fail("an assignment to an attribute", target)

    def augassign(self, s):
        op = _BINOP.get(type(s.op))
        if op is None:
            self.fail("this augmented assignment", s)
        target = s.target
        pre = []
        if isinstance(target, ast.Name):
            cur = self.name_load(target)
            v = self.expr(s.value, pre)
            res = _call(f"_v_{op}", cur, v, _N("_vm"))
            tv = self.tmp()
            pre.append(ast.copy_location(_assign(tv, res), s))
            return pre + self.store(ast.Name(id=target.id, ctx=ast.Store(), lineno=target.lineno,
                                             col_offset=target.col_offset), _N(tv), s)
        if isinstance(target, ast.Subscript):
            to, ti, tv, tr = self.tmp(), self.tmp(), self.tmp(), self.tmp()
            pre.append(_assign(to, self.expr(target.value, pre)))
            pre.append(_assign(ti, self.slice_(target.slice, pre)))
            pre.append(_assign(tv, _call("_v_ld", _N(to), _N(ti), _N("_vm"), self.site(target))))
            v = self.expr(s.value, pre)
            pre.append(_assign(tr, _call(f"_v_{op}", _N(tv), v, _N("_vm"))))
            pre.append(ast.Expr(value=_call("_v_st", _N(to), _N(ti), _N(tr), _N("_vm"), self.site(target))))
            for p in pre:
                if not hasattr(p, "lineno"):
                    ast.copy_location(p, s)
            return pre
        self.fail("an augmented assignment to an attribute", target)

    def _restore(self, sv, body_stmts):
        """``_vm`` after a compound statement whose body is ``body_stmts``."""
        if _disables(body_stmts):
            rs = _N("_vrs") if self.need_rs or (self.kernel and _has_return(body_stmts)) else _C(None)
            ls = _N(self.loops[-1]) if self.loops else _C(None)
            return _assign("_vm", _call("_v_restore", _N(sv), rs, ls))
        return _assign("_vm", _N(sv))

    def if_(self, s):
        pre = []
        test = self.expr(s.test, pre)
        tc, sv, mt, mf = self.tmp(), self.tmp("sv"), self.tmp("mt"), self.tmp("mf")
        pre.append(_assign(tc, test))
        pre.append(_assign(sv, _N("_vm")))
        pre.append(ast.Assign(targets=[ast.Tuple(elts=[_S(mt), _S(mf)], ctx=ast.Store())],
                              value=_call("_v_split", _N(tc), _N("_vm"))))
        body = [_assign("_vm", _N(mt))] + self.block(s.body)
        out = pre + [_if(_is_not(_N(mt), _C(False)), body)]
        if s.orelse:
            orelse = [_assign("_vm", _N(mf))] + self.block(s.orelse)
            out.append(_if(_is_not(_N(mf), _C(False)), orelse))
        out.append(self._restore(sv, s.body + s.orelse))
        for o in out:
            ast.copy_location(o, s)
        return out

    def for_(self, s):
        if s.orelse:
            self.fail("a `for` loop with an `else`", s)
        pre = []
        sv, ls, it = self.tmp("sv"), self.tmp("ls"), self.tmp("i")
        rs = _N("_vrs") if (self.need_rs or self.kernel) and _has_return(s.body) else _C(None)
        pre.append(_assign(sv, _N("_vm")))
        pre.append(_assign(ls, _call("_v_loop", _N("_vm"), rs)))
        simple = not _disables(s.body, in_loop=True) and not any(
            isinstance(n, (ast.Break, ast.Continue)) for b in s.body for n in ast.walk(b))
        itn = s.iter
        if isinstance(itn, ast.Call) and isinstance(itn.func, ast.Name) and itn.func.id == "range" and \
                not itn.keywords and 1 <= len(itn.args) <= 3 and not any(isinstance(a, ast.Starred) for a in itn.args):
            args = [self.expr(a, pre) for a in itn.args]
            args = self._order(args, pre)
            # `range` is the builtin unless the kernel's globals shadow it (then: the general path)
            iterable = _call("_v_range", _N(ls), _C(simple), ast.Tuple(elts=args, ctx=ast.Load()))
            iterable = ast.IfExp(test=_is(_N("range"), _N("_v_builtin_range")), body=iterable,
                                 orelse=_call("_v_iter", _N(ls), _C(simple), _call(_N("range"), *args)))
        else:
            iterable = _call("_v_iter", _N(ls), _C(simple), self.expr(itn, pre))
        self.loops.append(ls)
        body = [_assign("_vm", _attr(ls, "m"))] + self.store(s.target, _N(it), s) + self.block(s.body)
        self.loops.pop()
        loop = ast.For(target=_S(it), iter=iterable, body=body, orelse=[], type_comment=None)
        out = pre + [loop]
        if _has_return(s.body):
            out.append(_assign("_vm", _call("_v_andnot", _N(sv), _attr("_vrs", "m"))))
        else:
            out.append(_assign("_vm", _N(sv)))
        for o in out:
            ast.copy_location(o, s)
        return out

    def _order(self, exprs, pre):
        return exprs

    def while_(self, s):
        if s.orelse:
            self.fail("a `while` loop with an `else`", s)
        sv, ls, tc = self.tmp("sv"), self.tmp("ls"), self.tmp()
        rs = _N("_vrs") if (self.need_rs or self.kernel) and _has_return(s.body) else _C(None)
        out = [_assign(sv, _N("_vm")), _assign(ls, _call("_v_loop", _N("_vm"), rs))]
        tpre = []
        test = self.expr(s.test, tpre)
        self.loops.append(ls)
        body = ([_assign("_vm", _attr(ls, "m"))] + tpre + [_assign(tc, test),
                _assign("_vm", _call(_attr(ls, "test"), _N(tc))), _if(_is(_N("_vm"), _C(False)), [ast.Break()])]
                + self.block(s.body))
        self.loops.pop()
        out.append(ast.While(test=_call(_attr(ls, "alive")), body=body, orelse=[]))
        if _has_return(s.body):
            out.append(_assign("_vm", _call("_v_andnot", _N(sv), _attr("_vrs", "m"))))
        else:
            out.append(_assign("_vm", _N(sv)))
        for o in out:
            ast.copy_location(o, s)
        return out

    def return_(self, s):
        pre = []
        v = self.expr(s.value, pre) if s.value is not None else _C(None)
        if s is self.final_return or (not self.need_rs and not self.kernel):
            return pre + [ast.Return(value=v)]
        if not self.need_rs:                      # a kernel's return: the lanes exit
            out = pre + [ast.Expr(value=_call(_attr("_vrs", "ret"), _N("_vm"))), _assign("_vm", _C(False))]
            return out
        tv = self.tmp()
        out = pre + [_assign(tv, v),
                     _assign("_vrv", _call("_v_retval", _N("_vm"), _N("_vm0"), _N("_vrv"), _N(tv))),
                     ast.Expr(value=_call(_attr("_vrs", "ret"), _N("_vm"))),
                     _assign("_vm", _C(False))]
        return out

    # -- expressions
    def name_load(self, node):
        if id(node) in self.an.checks:
            return ast.copy_location(_call("_v_chk", _N(node.id), _N("_vm"), _C(node.id)), node)
        if node.id in self.an.targets:
            # assigned here on every lane that runs the load, maybe still a Partial of the lanes that ever assigned
            # it (both branches of an if/else under a mask that is not every lane's): its value
            return ast.copy_location(_call("_v_val", _N(node.id)), node)
        return ast.copy_location(_N(node.id), node)

    def _hoist_before(self, pre, mark, exprs):
        """Earlier operands of an expression whose later operand needed statements (at ``pre[mark:]``): evaluate
        the earlier ones into temporaries first, as Python evaluates left to right."""
        out = []
        inserts = []
        for e in exprs:
            if isinstance(e, (ast.Name, ast.Constant)):
                out.append(e)
                continue
            tv = self.tmp()
            inserts.append(_assign(tv, e))
            out.append(_N(tv))
        pre[mark:mark] = inserts
        return out

    def exprs(self, nodes, pre):
        out = []
        for node in nodes:
            mark = len(pre)
            e = self.expr(node, pre)
            if len(pre) > mark and out:
                out = self._hoist_before(pre, mark, out)
            out.append(e)
        return out

    def expr(self, node, pre):
        t = type(node)
        if t in _BAD_EXPR:
            self.fail(_BAD_EXPR[t], node)
        if t is ast.Constant:
            return node
        if t is ast.Name:
            return self.name_load(node)
        if t is ast.Attribute:
            return ast.copy_location(_attr(self.expr(node.value, pre), node.attr), node)
        if t is ast.BinOp:
            op = _BINOP.get(type(node.op))
            if op is None:
                self.fail("the @ operator", node)
            a, b = self.exprs([node.left, node.right], pre)
            return ast.copy_location(_call(f"_v_{op}", a, b, _N("_vm")), node)
        if t is ast.UnaryOp:
            x = self.expr(node.operand, pre)
            return ast.copy_location(_call(_UNARY[type(node.op)], x, _N("_vm")), node)
        if t is ast.Compare:
            return self.compare(node, pre)
        if t is ast.BoolOp:
            return self.boolop(node, pre)
        if t is ast.IfExp:
            return self.ifexp(node, pre)
        if t is ast.Call:
            return self.call(node, pre)
        if t is ast.Subscript:
            obj, = self.exprs([node.value], pre)
            mark = len(pre)
            idx = self.slice_(node.slice, pre)
            if len(pre) > mark:
                (obj,) = self._hoist_before(pre, mark, [obj])
            return ast.copy_location(_call("_v_ld", obj, idx, _N("_vm"), self.site(node)), node)
        if t in (ast.Tuple, ast.List):
            if any(isinstance(e, ast.Starred) for e in node.elts):
                elts = []
                for e in node.elts:
                    if isinstance(e, ast.Starred):
                        elts.append(ast.Starred(value=self.expr(e.value, pre), ctx=ast.Load()))
                    else:
                        elts.append(self.expr(e, pre))
            else:
                elts = self.exprs(node.elts, pre)
            return ast.copy_location((ast.Tuple if t is ast.Tuple else ast.List)(elts=elts, ctx=ast.Load()), node)
        if t is ast.Slice:
            return self.slice_(node, pre)
        if t is ast.Starred:
            self.fail("a starred expression", node)
        self.fail(f"a {t.__name__} expression", node)

    def slice_(self, node, pre):
        if isinstance(node, ast.Slice):
            parts = [self.expr(p, pre) if p is not None else _C(None) for p in (node.lower, node.upper, node.step)]
            return _call("_v_slice", *parts)
        if isinstance(node, ast.Tuple):
            elts = []
            for e in node.elts:
                mark = len(pre)
                x = self.slice_(e, pre)
                if len(pre) > mark and elts:
                    elts = self._hoist_before(pre, mark, elts)
                elts.append(x)
            return ast.Tuple(elts=elts, ctx=ast.Load())
        return self.expr(node, pre)

    def compare(self, node, pre):
        ops = [_CMP[type(o)] for o in node.ops]
        if len(ops) == 1:
            a, b = self.exprs([node.left, node.comparators[0]], pre)
            return ast.copy_location(_call(f"_v_{ops[0]}", a, b, _N("_vm")), node)
        # a < b < c: (a < b) and (b < c), b evaluated once, c only where a < b
        left = self.expr(node.left, pre)
        tl = self.tmp()
        pre.append(_assign(tl, left))
        cur = _N(tl)
        res = self.tmp()
        first = True
        svs = []
        for op, comp in zip(ops, node.comparators):
            if first:
                tr = self.tmp()
                pre.append(_assign(tr, self.expr(comp, pre)))
                pre.append(_assign(res, _call(f"_v_{op}", cur, _N(tr), _N("_vm"))))
                cur = _N(tr)
                first = False
                continue
            mb, sv, tr, tc = self.tmp("mb"), self.tmp("sv"), self.tmp(), self.tmp()
            inner = [_assign(sv, _N("_vm")), _assign("_vm", _N(mb))]
            ipre = []
            c = self.expr(comp, ipre)
            inner += ipre + [_assign(tr, c), _assign(tc, _call(f"_v_{op}", cur, _N(tr), _N("_vm"))),
                             _assign("_vm", _N(sv)),
                             _assign(res, _call("_v_pick", _N(mb), _N(sv), _N(tc), _N(res)))]
            pre.append(_assign(mb, _call("_v_need_and", _N(res), _N("_vm"))))
            pre.append(_if(_is_not(_N(mb), _C(False)), inner))
            cur = _N(tr)
            svs.append(sv)
        return _N(res)

    def boolop(self, node, pre):
        need = "_v_need_and" if isinstance(node.op, ast.And) else "_v_need_or"
        res = self.tmp()
        pre.append(ast.copy_location(_assign(res, self.expr(node.values[0], pre)), node))
        for v in node.values[1:]:
            mb, sv, tv = self.tmp("mb"), self.tmp("sv"), self.tmp()
            ipre = []
            e = self.expr(v, ipre)
            inner = [_assign(sv, _N("_vm")), _assign("_vm", _N(mb))] + ipre + [
                _assign(tv, e), _assign("_vm", _N(sv)),
                _assign(res, _call("_v_pick", _N(mb), _N(sv), _N(tv), _N(res)))]
            pre.append(_assign(mb, _call(need, _N(res), _N("_vm"))))
            pre.append(_if(_is_not(_N(mb), _C(False)), inner))
        return _N(res)

    def ifexp(self, node, pre):
        tc, mt, mf, x, y, sv = (self.tmp(), self.tmp("mt"), self.tmp("mf"), self.tmp(), self.tmp(),
                                self.tmp("sv"))
        pre.append(_assign(tc, self.expr(node.test, pre)))
        pre.append(ast.Assign(targets=[ast.Tuple(elts=[_S(mt), _S(mf)], ctx=ast.Store())],
                              value=_call("_v_split", _N(tc), _N("_vm"))))
        pre.append(_assign(x, _N("_v_U")))
        pre.append(_assign(y, _N("_v_U")))
        bpre, opre = [], []
        b = self.expr(node.body, bpre)
        o = self.expr(node.orelse, opre)
        pre.append(_if(_is_not(_N(mt), _C(False)), [_assign(sv, _N("_vm")), _assign("_vm", _N(mt))] + bpre +
                       [_assign(x, b), _assign("_vm", _N(sv))]))
        pre.append(_if(_is_not(_N(mf), _C(False)), [_assign(sv, _N("_vm")), _assign("_vm", _N(mf))] + opre +
                       [_assign(y, o), _assign("_vm", _N(sv))]))
        for p in pre:
            if not hasattr(p, "lineno"):
                ast.copy_location(p, node)
        return ast.copy_location(_call("_v_select", _N(mt), _N(mf), _N(x), _N(y)), node)

    def call(self, node, pre, used=True):
        if any(isinstance(k.value, ast.Starred) for k in node.keywords) or any(k.arg is None for k in node.keywords):
            self.fail("** arguments", node)
        # float32(math.exp(x)) and friends: the float32 result of a math function (see values.f32_math)
        if (len(node.args) == 1 and not node.keywords and isinstance(node.args[0], ast.Call)
                and len(node.args[0].args) == 1 and not node.args[0].keywords
                and not isinstance(node.args[0].args[0], ast.Starred)):
            inner = node.args[0]
            f, g, x = self.exprs([node.func, inner.func, inner.args[0]], pre)
            return ast.copy_location(_call("_v_f32m", f, g, ast.Tuple(elts=[x], ctx=ast.Load()), _N("_vm"),
                                           self.site(node)), node)
        func = self.expr(node.func, pre)
        mark = len(pre)
        parts = []
        for a in node.args:
            if isinstance(a, ast.Starred):
                parts.append(ast.Starred(value=self.expr(a.value, pre), ctx=ast.Load()))
            else:
                m2 = len(pre)
                e = self.expr(a, pre)
                if len(pre) > m2 and parts:
                    parts = [p if isinstance(p, ast.Starred) else p for p in self._hoist_before(pre, m2, parts)]
                parts.append(e)
        kws = []
        for k in node.keywords:
            m2 = len(pre)
            e = self.expr(k.value, pre)
            if len(pre) > m2 and (parts or kws):
                hoisted = self._hoist_before(pre, m2, parts + [kv for _, kv in kws])
                parts = hoisted[:len(parts)]
                kws = [(kn, hv) for (kn, _), hv in zip(kws, hoisted[len(parts):])]
            kws.append((k.arg, e))
        if len(pre) > mark:
            (func,) = self._hoist_before(pre, mark, [func])
        args = ast.Tuple(elts=parts, ctx=ast.Load())
        kw = ast.Dict(keys=[_C(k) for k, _ in kws], values=[v for _, v in kws]) if kws else _C(None)
        c = _call("_v_call", func, _N("_vm"), self.site(node), args, kw)
        if not used:
            c.args.append(_C(False))
        return ast.copy_location(c, node)


# --------------------------------------------------------------------------- translation and instances

_templates: dict = {}       # (code object, kernel) -> compiled code of the lane version (or the Unsupported)


def _source(fn):
    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError):
        raise Unsupported("no source (inspect.getsource found none)") from None
    try:
        tree = ast.parse(textwrap.dedent(src))
    except SyntaxError:
        raise Unsupported("its source does not parse on its own") from None
    if not tree.body or not isinstance(tree.body[0], ast.FunctionDef):
        raise Unsupported("its source is not a def (a lambda?)")
    fdef = tree.body[0]
    code = fn.__code__
    ast.increment_lineno(tree, code.co_firstlineno - 1)
    params = [a.arg for a in fdef.args.args]
    if fdef.name != code.co_name or params != list(code.co_varnames[:code.co_argcount]):
        raise Unsupported("its source does not match its code (edited since it was defined?)")
    assigned = set(params)
    for n in ast.walk(fdef):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            assigned.add(n.id)
        if any(isinstance(n, t) for t in _NOT_TRANSLATED) and n is not fdef:
            raise Unsupported(_NOT_TRANSLATED[type(n)],
                              f"{code.co_filename.rsplit('/', 1)[-1]}:{n.lineno} ({code.co_name})")
    if assigned != set(code.co_varnames) or code.co_cellvars:
        raise Unsupported("its source does not match its code (edited since it was defined?)")
    for name in assigned | set(code.co_names) | set(code.co_freevars):
        if name.startswith("_v"):
            raise Unsupported(f"a name the vectorised simulator reserves ({name})")
    return fdef, params


def _fix_locations(mod):
    """Locations for the generated nodes: those made from a source node carry its line (tracebacks name the
    kernel's lines), the rest their parent's; ranges made consistent for ``compile``."""
    ast.fix_missing_locations(mod)
    for n in ast.walk(mod):
        if hasattr(n, "lineno"):
            if n.end_lineno is None or n.end_lineno < n.lineno:
                n.end_lineno = n.lineno
            if n.end_lineno == n.lineno and (n.end_col_offset is None or n.end_col_offset < n.col_offset):
                n.end_col_offset = n.col_offset


def translate(fn, kernel: bool):
    """The compiled lane version of ``fn`` (a Python function): ``f(mask, *params)``.  Raises
    :class:`Unsupported` (cached) when it cannot be translated."""
    code = fn.__code__
    key = (code, kernel)
    t = _templates.get(key)
    if t is None:
        try:
            fdef, params = _source(fn)
            an = Analysis(fdef, params)
            gen = _Gen(fdef, an, code.co_filename, kernel)
            f = gen.function()
            mod = ast.Module(body=[f], type_ignores=[])
            _fix_locations(mod)
            compiled = compile(mod, code.co_filename, "exec")
            t = next(c for c in compiled.co_consts if isinstance(c, types.CodeType))
            values.now.generated.add(t)
        except Unsupported as exc:
            t = exc
        _templates[key] = t
    if isinstance(t, Unsupported):
        raise t
    return t


def generated_source(fn, kernel: bool = False) -> str:
    """The translated source of ``fn`` (for reading what the simulator runs)."""
    fdef, params = _source(fn)
    an = Analysis(fdef, params)
    f = _Gen(fdef, an, fn.__code__.co_filename, kernel).function()
    mod = ast.Module(body=[f], type_ignores=[])
    _fix_locations(mod)
    return ast.unparse(mod)


_instances: dict = {}
_state = {"cuda": None}


def reset_instances(vcuda):
    """A new launch: functions are instantiated afresh (their globals and closures are read again)."""
    _instances.clear()
    _state["cuda"] = vcuda


def instance(fn, kernel: bool = False):
    """The lane version of ``fn`` for this launch: the translated code with ``fn``'s globals (``cuda`` swapped for
    the vectorised one, as the threads simulator swaps it) and closure values."""
    got = _instances.get((id(fn), kernel))
    if got is not None and got[0] is fn:
        return got[1]
    code = translate(fn, kernel)
    from numba import cuda as real_cuda

    g = dict(fn.__globals__)
    vc = _state["cuda"]
    for k, v in list(g.items()):
        if v is real_cuda:
            g[k] = vc
    if fn.__closure__:
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__):
            try:
                g[name] = cell.cell_contents
            except ValueError:
                g.pop(name, None)
    g.update(HELPERS)
    g["_v_builtin_range"] = range
    if "range" not in g:
        g["range"] = range
    f = types.FunctionType(code, g, fn.__name__, fn.__defaults__)
    _instances[(id(fn), kernel)] = (fn, f)
    return f


calls.INSTANCE[0] = instance
