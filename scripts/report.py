"""What the scripts that write ``benchmarks/*.md`` share: a Markdown table, the goals tables' columns, and
writing the report (and printing it)."""

from __future__ import annotations

from pathlib import Path

#: The columns of a goals table (scripts/stage6_goals.py, scripts/stage7_goals.py).
GOAL_COLUMNS = ("goal", "kernel", "target", "value", "met", "how")


def markdown_table(head, rows) -> str:
    """``rows`` (sequences of cells) under the header ``head``, as a Markdown table."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def write_report(out, text: str) -> int:
    """Write ``text`` to ``out`` (its folder made if needed), print it, and return 0 (the script's exit code)."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(text)
    print(text)
    return 0
