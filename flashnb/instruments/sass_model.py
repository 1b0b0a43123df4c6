"""A modelled time from the machine code: what a kernel's SASS costs on a GPU's pipes, without a GPU.

The roofline (:mod:`flashnb.instruments.roofline`) says how fast a kernel *could* run from its FLOPs and HBM bytes.  It
cannot tell a kernel whose inner loop is 85 % FFMA from one at 25 %: both do the same FLOPs.  This model
counts the instructions the kernel *issues* -- from its SASS (:mod:`flashnb.instruments.sass`) -- and charges each one
to the pipes of an SM (NVIDIA's published per-SM throughputs, CUDA C++ Programming Guide, "Arithmetic
Instructions", cc 8.0 / 9.0):

=============  =====================================  =========================================================
pipe           per SM per clock                       what is charged
=============  =====================================  =========================================================
``issue``      4 warp-instructions (4 schedulers)     every instruction
``fp32``       FP32 lanes / 32 warp-instructions      FFMA, FADD, FMUL, FMNMX, FSETP, ... (128 lanes on
                                                      cc 9.0: 4 per clock; 64 on cc 8.0: 2)
``mufu``       16 lanes: 0.5 warp-instructions        MUFU (``exp2``, ``rcp``, ``lg2``)
``mio``        128 bytes of shared memory (one        LDS/STS: 32 lanes x width / 128 B wavefronts (LDS.128:
               wavefront); one shuffle                4), assuming no bank conflicts; LDSM: one per 8×8 matrix
                                                      (``.4``: 4); LDGSTS.128: 4 (its shared-memory write); SHFL: 1
``tensor``     dense FP16 multiply-adds per SM per    HMMA: its multiply-adds (``16816``: 2,048, ``1688``: 1,024),
               clock: cc 7.5 512, cc 8.0 1,024, cc    TF32 counted twice (half the rate); see
               9.0 2,048 (the roofline module's       :attr:`~flashnb.instruments.roofline.GPU.tensor_clock_hz`
               whitepaper figures)                    for the clock that gives each datasheet's dense peak
=============  =====================================  =========================================================

and HBM is charged the bytes of the kernel's analytic traffic model at the datasheet bandwidth.

The *work* of a kernel is its FFMAs, or its HMMAs when it has tensor-core instructions
(:attr:`flashnb.instruments.sass.Sass.work`): the tile loop and the matmul loops below are found by that category, and
``phases`` count it.  A tensor-core tile loop usually holds no inner loop at all (every MMA of a tile unrolled); then
it is the loop with the most HMMAs.

**How many times each instruction runs** (the SASS is static; the count is not).  A FlashAttention kernel is
a prologue (load ``Q_i``), a loop over K/V tiles -- the *tile loop*, the loop with the most FFMAs that holds
other loops -- and an epilogue (store ``O_i``).  Inside the tile loop, the loops that did not unroll are
given trip counts by *conservation*: the kernel module says how many FFMAs per thread each matmul of a tile
needs (``phases``, in source order: ``S = Q_i K_jᵀ``, then ``P V_j``), and the FFMA loops, in address order,
get ``trips = phase / FFMAs per iteration`` (checked to divide exactly).  Loops that only load or store get
the trips that make the global words a thread loads (or stores) per tile -- or in the prologue / epilogue --
equal what the algorithm needs, after the unrolled code outside loops is counted; when that code already
covers the need, they are the partial-tile paths and get 0.  Everything outside loops counts once per tile
(or per block), **including the branches an interior tile never takes** (masking, partial tiles): the
instruction count is an upper bound for full, non-crossing tiles.

**Time.**  A block of ``warps`` warps needs, per pipe, ``warps · (prologue + tiles · tile + epilogue)``
pipe-cycles; ``occ`` resident blocks share an SM, so a block lasts ``occ · max over pipes`` cycles.  Blocks
are dispatched in launch order onto ``SMs · occ`` slots, each to the slot that frees first (list scheduling:
what makes heavy-first causal scheduling pay), and the kernel lasts until the last block ends, or as long as
its HBM traffic needs at the datasheet bandwidth, whichever is longer.

What it leaves out (so it is an *upper bound on speed* for the issue-bound kernels it is meant for): latency
the warps cannot hide (it assumes every scheduler finds a ready instruction every cycle -- plausible with
many independent FFMAs per loop body, optimistic at low occupancy), bank conflicts and instruction-cache
misses, L2, launch overhead.  A measured GPU time is the only proof: see ``scripts/gpu_check.py``.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Sequence

from .roofline import GPU, get_gpu

__all__ = ["KernelShape", "Counts", "SassCounts", "SassTime", "count", "modelled_time", "forward_time", "backward_time",
           "PIPES", "hmma_fmas", "pipe_rates"]

PIPES = ("issue", "fp32", "mufu", "mio", "tensor")
_FP32_PIPE = {"ffma", "fp32"}
_MIO = {"lds", "sts", "ldsm", "ldgsts"}


def _per_clock(gpu: GPU) -> dict:
    """Warp-instructions (wavefronts; FP16 multiply-adds for the tensor pipe) each pipe of one SM takes per clock of
    ``gpu.boost_clock_hz``.  The tensor pipe's per-SM rate runs at
    :attr:`~flashnb.instruments.roofline.GPU.tensor_clock_hz`, converted here to boost-clock cycles, so a
    tensor-bound kernel meets the datasheet's dense peak."""
    tensor = gpu.tensor_fma_per_sm_clk * gpu.tensor_clock_hz / gpu.boost_clock_hz if gpu.tensor_fma_per_sm_clk \
        else 0.0
    return {"issue": 4.0, "fp32": gpu.fp32_lanes_per_sm / 32, "mufu": 0.5, "mio": 1.0, "tensor": tensor}


