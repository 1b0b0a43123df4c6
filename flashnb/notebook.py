"""Small helpers the notebooks share: where figures go, and showing kernel source from the package."""

from __future__ import annotations

import inspect
import os
import textwrap
from pathlib import Path

__all__ = ["figures_dir", "savefig", "show_source"]


def figures_dir() -> Path:
    """Where :func:`savefig` writes: ``$FLASHNB_FIGURES_DIR`` when set (the test suite sets a temporary folder, so a
    test run leaves the committed figures as they are), else the repository's ``figures/`` folder (notebooks run
    from ``notebooks/``), else ``./figures``."""
    env = os.environ.get("FLASHNB_FIGURES_DIR")
    if env:
        out = Path(env)
        out.mkdir(parents=True, exist_ok=True)
        return out
    here = Path.cwd()
    for base in (here, here.parent):
        if (base / "figures").is_dir() and (base / "flashnb").is_dir():
            return base / "figures"
    out = here / "figures"
    out.mkdir(exist_ok=True)
    return out


def savefig(fig, name: str) -> Path:
    """Save ``fig`` as ``figures/<name>.png`` (150 dpi) and return the path."""
    path = figures_dir() / f"{name}.png"
    fig.savefig(path, dpi=150, bbox_inches="tight")
    return path


def show_source(obj, grep: str | None = None, *, region: str | None = None, numbers: bool = True) -> None:
    """Print the source of a function, kernel factory or kernel, straight from the package, each line with its
    line number in the file (after a header naming the file), so that prose and tracebacks can point at lines;
    ``numbers=False`` prints the plain text (to copy into a cell of your own).

    With ``grep``, print only the lines containing that text (for pointing at a few lines of a long kernel).
    With ``region``, print the lines of that named region (:mod:`flashnb.regions`: what
    ``registry.variant(..., region=...)`` edits), its markers included."""
    target = getattr(obj, "py_func", None) or getattr(obj, "__wrapped__", None) or obj
    if grep is None and region is None:
        lines, first = inspect.getsourcelines(target)
        text = textwrap.dedent("".join(lines)).rstrip("\n").splitlines()
        if not numbers:
            print("\n".join(text) + "\n")
            return
        print(f"{_where(target)}, lines {first}-{first + len(text) - 1}:")
        width = len(str(first + len(text) - 1))
        for i, line in enumerate(text):
            print(f"{first + i:>{width}}  {line}".rstrip())
        return
    if grep is not None and region is not None:
        raise TypeError("pass grep= or region=, not both")
    lines, first = inspect.getsourcelines(target)
    if region is not None:
        from . import regions

        r = regions.find("".join(lines), region, getattr(target, "__name__", None))
        span = range(r.first - 1, r.last + 1) if r.kind == "markers" else range(r.first, r.last)
        hits = [(first + i, lines[i].rstrip()) for i in span]
    else:
        hits = [(first + i, line.rstrip()) for i, line in enumerate(lines) if grep in line]
    if not hits:
        raise ValueError(f"grep: {grep!r} does not occur in the source of {getattr(target, '__name__', target)}")
    name = Path(inspect.getsourcefile(target)).name
    common = min(len(text) - len(text.lstrip()) for _, text in hits if text.strip())
    if not numbers:
        print("\n".join(text[common:] for _, text in hits))
        return
    width = max(len(str(n)) for n, _ in hits)
    for n, text in hits:
        print(f"{name}:{n:<{width}}  {text[common:]}")


def _where(target) -> str:
    """The file of ``target``: relative to the repository for flashnb's own modules (``flashnb/stages/fa2.py``),
    its name otherwise (a notebook cell, a user's module)."""
    path = Path(inspect.getsourcefile(target) or "?").resolve()
    package = Path(__file__).resolve().parent
    try:
        return str(Path("flashnb") / path.relative_to(package))
    except ValueError:
        return path.name
