"""Count the memory traffic of every kernel launch, on the simulator: the counter users call.

::

    with flashnb.instruments.traffic.count() as t:
        flashnb.attention_forward(q, k, v, impl="naive")
    print(t)                                  # a table: launch, array, reads, writes, atomics, bytes
    t.summary() == flashnb.stages.naive.model_forward(BH, Nq, Nk, d)   # the model format of CONTRIBUTING.md

The counting itself -- what is counted and how, the records, the model format, :meth:`Traffic.check_model` -- is
:mod:`flashnb.sim.traffic`'s (it lives with the simulator it patches, which counts through it).  This module gives
the same names, and a counter whose :meth:`Traffic.modelled_time` is the roofline's time of its bytes
(:mod:`flashnb.instruments.roofline`).  Counting needs the simulator: in GPU mode :func:`count` raises
:class:`TrafficError`.
"""

from __future__ import annotations

from ..sim import traffic as _counter
from ..sim.traffic import (  # noqa: F401  (the counter's names, here under their usual module)
    MODEL_KEYS,
    RECORD_FIELDS,
    LaunchTraffic,
    ModelMismatch,
    TrafficError,
    memory_of,
)

__all__ = ["count", "Traffic", "LaunchTraffic", "TrafficError", "ModelMismatch", "RECORD_FIELDS"]


class Traffic(_counter.Traffic):
    """Counts of every launch made while the ``with`` block ran (:class:`flashnb.sim.traffic.Traffic`), with the
    roofline's modelled time of them."""

    def modelled_time(self, flops: float, gpu="H100 SXM"):
        """Roofline time of these counted bytes (:attr:`global_bytes`) and ``flops`` on a GPU preset -- a
        :class:`flashnb.instruments.roofline.ModelledTime`, modelled, not measured."""
        from .roofline import modelled_time

        return modelled_time(flops, self.global_bytes, gpu)


def count() -> Traffic:
    """A new traffic counter: ``with flashnb.instruments.traffic.count() as t: ...``; raises :class:`TrafficError` in
    GPU mode."""
    _counter._check_simulator()
    return Traffic()
