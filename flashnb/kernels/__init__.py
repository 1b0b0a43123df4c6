"""flashnb's kernels beyond the stages' lessons, laid out by feature and by backend.

* :mod:`flashnb.kernels.policies`: the features as small device-function policies every loop calls at the same
  place, one per file (storage, block mask, modifiers, dropout, GQA, K/V rows, the causal tile range).
* :mod:`flashnb.kernels.simt`: the product kernels on CUDA cores -- the fast loop's building blocks
  (:mod:`~flashnb.kernels.simt.blocks`, shared with stage 6's lessons), the forward and the backward.
* Stage 7, the tensor cores: the intrinsics (:mod:`flashnb.kernels.mma`, with simulator twins), their GPU check
  (:mod:`flashnb.kernels.mma_check`) and FlashAttention-2 on them (:mod:`flashnb.kernels.flash_tc`,
  ``impl="fa2-tc"``).
* :mod:`flashnb.kernels.launch`: the host launchers (``impl="flash"``: :mod:`~flashnb.kernels.launch.flash`) and
  the tile fitting both backends share (:mod:`~flashnb.kernels.launch.fit`); :mod:`flashnb.kernels.models`: the
  traffic models.
* The default, ``impl="auto"`` (:mod:`flashnb.kernels.auto`): fa2-tc for half inputs on a checked sm_80+ GPU,
  else the product kernel.

The modules' old names (``flashnb.kernels.flash``, ``.blocks``, ``.tiles``, ``.models``) still import and give the
names they had.
"""

from . import auto, blocks, flash, flash_tc, mma, mma_check, models, policies, tiles  # noqa: F401  (registers the impls)  # noqa: F401  (old names)
from .launch import flash as _flash_launch  # noqa: F401  (registers impl="flash")
