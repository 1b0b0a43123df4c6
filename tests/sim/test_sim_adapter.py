"""flashnb reaches numba-cuda's private simulator only through ``flashnb.sim._numba_adapter``: an upgrade of
numba-cuda touches that one file.  This test lists what flashnb uses and checks nothing else imports it."""

import ast
import pathlib

import pytest

import flashnb
from flashnb.sim import _numba_adapter

ROOT = pathlib.Path(flashnb.__file__).parent
ADAPTER = pathlib.Path(_numba_adapter.__file__).resolve()


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        yield path, ast.parse(path.read_text(), str(path))


def test_no_module_but_the_adapter_imports_the_simulator():
    found = []
    for path, tree in _modules():
        if path.resolve() == ADAPTER:
            continue
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    node.value.startswith("numba.cuda.simulator.") and " " not in node.value:
                names = [node.value]          # importlib.import_module("numba.cuda.simulator.x")
            if any(n.startswith("numba.cuda.simulator") for n in names) or \
                    (isinstance(node, ast.ImportFrom) and node.module == "numba.cuda" and
                     any(a.name == "simulator" for a in node.names)):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, f"imports of numba.cuda.simulator outside {ADAPTER.name}: {found}"


def _sim_calls():
    """Every ``sim("module", "Name")`` / ``sim("module")`` call in flashnb: {(module, name or None)}."""
    calls = set()
    for _, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("sim", "_sim") \
                    and node.args and all(isinstance(a, ast.Constant) for a in node.args):
                calls.add(tuple(a.value for a in node.args) + ((None,) if len(node.args) == 1 else ()))
    return calls


def test_every_private_name_is_listed_and_exists():
    listed = {(m, n) for m, names in _numba_adapter.PRIVATE.items() for n in names}
    calls = _sim_calls()
    assert {c for c in calls if c[1] is not None} <= listed
    assert {m for m, _ in calls} == set(_numba_adapter.PRIVATE)
    for module, name in sorted(listed):
        assert hasattr(_numba_adapter.sim(module), name), f"numba.cuda.simulator.{module}.{name} is gone"


def test_the_adapter_refuses_what_it_does_not_list():
    with pytest.raises(ValueError, match="not listed"):
        _numba_adapter.sim("kernel", "something_else")
    with pytest.raises(ValueError, match="module must be one of"):
        _numba_adapter.sim("reduction")


def test_attributes_of_the_simulators_modules_are_listed():
    """``kernel = sim("kernel")`` then ``kernel.X``: every such X is in the list too."""
    used = set()
    for _, tree in _modules():
        bound = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                targets = node.targets[0].elts if isinstance(node.targets[0], ast.Tuple) else [node.targets[0]]
                values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
                for t, v in zip(targets, values):
                    if isinstance(t, ast.Name) and isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and \
                            v.func.id in ("sim", "_sim") and len(v.args) == 1:
                        bound[t.id] = v.args[0].value
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound \
                    and not node.attr.startswith("__"):
                used.add((bound[node.value.id], node.attr))
    listed = {(m, n) for m, names in _numba_adapter.PRIVATE.items() for n in names}
    assert used and used <= listed, sorted(used - listed)
