"""The static screen, a deny-list: the second check of the answer cells, behind the allow-list grammar of
:mod:`flashnb.course.grammar` (which the grader applies first, and which decides what may run).

A submission's answer cells run in the grader's child process next to the tests, the grading criteria, NumPy
and flashnb.  Python cannot keep two pieces of code in one interpreter apart, so the grader first reads the
answer cells (their syntax tree, nothing is executed) and refuses a submission that reaches for what an
answer to these assignments never needs:

* **imports** outside a short list (``math``, ``numpy``, numba's ``cuda`` and types, flashnb's kernel
  modules, a few pure standard modules); no ``from ... import *``;
* **names** that open the process up: ``exec``, ``eval``, ``compile``, ``open``, ``__import__``, ``globals``,
  ``vars``, ``setattr``, ``getattr`` on a computed name, ``breakpoint``, and the modules ``os``, ``sys``,
  ``subprocess``, ``ctypes``, ``gc``, ``inspect``, ``threading``, ... and the grader's own (``course``,
  ``criteria``, ``registry``, ``traffic``);
* **attributes** that lead out of the language: any ``_private`` or ``__dunder__`` one, frame and code
  objects (``f_back``, ``gi_frame``, ``tb_frame``, ...), files and pickles (``np.load``, ``tofile``, ...),
  the simulator's and numba's internals;
* **changes to objects the submission did not create**: assigning to (or deleting) an attribute or an item
  of a module, of something imported, or of an alias of either (``np.abs = ...``, ``x = flashnb.common;
  x.launch_hooks.append(...)``), and the mutating methods (``append``, ``update``, ...) on them;
* **kernels that are not CUDA**: inside a ``@cuda.jit`` function only ``cuda.*``, ``math.*``, NumPy dtypes and
  an array's ``shape`` / ``ndim`` / ``size`` / ``dtype`` -- the simulator would run ``X.max()`` or
  ``np.dot(Q, K)`` as NumPy, unseen by the traffic counter, where a GPU could not run it at all;
* classes with special methods beyond ``__init__`` / ``__repr__`` and the like, metaclasses, and
  ``type(name, bases, dict)``.

:func:`screen` returns one :class:`Finding` per refused construct (cell, line, what, why); the grader scores a
refused submission 0 with those lines as feedback.  ``tests/course/test_course_hostile.py`` runs the screen on every
solution, every catalogued bug and a set of student-written helpers (none is refused) and on every hostile
submission of its catalogue (each is).  The screen is one layer: what it lets through still runs with the
grader's process limits, its integrity check and its authenticated results channel (``assignments/README.md``,
"Threat model").
"""

from __future__ import annotations

import ast
import string
from dataclasses import dataclass

__all__ = ["Finding", "screen", "ALLOWED_IMPORTS"]

