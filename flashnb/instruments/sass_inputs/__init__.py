"""The SASS time model's inputs for each kernel (configurations, shapes, launch orders, edge tiles), apart from the
kernels they describe."""
