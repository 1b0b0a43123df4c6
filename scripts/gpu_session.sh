#!/usr/bin/env bash
# One call on a lent GPU machine: everything flashnb can only check on a GPU, results under $OUT.
#
#   device tool:  run  command="bash scripts/gpu_session.sh"  timeout_s=450   (carry [".whl"] if you made it)
#
# That machine has no network, so flashnb is not pip-installed there: it runs from this checkout
# (PYTHONPATH) on the machine's own numba/numba-cuda, whose versions go into every CSV. If flashnb does not
# import with them, the pinned numba-cuda wheel is used when carried in .whl/ (scripts/fetch_device_wheels.sh).
# Writes at most 8 files to $OUT (what the device tool brings back): session.log + gpu_check.py's seven.
set -u
OUT=${OUT:-results/gpu/local}
BUDGET=${BUDGET:-240}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
exec > >(tee "$OUT/session.log") 2>&1

echo "== flashnb GPU session $(date -u +%FT%TZ) at $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv || true
$PY --version
$PY -m pip list 2>/dev/null | grep -iE "^(numba|numba-cuda|cuda-bindings|cuda-core|cuda-toolkit|numpy|tqdm|matplotlib) " || true
which ncu || echo "ncu: not on PATH"

if ! $PY -m flashnb.cli info; then
  if ls .whl/numba_cuda-*.whl >/dev/null 2>&1; then
    echo "== flashnb did not import with the machine's numba-cuda: trying the carried pinned wheel"
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && export PYTHONPATH="/tmp/site:$PYTHONPATH"
    $PY -m flashnb.cli info || { echo "flashnb does not import on this machine; stopping"; exit 1; }
  else
    echo "flashnb does not import on this machine and no .whl/ was carried; stopping"; exit 1
  fi
fi

echo "== tour (tiny sizes, measured column)"
timeout 120 $PY -m flashnb.cli tour --quiet; echo "tour exit $?"

echo "== gpu_check (budget ${BUDGET} s)"
timeout $((BUDGET + 60)) $PY scripts/gpu_check.py --out "$OUT" --budget "$BUDGET"; echo "gpu_check exit $?"

echo "== notebook 01 as a script: counts on the simulator, measures through bench.on_gpu's GPU process"
timeout 120 $PY notebooks/01_naive_attention.py 2>&1 | tail -n 25; echo "notebook 01 exit ${PIPESTATUS[0]}"
echo "== done $(date -u +%FT%TZ)"
