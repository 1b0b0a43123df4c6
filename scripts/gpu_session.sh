#!/usr/bin/env bash
# One call on a lent GPU machine: everything flashnb can only check on a GPU, results under $OUT.
#
#   device tool:  run  command="bash scripts/gpu_session.sh"  timeout_s=360   (carry [".whl"] if you made it)
#
# About 5 minutes (BUDGET=150 s for gpu_check + the tour + a notebook-style on_gpu call + setup), so a
# 15-minute device allowance leaves room to run it again. That machine has no network, so flashnb is not
# pip-installed there: it runs from this checkout (PYTHONPATH) on the machine's own numba/numba-cuda, whose
# versions go into every CSV. If flashnb does not import with them, the pinned numba-cuda wheel is used when
# carried in .whl/ (scripts/fetch_device_wheels.sh). Leaves at most 8 files in $OUT (what the device tool
# brings back): session.log + the seven of scripts/gpu_check.py (+ ring_gpu_check.json, written only on a
# machine with two or more GPUs).
set -u
OUT=${OUT:-results/gpu/local}
BUDGET=${BUDGET:-150}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

use_carried_wheel() {
  ls .whl/numba_cuda-*.whl >/dev/null 2>&1 || return 1
  echo "== using the carried pinned wheel: $(ls .whl/*.whl | tr '\n' ' ')"
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
  # .pth files (numba-cuda's numba.cuda redirect) are only read in site dirs: make /tmp/site one
  echo "import site; site.addsitedir('/tmp/site')" > /tmp/site/sitecustomize.py
  export PYTHONPATH="/tmp/site:$PYTHONPATH"
}

session() {
  echo "== flashnb GPU session $(date -u +%FT%TZ) at $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv || true
  $PY --version
  $PY -m pip list 2>/dev/null | grep -iE "^(numba|numba-cuda|cuda-bindings|cuda-core|cuda-toolkit|numpy|tqdm|matplotlib) " || true
  which ncu || echo "ncu: not on PATH"

  if ! $PY -m flashnb.cli info; then
    use_carried_wheel || { echo "flashnb does not import on this machine (no usable .whl/ carried); stopping"; return 1; }
    $PY -m flashnb.cli info || { echo "flashnb does not import with the carried wheel either; stopping"; return 1; }
  fi
  $PY -c "import numba.cuda, numba_cuda; print('numba.cuda from', numba.cuda.__file__, numba_cuda.__version__)" || true

  echo "== tour (tiny sizes, measured column)"
  timeout 90 $PY -m flashnb.cli tour --quiet; echo "tour exit $?"

  echo "== gpu_check (budget ${BUDGET} s)"
  timeout $((BUDGET + 90)) $PY scripts/gpu_check.py --out "$OUT" --budget "$BUDGET"; echo "gpu_check exit $?"

  echo "== ring attention over NCCL (needs 2 or more GPUs: with one it says so and measures nothing)"
  timeout 150 $PY scripts/ring_gpu_check.py --out "$OUT"; echo "ring_gpu_check exit $?"

  echo "== a notebook's GPU cell: a simulator process measuring through bench.on_gpu's GPU child process"
  timeout 90 $PY - <<'PYEOF'
import os
os.environ["FLASHNB_DEVICE"] = "sim"
import flashnb
from flashnb import bench
assert flashnb.is_simulator() and bench.gpu_available()
rows = bench.on_gpu("flashnb.instruments.bench:measure_impls", impls=["fa2"], BH=8, N=1024, d=64, directions=["fwd", "bwd"])
print(bench.table(rows, ["impl", "direction", "median_ms", "q1_ms", "q3_ms", "host_ms", "tflops", "pct_fp32_peak",
                         "gpu_name", "mode"]))
PYEOF
  echo "on_gpu exit $?"
  echo "== done $(date -u +%FT%TZ)"
}

session 2>&1 | tee "$OUT/session.log"
exit "${PIPESTATUS[0]}"
