"""Kernels built on the tensor cores: the intrinsics (:mod:`flashnb.kernels.mma`, with simulator twins), their GPU
check (:mod:`flashnb.kernels.mma_check`) and stage 7's FlashAttention-2 (:mod:`flashnb.kernels.flash_tc`,
``impl="fa2-tc"``)."""

from . import flash_tc, mma, mma_check  # noqa: F401
