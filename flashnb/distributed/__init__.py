"""Context parallelism (ring attention) on ``torch.distributed``: one sequence, its tokens spread over W ranks.

Each rank holds a shard of Q, K and V (:func:`shard`: ``"contiguous"``, ``"zigzag"`` or ``"striped"``).  K/V
shards travel around a ring of ranks (or are all-gathered once) while every rank merges its partial
``(O, L)`` with the online-softmax merge of notebook 02; the backward sends dK/dV along with their K/V and
home.  The block computation is flashnb's kernels (the simulator for CPU tensors, the GPU for CUDA tensors).
gloo runs it on one CPU machine (``torchrun --standalone --nproc_per_node 4 -m flashnb.distributed.demo``),
NCCL on GPUs.  Notebook 13 (``notebooks/13_context_parallelism.ipynb``) counts its bytes, work and time.

Needs PyTorch (``pip install "flashnb[torch]"``); ``import flashnb`` does not import this package.

* :func:`ring_attention` -- differentiable attention on a rank's shards (:mod:`.function`).
* :func:`shard`, :func:`unshard`, :func:`positions` -- the layouts (:mod:`.layouts`).
* :class:`Kernels`, :class:`Exact` -- block computations (:mod:`.blocks`, with the block plan and the merge).
* :class:`RingStats` -- bytes, attended pairs, compute and wait time per rank and step (:mod:`.stats`).
* :mod:`.ring` -- the ring and all-gather schedules and their transfers; :mod:`.model` -- the formulas
  (bytes, work imbalance, memory, the overlap condition); :mod:`.errors` -- the checks every rank runs
  together and the errors; :mod:`.launch` -- W local ranks from Python; :mod:`.demo` -- the torchrun demo;
  :mod:`.measure` -- what ``scripts/ring_gpu_check.py`` measures on GPUs; :mod:`.lessons` -- notebook 13's
  workers and its wrong schedule.
"""

from .blocks import Exact, Kernels, merge, plan
from .errors import RanksFailed, RingCommError, RingTimeout
from .function import MODES, ring_attention
from .layouts import LAYOUTS, positions, shard, unshard
from .stats import RingStats

__all__ = ["ring_attention", "shard", "unshard", "positions", "LAYOUTS", "MODES", "Kernels", "Exact", "merge",
           "plan", "RingStats", "RingCommError", "RingTimeout", "RanksFailed"]
