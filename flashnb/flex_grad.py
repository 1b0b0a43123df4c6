"""``d score_mod / d score`` derived from the modifier's own Python source: forward mode, source to source.

The backward of a kernel with a ``score_mod`` needs its derivative with respect to the score (FA2 Alg. 2 line 14
with the chain rule: ``dS = P ∘ (dP - D) · score_mod'(S)``).  :func:`derivative` writes that derivative as
another Python function of the same five arguments, which numba compiles into the backward kernel exactly like
the modifier itself; a hand-written ``score_mod_grad`` (or ``score_mod.grad``) still takes precedence.

How it works (forward-mode differentiation on the syntax tree):

* Each value the modifier computes is either **active** (it depends on ``score``) or a constant of the
  derivative (the indices ``b, h, q_idx, kv_idx``, numbers, captured arrays and everything computed from them
  alone).  Every active local ``x`` gets a tangent ``d_x = dx/dscore``; ``d_score = 1``.
* Each statement ``x = e`` becomes ``d_x = D(e)`` followed by ``x = e`` (the tangent first: ``e`` may read the
  old ``x``); ``return e`` becomes ``return float32(D(e))``; an ``if`` keeps its test and transforms both
  branches.  ``D`` applies the rules below to the expression tree, keeping the primal subexpressions it needs
  (``D(u·v) = D(u)·v + u·D(v)``); constant subtrees have no tangent, so ``score + bias[h]`` derives to ``1``.
* The result is real Python source (:func:`derivative_source` shows it), registered with :mod:`linecache`, so
  the modifier compile check (:func:`flashnb.flex.check_modifiers`: compiled alone for a GPU, no ``.f64``)
  and ``inspect.getsource`` treat it like any user function.

The supported subset (anything else that depends on ``score`` is refused with a :class:`NotDifferentiable`
naming the construct and its line; pass ``score_mod_grad`` then):

* statements: ``x = e``, ``x op= e``, ``if``/``elif``/``else``, ``return e``, ``pass``, a docstring;
* ``+ - * /``, unary ``-``/``+``, ``u ** c`` with a constant exponent;
* comparisons, ``and``/``or``/``not`` of comparisons, conditional expressions ``a if c else b`` (the derivative
  of the branch taken: a kink's derivative is that of the side its test picks);
* ``math.exp``, ``math.log``, ``math.tanh``, ``math.sqrt``, ``abs`` / ``math.fabs`` (derivative 0 at 0, as
  ``torch.abs``), ``min`` and ``max`` of two or more values (a tie takes the first argument's derivative),
  ``float32(...)`` (numba's or NumPy's);
* captured arrays (closure cells or globals) indexed by ``b``, ``h``, ``q_idx``, ``kv_idx`` or any constant
  expression, and any call or attribute of a module (``math.pi``) whose arguments do not depend on ``score``:
  constants of the derivative.

Refused wherever they appear: any other statement (loops, ``with``, ``try``, nested functions, tuple
targets).  Refused when they depend on ``score``: ``//`` and ``%``, integer casts (their derivative is zero almost
everywhere: a derivative that is almost surely a bug), a call of any other function, indexing by the score,
attribute access, comprehensions, lambdas.  Everything is float32 (constants are written ``float32(...)``), so
the derivative passes the same float64 check as the modifier (:func:`flashnb.flex.check_modifiers` compiles
it, as it compiles a hand-written one).
"""

from __future__ import annotations

import ast
import builtins
import hashlib
import linecache
import math
import types as py_types

import numpy as np
from numba import float32
from numba.core import types as numba_types

from .kernels.policies.modifier_keys import ModifierError

__all__ = ["derivative", "derivative_source", "score_mod_grad_of", "NotDifferentiable"]


class NotDifferentiable(ModifierError):
    """A ``score_mod`` whose derivative :func:`derivative` cannot write (a construct outside its subset)."""


_F32 = "_fnb_float32"                      # the name the derivative's own float32(...) calls use
_UNARY = {"exp", "log", "tanh", "sqrt", "abs"}
_INT_CASTS = (builtins.int, builtins.round, math.floor, math.ceil, math.trunc, np.int8, np.int16, np.int32,
              np.int64, np.uint8, np.uint16, np.uint32, np.uint64, numba_types.int8, numba_types.int16,
              numba_types.int32, numba_types.int64, numba_types.uint8, numba_types.uint16, numba_types.uint32,
              numba_types.uint64)


