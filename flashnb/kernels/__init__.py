"""flashnb's kernels beyond the stages' lessons.

* The product kernels: one fast FA2 forward and backward with every feature as a policy --
  :mod:`flashnb.kernels.blocks` (the fast loop's building blocks: tile loads, the ``S = Q_i K_jᵀ`` micro-tile, the
  online-softmax update, ``P~ V_j``, the epilogues; the backward's phases, shared with stage 6's lessons),
  :mod:`flashnb.kernels.policies` (the features as small device-function policies the loop calls),
  :mod:`flashnb.kernels.flash` (the forward, preprocessing, backward and dQ-conversion kernels, their launchers, the
  SASS time model's inputs, and ``impl="flash"``), with :mod:`~flashnb.kernels.tiles` (default tiles, block masks on
  the kernels' tiles) and :mod:`~flashnb.kernels.models` (traffic models) as its host side.
* Stage 7, the tensor cores: the intrinsics (:mod:`flashnb.kernels.mma`, with simulator twins), their GPU check
  (:mod:`flashnb.kernels.mma_check`) and FlashAttention-2 on them (:mod:`flashnb.kernels.flash_tc`,
  ``impl="fa2-tc"``).
* The default, ``impl="auto"`` (:mod:`flashnb.kernels.auto`): fa2-tc for half inputs on a checked sm_80+ GPU,
  else the product kernel.
"""

from . import auto, blocks, flash, flash_tc, mma, mma_check, models, policies, tiles  # noqa: F401  (registers the impls)
