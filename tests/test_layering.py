"""The parts of flashnb and which may import which (CONTRIBUTING, "Layers"), held to every ``import`` statement.

Every module of the package belongs to one part (:data:`PARTS`: the longest prefix that names it); a part imports
only the parts :data:`ALLOWED` lists for it.  Every ``import`` counts -- at module level and inside functions (a
lazy import is still a dependency, and a cycle through one is still a cycle) -- and importing ``a.b.c`` imports the
packages ``a.b`` (its ``__init__``) on the way, so those edges count too (not the importer's own packages, which
Python initialises first in any case).  Old names reached through ``importlib.import_module(name)`` (the packages'
``MOVED`` maps) are not import statements and do not count: they serve users of the old names, never the library.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "flashnb"

#: part -> the module prefixes it holds (a prefix names a module and everything below it); the longest wins.
PARTS: dict[str, tuple[str, ...]] = {
    # the bottom: device choice, launch helpers, the registries, the RNG, block masks, the float64 reference
    "base": ("flashnb.runtime", "flashnb.common", "flashnb.registry", "flashnb.rng", "flashnb.masks",
             "flashnb.reference", "flashnb.argtypes", "flashnb.regions"),
    "sim": ("flashnb.sim",),
    "instruments": ("flashnb.instruments",),
    "stages": ("flashnb.stages",),
    # the device building blocks the stages' lessons share with the product kernels: the hardware's intrinsics and
    # register tiles (kernels.mma and kernels.blocks until they move into tensorcore/ and simt/)
    "kernels.blocks": ("flashnb.kernels.tensorcore.mma", "flashnb.kernels.simt.blocks", "flashnb.kernels.mma",
                       "flashnb.kernels.blocks", "flashnb.kernels.simt.defaults"),
    # one feature per file, called at the same place by every loop (flashnb.modifiers is moving in)
    "kernels.policies": ("flashnb.kernels.policies", "flashnb.modifiers"),
    "kernels.simt": ("flashnb.kernels.simt",),
    "kernels.tensorcore": ("flashnb.kernels.tensorcore",),
    "kernels.decode": ("flashnb.kernels.decode",),
    "kernels.launch": ("flashnb.kernels.launch", "flashnb.kernels.tiles"),
    "kernels.models": ("flashnb.kernels.models",),
    # the package, the default impl's choice (auto) and the modules not yet split by feature and backend
    "kernels": ("flashnb.kernels",),
    # GPU measurements and the SASS model's inputs: they build on stages and kernels; nothing below imports them
    # (the SASS time model among them: it models the kernels' launches from their inputs and tile ranges)
    "studies": ("flashnb.instruments.measure", "flashnb.instruments.sass_inputs", "flashnb.instruments.sass_model"),
    "surface": ("flashnb.api", "flashnb.flex", "flashnb.flex_grad", "flashnb.pytorch", "flashnb.distributed"),
    "top": ("flashnb", "flashnb.course", "flashnb.exercises", "flashnb.cli", "flashnb.notebook",
            "flashnb.tiny_transformer", "flashnb._gpu_child"),
}

_LOW = {"base", "sim", "instruments"}
_KERNEL_LOW = _LOW | {"stages", "kernels.blocks", "kernels.policies"}
_KERNELS = {part for part in PARTS if part.startswith("kernels")}

#: part -> the parts it may import (itself included).  Lower never imports higher, not even inside a function.
ALLOWED: dict[str, set[str]] = {
    "base": {"base"},
    "sim": {"base", "sim"},
    "instruments": {"base", "sim", "instruments"},
    # the lessons may use the product's building blocks and its policies (the causal tile range, written once)
    "stages": _LOW | {"stages", "kernels.blocks", "kernels.policies"},
    "kernels.blocks": _LOW | {"kernels.blocks"},
    "kernels.policies": _LOW | {"kernels.blocks", "kernels.policies"},
    "kernels.simt": _KERNEL_LOW | {"kernels.simt"},
    "kernels.tensorcore": _KERNEL_LOW | {"kernels.tensorcore"},
    "kernels.decode": _KERNEL_LOW | {"kernels.decode"},
    "kernels.launch": _KERNEL_LOW | {"kernels.simt", "kernels.tensorcore", "kernels.decode", "kernels.launch"},
    "kernels.models": _KERNEL_LOW | {"kernels.simt", "kernels.tensorcore", "kernels.decode", "kernels.launch",
                                     "kernels.models"},
    "kernels": _KERNEL_LOW | _KERNELS,
    "studies": _LOW | {"stages"} | _KERNELS | {"studies"},
    "surface": _LOW | {"stages"} | _KERNELS | {"studies", "surface"},
    "top": set(PARTS),
}

#: Edges ``(importer, imported)`` that break the layers (or close a cycle) today, in modules being moved into the
#: planned layout; each goes when its module moves.  A known break that is gone fails the test below, so the entry
#: is removed with it.
KNOWN_BREAKS: set[tuple[str, str]] = {
}


def part_of(module: str) -> str:
    """The part of ``module``: the part whose longest prefix names it."""
    best, length = None, -1
    for part, prefixes in PARTS.items():
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > length:
                best, length = part, len(prefix)
    if best is None:
        raise AssertionError(f"{module} is in no part: add it to PARTS in tests/test_layering.py")
    return best


def modules() -> dict[str, Path]:
    """Every module of the package: dotted name -> file (a package is its ``__init__.py``)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_edges() -> dict[str, dict[str, int]]:
    """module -> {flashnb module it imports: the line of the first such import}, from every ``import`` and ``from
    ... import`` anywhere in its source, with the packages each import initialises on the way."""
    mods = modules()
    edges = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        named = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    named.setdefault(alias.name, node.lineno)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    named.setdefault(sub if sub in mods else base, node.lineno)
        out = {}
        for target, line in sorted(named.items(), key=lambda item: item[1]):
            pieces = target.split(".")
            for i in range(2, len(pieces) + 1):          # a.b.c initialises a.b first (not the top package)
                module = ".".join(pieces[:i])
                if module in mods and module != name and not name.startswith(module + "."):
                    out.setdefault(module, line)
        edges[name] = out
    return edges


