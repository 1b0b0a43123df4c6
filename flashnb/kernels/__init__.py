"""The product kernels: one fast FA2 forward and backward with every feature as a policy.

* :mod:`flashnb.kernels.blocks` -- the fast loop's building blocks (tile loads, the ``S = Q_i K_jᵀ`` micro-tile, the
  online-softmax update, ``P~ V_j``, the epilogues; the backward's phases), shared with stage 6's lessons.
* :mod:`flashnb.kernels.policies` -- the features as small device-function policies the loop calls.
* :mod:`flashnb.kernels.flash` -- the forward, preprocessing, backward and dQ-conversion kernels, their launchers,
  the SASS time model's inputs, and ``impl="flash"``; :mod:`~flashnb.kernels.tiles` (default tiles, block masks on
  the kernels' tiles) and :mod:`~flashnb.kernels.models` (traffic models) are its host side.
"""

from . import blocks, flash, models, policies, tiles  # noqa: F401  (flash registers impl="flash")