def pipe_rates(gpu: str | GPU) -> dict:
    """What each pipe of one SM of ``gpu`` takes per boost-clock cycle (see :func:`_per_clock`)."""
    return _per_clock(get_gpu(gpu))


def hmma_fmas(ins) -> int:
    """FP16-rate multiply-adds of one warp's HMMA: m16n8k16 2,048, m16n8k8 1,024, TF32 counted twice (its rate is
    half the FP16 one on cc 8.0 and 9.0)."""
    m = ins.modifiers
    fmas = 16 * 8 * 16 if ".16816" in m else 16 * 8 * 8 if ".1688" in m else 16 * 8 * 4
    return 2 * fmas if ".TF32" in m else fmas


@dataclass(frozen=True)
class KernelShape:
    """What the algorithm needs per thread, which the SASS alone cannot say (see the module docstring).

    ``phases``: FFMAs per thread per K/V tile of each matmul, in source order.  ``tile_loads``: 32-bit
    global words one thread loads per tile (``K_j``, ``V_j``); ``prologue_loads`` / ``epilogue_stores``:
    per block, before and after the tile loop (``Q_i``; ``O_i``).  ``element_loops``: the trips per tile of
    loops over a thread's elements that compute rather than move (the product kernel's Philox and ``mask_mod``
    loops: one trip per element); without it such loops count 0."""

    phases: tuple
    tile_loads: int
    prologue_loads: int = 0
    epilogue_stores: int = 0
    element_loops: int = 0     # trips per tile of the tile loop's loops that do no FFMA and move no global word


