"""Small helpers the notebooks share: where figures go, and showing kernel source from the package."""

from __future__ import annotations

import inspect
import textwrap
from pathlib import Path

__all__ = ["figures_dir", "savefig", "show_source"]


def figures_dir() -> Path:
    """The repository's ``figures/`` folder (notebooks run from ``notebooks/``), else ``./figures``."""
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


def show_source(obj, grep: str | None = None, *, region: str | None = None) -> None:
    """Print the source of a function, kernel factory or kernel, straight from the package.

    With ``grep``, print only the lines containing that text, each with its line number in the file (for
    pointing at a few lines of a long kernel).  With ``region``, print the lines of that named region
    (:mod:`flashnb.regions`: what ``registry.variant(..., region=...)`` edits), its markers included, the same
    way."""
    target = getattr(obj, "py_func", None) or getattr(obj, "__wrapped__", None) or obj
    if grep is None and region is None:
        print(textwrap.dedent(inspect.getsource(target)))
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
    width = max(len(str(n)) for n, _ in hits)
    common = min(len(text) - len(text.lstrip()) for _, text in hits)
    for n, text in hits:
        print(f"{name}:{n:<{width}}  {text[common:]}")
