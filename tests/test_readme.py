"""The README's Python example runs as written (and its test command is what .ci/run executes)."""

import importlib.util
import re
from pathlib import Path

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def test_python_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    assert blocks, "README has no python example"
    for block in blocks:
        if "flashnb.torch" in block and importlib.util.find_spec("torch") is None:
            continue   # PyTorch is optional (the [torch] extra); its example runs wherever it is installed
        exec(compile(block, "README.md", "exec"), {})
    assert "launch" in capsys.readouterr().out   # the traffic table was printed


def test_ci_runs_the_readme_test_command():
    ci = (Path(__file__).resolve().parent.parent / ".ci" / "run").read_text()
    assert "<!-- test-command -->" in README and "<!-- test-command -->" in ci
    command = README.split("<!-- test-command -->", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0].strip()
    assert "pytest" in command and "--nbmake" in command and "ruff check" in command