@dataclass
class Counts:
    """Per-warp dynamic counts of one region: instructions by category, and demand on each pipe."""

    categories: dict = field(default_factory=dict)
    pipes: dict = field(default_factory=lambda: dict.fromkeys(PIPES, 0))

    def add(self, ins, times: int = 1) -> None:
        if times == 0:
            return
        self.categories[ins.category] = self.categories.get(ins.category, 0) + times
        self.pipes["issue"] += times
        if ins.predicate.strip() == "@!PT":      # never executes (ptxas pads LDGSTS with these): an issue slot only
            return
        if ins.opcode == "MUFU":
            self.pipes["mufu"] += times
        elif ins.category in _FP32_PIPE:
            self.pipes["fp32"] += times
        elif ins.category == "hmma":
            self.pipes["tensor"] += times * hmma_fmas(ins)
        if ins.category in _MIO:
            self.pipes["mio"] += times * max(1, ins.bits // 32)
        elif ins.category == "shfl":
            self.pipes["mio"] += times

    @property
    def ffma(self) -> int:
        return self.categories.get("ffma", 0)

    @property
    def hmma(self) -> int:
        return self.categories.get("hmma", 0)

    @property
    def issued(self) -> int:
        return self.pipes["issue"]


@dataclass
class SassCounts:
    """A kernel's per-warp counts for one block's prologue, one K/V tile and the epilogue, and the trip count
    given to every loop (``(first, last instruction index, trips, role)``)."""

    name: str
    prologue: Counts
    tile: Counts
    epilogue: Counts
    loops: list
    work: str = "ffma"
    edge: Counts | None = None   # one edge tile (the masked copy of the tile loop), when the kernel has one

    @property
    def tile_ffma_fraction(self) -> float:
        """FFMAs / instructions issued per K/V tile (the steady state's share of useful work)."""
        return self.tile.ffma / self.tile.issued if self.tile.issued else 0.0

    @property
    def tile_work_fraction(self) -> float:
        """The work instructions (FFMA, or HMMA) / instructions issued per K/V tile."""
        n = self.tile.categories.get(self.work, 0)
        return n / self.tile.issued if self.tile.issued else 0.0


def _words(ins, kinds) -> int:
    return ins.bits // 32 if ins.category in kinds else 0


def _conserve(s, loops, body_outside, need, kinds):
    """Trip counts for the load/store-only ``loops`` so a thread moves ``need`` words of ``kinds``."""
    have = sum(_words(i, kinds) for i in body_outside)
    per_iter = sum(sum(_words(i, kinds) for i in s.instructions[a:b + 1]) for a, b in loops)
    if not loops or have >= need or per_iter == 0:
        return dict.fromkeys(loops, 0)
    trips = math.ceil((need - have) / per_iter)
    return dict.fromkeys(loops, trips)


def _region(s, lo, hi, loops):
    """Instructions of ``[lo, hi]`` outside every loop in ``loops``."""
    inside = set()
    for a, b in loops:
        inside.update(range(a, b + 1))
    return [s.instructions[i] for i in range(lo, hi + 1) if i not in inside]


def _tile_loop_trips(s, tile_loop, shape, ffma_in, trips, roles):
    """Trip counts of the loops inside one tile loop (matmul loops by ``shape.phases``, copy loops by
    conservation); returns those inner loops."""
    t0, t1 = tile_loop
    inner = [lp for lp in s.loops if lp != tile_loop and t0 <= lp[0] and lp[1] <= t1]
    if any(o != lp and lp[0] <= o[0] and o[1] <= lp[1] for lp in inner for o in inner):
        raise ValueError(f"{s.name}: loops nested two deep inside the tile loop; this model handles one level")
    ffma_loops = [lp for lp in inner if ffma_in(lp)]
    if len(ffma_loops) > len(shape.phases):
        raise ValueError(f"{s.name}: {len(ffma_loops)} FFMA loops in the tile loop, {len(shape.phases)} phases")
    # FFMA loops in address order take the phases in source order (a phase fully unrolled has no loop: the
    # phases left over are the ones with the largest FFMA counts that the loops can divide)
    phases = list(shape.phases)
    for lp in ffma_loops:
        per = ffma_in(lp)
        k = next((n for n, ph in enumerate(phases) if ph % per == 0), None)
        if k is None:
            raise ValueError(f"{s.name}: a loop of {per} FFMAs per iteration divides no phase of {phases}")
        trips[lp], roles[lp] = phases[k] // per, f"matmul phase {shape.phases.index(phases[k]) + 1}"
        phases = phases[k + 1:]
    tile_body = _region(s, t0, t1, inner)
    mem = [lp for lp in inner if not ffma_in(lp)]
    moves = lambda lp: any(_words(i, ("ldg", "stg")) for i in s.instructions[lp[0]:lp[1] + 1])
    for lp in [lp for lp in mem if not moves(lp)] if shape.element_loops else []:
        trips[lp], roles[lp] = shape.element_loops, "element loop"
    mem = [lp for lp in mem if lp not in trips]
    for lp, n in _conserve(s, mem, tile_body, shape.tile_loads, ("ldg", "ldgsts")).items():
        trips[lp], roles[lp] = n, "tile load" if n else "partial-tile path (0 on full tiles)"
    return inner


def count(s, shape: KernelShape) -> SassCounts:
    """Per-warp dynamic counts of the kernel whose SASS is ``s`` (a :class:`flashnb.instruments.sass.Sass`).

    A tensor-core kernel may run its tiles in two loops with the same HMMAs: the tiles no mask touches, and the
    *edge* tiles (the causal diagonal, the end of the keys) with the masking code.  Then the shorter loop is the
    tile loop and the other the edge loop, whose counts (:attr:`SassCounts.edge`) are charged per edge tile."""
    ends = [k for k, i in enumerate(s.instructions) if i.opcode == "EXIT"]
    last = ends[-1] if ends else len(s.instructions) - 1   # after the last EXIT: padding, never run
    work = s.work
    ffma_in = lambda lp: sum(i.category == work for i in s.instructions[lp[0]:lp[1] + 1])
    outer = [lp for lp in s.loops if any(o != lp and lp[0] <= o[0] and o[1] <= lp[1] for o in s.loops)]
    edge_loop = None
    if work == "hmma":      # a tensor-core tile loop: the loop with the most HMMAs (its MMAs usually all unrolled)
        outer = [lp for lp in s.loops if ffma_in(lp)]
        if outer:
            best = max(ffma_in(lp) for lp in outer)
            top = sorted((lp for lp in outer if ffma_in(lp) == best), key=lambda lp: lp[1] - lp[0])
            outer = top[:1]
            if len(top) == 2 and not (top[1][0] <= top[0][0] and top[0][1] <= top[1][1]):
                edge_loop = top[1]
    if not outer:
        raise ValueError(f"{s.name}: no loop holds another loop: no K/V tile loop to model")
    tile_loop = max(outer, key=lambda lp: (ffma_in(lp), lp[1] - lp[0]))
    t0, t1 = tile_loop
    trips, roles = {}, {}
    inner = _tile_loop_trips(s, tile_loop, shape, ffma_in, trips, roles)
    edge_inner = _tile_loop_trips(s, edge_loop, shape, ffma_in, trips, roles) if edge_loop else []
    rest = [lp for lp in s.loops if lp not in (tile_loop, edge_loop) and lp not in inner and lp not in edge_inner]
    if any(lp[0] <= t0 and t1 <= lp[1] for lp in rest):
        raise ValueError(f"{s.name}: the tile loop sits inside another loop; this model handles one tile loop")
    skip = [edge_loop] if edge_loop else []           # the edge loop is charged per edge tile, not as pro/epilogue
    pro = [lp for lp in rest if lp[1] < t0]
    epi = [lp for lp in rest if lp[0] > t1 and lp[1] <= last]
    for loops, lo, hi, need, kinds, role in ((pro, 0, t0 - 1, shape.prologue_loads, ("ldg", "ldgsts"),
                                              "prologue load"),
                                             (epi, t1 + 1, last, shape.epilogue_stores,
                                              ("stg",), "epilogue store")):
        moving = [lp for lp in loops if any(_words(i, kinds) for i in s.instructions[lp[0]:lp[1] + 1])]
        for lp, n in _conserve(s, moving, _region(s, lo, hi, loops + skip), need, kinds).items():
            trips[lp], roles[lp] = n, role if n else f"{role}: partial path (0 when full)"
        for lp in loops:
            if lp not in trips:
                trips[lp], roles[lp] = 1, "other (counted once)"

    def counts(lo, hi, loops, exclude=()):
        c = Counts()
        for ins in _region(s, lo, hi, list(loops) + list(exclude)):
            c.add(ins)
        for a, b in loops:
            for ins in s.instructions[a:b + 1]:
                c.add(ins, trips[(a, b)])
        return c

    tile = counts(t0, t1, inner)
    done = tile.categories.get(work, 0)
    if done < sum(shape.phases):
        raise ValueError(f"{s.name}: {done} {work.upper()}s counted per tile, the matmuls need {sum(shape.phases)}")
    edge = counts(edge_loop[0], edge_loop[1], edge_inner) if edge_loop else None
    loops = sorted((a, b, n, roles[(a, b)]) for (a, b), n in trips.items()) + [(t0, t1, None, "tile loop")]
    if edge_loop:
        loops.append((edge_loop[0], edge_loop[1], None, "edge tile loop"))
    return SassCounts(s.name, counts(0, t0 - 1, pro, skip), tile, counts(t1 + 1, last, epi, skip), loops, work,
                      edge)


@dataclass
class SassTime:
    """The modelled time of one launch (seconds) and what bounds it."""

    name: str
    gpu: str
    seconds: float
    flops: float
    bound: str                 # the pipe (or "hbm") that sets the time
    blocks: int
    blocks_per_sm: int
    pipe_seconds: dict         # each pipe's busiest-SM time, and HBM's
    tile_ffma_fraction: float
    tile_work_fraction: float = 0.0

    @property
    def tflops(self) -> float:
        return self.flops / self.seconds / 1e12

    def fraction_of_peak(self, gpu: str | GPU | None = None, peak: str = "fp32") -> float:
        """Modelled FLOP/s over a roof of ``gpu``: ``peak`` as in :meth:`flashnb.instruments.roofline.GPU.peak`
        (``"fp32"``, ``"tensor_fp16"``, ``"tensor_tf32"``)."""
        return self.flops / self.seconds / get_gpu(gpu or self.gpu).peak(peak)


def modelled_time(c: SassCounts, *, tiles_per_block: Sequence[int], warps: int, blocks_per_sm: int,
                  hbm_bytes: float, flops: float, gpu: str | GPU = "H100 SXM") -> SassTime:
    """List-schedule the blocks (``tiles_per_block`` in launch order: a tile count, or ``(tiles, edge tiles)``
    for a kernel with an edge tile loop) on ``gpu`` and return the modelled time (see the module docstring for what
    it assumes)."""
    g = get_gpu(gpu)
    if blocks_per_sm < 1:
        raise ValueError(f"blocks_per_sm must be >= 1 (the kernel must fit on an SM), got {blocks_per_sm}")
    rate = _per_clock(g)
    slots = g.sm_count * blocks_per_sm
    busy = dict.fromkeys(PIPES, 0.0)      # pipe-cycles of the whole launch, per pipe
    heap = [0.0] * slots                  # when each slot frees (cycles)
    if not rate["tensor"] and any(x.pipes.get("tensor", 0) for x in (c.prologue, c.tile, c.epilogue)):
        raise ValueError(f"{c.name}: tensor-core instructions, but {g.name} has no tensor pipe rate")
    for entry in tiles_per_block:
        tiles, edges = entry if isinstance(entry, tuple) else (entry, 0)
        if edges and c.edge is None:
            raise ValueError(f"{c.name}: edge tiles given, but the kernel has no edge tile loop")
        edge = c.edge.pipes if edges else dict.fromkeys(PIPES, 0)
        need = {p: warps * (c.prologue.pipes[p] + (tiles - edges) * c.tile.pipes[p] + edges * edge[p]
                            + c.epilogue.pipes[p]) / rate[p] if rate[p] else 0.0 for p in PIPES}
        for p in PIPES:
            busy[p] += need[p]
        start = heapq.heappop(heap)
        heapq.heappush(heap, start + blocks_per_sm * max(need.values()))
    compute = max(heap) / g.boost_clock_hz if tiles_per_block else 0.0
    pipe_seconds = {p: busy[p] / slots * blocks_per_sm / g.boost_clock_hz for p in PIPES}
    pipe_seconds["hbm"] = hbm_bytes / g.hbm_bandwidth
    seconds = max(compute, pipe_seconds["hbm"])
    bound = "hbm" if pipe_seconds["hbm"] >= compute else max(PIPES, key=lambda p: pipe_seconds[p])
    return SassTime(c.name, g.name, seconds, flops, bound, len(tiles_per_block), blocks_per_sm, pipe_seconds,
                    c.tile_ffma_fraction, c.tile_work_fraction)


def _module_of(kernel: str):
    """The module that provides a kernel's model inputs: ``flashnb.instruments.sass_inputs.<family>`` where there is
    one (``"fa2_tc.forward"``: :mod:`~flashnb.instruments.sass_inputs.fa2_tc`), else the module that defines the
    registered kernel's factory."""
    import importlib
    import importlib.util
    import sys

    from ..registry import KERNELS

    inputs = f"{__package__}.sass_inputs.{kernel.split('.')[0]}"
    if importlib.util.find_spec(inputs) is not None:
        return importlib.import_module(inputs)
    if kernel in KERNELS:
        return sys.modules[KERNELS[kernel].factory.__module__]
    return importlib.import_module(f"flashnb.{kernel.split('.')[0]}")


def _hbm_bytes(module, model, config) -> float:
    """Bytes of a traffic model: the module's own ``hbm_bytes(model, config)`` or ``model_bytes(model, storage)``
    (half storage), else 4 per element."""
    if hasattr(module, "hbm_bytes"):
        return float(module.hbm_bytes(model, config))
    if hasattr(module, "model_bytes"):           # the product kernel: bytes at the config's storage
        return float(sum(x["read_bytes"] + x["write_bytes"] + x["atomic_bytes"]
                         for x in module.model_bytes(model, config.get("storage", "float32"))))
    return 4.0 * sum(sum(x.get("reads", {}).values()) + sum(x.get("writes", {}).values())
                     + sum(x.get("atomics", {}).values()) for x in model)


def _launch(kernel, module, config, shape, visited, order, BH, model, flops, g, cc, Nq, Nk,
            edge_name) -> SassTime:
    """One launch's modelled time; ``visited``: :func:`flashnb.stages.fa2.tiles_visited` (its first field, the
    block)."""
    from .. import instruments as fi
    from . import sass

    s = sass.sass(kernel, config=config, cc=cc)
    c = count(s, KernelShape(**shape))
    res = fi.resources_for(kernel, config, cc)
    occ = res.occupancy(32 * config["warps"], cc).blocks_per_sm
    per_block, edges = {}, {}
    is_edge = getattr(module, edge_name, None) if c.edge is not None else None
    for v in visited:
        per_block[v[0]] = per_block.get(v[0], 0) + 1
        if is_edge is not None and is_edge(v, config, Nq, Nk):
            edges[v[0]] = edges.get(v[0], 0) + 1
    tiles_per_block = [(per_block.get(i, 0), edges.get(i, 0)) for _ in range(BH) for i in order]
    return modelled_time(c, tiles_per_block=tiles_per_block, warps=config["warps"], blocks_per_sm=occ,
                         hbm_bytes=_hbm_bytes(module, model, config), flops=flops, gpu=g)


def forward_time(kernel: str, BH: int, Nq: int, Nk: int, d: int, *, causal: bool = False,
                 gpu: str | GPU = "H100 SXM", cc=None, **tiles) -> SassTime:
    """The modelled time of an FA2-style forward (``kernel``: ``"fa2.forward"``, ``"fa2_fast.forward"`` or
    ``"flash.forward"``, ``"fa2_tc.forward"``) at ``(BH, Nq, Nk, d)``: its SASS for ``gpu``'s architecture, its
    module's :class:`KernelShape` (``sass_shape``), its analytic HBM traffic (``model_forward``; in bytes by the
    module's ``hbm_bytes``, or ``model_bytes`` at the config's ``storage``, where it has one), its occupancy
    (ptxas's registers and static shared memory, plus the dynamic shared memory the registry says its launcher
    asks for), and its blocks in launch order (``launch_order``: heavy-first or not).  ``tiles`` go to the
    module's ``sass_config`` (tiles, the product kernel's features; ``storage`` for fa2-tc)."""
    from ..stages.fa2 import tiles_visited
    from . import roofline

    g = get_gpu(gpu)
    cc = tuple(cc or g.cc)
    module = _module_of(kernel)
    config = module.sass_config(d, causal, **tiles)
    visited = tiles_visited(Nq, Nk, config["Br"], config["Bc"], causal)
    order = module.launch_order(-(-Nq // config["Br"]), causal)
    model = module.model_forward(BH, Nq, Nk, d, causal=causal, **module.model_options(config)) \
        if hasattr(module, "model_options") else \
        module.model_forward(BH, Nq, Nk, d, causal=causal, **{k: config[k] for k in ("Br", "Bc", "warps")})
    return _launch(kernel, module, config, module.sass_shape(config), visited, order, BH, model,
                   roofline.flops_forward(1, BH, Nq, Nk, d, causal), g, cc, Nq, Nk, "edge_tile")


def backward_time(kernel: str, BH: int, Nq: int, Nk: int, d: int, *, causal: bool = False,
                  gpu: str | GPU = "H100 SXM", cc=None, **tiles) -> SassTime:
    """The modelled time of an FA2 backward (FA2 Alg. 2; ``kernel`` e.g. ``"fa2_tc.backward"``): its main launch,
    one block per K/V tile visiting the Q tiles (the module's ``bwd_sass_config``, ``bwd_sass_shape``,
    ``bwd_launch_order``), plus the HBM time of the launches around it (``D = rowsum(dO∘O)``, dQ's narrowing),
    which move bytes and do no matmul.  FLOPs: 2.5 × the forward's (the benchmark formula)."""
    from ..stages.fa2 import tiles_visited
    from . import roofline

    g = get_gpu(gpu)
    cc = tuple(cc or g.cc)
    module = _module_of(kernel)
    config = module.bwd_sass_config(d, causal, **tiles)
    visited = tiles_visited(Nq, Nk, config["Br"], config["Bc"], causal, "backward")
    order = module.bwd_launch_order(-(-Nk // config["Bc"]), causal)
    model = module.model_backward(BH, Nq, Nk, d, causal=causal, **module.bwd_model_options(config))
    main = [m for m in model if m["launch"] == module.BWD_LABEL]
    rest = [m for m in model if m["launch"] != module.BWD_LABEL]
    t = _launch(kernel, module, config, module.bwd_sass_shape(config), visited, order, BH, main,
                roofline.flops_backward(1, BH, Nq, Nk, d, causal), g, cc, Nq, Nk, "bwd_edge_tile")
    extra = _hbm_bytes(module, rest, config) / g.hbm_bandwidth
    t.pipe_seconds = dict(t.pipe_seconds, other_launches=extra)
    t.seconds += extra
    return t
