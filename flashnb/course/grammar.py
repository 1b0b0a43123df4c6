"""The answer grammar: what an answer cell may say, as an allow-list, checked on its syntax tree before anything of
a submission runs.

Answers to these assignments are device code -- kernels, device functions, the kernel factories that close over
their tile sizes -- plus, where an assignment asks for them, module constants (numeric answers) and a launcher.
So an answer cell is read as *definitions*:

* **imports** of :data:`IMPORTS` only (``math``, NumPy, numba's ``cuda`` and types, the names flashnb's kernel
  modules export for answers);
* **functions** (``def``), decorated with nothing or with ``cuda.jit`` (keyword arguments that are constants);
  default arguments are constants;
* **constants**: ``name = <constant expression>`` (numbers, arithmetic, the names of other constants, ``min``,
  ``max``, ``sum``, ``range``, ... and comprehensions of them);
* docstrings, ``pass``, and the release's ``raise NotImplementedError("TODO ...")``.

Any other statement at the top level of a cell (a print, a self-check, a launch to try a kernel) is **never run by
the grader**: :func:`check` returns the cells with those lines blanked, and the feedback lists them.  Helper
functions may stand anywhere in the answer cells: they are definitions like any other.

Inside a function, the grammar is the Numba CUDA subset.  Statements: assignments (to names, tuples of names and,
in a kernel, array elements), ``if``, ``for`` over ``range``, ``while``, ``break``, ``continue``, ``return``,
``pass``, nested ``def``, ``raise`` of a built-in exception.  Expressions: constants, arithmetic, comparisons,
conditional expressions, tuples, indexing, and calls of -- the answer's own functions, the device functions and
host helpers flashnb's kernel modules offer (:data:`HOST_HELPER_NAMES`), NumPy/numba scalar types, ``math.*``,
``cuda.*`` intrinsics (:data:`CUDA_DEVICE`) inside a kernel, and the builtins of :data:`BUILTINS`.  Attributes:
``cuda.*`` and ``math.*`` from fixed lists, NumPy's dtypes, and an array's ``shape`` / ``ndim`` / ``size`` /
``dtype`` (and ``x`` / ``y`` / ``z`` of a dim3).  Nothing else: no other attribute, no dunder, no string that
becomes code, no class, lambda, ``with``, ``try``, ``global``, ``import`` inside a function.

Host code (a factory's own lines, a launcher) is smaller still: it indexes only shapes and the tuples and dicts it
builds (never an array: a launcher cannot read the inputs and compute the answer on the host), and it creates no
array -- so a kernel can read only the arrays it is given and those it allocates in shared or local memory, which
the traffic counter sees.  Free names resolve to what the answer binds, or to flashnb's kernel modules' values,
each classified by what it *is* (a constant, a device function, an allowed host helper, ``math``/NumPy/``cuda``);
a name that is anything else (a module, the grader, a function not listed) is refused.

What passes is then compiled by numba before any test runs (:mod:`flashnb.course.vouch`: ``compile_ptx`` for
sm_80 and sm_90; what does not compile scores 0 on its question), and the tests' own compile check
(``criteria.compiles``) adds the PTX guard's verdict.  :func:`check` returns the findings (cell, line,
construct, rule): a submission with any scores 0 with them as feedback.
"""

from __future__ import annotations

import ast
import builtins
import functools
import math
import sys
from dataclasses import dataclass

from .screen import _chain, _is_cuda_jit, _targets, parse_cells

__all__ = ["Finding", "check", "BUILTINS", "IMPORTS", "CUDA_DEVICE", "HOST_HELPER_NAMES", "classify", "setup_names"]

#: builtins an answer may call (pure: numbers, ranges, tuples)
BUILTINS = frozenset({"range", "min", "max", "abs", "int", "float", "bool", "len", "sum", "round", "divmod",
                      "tuple", "pow", "isinstance"})
#: builtins a ``raise`` may name
EXCEPTIONS = frozenset({"NotImplementedError", "ValueError", "TypeError", "AssertionError", "RuntimeError"})
#: ``import m`` / ``from m import ...`` (flashnb's modules: their public names, each classified like any free name)
IMPORTS = frozenset({"math", "numpy", "numba", "numba.cuda", "flashnb.common",
                     *(f"flashnb.stages.{m}" for m in ("naive", "softmax", "fa1", "fa2", "fa2_steps", "block_sparse",
                                                       "fa2_fast", "fa2_fast_steps"))})
