"""GPU measurements (CUDA-event timings) of the kernels, one module per lesson."""
