"""A kernel written outside flashnb (a script, a notebook cell, a user module), described so that a compile
process can rebuild it without importing or re-running the user's code."""

from __future__ import annotations

import contextlib
import importlib.util
import sys

from ..registry import KERNELS

# --------------------------------------------------------------------------- user kernels (source shipping)
#
# In simulator mode the compile runs in a child process, which cannot import a kernel defined in ``__main__``
# (a script, a notebook cell) and must not re-run the user's script.  So the parent sends the kernel's source
# text (``inspect.getsource``, which reads notebook cells from ``linecache``) and, for every global or closure
# name the code loads, a description the child can rebuild: a module by name, a plain constant (int, float,
# numpy scalar/array/dtype, numba type) by pickle, a device function by its own source (recursively), an
# object of an importable non-user module by import path.  Numba treats globals and closure variables alike
# (compile-time constants), so rebuilding closure values as globals compiles the same kernel.

_REBUILD_ERROR = "could not rebuild the kernel from its source in the compile process"


def _python_function(kernel):
    """The Python function behind a ``@cuda.jit`` kernel (GPU dispatcher or simulator FakeCUDAKernel)."""
    for attr in ("py_func", "fn"):
        fn = getattr(kernel, attr, None)
        if fn is not None and hasattr(fn, "__code__"):
            return fn
    if hasattr(kernel, "__code__"):
        return kernel
    raise TypeError(f"kernel must be a @cuda.jit kernel or a Python function, got {type(kernel).__name__}")


def _is_flashnb_module(name: str | None) -> bool:
    return bool(name) and (name == "flashnb" or name.startswith("flashnb."))


def _loaded_names(code) -> set[str]:
    """Global names the code (and the code nested in it: comprehensions, lambdas) loads."""
    import dis

    names = {ins.argval for ins in dis.get_instructions(code) if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
    for const in code.co_consts:
        if hasattr(const, "co_code"):
            names |= _loaded_names(const)
    return names


def _picklable_constant(value) -> bool:
    import numpy as np
    from numba.core import types as nb_types

    if isinstance(value, (bool, int, float, complex, str, bytes, type(None), np.generic, np.ndarray, np.dtype,
                          nb_types.Type)):
        return True
    if isinstance(value, type) and value.__module__ in ("numpy", "builtins"):
        return True
    if isinstance(value, (tuple, list)):
        return all(_picklable_constant(v) for v in value)
    return False


def _describe_value(owner: str, name: str, value, seen: set) -> dict:
    import base64
    import pickle
    import types as py_types

    if isinstance(value, py_types.ModuleType):
        if value.__name__ == "__main__":
            raise TypeError(f"{owner}: global {name!r} is the __main__ module, which the compile process "
                            "cannot import")
        return {"kind": "module", "module": value.__name__}
    if _picklable_constant(value):
        return {"kind": "pickle", "data": base64.b64encode(pickle.dumps(value)).decode()}
    module = getattr(value, "__module__", None)
    qualname = getattr(value, "__qualname__", None)
    is_kernel = hasattr(value, "py_func") or (hasattr(value, "fn") and hasattr(value, "_device"))
    if is_kernel and (not _is_flashnb_module(module) or not qualname or "<" in qualname):
        # a user's device function, or one a factory made (flashnb's own or a registry.variant's): by source
        fn = _python_function(value)
        device = bool(getattr(value, "_device", False) or getattr(value, "targetoptions", {}).get("device"))
        return {"kind": "function", "function": _describe_function(fn, device=device, seen=seen)}
    if module and qualname and module != "__main__" and "<" not in qualname and \
            not module.startswith("numba.cuda.simulator") and module in sys.modules:
        obj = sys.modules[module]
        with contextlib.suppress(AttributeError):
            for part in qualname.split("."):
                obj = getattr(obj, part)
            if obj is value:
                return {"kind": "import", "module": module, "attr": qualname}
    raise TypeError(
        f"{owner}: global or closure variable {name!r} ({type(value).__name__}) cannot be sent to the process "
        "that compiles the kernel (it can send modules, device functions, numbers, numpy values and numba "
        "types); make it one of those, or define the kernel in an importable module and compile it there"
    )


def _describe_function(fn, *, device: bool = False, seen: set | None = None) -> dict:
    """What the compile process needs to rebuild ``fn``: its source and every name its code loads."""
    import inspect as std_inspect
    import textwrap

    seen = set() if seen is None else seen
    owner = f"{fn.__module__}.{fn.__qualname__}"
    if id(fn) in seen:
        raise TypeError(f"{owner}: recursive device functions cannot be sent to the compile process")
    seen.add(id(fn))
    try:
        lines, first = std_inspect.getsourcelines(fn)
    except (OSError, TypeError) as exc:
        raise TypeError(f"{owner}: its source is not available ({exc}); define the kernel in a file or a "
                        "notebook cell so flashnb.instruments can read it") from None
    env = {}
    code = fn.__code__
    for name in sorted(_loaded_names(code)):
        if name in fn.__globals__:
            env[name] = _describe_value(owner, name, fn.__globals__[name], seen)
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            value = cell.cell_contents
        except ValueError:
            raise TypeError(f"{owner}: closure variable {name!r} is not set yet") from None
        env[name] = _describe_value(owner, name, value, seen)
    seen.discard(id(fn))
    return {"source": textwrap.dedent("".join(lines)), "filename": code.co_filename, "firstlineno": first,
            "name": fn.__name__, "env": env, "device": device}


def _rebuild_value(desc: dict):
    import base64
    import pickle

    kind = desc["kind"]
    if kind == "module":
        return importlib.import_module(desc["module"])
    if kind == "pickle":
        return pickle.loads(base64.b64decode(desc["data"]))
    if kind == "import":
        obj = importlib.import_module(desc["module"])
        for part in desc["attr"].split("."):
            obj = getattr(obj, part)
        return obj
    if kind == "function":
        return _rebuild_function(desc["function"])
    raise ValueError(f"unknown kind {kind!r}")


def _rebuild_function(desc: dict):
    """Execute a function's source (decorators removed) in a fresh namespace holding the names it loads."""
    import ast
    import builtins

    from numba import cuda

    namespace = {"__builtins__": builtins, "__name__": "__flashnb_inspect_user__"}
    namespace.update({name: _rebuild_value(d) for name, d in desc["env"].items()})
    tree = ast.parse(desc["source"])
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    if len(tree.body) != 1 or not defs:
        raise ValueError(f"the source of {desc['name']} is not one function definition")
    defs[0].decorator_list = []
    ast.increment_lineno(tree, desc["firstlineno"] - 1)   # error messages point into the user's file / cell
    exec(compile(tree, desc["filename"], "exec"), namespace)
    fn = namespace[defs[0].name]
    return cuda.jit(device=True)(fn) if desc["device"] else fn


def _source_job(kernel, signature: str, cc, name: str, config: dict) -> dict:
    return dict(source=_describe_function(_python_function(kernel)), signature=signature, cc=list(cc), name=name,
                config=dict(config))


def _job_for(name: str, config: dict, cc) -> dict:
    """The child-process job for a registered kernel: by name for flashnb's own (the child imports flashnb),
    by source for one registered from user code (the child never imports the user's module)."""
    spec = KERNELS[name]
    if _is_flashnb_module(getattr(spec.factory, "__module__", None)):
        return dict(name=name, config=config, cc=list(cc))
    return _source_job(spec.factory(**config), spec.signature_for(config), cc, name, config)