_STAGE_MODULES = ("naive", "softmax", "fa1", "fa2", "fa2_steps", "block_sparse", "fa2_fast", "fa2_fast_steps")
#: modules an answer cell may import (``import m`` / ``from m import name``), and flashnb's kernel modules
ALLOWED_IMPORTS = frozenset({
    "math", "cmath", "numpy", "numpy.linalg", "numpy.random", "numpy.fft", "functools", "itertools",
    "collections", "dataclasses", "typing", "statistics", "fractions", "heapq", "bisect", "random",
    "flashnb", "flashnb.common", "flashnb.flex", "flashnb.reference", "flashnb.rng", "flashnb.stages",
    *(f"flashnb.stages.{m}" for m in _STAGE_MODULES), "flashnb.kernels.decode", "flashnb.instruments.roofline",
    # the same modules by the names they had before the stages and instruments sub-packages
    *(f"flashnb.{m}" for m in _STAGE_MODULES), "flashnb.decode", "flashnb.roofline",
})
#: ``from numba import ...`` / ``from numba.cuda import ...``: these names only (never the numba module itself)
NUMBA_NAMES = frozenset({
    "cuda", "float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
    "uint64", "boolean", "void",
})
#: ``cuda.<name>``: the CUDA Python API (device side and the host calls a course needs)
CUDA_ATTRS = frozenset({
    "jit", "grid", "gridsize", "gridDim", "blockDim", "blockIdx", "threadIdx", "laneid", "warpsize", "shared",
    "local", "const", "atomic", "syncthreads", "syncthreads_and", "syncthreads_count", "syncthreads_or",
    "syncwarp", "shfl_sync", "shfl_up_sync", "shfl_down_sync", "shfl_xor_sync", "all_sync", "any_sync",
    "eq_sync", "ballot_sync", "activemask", "lanemask_lt", "match_any_sync", "match_all_sync", "threadfence",
    "threadfence_block", "threadfence_system", "fma", "cbrt", "brev", "clz", "ffs", "popc", "selp", "fp16",
    "nanosleep", "to_device", "device_array", "device_array_like", "pinned_array", "as_cuda_array",
    "synchronize",
})
#: ``np.testing.<name>``: the assertions (the module also holds ``runstring``, ``measure``, ``extbuild``)
NP_TESTING = frozenset({
    "assert_allclose", "assert_array_equal", "assert_array_almost_equal", "assert_array_less", "assert_equal",
    "assert_almost_equal", "assert_approx_equal", "assert_array_max_ulp", "assert_raises", "assert_warns",
})
NP_DTYPES = frozenset({
    "float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "bool_", "inf", "nan", "pi", "e",
})
#: bare names refused unless the answer binds them itself inside the function that uses them
DENIED_NAMES = frozenset({
    # builtins that run text as code, reach the interpreter's state, or read and write files
    "exec", "eval", "compile", "open", "globals", "locals", "vars", "setattr", "delattr", "breakpoint", "input",
    "help", "exit", "quit", "memoryview", "copyright", "credits", "license", "getattr", "hasattr",
    # modules: the process, the interpreter, files, processes, threads -- and the grader's own
    "os", "sys", "subprocess", "ctypes", "gc", "inspect", "importlib", "builtins", "threading", "multiprocessing",
    "concurrent", "asyncio", "signal", "socket", "shutil", "pathlib", "tempfile", "io", "pickle", "marshal",
    "weakref", "atexit", "resource", "faulthandler", "linecache", "traceback", "pdb", "code", "codeop",
    "runpy", "types", "mmap", "selectors", "sysconfig", "site", "contextlib",
    "course", "criteria", "registry", "traffic", "runtime", "racecheck", "sanitizer", "memprofile", "numba",
})
#: attributes refused on anything (module or object)
DENIED_ATTRS = DENIED_NAMES - {"input", "help", "compile", "open", "exit", "quit", "code", "types", "license",
                               "copyright", "credits", "memoryview"} | frozenset({
    # flashnb's machinery (the kernel modules stay reachable)
    "api", "bench", "cli", "inspect", "notebook", "exercises", "rehearsal", "sass", "sass_model", "sim",
    "torch", "pytorch", "tiny_transformer", "launch_hooks", "poison_hooks", "register_impl", "kernel_factory",
    "variant", "using", "KERNELS",
    # frames, code objects, tracebacks: the way from a value back to the grader's variables
    "gi_frame", "gi_code", "gi_yieldfrom", "cr_frame", "cr_code", "cr_await", "ag_frame", "ag_code", "ag_await",
    "tb_frame", "tb_next", "tb_lasti", "f_back", "f_globals", "f_locals", "f_builtins", "f_code", "f_trace",
    "f_lasti", "co_code", "co_consts", "co_names", "func_globals", "func_code", "with_traceback", "mro",
    # files, pickles and foreign memory through NumPy and numba
    "load", "loads", "save", "savez", "savez_compressed", "savetxt", "loadtxt", "genfromtxt", "fromfile",
    "tofile", "dump", "dumps", "memmap", "open_memmap", "DataSource", "fromregex", "ctypeslib", "lib", "core",
    "_core", "f2py", "distutils", "compat", "simulator", "cudadrv", "kernelapi", "njit", "cfunc", "carray",
    "farray", "intrinsic", "extending", "generated_jit", "objmode", "config", "declare_device",
    "get_type_hints", "singledispatch", "singledispatchmethod", "update_wrapper", "wraps", "format_map",
})
#: methods that change a container in place: refused on modules' objects and on what was imported
MUTATORS = frozenset({
    "append", "extend", "insert", "remove", "pop", "popitem", "clear", "update", "setdefault", "add", "discard",
    "sort", "reverse", "fill", "put", "itemset", "setfield", "resize", "setflags", "appendleft", "extendleft",
    "difference_update", "intersection_update", "symmetric_difference_update",
})
#: special methods a student's helper class may define (printing, containers, callables)
DUNDER_DEFS = frozenset({"__init__", "__repr__", "__str__", "__len__", "__iter__", "__next__", "__getitem__",
                         "__contains__", "__call__", "__post_init__"})
