#!/usr/bin/env python
"""Regenerate notebooks from their jupytext sources and execute them, as they are committed.

    python scripts/execute_notebooks.py 12            # notebooks/12_*.py -> notebooks/12_*.ipynb, executed
    python scripts/execute_notebooks.py 03 05 --timeout 900

For each number: ``notebooks/NN_*.py`` (the source) is read with jupytext, given the committed ``.ipynb``'s
metadata (kernel spec, jupytext header) when there is one, executed top to bottom with nbclient in
``notebooks/`` on the simulator (``FLASHNB_DEVICE=sim`` unless set), and written over ``NN_*.ipynb``.  This is
``jupytext --to ipynb --execute`` without nbconvert, which the test extras do not install.  Figures go to
``figures/`` (``flashnb.notebook.savefig``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"


def source_of(number: str) -> Path:
    matches = sorted(NOTEBOOKS.glob(f"{number}_*.py"))
    if len(matches) != 1:
        raise SystemExit(f"notebook {number!r}: expected one notebooks/{number}_*.py, found {len(matches)}")
    return matches[0]


def execute(src: Path, timeout: int) -> Path:
    import jupytext
    import nbclient
    import nbformat

    dst = src.with_suffix(".ipynb")
    nb = jupytext.read(src)
    if dst.exists():
        nb.metadata = nbformat.read(dst, as_version=4).metadata
    nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    nbformat.write(nb, dst)
    return dst


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("numbers", nargs="+", help="notebook numbers, e.g. 03 12")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per cell (default 600)")
    args = parser.parse_args(argv)
    os.environ.setdefault("FLASHNB_DEVICE", "sim")
    sources = [source_of(n) for n in args.numbers]        # every name checked before anything runs
    for src in sources:
        start = time.monotonic()
        print(f"{src.name}: executing ...", flush=True)
        dst = execute(src, args.timeout)
        print(f"{dst.name}: written ({time.monotonic() - start:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
