"""The README's and the reference pages' Python examples run as written, every page is linked from the README
and every relative link resolves, and the README's test command is what .ci/run executes."""

import importlib.util
import linecache
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
PAGES = sorted((ROOT / "docs").glob("*.md"))


def test_python_examples_run(capsys):
    # each block runs as a notebook cell does: its source registered in linecache under a cell name, in __main__
    # (the experimenting page's resource report reads its kernel's source from there)
    blocks = [b for text in [README] + [p.read_text() for p in PAGES]
              for b in re.findall(r"```python\n(.*?)```", text, flags=re.S)]
    assert len(blocks) == 9, ("the python examples: the README's first call, modifiers, experimenting, changing a "
                              "library kernel, sanitizer and profiler, torch, transformers, flash-attn's functions, "
                              "the start page's product kernel")
    for n, block in enumerate(blocks):
        if "flashnb.pytorch" in block and importlib.util.find_spec("torch") is None:
            continue   # PyTorch is optional (the [torch] extra); its example runs wherever it is installed
        if "transformers" in block and importlib.util.find_spec("transformers") is None:
            continue   # likewise transformers (the [transformers] extra)
        name = f"<ipython-input-{n}-readme>"
        linecache.cache[name] = (len(block), None, block.splitlines(True), name)
        exec(compile(block, name, "exec"), {"__name__": "__main__"})
    out = capsys.readouterr().out
    assert "launch" in out   # the traffic table was printed
    # the experimenting section: the CSV, the modelled time in a unit that fits, the resource line
    assert "0,scale_rows,scale_rows,(8),(64),X,global,4,512,0,0,2048,0,0" in out
    assert re.search(r"modelled \d+\.\d{3} ns on H100 SXM", out)
    assert re.search(r"\d+ registers, 256 B shared, \d+% occupancy", out)
    # changing a library kernel: the region's lines, its markers included, with their line numbers in naive.py
    assert re.search(r"naive\.py:\d+ +# region max-and-sum\n", out) and "# endregion max-and-sum" in out
    # the sanitizer and profiler example
    assert "no errors in 1 launch(es) (memcheck, racecheck, initcheck, synccheck)" in out
    assert "QsT" in out and "wave" in out


def test_the_readme_is_a_front_page_linking_every_reference_page():
    assert len(README.splitlines()) <= 125
    for page in PAGES:
        assert f"](docs/{page.name})" in README, f"README does not link docs/{page.name}"
    for path in [ROOT / "README.md"] + PAGES:
        prose = re.sub(r"`[^`]*`", "", re.sub(r"```.*?```", "", path.read_text(), flags=re.S))   # no code
        for target in re.findall(r"\]\((?!https?:)([^)#]+)(?:#[^)]*)?\)", prose):
            assert (path.parent / target).exists(), f"{path.name}: link to {target} does not resolve"


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "<!-- test-command -->" in README and "<!-- test-command -->" in ci
    command = README.split("<!-- test-command -->", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0].strip()
    assert "pytest" in command and "--nbmake" in command and "ruff check" in command


def test_the_readme_shows_what_the_tour_prints():
    """The README's tour printout is exactly what ``flashnb tour`` prints now (``scripts/readme_tour.py``
    writes it): counted bytes, errors and modelled times are never copied by hand, never stale."""
    spec = importlib.util.spec_from_file_location("readme_tour", ROOT / "scripts" / "readme_tour.py")
    tour = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tour)
    assert tour.readme_printout(README) == tour.tour_printout(), \
        "README.md's tour printout is stale: run python scripts/readme_tour.py"


def test_the_impl_table_has_a_row_for_every_impl():
    """"Which impl runs what" names every impl ``impl=`` takes (the registered ones and the default), each once."""
    import flashnb  # noqa: F401  (registers the impls)
    from flashnb.registry import impl_names

    table = README.split("**Which impl runs what.**", 1)[1].split("\n\n", 2)[1]
    named = re.findall(r'^\| ([^|]+) \|', table, flags=re.M)[1:]          # after the header (the rule has no spaces)
    listed = [n for cell in named for n in re.findall(r'`"([^"]+)"`', cell)]
    assert sorted(listed) == sorted(set(listed)), f"an impl has two rows: {listed}"
    missing = set(impl_names()) - {"auto"} - set(listed)                 # the default: in the sentence above
    assert not missing, f"README's impl table has no row for {sorted(missing)}"
    assert '`"auto"`' in README.split("**Which impl runs what.**", 1)[1].split("\n", 1)[0]