#: attributes a kernel may read on any value (arrays, dim3)
KERNEL_ATTRS = frozenset({"shape", "ndim", "size", "dtype", "x", "y", "z"})
#: special attributes an answer may read (names and docstrings: text, nothing to call or change)
READABLE_DUNDERS = frozenset({"__name__", "__qualname__", "__doc__", "__main__"})


@dataclass
class Finding:
    cell: int          # 1-based answer cell
    line: int          # line in that cell
    what: str          # the construct, as written
    why: str           # what the rule is

    def __str__(self) -> str:
        return f"answer cell {self.cell}, line {self.line}: {self.what} -- {self.why}"


def _root(node):
    """The node at the bottom of an attribute / subscript chain (``a`` of ``a.b[c].d``)."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node


def _chain(node) -> list[str]:
    """``a.b.c`` -> ["a", "b", "c"]; [] unless it is names and attributes only."""
    out = []
    while isinstance(node, ast.Attribute):
        out.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id] + out[::-1]
    return []


def _is_cuda_jit(dec) -> bool:
    target = dec.func if isinstance(dec, ast.Call) else dec
    return _chain(target) in (["cuda", "jit"], ["jit"])


def _targets(node) -> list:
    """Names bound by an assignment target (recursing into tuples, lists and starred)."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, (ast.Tuple, ast.List)):
        return [n for e in node.elts for n in _targets(e)]
    if isinstance(node, ast.Starred):
        return _targets(node.value)
    return []


class _Scope:
    def __init__(self, node, parent):
        self.node = node
        self.parent = parent
        self.bound: set[str] = set()          # names bound here
        self.foreign: set[str] = set()        # ... of which aliases of imported / outside objects
        self.declared_global: set[str] = set()
        self.kernel = False                   # a @cuda.jit function (or inside one)
        self.factory = False                  # a function that defines a @cuda.jit function
        self.jit_defs: set[str] = set()       # @cuda.jit functions defined here


