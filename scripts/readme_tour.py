"""Write `flashnb tour`'s printout into README.md, between the ``<!-- tour -->`` markers.

    FLASHNB_DEVICE=sim python scripts/readme_tour.py      # about 12 s on 2 cores

The README shows what the tour prints on the simulator; ``tests/test_readme.py`` runs the tour and checks that
the README's copy is exactly that, so it is never stale.  Rerun this after changing an impl or the tour.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
MARKERS = re.compile(r"(<!-- tour -->\n```\n)(.*?)(```\n<!-- /tour -->)", re.S)


def tour_printout() -> str:
    """What ``flashnb tour --quiet`` prints on the simulator (stdout only)."""
    env = dict(os.environ, FLASHNB_DEVICE="sim", FLASHNB_SIM_QUIET="1")
    out = subprocess.run([sys.executable, "-m", "flashnb.cli", "tour", "--quiet"], capture_output=True, text=True,
                         env=env, check=True)
    return out.stdout


def readme_printout(text: str) -> str:
    m = MARKERS.search(text)
    if m is None:
        raise SystemExit("README.md has no <!-- tour --> ... <!-- /tour --> block")
    return m.group(2)


def main():
    text = README.read_text()
    readme_printout(text)
    printout = tour_printout()
    README.write_text(MARKERS.sub(lambda m: m.group(1) + printout + m.group(3), text))
    print(printout, end="")


if __name__ == "__main__":
    main()