def strongly_connected(edges: dict[str, dict[str, int]]) -> dict[str, int]:
    """module -> the index of its strongly connected component (Tarjan): two modules share one iff each imports
    the other, directly or through others (an import cycle)."""
    index, low, on_stack, stack, comp = {}, {}, set(), [], {}
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp[w] = v
                if w == v:
                    break

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return {v: hash(c) for v, c in comp.items()}


def _path(edges, start: str, goal: str) -> list[str]:
    """One import path from ``start`` to ``goal`` (breadth first)."""
    prev, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges.get(v, ())):
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    out, v = [], goal
    while v is not None:
        out.append(v)
        v = prev.get(v)
    return out[::-1]


def test_every_module_is_in_a_part():
    for module in modules():
        part_of(module)
    assert set(ALLOWED) == set(PARTS)
    for part, allowed in ALLOWED.items():
        assert part in allowed and allowed <= set(PARTS), part


def test_no_part_imports_a_higher_one():
    edges, files = import_edges(), modules()
    # a package whose __init__ imports nothing of flashnb (a docstring, or a module __getattr__ for old names) is
    # initialised on the way to its modules without bringing anything above them: passing through it is no edge
    inert = {m for m, path in files.items() if path.name == "__init__.py" and not edges.get(m)}
    broken = []
    for importer, targets in sorted(edges.items()):
        for imported, line in targets.items():
            low, high = part_of(importer), part_of(imported)
            if imported in inert:
                continue
            if high not in ALLOWED[low] and (importer, imported) not in KNOWN_BREAKS:
                broken.append(f"{files[importer].relative_to(ROOT)}:{line}: {importer} ({low}) imports {imported} "
                              f"({high}); {low} may import {sorted(ALLOWED[low])}")
    assert not broken, "imports against the layers (CONTRIBUTING, Layers):\n" + "\n".join(broken)


def test_no_import_cycle():
    edges = import_edges()
    pruned = {m: {t: line for t, line in ts.items() if (m, t) not in KNOWN_BREAKS} for m, ts in edges.items()}
    comp = strongly_connected(pruned)
    for importer, targets in sorted(pruned.items()):
        for imported in sorted(targets):
            if comp[importer] == comp[imported]:
                cycle = [importer] + _path(pruned, imported, importer)
                raise AssertionError("import cycle (function-level imports count): " + " -> ".join(cycle))


def test_known_breaks_are_still_there():
    """An entry of KNOWN_BREAKS whose edge is gone, or now allowed and on no cycle, is removed from the set."""
    edges = import_edges()
    comp = strongly_connected(edges)
    stale = []
    for importer, imported in sorted(KNOWN_BREAKS):
        if imported not in edges.get(importer, {}):
            stale.append(f"{importer} -> {imported}: no longer imported")
        elif part_of(imported) in ALLOWED[part_of(importer)] and comp[importer] != comp[imported]:
            stale.append(f"{importer} -> {imported}: allowed by the layers and on no cycle now")
    assert not stale, "remove from KNOWN_BREAKS in tests/test_layering.py:\n" + "\n".join(stale)


def test_the_scan_sees_function_level_imports_and_packages(tmp_path):
    edges = import_edges()
    assert "flashnb.regions" in edges["flashnb.registry"]                   # inside registry.variant()
    assert "flashnb.stages" in edges["flashnb.instruments.measure.softmax"]   # initialised by stages.softmax
    assert "flashnb" not in edges["flashnb.stages.fa2"]                      # its own package: left out
    assert part_of("flashnb.kernels.decode") == "kernels.decode" and part_of("flashnb.kernels.flash") == "kernels"
    assert part_of("flashnb.instruments.measure.decode") == "studies"


def test_scan_sees_function_level_and_relative_imports():
    edges = import_edges()
    assert "flashnb.regions" in edges["flashnb.registry"]   # inside variant()
    assert "flashnb.stages.fa2" in edges["flashnb.stages.block_sparse"]   # from . import fa2, from .fa2 import ...
    assert "flashnb.runtime" in edges["flashnb.sim"]              # from .. import runtime
    assert "flashnb.sim.fastbarrier" in edges["flashnb.sim.warp"]  # from .fastbarrier import ...
    assert "flashnb" not in edges["flashnb.instruments.bench"]     # its own package: implied, left out
