"""flashnb -- FlashAttention built kernel by kernel in Numba CUDA, one notebook per stage.

Importing flashnb chooses the device first (a real GPU when a CUDA driver and device are present, the
Numba CUDA simulator otherwise; ``FLASHNB_DEVICE=gpu|sim`` overrides), then registers every stage.
"""

from . import runtime  # must come first: decides NUMBA_ENABLE_CUDASIM before numba.cuda is imported
from . import sim  # noqa: F401  simulator only: sim.install() (fast barrier, warp intrinsics) when MODE == "sim"
from .runtime import MODE, is_simulator
from . import registry, common  # noqa: E402
from .api import attention, attention_forward, attention_backward  # noqa: E402
from . import naive  # noqa: E402,F401  (stage 1 registers impl="naive")
from . import softmax  # noqa: E402,F401  (stage 2 registers impl="onepass")
from . import fa1  # noqa: E402,F401  (stage 3 registers impl="fa1")
from . import rng  # noqa: E402,F401  (Philox4x32-10 for attention dropout, device and NumPy)
from . import fa2  # noqa: E402,F401  (stage 4 registers impl="fa2")
from . import fa2_steps  # noqa: E402,F401  (stage 4, step by step: impl="fa2-rows", "fa2-splitq")
from . import block_sparse  # noqa: E402,F401  (stage 5 registers impl="fa2-sparse"; fa2 takes block_mask=)
from . import flex  # noqa: E402,F401  (attention modifiers: score_mod / mask_mod on fa2, the gallery)
from . import fa2_fast  # noqa: E402,F401  (stage 6 registers impl="fa2-fast")
from . import fa2_fast_steps  # noqa: E402,F401  (stage 6, step by step: the line-8 kernels of notebook 08)
from . import decode  # noqa: E402,F401  (decoding with a KV cache: impl="flash-decoding")
from . import kernels  # noqa: E402,F401  (the product kernel, impl="flash"; stage 7, tensor cores, impl="fa2-tc")
from . import reference, traffic, roofline, bench, inspect, rehearsal  # noqa: E402,F401  (reference and measurement)

__version__ = "0.1.0"

__all__ = ["MODE", "is_simulator", "attention", "attention_forward", "attention_backward", "registry", "common",
           "runtime", "sim", "naive", "softmax", "fa1", "rng", "fa2", "fa2_steps", "block_sparse", "fa2_fast",
           "fa2_fast_steps", "kernels", "decode", "reference", "traffic", "roofline", "bench", "inspect", "rehearsal",
           "__version__"]