#: ``cuda.<name>`` in a kernel (and ``cuda.jit`` anywhere), with the names below them
CUDA_DEVICE = {
    "jit": None, "grid": None, "gridsize": None, "laneid": None, "warpsize": None,
    "threadIdx": {"x", "y", "z"}, "blockIdx": {"x", "y", "z"}, "blockDim": {"x", "y", "z"}, "gridDim": {"x", "y", "z"},
    "shared": {"array"}, "local": {"array"}, "const": {"array_like"},
    "atomic": {"add", "sub", "max", "min", "exch", "cas", "and_", "or_", "xor", "inc", "dec", "nanmax", "nanmin"},
    "syncthreads": None, "syncthreads_and": None, "syncthreads_count": None, "syncthreads_or": None,
    "syncwarp": None, "shfl_sync": None, "shfl_up_sync": None, "shfl_down_sync": None, "shfl_xor_sync": None,
    "all_sync": None, "any_sync": None, "eq_sync": None, "ballot_sync": None, "activemask": None,
    "lanemask_lt": None, "match_any_sync": None, "match_all_sync": None, "threadfence": None,
    "threadfence_block": None, "threadfence_system": None, "fma": None, "cbrt": None, "brev": None, "clz": None,
    "ffs": None, "popc": None, "selp": None, "nanosleep": None,
    "fp16": {"hadd", "hsub", "hmul", "hdiv", "hfma", "hneg", "habs", "hexp", "hexp2", "hexp10", "hlog", "hlog2",
             "hlog10", "hsqrt", "hrsqrt", "hrcp", "hmax", "hmin", "heq", "hne", "hgt", "hge", "hlt", "hle", "hsin",
             "hcos", "hceil", "hfloor", "htrunc", "hrint"},
}
NP_NAMES = frozenset({"float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                      "uint64", "bool_", "inf", "nan", "pi", "e"})
NUMBA_NAMES = frozenset({"cuda", "float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8",
                         "uint16", "uint32", "uint64", "boolean", "void"})
MATH_NAMES = frozenset(n for n in dir(math) if not n.startswith("_"))
#: host functions of flashnb's kernel modules an answer may call (by name, and only the very object)
HOST_HELPER_NAMES = frozenset({"cdiv", "launch", "geometry", "_red_size", "causal_diag"})
#: attributes of any value (arrays, dim3)
VALUE_ATTRS = frozenset({"shape", "ndim", "size", "dtype", "x", "y", "z"})
#: the flashnb modules whose values answer names resolve to (what the assignments' setups import from)
ENV_MODULES = ("flashnb.common", *(f"flashnb.stages.{m}" for m in ("naive", "softmax", "fa1", "fa2", "fa2_steps",
                                                                   "block_sparse", "fa2_fast", "fa2_fast_steps")))


@dataclass
class Finding:
    cell: int          # 1-based answer cell
    line: int          # line in that cell
    what: str          # the construct, as written
    why: str           # the rule

    def __str__(self) -> str:
        return f"answer cell {self.cell}, line {self.line}: {self.what} -- {self.why}"


# --------------------------------------------------------------------------- what free names are


def _is_dispatcher(v) -> bool:
    t = type(v).__name__
    return hasattr(v, "py_func") and ("Dispatcher" in t or "Kernel" in t)


def classify(v) -> str | None:
    """What a value an answer names may be used as: "math", "np", "cuda" (those modules), "type" (a scalar
    type: callable as a cast), "const", "device" (a ``@cuda.jit`` function), "host" (an allowed host helper);
    None: not available to answers."""
    import numpy as np

    if v is math:
        return "math"
    if v is np:
        return "np"
    numba = sys.modules.get("numba")
    if numba is not None and v is getattr(numba, "cuda", None):
        return "cuda"
    if isinstance(v, type) and issubclass(v, np.generic):
        return "type"
    try:
        from numba.core import types as nbt

        if isinstance(v, nbt.Type):
            return "type"
    except ImportError:     # pragma: no cover -- numba is a dependency
        pass
    if v is None or isinstance(v, (bool, int, float, complex, str, np.generic, np.dtype)):
        return "const"
    if isinstance(v, tuple) and all(classify(x) == "const" for x in v):
        return "const"
    if _is_dispatcher(v):
        return "device"
    return None


def _host_helper(name: str, v) -> bool:
    """An allowed host function of flashnb: a listed helper, or a kernel factory of its stage modules (``make_*``:
    library code that builds library kernels, which the tests tell apart from the student's)."""
    module = getattr(v, "__module__", "") or ""
    if not callable(v) or not module.startswith("flashnb."):
        return False
    return name in HOST_HELPER_NAMES or (name.startswith("make_") and module.startswith("flashnb.stages."))


@functools.lru_cache(maxsize=1)
def _all_env_names() -> frozenset:
    """Every name of flashnb's kernel modules, whatever its value (a name an answer may not use is refused, not
    left to fail at run time: code may run in those modules' namespaces)."""
    import importlib

    out = set()
    for name in ENV_MODULES:
        try:
            out.update(vars(importlib.import_module(name)))
        except ImportError:     # pragma: no cover
            pass
    return frozenset(out)


@functools.lru_cache(maxsize=1)
def _env() -> dict:
    """name -> (value, kind) for the values of flashnb's kernel modules and the modules answers use."""
    import importlib

    import numpy as np

    out = {}
    for name in ENV_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:     # pragma: no cover
            continue
        for k, v in vars(mod).items():
            if k.startswith("__") or k in out:
                continue
            kind = "host" if _host_helper(k, v) else classify(v)
            if kind is not None:
                out[k] = (v, kind)
    from numba import cuda

    out.update(math=(math, "math"), np=(np, "np"), numpy=(np, "np"), cuda=(cuda, "cuda"))
    return out


# --------------------------------------------------------------------------- the checker


class _Scope:
    def __init__(self, node, parent, kernel: bool):
        self.node = node
        self.parent = parent
        self.kernel = kernel
        self.bound: set[str] = set()
        self.params: set[str] = set()
        self.values: dict[str, list] = {}       # name -> the expressions assigned to it here


class _Checker:
    def __init__(self, cell: int, lines: list[str], module: dict, findings: list[Finding],
                 setup_names: frozenset = frozenset()):
        self.cell, self.lines, self.module, self.findings = cell, lines, module, findings
        self.setup_names = setup_names
        self.scope: _Scope | None = None
        self.top = False            # checking a top-level statement the grader will not run

    def refuse(self, node, why: str) -> None:
        line = getattr(node, "lineno", 0)
        try:
            what = ast.unparse(node) if not isinstance(node, ast.stmt) else self.lines[line - 1].strip()
        except (IndexError, ValueError):
            what = type(node).__name__
        f = Finding(self.cell, line, f"`{what[:80]}`", why)
        if not any((g.cell, g.line, g.why) == (f.cell, f.line, f.why) for g in self.findings):
            self.findings.append(f)

    # ------------------------------------------------------------- names

    def lookup(self, name: str):
        """("local", scope) | ("module", kind) | ("builtin", None) | ("env", kind) | None."""
        s = self.scope
        while s is not None:
            if name in s.bound:
                return "local", s
            s = s.parent
        if name in self.module:
            return "module", self.module[name]
        if name in BUILTINS or name in EXCEPTIONS:
            return "builtin", None
        env = _env()
        if name in env:
            return "env", env[name][1]
        return None

    def kind_of(self, name: str) -> str | None:
        """What a name is, as far as the grammar can tell: math/np/cuda/type/const/device/host/function/value."""
        found = self.lookup(name)
        if found is None:
            return None
        where, info = found
        if where == "local":
            return "value"
        if where == "builtin":
            return "builtin"
        return info

    # ------------------------------------------------------------- statements

    def module_stmt(self, node) -> bool:
        """Check one top-level statement; False: it is not a definition (blanked, never run)."""
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            self.imports(node)
            return True
        if isinstance(node, ast.FunctionDef):
            self.function(node)
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and self._constant_assign(node):
            value = node.value
            if value is not None:
                self.expr(value, const=True)
            return True
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            return True
        if isinstance(node, ast.Pass):
            return True
        if isinstance(node, ast.Raise) and self._todo_raise(node):
            return True
        # anything else is never run (unless it only computes constants); still, it must not reach beyond the
        # grammar (it says what the code is for)
        before = len(self.findings)
        self.top = True
        saved, self.scope = self.scope, _Scope(node, None, False)
        try:
            self._bind(self.scope, [node])
            if isinstance(node, ast.Assert):
                self.expr(node.test)
                if node.msg is not None:
                    self.expr(node.msg)
            elif isinstance(node, (ast.If, ast.For, ast.While, ast.Assign, ast.AugAssign, ast.Expr)):
                self.stmt(node)
            else:
                self.refuse(node, f"{type(node).__name__.lower()} statements are not part of an answer")
        finally:
            self.scope, self.top = saved, False
        return len(self.findings) == before and self._constant_computation(node)

    def _constant_assign(self, node) -> bool:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        if not all(isinstance(t, ast.Name) or (isinstance(t, ast.Tuple) and all(isinstance(e, ast.Name)
                                                                                for e in t.elts)) for t in targets):
            return False
        return node.value is not None and self._is_constant_expr(node.value)

    def _is_constant_expr(self, node) -> bool:
        """Syntax a constant (or a computation of constants at the top level) may have: numbers, names,
        arithmetic, the pure builtins and ``math.*`` (names are checked by :meth:`expr`)."""
        ok = (ast.Constant, ast.Name, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.IfExp, ast.Tuple,
              ast.GeneratorExp, ast.ListComp, ast.comprehension, ast.Load, ast.Store, ast.operator, ast.unaryop,
              ast.boolop, ast.cmpop, ast.expr_context, ast.Call, ast.keyword, ast.List, ast.Attribute)
        for n in ast.walk(node):
            if not isinstance(n, ok):
                return False
            if isinstance(n, ast.Attribute) and not (isinstance(n.value, ast.Name) and n.value.id == "math"
                                                     and self.kind_of("math") == "math"):
                return False
            if isinstance(n, ast.Call) and not ((isinstance(n.func, ast.Name) and n.func.id in BUILTINS)
                                                or isinstance(n.func, ast.Attribute)):
                return False
        return True

    def _constant_computation(self, node) -> bool:
        """A top-level ``for`` over ``range``, ``if``, ``while`` or augmented assignment that only computes
        constants (assignments to names of constant expressions): run, like the constants it defines."""
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            return all(isinstance(t, ast.Name) for t in targets) and self._is_constant_expr(node.value)
        if isinstance(node, ast.For):
            return (isinstance(node.target, ast.Name) and self._is_constant_expr(node.iter)
                    and all(self._constant_computation(b) for b in node.body + node.orelse))
        if isinstance(node, (ast.If, ast.While)):
            return self._is_constant_expr(node.test) and all(self._constant_computation(b)
                                                             for b in node.body + node.orelse)
        return isinstance(node, (ast.Pass, ast.Break, ast.Continue))

    def _todo_raise(self, node) -> bool:
        exc = node.exc
        return (isinstance(exc, ast.Call) and isinstance(exc.func, ast.Name) and exc.func.id in EXCEPTIONS
                and all(isinstance(a, ast.Constant) for a in exc.args) and not exc.keywords and node.cause is None)

    def imports(self, node) -> None:
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name not in ("math", "numpy"):
                    self.refuse(node, f"imports {a.name}: answers import math and numpy as modules, and names from "
                                      "numba (cuda, float32, ...) and flashnb's kernel modules")
            return
        mod = node.module or ""
        if node.level or mod not in IMPORTS:
            self.refuse(node, f"imports from {'.' * node.level + mod}; answers may import from "
                              f"{', '.join(sorted(IMPORTS))}")
            return
        for a in node.names:
            if a.name == "*":
                self.refuse(node, "`from ... import *` (name what you use)")
            elif mod in ("numba", "numba.cuda") and a.name not in NUMBA_NAMES:
                self.refuse(node, f"imports {a.name} from {mod}; only {', '.join(sorted(NUMBA_NAMES))}")
            elif mod == "numpy" and a.name not in NP_NAMES:
                self.refuse(node, f"imports {a.name} from numpy; only its scalar types and constants")
            elif mod == "math" and a.name not in MATH_NAMES:
                self.refuse(node, f"imports {a.name} from math")
            elif mod.startswith("flashnb."):
                kind = self._module_value_kind(mod, a.name)
                if kind is None:
                    self.refuse(node, f"imports {a.name} from {mod}: answers may use its constants, device "
                                      f"functions and the host helpers {', '.join(sorted(HOST_HELPER_NAMES))}")

    @staticmethod
    def _module_value_kind(mod: str, name: str) -> str | None:
        import importlib

        try:
            v = getattr(importlib.import_module(mod), name)
        except (ImportError, AttributeError):
            return None
        return "host" if _host_helper(name, v) else classify(v)

    def function(self, node: ast.FunctionDef) -> None:
        jit = False
        for d in node.decorator_list:
            if not _is_cuda_jit(d):
                self.refuse(d, "the only decorator an answer uses is cuda.jit")
                continue
            jit = True
            if isinstance(d, ast.Call):
                for a in d.args:
                    if not isinstance(a, ast.Constant):
                        self.refuse(d, "cuda.jit's arguments are constants (a signature string)")
                for k in d.keywords:
                    if k.arg is None or not isinstance(k.value, ast.Constant):
                        self.refuse(d, "cuda.jit's keyword arguments are constants (device=True, ...)")
        if node.name.startswith("__"):
            self.refuse(node, f"the name {node.name} (special names are the interpreter's)")
        args = node.args
        for d in args.defaults + [d for d in args.kw_defaults if d is not None]:
            if not isinstance(d, ast.Constant) and not (isinstance(d, ast.UnaryOp) and isinstance(d.operand,
                                                                                                  ast.Constant)):
                self.refuse(d, "a default argument is a constant (a default that is an expression runs code when "
                               "the function is defined)")
        if args.vararg or args.kwarg:
            self.refuse(node, "*args / **kwargs: name the parameters")
        if node.returns is not None or any(a.annotation is not None for a in args.posonlyargs + args.args
                                             + args.kwonlyargs):
            self.refuse(node, "annotations are not needed by an answer (they run when the function is defined)")
        scope = _Scope(node, self.scope, jit or (self.scope is not None and self.scope.kernel))
        for a in args.posonlyargs + args.args + args.kwonlyargs:
            scope.bound.add(a.arg)
            scope.params.add(a.arg)
        self._bind(scope, node.body)
        saved, self.scope = self.scope, scope
        try:
            for stmt in node.body:
                self.stmt(stmt)
        finally:
            self.scope = saved

    def _bind(self, scope: _Scope, body) -> None:
        stack = list(body)
        while stack:
            n = stack.pop()
            if isinstance(n, ast.FunctionDef):
                scope.bound.add(n.name)
                scope.values.setdefault(n.name, []).append(n)
                continue
            if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                    for name in _targets(t):
                        scope.bound.add(name)
                        scope.values.setdefault(name, []).append(n.value if isinstance(t, ast.Name) else None)
            elif isinstance(n, ast.For):
                for name in _targets(n.target):
                    scope.bound.add(name)
                    scope.values.setdefault(name, []).append(None)
            elif isinstance(n, ast.comprehension):
                for name in _targets(n.target):
                    scope.bound.add(name)
            elif isinstance(n, ast.NamedExpr):
                scope.bound.add(n.target.id)
                scope.values.setdefault(n.target.id, []).append(n.value)
            stack.extend(ast.iter_child_nodes(n))

    def stmt(self, node) -> None:
        kernel = self.scope.kernel
        if isinstance(node, ast.FunctionDef):
            self.function(node)
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if isinstance(node, ast.AnnAssign):
                self.refuse(node, "annotations are not needed by an answer")
            for t in targets:
                self.target(t, node)
            if node.value is not None:
                self.expr(node.value)
        elif isinstance(node, ast.Expr):
            if not isinstance(node.value, ast.Constant):
                self.expr(node.value)
        elif isinstance(node, ast.Return):
            if node.value is not None:
                self.expr(node.value)
        elif isinstance(node, ast.If):
            self.expr(node.test)
            for s in node.body + node.orelse:
                self.stmt(s)
        elif isinstance(node, ast.While):
            self.expr(node.test)
            for s in node.body + node.orelse:
                self.stmt(s)
        elif isinstance(node, ast.For):
            if not (isinstance(node.iter, ast.Call) and isinstance(node.iter.func, ast.Name)
                    and node.iter.func.id == "range" and self.lookup("range") == ("builtin", None)):
                self.refuse(node, "a loop is `for i in range(...)`")
            self.target(node.target, node)
            self.expr(node.iter)
            for s in node.body + node.orelse:
                self.stmt(s)
        elif isinstance(node, (ast.Pass, ast.Break, ast.Continue)):
            pass
        elif isinstance(node, ast.Raise):
            exc = node.exc
            if not (isinstance(exc, ast.Call) and isinstance(exc.func, ast.Name) and exc.func.id in EXCEPTIONS
                    and self.lookup(exc.func.id) == ("builtin", None)) or node.cause is not None or (
                    kernel and not all(isinstance(a, ast.Constant) for a in exc.args)):
                self.refuse(node, "raise only a built-in exception with a message (a constant one in a kernel)")
            else:
                for a in exc.args:
                    self.expr(a)
        else:
            self.refuse(node, f"{type(node).__name__.lower()} statements are not part of the answer grammar "
                              "(assignments, if, for over range, while, return, def)")

    def target(self, t, stmt) -> None:
        if isinstance(t, ast.Name):
            if t.id.startswith("__"):
                self.refuse(stmt, f"the name {t.id}")
            return
        if isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                self.target(e, stmt)
            return
        if isinstance(t, ast.Subscript) and self.scope.kernel:
            if not isinstance(t.value, ast.Name):
                self.refuse(stmt, "a kernel stores into an array it names (X[i] = ...)")
            self.expr(t.value)
            self.expr(t.slice)
            return
        self.refuse(stmt, "host code assigns only names (a kernel stores into arrays; a launcher passes them)"
                    if isinstance(t, ast.Subscript) else "assign to names (and, in a kernel, array elements) only")

    # ------------------------------------------------------------- expressions

    def expr(self, node, const: bool = False) -> None:
        kernel = self.scope is not None and self.scope.kernel
        if isinstance(node, ast.Constant):
            if isinstance(node.value, bytes):
                self.refuse(node, "bytes are not part of an answer")
            return
        if isinstance(node, ast.Name):
            self.name(node)
            return
        if isinstance(node, (ast.BinOp,)):
            self.expr(node.left, const)
            self.expr(node.right, const)
            if isinstance(node.op, ast.MatMult):
                self.refuse(node, "@ (matrix product) is NumPy, not CUDA")
            return
        if isinstance(node, ast.UnaryOp):
            self.expr(node.operand, const)
            return
        if isinstance(node, ast.BoolOp):
            for v in node.values:
                self.expr(v, const)
            return
        if isinstance(node, ast.Compare):
            self.expr(node.left, const)
            for c in node.comparators:
                self.expr(c, const)
            if any(isinstance(op, (ast.In, ast.NotIn, ast.Is, ast.IsNot)) for op in node.ops) and kernel:
                self.refuse(node, "`in` / `is` are not CUDA Python")
            return
        if isinstance(node, ast.IfExp):
            for v in (node.test, node.body, node.orelse):
                self.expr(v, const)
            return
        if isinstance(node, (ast.Tuple, ast.List)):
            if isinstance(node, ast.List) and kernel:
                self.refuse(node, "a list in a kernel (use cuda.local.array)")
            for e in node.elts:
                self.expr(e.value if isinstance(e, ast.Starred) else e, const)
            return
        if isinstance(node, ast.Dict) and not kernel and not const:
            for k, v in zip(node.keys, node.values):
                if k is None:
                    self.refuse(node, "** in a dict")
                    continue
                self.expr(k)
                self.expr(v)
            return
        if isinstance(node, (ast.GeneratorExp, ast.ListComp)) and not kernel:
            saved = self.scope
            comp = _Scope(node, saved, False)
            for g in node.generators:
                comp.bound.update(_targets(g.target))
            for g in node.generators:
                self.expr(g.iter, const)
                self.scope = comp
                for c in g.ifs:
                    self.expr(c, const)
            self.scope = comp
            try:
                self.expr(node.elt, const)
            finally:
                self.scope = saved
            return
        if isinstance(node, ast.JoinedStr) and not kernel:
            for v in node.values:
                if isinstance(v, ast.FormattedValue):
                    self.expr(v.value)
                    if v.format_spec is not None:
                        self.expr(v.format_spec)
            return
        if isinstance(node, ast.Subscript):
            self.subscript(node)
            return
        if isinstance(node, ast.Slice):
            for v in (node.lower, node.upper, node.step):
                if v is not None:
                    self.expr(v)
            return
        if isinstance(node, ast.Attribute):
            self.attribute(node)
            return
        if isinstance(node, ast.Call):
            self.call(node, const)
            return
        self.refuse(node, f"{type(node).__name__} expressions are not part of the answer grammar")

    def name(self, node: ast.Name) -> None:
        if node.id.startswith("__"):
            self.refuse(node, f"the name {node.id} reaches the interpreter's internals")
            return
        kind = self.kind_of(node.id)
        if kind is None and self.top and node.id == "print":
            return
        if kind is None and (node.id in self.setup_names or node.id in _all_env_names()
                             or hasattr(builtins, node.id)):
            self.refuse(node, f"{node.id} is not available to answers (an answer names its own definitions, "
                              "flashnb's device functions and constants, math, NumPy's dtypes and cuda)")
        elif kind == "builtin" and node.id not in BUILTINS | EXCEPTIONS:
            self.refuse(node, f"{node.id} is not available to answers")

    def attribute(self, node: ast.Attribute) -> None:
        chain = _chain(node)
        kernel = self.scope is not None and self.scope.kernel
        if node.attr.startswith("_"):
            self.refuse(node, f"the attribute .{node.attr} (private and special attributes are not part of an "
                              "answer)")
            return
        if chain:
            root = self.kind_of(chain[0])
            if root == "cuda":
                self._cuda_chain(node, chain, kernel)
                return
            if root == "math":
                if len(chain) != 2 or chain[1] not in MATH_NAMES:
                    self.refuse(node, "math.<function> only")
                return
            if root == "np":
                if len(chain) != 2 or chain[1] not in NP_NAMES:
                    self.refuse(node, f"NumPy in an answer: its scalar types and constants only "
                                      f"({', '.join(sorted(NP_NAMES))}); arrays are the kernel's arguments")
                return
        if node.attr not in VALUE_ATTRS:
            self.refuse(node, f".{node.attr} is not part of the answer grammar (attributes: cuda.*, math.*, "
                              f"NumPy's dtypes, {', '.join(sorted(VALUE_ATTRS))})")
            return
        self.expr(node.value)

    def _cuda_chain(self, node, chain, kernel) -> None:
        if len(chain) < 2 or chain[1] not in CUDA_DEVICE:
            self.refuse(node, f"cuda.{'.'.join(chain[1:])} is not one of the CUDA intrinsics an answer uses")
            return
        sub = CUDA_DEVICE[chain[1]]
        if len(chain) > 3 or (len(chain) == 3 and (sub is None or chain[2] not in sub)):
            self.refuse(node, f"cuda.{'.'.join(chain[1:])} is not one of the CUDA intrinsics an answer uses")
            return
        if chain[1] != "jit" and not kernel:
            self.refuse(node, f"cuda.{chain[1]} is device code: it belongs in a @cuda.jit function")

    def subscript(self, node: ast.Subscript) -> None:
        kernel = self.scope is not None and self.scope.kernel
        self.expr(node.slice)
        value = node.value
        if kernel:
            self.expr(value)
            return
        # host code: a shape (X.shape[1]), or a tuple / dict it built itself -- never an array
        if isinstance(value, ast.Attribute) and value.attr == "shape":
            self.expr(value)
            return
        if isinstance(value, ast.Name) and self._built_here(value.id):
            self.expr(value)
            return
        self.refuse(node, "host code indexes only shapes (X.shape[1]) and the tuples and dicts it builds: reading an "
                          "array's elements is the kernel's work")

    def _built_here(self, name: str) -> bool:
        found = self.lookup(name)
        if found is None:
            return False
        where, info = found
        if where == "module":
            return info == "const"
        if where != "local":
            return False
        values = info.values.get(name, [])
        if name in info.params or not values:
            return False
        for v in values:
            if isinstance(v, (ast.Tuple, ast.Dict, ast.List)):
                continue
            if isinstance(v, ast.Attribute) and v.attr == "shape":
                continue
            if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and self.kind_of(v.func.id) == "host":
                continue
            return False
        return True

    def call(self, node: ast.Call, const: bool) -> None:
        kernel = self.scope is not None and self.scope.kernel
        f = node.func
        for a in node.args:
            self.expr(a.value if isinstance(a, ast.Starred) else a, const)
        for k in node.keywords:
            if k.arg is None:
                self.refuse(node, "** in a call")
            self.expr(k.value, const)
        if isinstance(f, ast.Attribute):
            self.attribute(f)
            chain = _chain(f)
            if not chain or self.kind_of(chain[0]) not in ("cuda", "math", "np"):
                self.refuse(node, "call functions by name (the answer's, flashnb's device functions), cuda.*, math.*"
                                  " or a scalar type")
            elif self.kind_of(chain[0]) == "np" and kernel is False and const:
                pass
            return
        if not isinstance(f, ast.Name):
            self.refuse(node, "call functions by name (the result of an expression is not called)")
            return
        self.name(f)
        kind = self.kind_of(f.id)
        found = self.lookup(f.id)
        if kind == "builtin" or (kind is None and found is None):
            return
        if kind == "type":
            return
        if kind in ("device", "jit") and not kernel and not self.top:
            # on the simulator a device function called from the host runs as Python on whole arrays, unseen by
            # the traffic counter (a launcher could compute the answer with flashnb's own tile functions)
            self.refuse(node, f"{f.id} is device code: call it from a kernel, never from the host")
            return
        if kind == "device":
            return
        if kind == "host":
            if kernel:
                self.refuse(node, f"{f.id} is host code: a kernel cannot call it")
            return
        if found is not None and found[0] == "local":
            scope = found[1]
            defs = [v for v in scope.values.get(f.id, []) if isinstance(v, ast.FunctionDef)]
            jitted = any(_is_cuda_jit(d) for fn in defs for d in fn.decorator_list)
            if defs and jitted and not kernel and not self.top:
                self.refuse(node, f"{f.id} is device code: call it from a kernel, never from the host")
                return
            if defs and not (kernel and not jitted):
                return
            if defs:
                self.refuse(node, f"a kernel calls {f.id}, a Python function that is not @cuda.jit(device=True)")
                return
            self.refuse(node, f"{f.id} is not a function this answer defines")
            return
        if kind in ("function", "jit"):
            if kernel and kind == "function":
                self.refuse(node, f"a kernel calls {f.id}, a Python function that is not @cuda.jit(device=True)")
            return
        if kind is not None:
            self.refuse(node, f"{f.id} is not callable in an answer")


def _module_bindings(trees) -> dict:
    """Top-level names of all the answer cells (one namespace): function -> "function"/"jit", constant ->
    "const", import -> the imported value's kind."""
    import importlib

    out: dict[str, str] = {}
    for tree in trees:
        for n in tree.body:
            if isinstance(n, ast.FunctionDef):
                out[n.name] = "jit" if any(_is_cuda_jit(d) for d in n.decorator_list) else "function"
            elif isinstance(n, (ast.Assign, ast.AnnAssign)):
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                    for name in _targets(t):
                        out.setdefault(name, "const")
            elif isinstance(n, ast.Import):
                for a in n.names:
                    name = a.asname or a.name.split(".")[0]
                    out[name] = {"math": "math", "numpy": "np"}.get(a.name)
            elif isinstance(n, ast.ImportFrom) and not n.level:
                for a in n.names:
                    name = a.asname or a.name
                    mod = n.module or ""
                    if mod in ("numba", "numba.cuda"):
                        out[name] = "cuda" if a.name == "cuda" else "type"
                    elif mod == "numpy":
                        out[name] = "type" if a.name not in ("inf", "nan", "pi", "e") else "const"
                    elif mod == "math":
                        out[name] = "const" if a.name in ("inf", "nan", "pi", "e", "tau") else "builtin-math"
                    elif mod.startswith("flashnb."):
                        try:
                            v = getattr(importlib.import_module(mod), a.name)
                        except (ImportError, AttributeError):
                            out[name] = None
                            continue
                        out[name] = "host" if _host_helper(a.name, v) else classify(v)
    return {k: ("device" if v == "builtin-math" else v) for k, v in out.items()}


def setup_names(setup: str) -> frozenset:
    """The names the bundle's setup binds at its top level (the grader's modules among them)."""
    try:
        tree = ast.parse(setup)
    except SyntaxError:
        return frozenset()
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            out.update((a.asname or a.name).split(".")[0] for a in n.names)
        elif isinstance(n, (ast.FunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                out.update(_targets(t))
    return frozenset(out)


def check(cells: list[str], setup: str = "") -> tuple[list[Finding], list[str], list[tuple[int, int]]]:
    """Check the answer cells (in notebook order, ``%``/``!`` lines already dropped).  Returns (findings, the cells
    with every top-level statement that is not a definition blanked -- what the grader runs --, and the (cell,
    line) of each statement blanked).  A cell that does not parse is returned as it is (the grader reports the
    SyntaxError)."""
    trees = parse_cells(cells)
    module = _module_bindings([t for t in trees if t is not None])
    findings: list[Finding] = []
    out, dropped = [], []
    for i, (src, tree) in enumerate(zip(cells, trees), 1):
        if tree is None:
            out.append(src)
            continue
        lines = src.splitlines()
        checker = _Checker(i, lines, {k: v for k, v in module.items() if v is not None}, findings,
                           setup_names(setup) - set(module))
        for n in ast.walk(tree):          # no name of Python's builtins is bound again (exec = ..., as exec)
            bound = []
            if isinstance(n, (ast.FunctionDef, ast.ClassDef)):
                bound = [n.name]
            elif isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
                bound = [n.id]
            elif isinstance(n, ast.arg):
                bound = [n.arg]
            elif isinstance(n, ast.ExceptHandler) and n.name:
                bound = [n.name]
            elif isinstance(n, (ast.Import, ast.ImportFrom)):
                bound = [(a.asname or a.name).split(".")[0] for a in n.names]
            for name in bound:
                if hasattr(builtins, name) and name not in ("print",):
                    checker.refuse(n, f"binds {name}, a name of Python's builtins (choose another name)")
        blank: set[int] = set()
        for node in tree.body:
            if not checker.module_stmt(node):
                blank.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
                dropped.append((i, node.lineno))
        for node in tree.body:      # a definition sharing a line with a statement that is blanked
            if node.lineno in blank and (i, node.lineno) not in dropped:
                checker.refuse(node, "one statement per line (a definition shares this line with code the grader "
                                     "does not run)")
        out.append("\n".join("" if k in blank else ln for k, ln in enumerate(lines, 1)) + "\n")
    return findings, out, dropped
