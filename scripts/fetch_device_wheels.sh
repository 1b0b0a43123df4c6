#!/usr/bin/env bash
# Download the pinned numba-cuda wheel for the lent GPU machine (Python 3.12, x86-64, no network there) into
# .whl/ (git-ignored); carry it with the device tool: carry [".whl"]. scripts/gpu_session.sh uses it only when
# flashnb does not import with the machine's own numba-cuda.
set -eu
cd "$(dirname "$0")/.."
VERSION=$(sed -n 's/.*"numba-cuda\[cu12\]==\([0-9.]*\)".*/\1/p' pyproject.toml)
mkdir -p .whl
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  -d .whl "numba-cuda==${VERSION}"
ls -l .whl
