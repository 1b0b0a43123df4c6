"""Stage 7 -- the old name of :mod:`flashnb.kernels.tensorcore.mma` (one module object under both names)."""

import sys

from .tensorcore import mma

sys.modules[__name__] = mma