class _Screen(ast.NodeVisitor):
    def __init__(self, cell: int, lines: list[str], module_bound: set[str], module_foreign: set[str],
                 module_jit: set[str], module_defs: set[str], findings: list[Finding]):
        self.cell = cell
        self.lines = lines
        self.findings = findings
        self.module_bound = module_bound
        self.module_foreign = module_foreign
        self.module_jit = module_jit
        self.module_defs = module_defs
        self.scope: _Scope | None = None

    # ----------------------------------------------------------------- reporting

    def refuse(self, node, why: str) -> None:
        line = getattr(node, "lineno", 0)
        text = self.lines[line - 1].strip() if 0 < line <= len(self.lines) else ""
        seg = ast.unparse(node) if not isinstance(node, (ast.stmt,)) or isinstance(node, ast.Expr) else text
        what = f"`{seg[:80]}`" if seg else f"`{text[:80]}`"
        f = Finding(self.cell, line, what, why)
        if not any((g.cell, g.line, g.why) == (f.cell, f.line, f.why) for g in self.findings):
            self.findings.append(f)

    # ----------------------------------------------------------------- name resolution

    def _function_scopes(self):
        s = self.scope
        while s is not None:
            yield s
            s = s.parent

    def local(self, name: str) -> _Scope | None:
        """The enclosing function scope that binds ``name`` (None: a global -- the cells', setup's, a builtin)."""
        for s in self._function_scopes():
            if name in s.declared_global:
                return None
            if name in s.bound:
                return s
        return None

    def foreign(self, name: str) -> bool:
        """Does ``name`` refer to something the answer did not create (setup's, imported, a builtin, an alias
        of one)?"""
        s = self.local(name)
        if s is not None:
            return name in s.foreign
        if name in self.module_bound:
            return name in self.module_foreign
        return True

    def foreign_expr(self, node) -> bool:
        """An expression that *is* an outside object (a foreign name, or attributes of one; no call)."""
        chain = _chain(node)
        return bool(chain) and self.foreign(chain[0])

    # ----------------------------------------------------------------- scopes

    def _bind_scope(self, scope: _Scope, body) -> None:
        """Collect what a body binds (not descending into nested functions or classes), then which of those
        names are aliases of outside objects (``x = np``, ``h = flashnb.common``), resolved in ``scope``."""
        assigns = []
        stack = list(body)
        while stack:
            n = stack.pop()
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                scope.bound.add(n.name)
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(_is_cuda_jit(d)
                                                                                   for d in n.decorator_list):
                    scope.jit_defs.add(n.name)
                    scope.factory = True
                stack.extend(n.decorator_list)
                continue
            if isinstance(n, ast.Lambda):
                continue
            if isinstance(n, ast.Global):
                scope.declared_global.update(n.names)
                continue
            if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                    scope.bound.update(_targets(t))
                    if n.value is not None and isinstance(t, ast.Name):
                        assigns.append((t.id, n.value))
            elif isinstance(n, (ast.For, ast.AsyncFor, ast.comprehension)):
                scope.bound.update(_targets(n.target))
            elif isinstance(n, (ast.With, ast.AsyncWith)):
                for item in n.items:
                    if item.optional_vars is not None:
                        scope.bound.update(_targets(item.optional_vars))
                        if isinstance(item.optional_vars, ast.Name):
                            assigns.append((item.optional_vars.id, item.context_expr))
            elif isinstance(n, ast.ExceptHandler) and n.name:
                scope.bound.add(n.name)
            elif isinstance(n, ast.NamedExpr):
                scope.bound.add(n.target.id)
                assigns.append((n.target.id, n.value))
            elif isinstance(n, (ast.Import, ast.ImportFrom)):
                for a in n.names:
                    name = (a.asname or a.name).split(".")[0]
                    scope.bound.add(name)
                    scope.foreign.add(name)
            stack.extend(ast.iter_child_nodes(n))
        saved, self.scope = self.scope, scope
        try:
            for _ in range(3):        # aliases of aliases
                for name, value in assigns:
                    if self.foreign_expr(value):
                        scope.foreign.add(name)
        finally:
            self.scope = saved

    def _visit_function(self, node, args: ast.arguments, body, *, jit: bool) -> None:
        scope = _Scope(node, self.scope)
        for a in args.posonlyargs + args.args + args.kwonlyargs + [x for x in (args.vararg, args.kwarg) if x]:
            scope.bound.add(a.arg)
        self._bind_scope(scope, body if isinstance(body, list) else [body])
        parent_kernel = self.scope is not None and self.scope.kernel
        parent_factory = self.scope is not None and self.scope.factory
        # kernel rules: a @cuda.jit function, anything inside one, and lambdas of a kernel factory
        scope.kernel = jit or parent_kernel or (isinstance(node, ast.Lambda) and parent_factory)
        self.scope = scope
        for d in args.defaults + [d for d in args.kw_defaults if d is not None]:
            self.visit(d)
        for stmt in (body if isinstance(body, list) else [body]):
            self.visit(stmt)
        self.scope = scope.parent

    def visit_FunctionDef(self, node):
        jit = any(_is_cuda_jit(d) for d in node.decorator_list)
        for d in node.decorator_list:
            self.visit(d)
        if node.name.startswith("__") and node.name.endswith("__") and node.name not in DUNDER_DEFS:
            self.refuse(node, f"defines the special method {node.name} (allowed: {', '.join(sorted(DUNDER_DEFS))})")
        if node.returns is not None:
            self.visit(node.returns)
        self._visit_function(node, node.args, node.body, jit=jit)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node):
        self._visit_function(node, node.args, node.body, jit=False)

    def visit_ClassDef(self, node):
        for d in node.decorator_list + node.bases:
            self.visit(d)
        if node.keywords:
            self.refuse(node, "class keywords (a metaclass) are not needed by an answer")
        for stmt in node.body:
            self.visit(stmt)

    # ----------------------------------------------------------------- imports

    def visit_Import(self, node):
        for a in node.names:
            if a.name not in ALLOWED_IMPORTS:
                self.refuse(node, f"imports {a.name}; answers may import only math, numpy, numba's cuda and "
                                  "types (from numba import cuda, float32), flashnb's kernel modules and "
                                  "functools/itertools/collections/dataclasses/typing/statistics/fractions/"
                                  "heapq/bisect/random")

    def visit_ImportFrom(self, node):
        mod = ("." * node.level) + (node.module or "")
        if any(a.name == "*" for a in node.names):
            self.refuse(node, "`from ... import *` (name what you use)")
            return
        if mod in ("numba", "numba.cuda"):
            bad = [a.name for a in node.names if a.name not in NUMBA_NAMES]
            if bad:
                self.refuse(node, f"imports {', '.join(bad)} from {mod}; only {', '.join(sorted(NUMBA_NAMES))}")
            return
        if mod not in ALLOWED_IMPORTS:
            self.refuse(node, f"imports from {mod}; answers may import only from math, numpy, numba (cuda and "
                              "types), flashnb's kernel modules and a few pure standard modules")
            return
        for a in node.names:
            self._check_attr_name(node, a.name, [mod.split(".")[-1], a.name])

    # ----------------------------------------------------------------- names and attributes

    def visit_Name(self, node):
        name = node.id
        if name.startswith("__") and name.endswith("__") and name not in READABLE_DUNDERS:
            self.refuse(node, f"the name {name} reaches the interpreter's internals")
        elif name in DENIED_NAMES and self.local(name) is None and (self.scope is not None
                                                                    or name not in self.module_bound):
            self.refuse(node, f"{name} is not available to answers (it reaches files, processes, the "
                              "interpreter or the grader)")
        if isinstance(node.ctx, ast.Load) and self.scope is not None and self.scope.kernel:
            if name in self.module_defs and name not in self.module_jit and self.local(name) is None:
                pass   # checked where it is called (visit_Call): a host function called from a kernel

    def _check_attr_name(self, node, attr: str, chain: list[str]) -> None:
        if attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__")):
            if not (chain and chain[0] in ("self", "cls") and len(chain) == 2):
                self.refuse(node, f"the private attribute .{attr}")
        elif attr.startswith("__") and attr not in READABLE_DUNDERS:
            self.refuse(node, f"the special attribute .{attr} reaches the interpreter's internals")
        elif attr in DENIED_ATTRS:
            self.refuse(node, f".{attr} is not available to answers (files, processes, the interpreter's frames, "
                              "or the grader's and simulator's machinery)")
        elif len(chain) >= 2 and chain[-2] == "testing" and attr not in NP_TESTING:
            self.refuse(node, f"np.testing.{attr} (only the assertions: {', '.join(sorted(NP_TESTING))})")
        elif len(chain) == 2 and chain[0] == "cuda" and attr not in CUDA_ATTRS:
            self.refuse(node, f"cuda.{attr} is not part of the CUDA Python an answer uses")

    def visit_Attribute(self, node):
        chain = _chain(node)
        self._check_attr_name(node, node.attr, chain)
        if self.scope is not None and self.scope.kernel and isinstance(node.ctx, ast.Load):
            ok = (node.attr in KERNEL_ATTRS
                  or (chain and chain[0] == "cuda")
                  or (chain and chain[0] == "math" and len(chain) == 2)
                  or (chain and chain[0] in ("np", "numpy") and len(chain) == 2 and node.attr in NP_DTYPES))
            if not ok:
                self.refuse(node, "a kernel is CUDA Python: it may use cuda.*, math.*, NumPy dtypes and an array's "
                                  "shape/ndim/size/dtype -- the simulator would run this as NumPy, unseen by the "
                                  "traffic counter, and a GPU could not run it")
        self.generic_visit(node)

    def visit_Constant(self, node):
        v = node.value
        if not isinstance(v, str):
            return
        if len(v) > 4 and v.startswith("__") and v.endswith("__") and v[2:-2].isidentifier() \
                and v not in READABLE_DUNDERS:
            self.refuse(node, f"the string {v!r} names an interpreter internal")
        elif "{" in v:              # str.format fields read attributes and items: "{0.__globals__[sys]}"
            try:
                fields = [f for _, f, _, _ in string.Formatter().parse(v) if f]
            except ValueError:
                fields = []
            if any("." in f or "[" in f for f in fields):
                self.refuse(node, "a format string whose fields read attributes or items ({0.x}, {0[k]}): "
                                  "format the values themselves")

    # ----------------------------------------------------------------- changes to outside objects

    def _check_store(self, target, stmt) -> None:
        if isinstance(target, (ast.Tuple, ast.List)):
            for e in target.elts:
                self._check_store(e, stmt)
            return
        if isinstance(target, ast.Starred):
            self._check_store(target.value, stmt)
            return
        if not isinstance(target, (ast.Attribute, ast.Subscript)):
            return
        root = _root(target)
        if not isinstance(root, ast.Name):
            self.refuse(stmt, "assigns into an object the answer did not name (the result of a call or "
                              "expression): assign to your own variables")
        elif self.foreign(root.id):
            self.refuse(stmt, f"changes {ast.unparse(target)}, which belongs to {root.id} (a module, something "
                              "imported, or the grader's): an answer changes only objects it creates")

    def visit_Assign(self, node):
        for t in node.targets:
            self._check_store(t, node)
        self.generic_visit(node)

    def visit_AugAssign(self, node):
        self._check_store(node.target, node)
        self.generic_visit(node)

    def visit_AnnAssign(self, node):
        self._check_store(node.target, node)
        self.generic_visit(node)

    def visit_Delete(self, node):
        for t in node.targets:
            self._check_store(t, node)
        self.generic_visit(node)

    def visit_Call(self, node):
        f = node.func
        if isinstance(f, ast.Name) and f.id in ("getattr", "hasattr") and self.local(f.id) is None:
            if len(node.args) < 2 or not isinstance(node.args[1], ast.Constant) or not isinstance(
                    node.args[1].value, str):
                self.refuse(node, f"{f.id} with a computed attribute name (write the attribute: x.name)")
            else:       # getattr(x, "name"): the same rules as x.name
                self._check_attr_name(node, node.args[1].value, ["?", node.args[1].value])
            for a in node.args[:1] + node.args[2:] + [k.value for k in node.keywords]:
                self.visit(a)
            return
        if isinstance(f, ast.Name) and f.id == "type" and self.local(f.id) is None and len(node.args) != 1:
            self.refuse(node, "type(name, bases, dict) makes a class from strings (write a class statement)")
        if isinstance(f, ast.Attribute) and f.attr in MUTATORS:
            recv = f.value
            chain = _chain(recv)
            exempt = chain and chain[0] in ("np", "numpy", "math", "cuda", "random")
            if not exempt and (self.foreign_expr(recv) if chain else False):
                self.refuse(node, f".{f.attr}() changes {ast.unparse(recv)}, which belongs to a module or was "
                                  "imported: an answer changes only objects it creates")
        if self.scope is not None and self.scope.kernel and isinstance(f, ast.Name):
            if (f.id in self.module_defs and f.id not in self.module_jit and self.local(f.id) is None) or \
                    self._local_host_function(f.id):
                self.refuse(node, f"a kernel calls {f.id}, a Python function of the answer that is not "
                                  "@cuda.jit(device=True): the simulator would run it as Python, a GPU could not")
        self.generic_visit(node)

    def _local_host_function(self, name: str) -> bool:
        s = self.local(name)
        if s is None or s.kernel:
            return False
        for n in ast.walk(s.node):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name and n is not s.node:
                return not any(_is_cuda_jit(d) for d in n.decorator_list)
        return False


