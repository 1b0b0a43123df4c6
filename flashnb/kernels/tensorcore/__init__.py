"""Stage 7, FlashAttention-2 on the tensor cores, by part.

* :mod:`~flashnb.kernels.tensorcore.mma` -- the intrinsics (``mma.sync``, ``ldmatrix``, ``cp.async`` as inline PTX,
  with simulator twins) and :mod:`~flashnb.kernels.tensorcore.check`, their check on a GPU against the twins;
* :mod:`~flashnb.kernels.tensorcore.geometry` -- the sizes of a configuration, default tiles, the tiles a launch
  validates and fits to a block mask, the configurations the PTX guard compiles;
* :mod:`~flashnb.kernels.tensorcore.fragments` -- the swizzled shared-memory layout and the device functions that
  copy tiles and make fragments;
* :mod:`~flashnb.kernels.tensorcore.forward` (FA2 Alg. 1) and :mod:`~flashnb.kernels.tensorcore.backward` (FA2
  Alg. 2, in its phases).

The host side: :mod:`flashnb.kernels.models.tensorcore` (the traffic models) and the launchers,
:mod:`flashnb.kernels.launch.tensorcore` (``impl="fa2-tc"``).
"""
