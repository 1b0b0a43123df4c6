"""show_source: kernel source straight from the package, numbered as in its file."""

import inspect
import textwrap
from pathlib import Path

import flashnb
from flashnb.notebook import show_source
from flashnb.stages import naive


def test_full_source_is_numbered_as_in_the_file(capsys):
    show_source(naive.make_softmax_rows)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("flashnb/stages/naive.py, lines ")
    first, last = (int(x) for x in out[0].split("lines ")[1].rstrip(":").split("-"))
    file_lines = (Path(flashnb.__file__).parent / "stages" / "naive.py").read_text().splitlines()
    assert last - first + 1 == len(out) - 1 and "def make_softmax_rows" in "\n".join(out)
    indent = min(len(t) - len(t.lstrip()) for t in file_lines[first - 1:last] if t.strip())
    for row in out[1:]:
        n, _, text = row.lstrip().partition("  ")
        assert text.rstrip() == file_lines[int(n) - 1][indent:].rstrip(), row   # the file's own line n


def test_plain_source_for_copying(capsys):
    show_source(naive.make_softmax_rows, numbers=False)
    assert capsys.readouterr().out == textwrap.dedent(inspect.getsource(naive.make_softmax_rows.__wrapped__)).rstrip() \
        + "\n\n"
    show_source(naive.make_softmax_rows, region="max-and-sum", numbers=False)
    text = capsys.readouterr().out
    assert text.startswith("# region max-and-sum") and text.rstrip().endswith("# endregion max-and-sum")