def _rule_of(obj):
    """The differentiation rule of a callable the subset knows, by identity (any alias resolves), or None."""
    if obj is math.exp:
        return "exp"
    if obj is math.log:
        return "log"
    if obj is math.tanh:
        return "tanh"
    if obj is math.sqrt:
        return "sqrt"
    if obj is math.fabs or obj is builtins.abs:
        return "abs"
    if obj is builtins.min:
        return "min"
    if obj is builtins.max:
        return "max"
    if obj is float32 or obj is np.float32:
        return "float32"
    if obj in _INT_CASTS:
        return "int"
    return None


class _Refused(Exception):
    def __init__(self, node, what):
        super().__init__(what)
        self.node, self.what = node, what


def _f32(value) -> ast.expr:
    """``float32(value)``: a constant of the derivative, never a Python float."""
    return ast.Call(ast.Name(_F32, ast.Load()), [ast.Constant(value)], [])


def _name(n) -> ast.Name:
    return ast.Name(n, ast.Load())


def _copy(node):
    import copy

    return copy.deepcopy(node)


class _One:
    """The tangent of ``score`` itself (so that ``D(score * c) = c``, not ``1 * c``)."""


ONE = _One()


def _as_expr(t) -> ast.expr:
    return _f32(1) if t is ONE else t


