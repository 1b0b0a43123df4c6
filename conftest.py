"""Settings for every pytest run of this repository: the tests and the notebooks (``--nbmake``) alike."""

import os

# `pytest -n 2` runs two workers on two cores. PyTorch and OpenMP start one thread per core in each of them by
# default, which oversubscribes the machine: their spinning threads made the tiny tensors of the notebooks' and
# tests' training loops about three times slower. One thread per worker; the notebooks' kernels inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
