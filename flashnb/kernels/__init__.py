"""flashnb's kernels beyond the stages' lessons.

* The product kernels: one fast FA2 forward and backward with every feature as a policy --
  :mod:`flashnb.kernels.blocks` (the fast loop's building blocks: tile loads, the ``S = Q_i K_jᵀ`` micro-tile, the
  online-softmax update, ``P~ V_j``, the epilogues; the backward's phases, shared with stage 6's lessons),
  :mod:`flashnb.kernels.policies` (the features as small device-function policies the loop calls),
  :mod:`flashnb.kernels.flash` (the forward, preprocessing, backward and dQ-conversion kernels, their launchers, the
  SASS time model's inputs, and ``impl="flash"``), with :mod:`~flashnb.kernels.tiles` (default tiles, block masks on
  the kernels' tiles) and :mod:`~flashnb.kernels.models` (traffic models) as its host side.
* Stage 7, the tensor cores (:mod:`flashnb.kernels.tensorcore`): the intrinsics (``tensorcore.mma``, with simulator
  twins), their GPU check (``tensorcore.check``) and FlashAttention-2 on them (``tensorcore.forward``,
  ``tensorcore.backward``), launched by :mod:`flashnb.kernels.launch.tensorcore` (``impl="fa2-tc"``).
* The default, ``impl="auto"`` (:mod:`flashnb.kernels.auto`): fa2-tc for half inputs on a checked sm_80+ GPU,
  else the product kernel.
"""

from . import auto, blocks, flash, models, policies, tiles  # noqa: F401  (registers the impls)
from .launch import tensorcore  # noqa: F401  (registers impl="fa2-tc")
from .tensorcore import check  # noqa: F401  (registers the intrinsics' check kernels)