def _add(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return ast.BinOp(_as_expr(a), ast.Add(), _as_expr(b))


def _sub(a, b):
    if b is None:
        return a
    if a is None:
        return _neg(b)
    return ast.BinOp(_as_expr(a), ast.Sub(), _as_expr(b))


def _neg(a):
    if a is None:
        return None
    return ast.UnaryOp(ast.USub(), _as_expr(a))


def _mul(t, factor: ast.expr):
    """tangent · primal factor."""
    if t is None:
        return None
    if t is ONE:
        return factor
    return ast.BinOp(t, ast.Mult(), factor)


def _div(t, divisor: ast.expr):
    if t is None:
        return None
    return ast.BinOp(_as_expr(t), ast.Div(), divisor)


def _choose(test: ast.expr, a, b):
    """``(a if test else b)`` of two tangents (None: 0)."""
    if a is None and b is None:
        return None
    return ast.IfExp(test, _as_expr(a) if a is not None else _f32(0), _as_expr(b) if b is not None else _f32(0))


def _int_literal(node):
    """The value of an integer literal ``3`` or ``-3`` (a whole-number float literal counts), else None."""
    sign = 1
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        sign, node = (-1 if isinstance(node.op, ast.USub) else 1), node.operand
    n = node.value if isinstance(node, ast.Constant) else None
    if isinstance(n, (int, float)) and not isinstance(n, bool) and math.isfinite(n) and n == int(n):
        return sign * int(n)
    return None


def _returns(stmts) -> bool:
    """Does this block always end in a ``return`` (directly, or an if/else whose branches both do)?"""
    last = stmts[-1] if stmts else None
    return isinstance(last, ast.Return) or (isinstance(last, ast.If) and bool(last.orelse)
                                            and _returns(last.body) and _returns(last.orelse))


def _source_of(node) -> str:
    try:
        return ast.unparse(node)
    except Exception:       # pragma: no cover - unparse handles every node of a parsed function
        return type(node).__name__


class _Deriver:
    def __init__(self, fdef: ast.FunctionDef, env: dict, name: str):
        self.env, self.name = env, name
        self.params = [a.arg for a in fdef.args.args]
        self.score = self.params[0]
        self.locals = set(self.params) | {n.id for n in ast.walk(fdef) if isinstance(n, ast.Name)
                                          and isinstance(n.ctx, ast.Store)}
        taken = self.locals | set(env)
        self.prefix = "d_"
        while any(n.startswith(self.prefix) for n in taken):
            self.prefix = "d" + self.prefix
        self.tangent = {self.score: ONE}          # active name -> its tangent (ONE, or the tangent variable)

    # ------------------------------------------------------------------ expressions
    def resolve(self, node):
        """The object a Name / Attribute chain denotes in the modifier's globals, closure or builtins."""
        if isinstance(node, ast.Name):
            if node.id in self.locals:
                raise KeyError(node.id)
            if node.id in self.env:
                return self.env[node.id]
            if hasattr(builtins, node.id):
                return getattr(builtins, node.id)
            raise _Refused(node, f"the name `{node.id}`, which is not defined")
        if isinstance(node, ast.Attribute):
            base = self.resolve(node.value)
            if not isinstance(base, py_types.ModuleType):
                raise _Refused(node, f"attribute access `{_source_of(node)}`")
            try:
                return getattr(base, node.attr)
            except AttributeError:
                raise _Refused(node, f"`{_source_of(node)}`, which does not exist") from None
        raise KeyError(type(node).__name__)

    def D(self, node):
        """The tangent of expression ``node`` (an AST, ONE, or None for a constant of the derivative)."""
        method = getattr(self, "D_" + type(node).__name__, None)
        if method is None:
            if not any(self.active_name(n) for n in ast.walk(node)):
                return None
            raise _Refused(node, _describe_node(node))
        return method(node)

    def active_name(self, n) -> bool:
        return isinstance(n, ast.Name) and n.id in self.tangent

    def D_Constant(self, node):
        return None

    def D_Name(self, node):
        return self.tangent.get(node.id)

    def D_BinOp(self, node):
        dl, dr = self.D(node.left), self.D(node.right)
        if dl is None and dr is None:
            return None
        op = node.op
        left, right = node.left, node.right
        if isinstance(op, ast.Add):
            return _add(dl, dr)
        if isinstance(op, ast.Sub):
            return _sub(dl, dr)
        if isinstance(op, ast.Mult):                         # d(u v) = du v + u dv
            return _add(_mul(dl, _copy(right)), _mul(dr, _copy(left)))
        if isinstance(op, ast.Div):                          # d(u / v) = du / v - u dv / v²
            first = _div(dl, _copy(right))
            if dr is None:
                return first
            second = ast.BinOp(_mul(dr, _copy(left)), ast.Div(), ast.BinOp(_copy(right), ast.Mult(), _copy(right)))
            return _sub(first, second)
        if isinstance(op, ast.Pow):
            if dr is not None:
                raise _Refused(node, f"a power whose exponent depends on {self.score} (`{_source_of(node)}`)")
            n = _int_literal(right)
            if n is not None:                                # d(u^n) = n u^(n-1) du
                if n == 0:
                    return None
                power = _copy(left) if n == 2 else ast.BinOp(_copy(left), ast.Pow(), ast.Constant(n - 1))
                return _mul(dl, ast.BinOp(_f32(n), ast.Mult(), power))
            c = ast.Call(_name(_F32), [_copy(right)], [])    # another constant exponent c: c u^(c-1) du, float32
            return _mul(dl, ast.BinOp(c, ast.Mult(), ast.BinOp(_copy(left), ast.Pow(),
                                                                ast.BinOp(_copy(c), ast.Sub(), _f32(1)))))
        raise _Refused(node, f"the operator `{_OPS.get(type(op), type(op).__name__)}` on a value that depends on "
                             f"{self.score} (`{_source_of(node)}`)")

    def D_UnaryOp(self, node):
        d = self.D(node.operand)
        if isinstance(node.op, ast.Not) or d is None:
            return None
        if isinstance(node.op, ast.USub):
            return _neg(d)
        if isinstance(node.op, ast.UAdd):
            return d
        raise _Refused(node, f"the operator `~` on a value that depends on {self.score}")

    def D_Compare(self, node):
        for part in [node.left] + node.comparators:
            self.D(part)                                     # refuses what it cannot read; the result is boolean
        return None

    def D_BoolOp(self, node):
        for v in node.values:
            if self.D(v) is not None:
                raise _Refused(node, f"`and`/`or` of a value that depends on {self.score} (`{_source_of(node)}`): "
                                     "use a conditional expression")
        return None

    def D_IfExp(self, node):
        self.D(node.test)
        return _choose(_copy(node.test), self.D(node.body), self.D(node.orelse))

    def D_Subscript(self, node):
        if any(self.active_name(n) for n in ast.walk(node.slice)) or self.D(node.slice) is not None:
            raise _Refused(node, f"indexing by a value that depends on {self.score} (`{_source_of(node)}`)")
        if self.D(node.value) is not None:
            raise _Refused(node, f"indexing a value that depends on {self.score} (`{_source_of(node)}`)")
        return None

    def D_Tuple(self, node):                                # a multi-dimensional index: arr[h, kv_idx]
        for e in node.elts:
            if self.D(e) is not None:
                raise _Refused(node, f"a tuple of values that depend on {self.score} (`{_source_of(node)}`)")
        return None

    def D_Attribute(self, node):
        if any(self.active_name(n) for n in ast.walk(node)):
            raise _Refused(node, f"attribute access `{_source_of(node)}` on a value that depends on {self.score}")
        return None                                          # math.pi, slopes.shape[0]: constants

    def D_Call(self, node):
        tangents = [self.D(a) for a in node.args]
        kw_active = any(self.D(k.value) is not None for k in node.keywords)
        if all(t is None for t in tangents) and not kw_active:
            return None                                      # a constant of the derivative, whatever it calls
        try:
            rule = _rule_of(self.resolve(node.func))
        except KeyError:
            rule = None
        where = f"`{_source_of(node)}`"
        if rule is None:
            raise _Refused(node, f"a call of `{_source_of(node.func)}` on a value that depends on {self.score} "
                                 f"({where})")
        if rule == "int":
            raise _Refused(node, f"an integer cast of a value that depends on {self.score} ({where}: its derivative "
                                 "is zero almost everywhere)")
        if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
            raise _Refused(node, f"a call with keyword or starred arguments ({where})")
        args = node.args
        if rule in _UNARY or rule == "float32":
            if len(args) != 1:
                raise _Refused(node, f"{where}: {rule} takes one argument")
            u, du = args[0], tangents[0]
            f = node.func
            if rule == "float32":
                return du
            if rule == "exp":                                # d exp(u) = exp(u) du
                return _mul(du, self.f32_call(f, u))
            if rule == "log":                                # d log(u) = du / u
                return _div(du, _copy(u))
            if rule == "tanh":                               # d tanh(u) = (1 - tanh²(u)) du
                t = self.f32_call(f, u)
                return _mul(du, ast.BinOp(_f32(1), ast.Sub(), ast.BinOp(t, ast.Mult(), self.f32_call(f, u))))
            if rule == "sqrt":                               # d sqrt(u) = du / (2 sqrt(u))
                return _div(du, ast.BinOp(_f32(2), ast.Mult(), self.f32_call(f, u)))
            if rule == "abs":                                # sign(u) du, 0 at u = 0 (as torch.abs)
                pos = ast.Compare(_copy(u), [ast.Gt()], [_f32(0)])
                neg = ast.Compare(_copy(u), [ast.Lt()], [_f32(0)])
                return _choose(pos, du, _choose(neg, _neg(du), None))
        if len(args) < 2:
            raise _Refused(node, f"{where}: {rule} of fewer than two values")
        cmp = ast.LtE() if rule == "min" else ast.GtE()  # the first argument wins a tie
        acc, dacc = args[0], tangents[0]
        for arg, darg in zip(args[1:], tangents[1:]):
            test = ast.Compare(_copy(acc), [cmp], [_copy(arg)])
            dacc = _choose(test, dacc, darg)
            acc = ast.Call(_copy(node.func), [_copy(acc), _copy(arg)], [])
        return dacc

    def f32_call(self, func, u) -> ast.expr:
        """``float32(f(u))``: a math function's result kept in float32 (the simulator's math returns float64)."""
        return ast.Call(_name(_F32), [ast.Call(_copy(func), [_copy(u)], [])], [])

    # ------------------------------------------------------------------ statements
    def tangent_var(self, name: str) -> str:
        return self.prefix + name

    def body(self, stmts, top=False) -> list:
        out = []
        for i, s in enumerate(stmts):
            if top and i == 0 and isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant) \
                    and isinstance(s.value.value, str):
                out.append(s)                                # the docstring
                continue
            out += self.stmt(s)
        return out or [ast.Pass()]

    def assign(self, target: str, value: ast.expr, node) -> list:
        t = self.D(value)
        out = []
        if t is None:
            self.tangent.pop(target, None)
        else:
            tv = self.tangent_var(target)
            if not (isinstance(t, ast.Name) and t.id == tv):     # x = x + c: d_x unchanged
                out.append(ast.Assign([ast.Name(tv, ast.Store())], _as_expr(t)))
            self.tangent[target] = _name(tv)
        out.append(ast.Assign([ast.Name(target, ast.Store())], value))
        return out

    def stmt(self, s) -> list:
        if isinstance(s, ast.Pass):
            return [s]
        if isinstance(s, ast.Return):
            if s.value is None:
                raise _Refused(s, "a `return` without a value")
            t = self.D(s.value)
            if t is None or t is ONE:
                return [ast.Return(_f32(0 if t is None else 1))]
            return [ast.Return(ast.Call(_name(_F32), [t], []))]
        if isinstance(s, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = s.targets if isinstance(s, ast.Assign) else [s.target]
            if len(targets) != 1 or not isinstance(targets[0], ast.Name):
                raise _Refused(s, f"the assignment `{_source_of(s)}` (only `name = ...` is supported)")
            name = targets[0].id
            if isinstance(s, ast.AugAssign):
                value = ast.BinOp(_name(name), s.op, s.value)
            elif s.value is None:
                return []
            else:
                value = s.value
            return self.assign(name, value, s)
        if isinstance(s, ast.If):
            self.D(s.test)
            before = dict(self.tangent)
            then = self.body(s.body)
            after_then, self.tangent = self.tangent, dict(before)
            orelse = self.body(s.orelse) if s.orelse else []
            after_else = self.tangent
            # the paths that reach the statement after the if (a branch ending in return does not)
            live = [(b, st) for b, st, ret in ((then, after_then, _returns(s.body)),
                                               (orelse, after_else, bool(s.orelse) and _returns(s.orelse))) if not ret]
            merged = {}
            for n in set().union(*(st for _, st in live)):
                merged[n] = ONE if n == self.score and all(st.get(n) is ONE for _, st in live) \
                    else _name(self.tangent_var(n))
            # a name active after the if has its tangent variable set on every path that gets there
            for branch, state in live:
                for n, t in merged.items():
                    if t is ONE:
                        continue
                    have = state.get(n)
                    if have is None:
                        branch.append(ast.Assign([ast.Name(self.tangent_var(n), ast.Store())], _f32(0)))
                    elif not (isinstance(have, ast.Name) and have.id == self.tangent_var(n)):
                        branch.append(ast.Assign([ast.Name(self.tangent_var(n), ast.Store())], _as_expr(have)))
            self.tangent = merged if live else before           # both branches return: what follows is dead
            return [ast.If(s.test, then or [ast.Pass()], orelse)]
        raise _Refused(s, _describe_node(s))


_OPS = {ast.FloorDiv: "//", ast.Mod: "%", ast.MatMult: "@", ast.LShift: "<<", ast.RShift: ">>", ast.BitOr: "|",
        ast.BitAnd: "&", ast.BitXor: "^"}
_CONSTRUCTS = {ast.For: "a loop (`for`)", ast.AsyncFor: "a loop (`async for`)", ast.While: "a loop (`while`)",
               ast.With: "a `with` statement", ast.Try: "a `try` statement", ast.Raise: "a `raise` statement",
               ast.Assert: "an `assert` statement", ast.FunctionDef: "a nested function definition",
               ast.Lambda: "a lambda", ast.ListComp: "a list comprehension", ast.GeneratorExp: "a generator",
               ast.DictComp: "a dict comprehension", ast.SetComp: "a set comprehension", ast.List: "a list",
               ast.Dict: "a dict", ast.Set: "a set", ast.NamedExpr: "an assignment expression (`:=`)",
               ast.JoinedStr: "an f-string", ast.Import: "an import", ast.ImportFrom: "an import",
               ast.Global: "a `global` statement", ast.Nonlocal: "a `nonlocal` statement",
               ast.Delete: "a `del` statement", ast.Expr: "an expression statement", ast.Starred: "a starred value",
               ast.Slice: "a slice"}


def _describe_node(node) -> str:
    what = _CONSTRUCTS.get(type(node), f"`{type(node).__name__}`")
    if isinstance(node, ast.expr):
        return f"{what} (`{_source_of(node)}`)"
    return what


# --------------------------------------------------------------------------- building the function

_DERIVED: dict = {}     # Snapshot of a score_mod -> (source, Snapshot of its derivative); bounded like the kernels


def _env_of(fn) -> dict:
    """The names the modifier's code can read: its globals, then its closure cells (which shadow them)."""
    env = dict(fn.__globals__)
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        try:
            env[name] = cell.cell_contents
        except ValueError:
            pass
    return env


def _derive(fn, name: str):
    """``(source, function)``: the derivative of the Python function ``fn`` (a snapshot's frozen copy)."""
    from .kernels.policies import modifier_keys as flex  # a modifier's source and snapshot (flex re-exports them)

    try:
        desc = flex._describe(fn, "score_mod")
    except ModifierError as exc:            # no source to read (a function typed at a bare interpreter prompt)
        raise NotDifferentiable(f"score_mod {name!r} cannot be differentiated automatically: "
                                f"{str(exc).split(': ', 1)[-1]}; or pass score_mod_grad (d score_mod / d score, "
                                "same arguments)") from None
    tree = ast.parse(desc["source"])
    fdef = next(n for n in tree.body if isinstance(n, ast.FunctionDef))
    if fdef.args.vararg or fdef.args.kwarg or fdef.args.kwonlyargs or len(fdef.args.args) != 5:
        raise NotDifferentiable(f"score_mod {name!r} must take five positional arguments (score, b, h, q_idx, "
                                "kv_idx) to be differentiated")
    env = _env_of(fn)
    d = _Deriver(fdef, env, name)
    try:
        body = d.body(fdef.body, top=True)
    except _Refused as r:
        # a lambda's desc is a one-line ``def lambda_`` written around it: its line is the lambda's
        line = desc["firstlineno"] if desc.get("name") == "lambda_" else \
            desc["firstlineno"] + getattr(r.node, "lineno", 1) - 1
        raise NotDifferentiable(
            f"score_mod {name!r} cannot be differentiated automatically: {r.what}, at line {line} of "
            f"{desc['filename']}, is outside the subset flashnb derives (arithmetic, comparisons, conditional "
            "expressions and if/else, math.exp/log/tanh/sqrt, abs, min/max, float32 casts, captured arrays indexed "
            "by b, h, q_idx, kv_idx; see flashnb.flex_grad); pass score_mod_grad (d score_mod / d score, same "
            "arguments) instead") from None
    gname = f"{fdef.name if fdef.name != 'lambda_' else 'lambda'}_dscore"
    new = ast.FunctionDef(name=gname, args=_copy(fdef.args), body=body, decorator_list=[], returns=None)
    if "type_params" in new._fields:
        new.type_params = []
    for a in new.args.args:
        a.annotation = None
    module = ast.Module([new], [])
    ast.fix_missing_locations(module)
    source = f"# d {name} / d {d.score}, derived by flashnb.flex_grad (forward mode)\n" + ast.unparse(module) + "\n"
    # named by its content: the same code with other captured values shares one linecache entry
    digest = hashlib.blake2b(source.encode(), digest_size=6).hexdigest()
    filename = f"<flashnb derivative of {name} {digest}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)   # inspect.getsource reads it
    glob = {n: v for n, v in env.items()}
    glob.setdefault("__builtins__", builtins)
    glob[_F32] = float32
    namespace: dict = {}
    exec(compile(source, filename, "exec"), glob, namespace)
    out = namespace[gname]
    out.__qualname__ = gname
    return source, out


def derivative(score_mod):
    """``d score_mod / d score`` derived from ``score_mod``'s source (see the module docstring): a
    :func:`flashnb.flex.snapshot` of a Python function of the same five arguments returning float32, for the
    modifier as it is now (its captured values included).  Cached by the modifier's code and captured contents.
    Raises :class:`NotDifferentiable` naming the first construct outside the subset."""
    from collections import OrderedDict

    from .kernels.policies import modifier_keys as flex  # a modifier's source and snapshot (flex re-exports them)
    from .registry import KERNEL_CACHE_SIZE

    snap = flex.snapshot(score_mod)
    global _DERIVED
    if not isinstance(_DERIVED, OrderedDict):
        _DERIVED = OrderedDict()
    hit = _DERIVED.get(snap)
    if hit is None:
        source, fn = _derive(snap.py_func, flex.name_of(snap))
        hit = _DERIVED[snap] = (source, flex.snapshot(fn))
        while len(_DERIVED) > KERNEL_CACHE_SIZE:
            _DERIVED.popitem(last=False)
    else:
        _DERIVED.move_to_end(snap)
    return hit[1]


def derivative_source(score_mod) -> str:
    """The Python source :func:`derivative` writes for ``score_mod``."""
    from .kernels.policies import modifier_keys as flex  # a modifier's source and snapshot (flex re-exports them)

    derivative(score_mod)
    return _DERIVED[flex.snapshot(score_mod)][0]


def score_mod_grad_of(score_mod, score_mod_grad=None):
    """The ``d score_mod / d score`` a backward uses: ``score_mod_grad`` when given, else ``score_mod.grad`` (the
    gallery's), else :func:`derivative` (raising :class:`NotDifferentiable` for a modifier outside the subset).
    ``None`` without a ``score_mod``."""
    from .kernels.policies import python_modifier

    if score_mod is None or score_mod_grad is not None:
        return score_mod_grad
    grad = getattr(python_modifier(score_mod), "grad", None)
    return grad if grad is not None else derivative(score_mod)