def _module_bindings(trees) -> tuple[set, set, set, set]:
    """What the cells bind at their top level (shared by all cells: one namespace): names, which of them are
    aliases of outside objects, the @cuda.jit functions, and every function defined."""
    jit, defs = set(), set()
    for tree in trees:
        for n in tree.body:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                defs.add(n.name)
                if any(_is_cuda_jit(d) for d in n.decorator_list):
                    jit.add(n.name)
    scope = _Scope(None, None)
    _Screen(0, [], set(), set(), jit, defs, [])._bind_scope(scope, [n for t in trees for n in t.body])
    return scope.bound, scope.foreign, jit, defs


def parse_cells(cells: list[str]) -> list:
    """Each cell's AST, or None for a cell that does not parse (the grader reports its SyntaxError)."""
    trees = []
    for src in cells:
        try:
            trees.append(ast.parse(src))
        except SyntaxError:
            trees.append(None)
    return trees


def screen(cells: list[str]) -> list[Finding]:
    """Screen the sources of a submission's answer cells (in notebook order, with ``%``/``!`` lines already
    dropped); returns what it refuses, empty when the submission may run.  A cell that does not parse is left
    to the grader (it reports the SyntaxError)."""
    trees = parse_cells(cells)
    bound, foreign, jit, defs = _module_bindings([t for t in trees if t is not None])
    findings: list[Finding] = []
    for i, (src, tree) in enumerate(zip(cells, trees), 1):
        if tree is not None:
            _Screen(i, src.splitlines(), bound, foreign, jit, defs, findings).visit(tree)
    return findings
