"""GPU measurements: each times kernels with CUDA events (:func:`flashnb.instruments.bench.time_call`) beside the
modelled bytes of the launches.  They build on the stages and the kernels they time, above both; run them on a GPU, or
from the simulator through :func:`flashnb.instruments.bench.on_gpu` (a child process on the GPU)."""
