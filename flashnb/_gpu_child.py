"""``python -m flashnb._gpu_child TARGET KWARGS_JSON``: run one measurement in a process of its own.

Started by :func:`flashnb.instruments.bench.on_gpu` with ``FLASHNB_DEVICE=gpu`` when the calling process is on the
simulator (a notebook counting traffic) but the machine has a GPU.  Prints the rows as one JSON line after
:data:`flashnb.instruments.bench.CHILD_MARKER`.  With ``FLASHNB_REHEARSAL=1`` on the simulator it rehearses instead
(:mod:`flashnb.instruments.rehearsal`: pretend device, rows labelled ``rehearsal``).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import os
import sys

import flashnb
from flashnb import runtime
from flashnb.instruments import bench, rehearsal


def _plain(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m flashnb._gpu_child flashnb.<module>:<function> '<kwargs as JSON>'", file=sys.stderr)
        return 2
    target, kwargs = argv[0], json.loads(argv[1])
    module, _, func = target.partition(":")
    if not module.startswith("flashnb."):
        print(f"target must be in flashnb, got {target!r}", file=sys.stderr)
        return 2
    rehearse = runtime.MODE == "sim" and os.environ.get(rehearsal.ENV) == "1"
    if flashnb.is_simulator() and not rehearse:
        print("flashnb._gpu_child: no GPU in this process (simulator mode); nothing measured", file=sys.stderr)
        return 3
    with rehearsal.pretend_gpu() if rehearse else contextlib.nullcontext():
        rows = getattr(importlib.import_module(module), func)(**kwargs)
    rows = [{k: _plain(v) for k, v in r.items()} for r in rows]
    print(bench.CHILD_MARKER + json.dumps(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
