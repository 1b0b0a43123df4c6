"""Stage 7 -- the old name of :mod:`flashnb.kernels.tensorcore.check` (one module object under both names)."""

import sys

from .tensorcore import check

sys.modules[__name__] = check
