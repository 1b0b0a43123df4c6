"""Every notebook is a jupytext pair: the .py (reviewed in diffs) and the .ipynb (executed by CI) must agree."""

import json
import re
from pathlib import Path

import pytest

jupytext = pytest.importorskip("jupytext")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
PAIRS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py"))


def _cells(nb):
    return [(c.cell_type, c.source.strip()) for c in nb.cells if c.source.strip()]


def test_there_are_notebooks():
    assert len(PAIRS) >= 2


@pytest.mark.parametrize("py", PAIRS, ids=lambda p: p.stem)
def test_ipynb_matches_py(py):
    ipynb = py.with_suffix(".ipynb")
    assert ipynb.exists(), f"{ipynb.name} missing: run `python scripts/execute_notebooks.py {py.name[:2]}`"
    from_py = _cells(jupytext.read(py))
    from_nb = _cells(jupytext.read(ipynb))
    assert from_py == from_nb, (f"{ipynb.name} is out of sync with {py.name}: run "
                                f"`python scripts/execute_notebooks.py {py.name[:2]}`")


@pytest.mark.parametrize("py", PAIRS, ids=lambda p: p.stem)
def test_notebook_ends_with_exercises(py):
    text = py.read_text()
    assert "## Exercises" in text, f"{py.name} has no Exercises section"


@pytest.mark.parametrize("py", PAIRS, ids=lambda p: p.stem)
def test_notebook_counts_on_the_simulator_and_measures_in_a_gpu_process(py):
    # On a machine with a GPU, importing flashnb would pick GPU mode and traffic.count() would refuse; so every
    # notebook asks for the simulator before its first flashnb import, and times kernels only via bench.on_gpu.
    lines = py.read_text().splitlines()
    first_import = next(i for i, ln in enumerate(lines) if ln.startswith(("import flashnb", "from flashnb")))
    assert any(ln.startswith('os.environ["FLASHNB_DEVICE"] = "sim"') for ln in lines[:first_import]), py.name
    code = "\n".join(ln for ln in lines if not ln.lstrip().startswith("#"))
    assert "if not flashnb.is_simulator()" not in code, f"{py.name}: measure with bench.on_gpu, not a GPU branch"
    assert code.count("bench.time_call(") <= code.count("except bench.SimulatorTimingError"), py.name


FIGURE = re.compile(r"\bsavefig\(|\bplt\.(subplots|figure|show)\(")
MACHINE_PATH = re.compile(r"(?<![\w.])/(home|tmp|work|root|Users|opt|usr|var|mnt)/")


@pytest.mark.parametrize("py", PAIRS, ids=lambda p: p.stem)
def test_committed_notebook_is_executed_shows_its_figures_and_no_machine_path(py):
    # Committed notebooks are read as static pages (GitHub, nbviewer, Colab): every code cell has run, a cell
    # that draws a figure shows it inline, and no output holds a path of the machine that ran it.
    nb = json.loads(py.with_suffix(".ipynb").read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code" and "".join(c["source"]).strip()]
    assert all(c.get("execution_count") for c in code), f"{py.stem}.ipynb has cells that never ran: execute it"
    for c in code:
        src = "".join(c["source"])
        if FIGURE.search(src):
            images = [o for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
            assert images, f"{py.stem}.ipynb: a cell draws a figure but shows none inline:\n{src[:300]}"
        outputs = json.dumps(c.get("outputs", []))
        m = MACHINE_PATH.search(outputs)
        assert m is None, f"{py.stem}.ipynb: an output holds a machine path ({outputs[m.start():m.start() + 60]})"


def test_execute_script_names_each_notebook_before_running_any():
    import importlib.util

    spec = importlib.util.spec_from_file_location("execute_notebooks", NOTEBOOKS.parent / "scripts" /
                                                  "execute_notebooks.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.source_of("12") == NOTEBOOKS / "12_tensor_cores.py"
    with pytest.raises(SystemExit, match=r"notebook '99': expected one notebooks/99_\*.py, found 0"):
        script.main(["12", "99"])                       # refused before notebook 12 runs
