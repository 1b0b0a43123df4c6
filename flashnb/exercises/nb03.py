"""Exercises of notebook 03 (FlashAttention-1 forward: tiles, the online softmax across tiles, HBM traffic)."""

from __future__ import annotations

import functools

import numpy as np

from . import close, exercise, require


def _total(model) -> int:
    return sum(sum(x["reads"].values()) + sum(x["writes"].values()) for x in model)


def _qkv(Nq, Nk, d, seed):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((1, Nq, d)), rng.standard_normal((1, Nk, d)), rng.standard_normal((1, Nk, d))


# --------------------------------------------------------------------------- 03.1


def _swapped_main_launch(N, d, Br):
    """Global accesses of the main launch with the loops swapped (one head, Nq = Nk = N): Q read and O
    written once, K and V read once per query block, l and m written once (the L = m + log l kernel reads
    them)."""
    Tr = -(-N // Br)
    return 2 * N * d + 2 * Tr * N * d + 2 * N


@exercise("03.1", "swap the loops", level=3, minutes=40,
          hint="""Make `for i` the outer loop: load Q_i once and set O_i = 0, l_i = 0, m_i = -inf in shared memory
          (no load of O, l, m from HBM); the inner `for j` loads K_j, V_j, then a barrier, then the same tile
          update; after the inner loop store O_i, l_i, m_i once. The loop heads and loads are the kernel's region
          loop-nest, the stores its region write-back (show_source(fa1.make_forward, region="loop-nest")):
          registry.variant(fa1.make_forward, regions={"loop-nest": ..., "write-back": ...}) with your lines, indented
          as they must stand in the kernel; run it with registry.using(fa1.make_forward, variant) through
          flashnb.attention_forward(..., impl="fa1", Br=16, Bc=16, warps=2). The model: count what crosses HBM per
          query block.""",
          explain="""With i outside, Q_i is read once and O_i, l_i, m_i live on chip for the whole inner loop: they are
          written once at the end and never read back, so the T_c·(3Nd + 4N) round trips of FA1 disappear. The
          price: K_j and V_j are now loaded once per query block, 2·T_r·N·d. Per head the main launch moves
          2Nd + 2T_r·N·d + 2N elements (FA2 writes L = m + log l directly: N instead of 2N). Both loop orders are
          Θ(N²d²/M), but this one has no read-modify-write of the output -- the change FlashAttention-2 made.
          The barrier after the K_j, V_j loads is what keeps a fast warp from overwriting a tile a slow warp
          still reads (the check runs the race checker).""")
def check_03_1(variant, model):
    """variant: a factory replacing fa1.make_forward (same arguments) with the query-block loop outside;
    model(N, d, Br): global element accesses of its main launch ("FA1 forward") for one head, Nq = Nk = N."""
    from .. import api, reference, registry, sim
    from ..instruments import traffic
    from ..stages import fa1

    require(callable(variant), "variant must be a kernel factory (what registry.variant returns)")
    require(callable(model), "model must be a function model(N, d, Br)")
    tiles = dict(Br=16, Bc=16, warps=2)
    q, k, v = _qkv(24, 40, 8, seed=24)
    with registry.using(fa1.make_forward, variant), traffic.count() as t:
        o, lse = api.attention_forward(q, k, v, causal=True, impl="fa1", **tiles)
    o_ref, lse_ref = reference.attention_forward(q, k, v, causal=True)
    # float32 over <= 40 keys of O(1) values: within 1e-5
    require(np.allclose(o, o_ref, atol=1e-5) and np.allclose(lse, lse_ref, atol=1e-5),
            "wrong output (Nq = 24, Nk = 40, causal)")
    main = next(x for x in t.summary() if x["launch"] == "FA1 forward")
    d, Tr = 8, -(-24 // 16)
    want_reads = {"Q": 24 * d, "K": Tr * 40 * d, "V": Tr * 40 * d}
    want_writes = {"O": 24 * d, "l": 24, "m": 24}
    for name in sorted(set(main["reads"]) | set(want_reads)):
        got, want = main["reads"].get(name, 0), want_reads.get(name, 0)
        require(got <= want, f"{name} is read {got / (24 * d if name in 'QO' else 24):g} times per element "
                f"(Nq=24, Nk=40, Br=16): with i outside, what still has to come from HBM, and how often?")
    require(main["writes"] == want_writes, f"writes {main['writes']}: O_i, l_i, m_i should reach HBM once each")
    for N, dd, Br in ((40, 8, 16), (1024, 64, 16), (1000, 32, 64)):
        close(model(N, dd, Br), _swapped_main_launch(N, dd, Br), rel=1e-9, what=f"model({N}, {dd}, {Br})")
    q, k, v = _qkv(32, 32, 8, seed=32)
    with registry.using(fa1.make_forward, variant), sim.sanitize(raise_on_error=False) as report:
        o, lse = api.attention_forward(q, k, v, impl="fa1", **tiles)
    require(not report, f"the sanitizer found errors:\n{report}")
    require(np.allclose(o, reference.attention(q, k, v), atol=1e-5), "wrong output (N = 32)")
    return f"{_total([main])} accesses counted (Nq=24, Nk=40) against FA1's " \
           f"{_total(fa1.model_forward(1, 24, 40, 8, **tiles)[1:2])}"


@check_03_1.solves
def _():
    from flashnb import registry
    from flashnb.stages import fa1

    swapped = """        for i in range((Nq + Br - 1) // Br):                      # outer loop: query blocks
            load_rows(Q, z, i * Br, Q_i, tid, NT)                 # Q_i -> SRAM, once
            for e in range(tid, Br * dd, NT):                     # O_i = 0, l_i = 0, m_i = -inf, on chip
                O_i[e // dd, e % dd] = float32(0.0)
            for r in range(tid, Br, NT):
                l_i[r] = float32(0.0)
                m_i[r] = NEG_INF
            for j in range((Nk + Bc - 1) // Bc):                  # inner loop: key blocks
                load_rows(K, z, j * Bc, K_j, tid, NT)             # K_j, V_j -> SRAM, once per query block
                load_rows(V, z, j * Bc, V_j, tid, NT)
                cuda.syncthreads()                                # K_j, V_j loaded before anyone reads them
"""
    once = """            store_rows(O_i, O, z, i * Br, tid, NT)                # O_i, l_i, m_i -> HBM once, after all j
            store_vec(l_i, l, z, i * Br, tid, NT)                 # (each thread stores what it wrote)
            store_vec(m_i, m, z, i * Br, tid, NT)
"""
    # both bodies indented as they stand in the kernel: the stores move out of the inner loop
    i_outer = registry.variant(fa1.make_forward, regions={"loop-nest": swapped, "write-back": once})

    def model(N, d, Br):
        Tr = -(-N // Br)
        return 2 * N * d + 2 * Tr * N * d + 2 * N      # Q in, O out once; K, V in per query block; l, m out

    return dict(variant=i_outer, model=model)


@check_03_1.fails
def _():
    from flashnb.stages import fa1

    return dict(variant=fa1.make_forward, model=lambda N, d, Br: 2 * N * d + 2 * -(-N // Br) * N * d + N)


@check_03_1.fails
def _():
    from flashnb import registry

    sol = check_03_1.solution()
    no_barrier = registry.variant(sol["variant"], region="loop-nest", replace=("cuda.syncthreads()", "pass"))
    return dict(variant=no_barrier, model=sol["model"])


# --------------------------------------------------------------------------- 03.2


def _causal_skip(Nq, Nk, Br, Bc, d):
    """(tiles fully masked, global accesses of fa1's main launch saved by skipping them), one head,
    bottom-right causal alignment (key j is allowed for query i when j <= i + Nk - Nq)."""
    Tr, Tc = -(-Nq // Br), -(-Nk // Bc)
    i = np.arange(Nq)[:, None]
    j = np.arange(Nk)[None, :]
    allowed = j <= i + (Nk - Nq)
    masked = np.ones((Tr, Tc), bool)
    for a in range(Tr):
        for b in range(Tc):
            masked[a, b] = not allowed[a * Br:(a + 1) * Br, b * Bc:(b + 1) * Bc].any()
    saved = 0
    for a in range(Tr):
        rows = min(Br, Nq - a * Br)
        saved += int(masked[a].sum()) * (3 * rows * d + 4 * rows)   # Q_i, O_i, l_i, m_i in; O_i, l_i, m_i out
    for b in range(Tc):
        if masked[:, b].all():                                       # a whole column skipped: K_j, V_j too
            saved += 2 * min(Bc, Nk - b * Bc) * d
    return int(masked.sum()), saved


@exercise("03.2", "causal skipping: tiles above the diagonal", level=1, minutes=15,
          hint="""Tile (i, j) holds queries i·Br .. i·Br + Br - 1 and keys j·Bc .. j·Bc + Bc - 1; query q may see key k
          when k <= q + (Nk - Nq) (bottom-right alignment). The tile is fully masked when even its last query
          cannot see its first key. For the saving, look at what one inner step (i, j) reads and writes in §4's
          table.""",
          explain="""With Nq = Nk = 1024, Br = Bc = 64 there are 16 x 16 tiles and those strictly above the diagonal,
          j > i, are fully masked: 16·15/2 = 120 of 256. With Nq = 512 the diagonal is shifted right by Nk - Nq =
          512 keys (the last query sees every key), so only j >= i + 9 is fully masked: 28 tiles -- aligning to the
          top-left would give 92. Skipping a tile (i, j) saves one inner step of FA1: Q_i, O_i, l_i, m_i in and
          O_i, l_i, m_i out, 3·Br·d + 4·Br elements (K_j, V_j are still loaded: every column has a tile someone
          needs). 120 x 12,544 = 1,505,280 elements per head, almost half of the main launch.""")
def check_03_2(tiles_above, tiles_above_short, saved_elements):
    """tiles_above: fully masked (i, j) tiles for Nq = Nk = 1024, Br = Bc = 64; tiles_above_short: the same
    for Nq = 512, Nk = 1024; saved_elements: global element accesses of FA1's main launch (one head,
    Nq = Nk = 1024, d = 64, Br = Bc = 64) that skipping the fully masked tiles would save."""
    full, saved = _causal_skip(1024, 1024, 64, 64, 64)
    short, _ = _causal_skip(512, 1024, 64, 64, 64)
    close(tiles_above, full, what="tiles_above")
    close(tiles_above_short, short, what="tiles_above_short")
    close(saved_elements, saved, rel=1e-9, what="saved_elements")


@check_03_2.solves
def _():
    def masked_tiles(Nq, Nk, B):
        diag = Nk - Nq
        return sum(1 for i in range(Nq // B) for j in range(Nk // B) if j * B > (i + 1) * B - 1 + diag)

    n = masked_tiles(1024, 1024, 64)
    return dict(tiles_above=n, tiles_above_short=masked_tiles(512, 1024, 64),
                saved_elements=n * (3 * 64 * 64 + 4 * 64))   # per step: Q_i, O_i, l_i, m_i in; O_i, l_i, m_i out


@check_03_2.fails
def _():
    return dict(tiles_above=120, tiles_above_short=92, saved_elements=120 * (3 * 64 * 64 + 4 * 64))   # top-left


@check_03_2.fails
def _():
    return dict(tiles_above=120, tiles_above_short=28, saved_elements=120 * (5 * 64 * 64 + 4 * 64))   # + K_j, V_j


# --------------------------------------------------------------------------- 03.3


def _constant(model_fn, N=1 << 16, d=32, M=4096):
    return _total(model_fn(1, N, N, d, M=M, check_fit=False)) / (N * N * d * d / M)


@exercise("03.3", "the constant in front of N²d²/M", level=2, minutes=15,
          hint="""total = sum of reads and writes over the launches of fa1.model_forward(1, N, N, 32, M=4096) (and
          model_backward); divide by N²d²/M at a large N (65,536) -- the lower-order terms (K, V once, the init,
          L) fade as N grows, but not the l, m terms. Which of the forward's per-step transfers are ∝ d, which are
          not?""",
          explain="""Per inner step the forward moves Q_i, O_i in and O_i out (3·Br·d) plus l_i, m_i in and out
          (4·Br): over all T_c·T_r steps that is T_c·N·(3d + 4), and with T_c = N/B_c = 4dN/M the leading terms are
          12·N²d²/M + 16·N²d/M: c = 12 + 16/d = 12.5 at d = 32 -- §5's 12 is the d → ∞ limit. The backward moves
          Q_i, O_i, dO_i, dQ_i in and dQ_i out (5·Br·d) plus L_i (Br) per step: c = 20 + 4/d = 20.125. Both are
          Θ(N²d²/M); the backward's constant is larger because more N x d arrays make the round trip.""")
def check_03_3(c_forward, c_backward):
    """c_forward, c_backward: traffic (elements read + written, all launches) / (N²d²/M) of fa1's forward and
    backward models at d = 32, M = 4096, N large (65,536)."""
    from ..stages import fa1

    close(c_forward, _constant(fa1.model_forward), rel=0.005, what="c_forward")
    close(c_backward, _constant(fa1.model_backward), rel=0.005, what="c_backward")


@check_03_3.solves
def _():
    from flashnb.stages import fa1

    def total(model):
        return sum(sum(x["reads"].values()) + sum(x["writes"].values()) for x in model)

    N, d, M = 1 << 16, 32, 4096
    return dict(c_forward=total(fa1.model_forward(1, N, N, d, M=M)) / (N * N * d * d / M),
                c_backward=total(fa1.model_backward(1, N, N, d, M=M)) / (N * N * d * d / M))


@check_03_3.fails
def _():
    return dict(c_forward=12, c_backward=12)


# --------------------------------------------------------------------------- 03.4


def _partials_fraction(W, N=1024, d=64, Br=16, Bc=128):
    """Share of the forward's shared reads that read the split-K partials m_w, l_w, O_w.  Per inner step:
    the merge reads m_w three times and l_w once per row and warp (4·W·Br), the O_i update reads a weight
    l_w and a partial O_w per element and warp (2·W·Br·d); :func:`_partials_counted` checks this against the
    traffic counter."""
    from ..stages import fa1

    return _partials(W, N, d, Br, Bc) / fa1.model_forward(1, N, N, d, Br=Br, Bc=Bc, warps=W,
                                                          check_fit=False)[1]["shared_reads"]


def _partials(W, N, d, Br, Bc):
    from ..common import cdiv

    return cdiv(N, Br) * cdiv(N, Bc) * (4 * W * Br + 2 * W * Br * d)


@functools.lru_cache(maxsize=None)
def _partials_counted(W=2, N=40, d=8, Br=16, Bc=16):
    """The split-K partials' shared reads, counted on fa1's kernel at a small size (the check's ground truth
    for the formula of :func:`_partials_fraction`)."""
    from .. import api
    from ..instruments import traffic

    q, k, v = _qkv(N, N, d, seed=34)
    with traffic.count() as t:
        api.attention_forward(q, k, v, impl="fa1", Br=Br, Bc=Bc, warps=W)
    main = next(x for x in t.launches if x.label == "FA1 forward")
    return sum(main.shared_reads.get(a, 0) for a in ("m_w", "l_w", "O_w")), _partials(W, N, d, Br, Bc)


@exercise("03.4", "split-K's bill in shared memory", level=2, minutes=20,
          hint="""Read fa1.model_forward's shared_reads formula (or count a small run with traffic.count() and look at
          the per-array shared reads of m_w, l_w and O_w): per inner step and per warp, the merge reads each row's
          m_w three times and l_w once, and the O_i update reads one weight and one partial per element of O_i.
          Divide by the launch's shared_reads at N = 1024, d = 64, Br = 16, Bc = 128.""",
          explain="""Each of the W warps leaves a full Br x d partial P̃V_j (plus its row max and sum) in shared memory,
          and the merge reads all of them back: 2·W·Br·d + 4·W·Br reads per inner step, against 3·Br·Bc·d for the
          scores and P̃V. The share grows about linearly with W (≈ 2W/(3·Bc)): under 1 % at W = 1, about 4 % at
          W = 8 -- plus as many shared *writes*, and the barriers the merge needs. FA2's split-Q gives each warp
          its own query rows and all the keys: a warp's rows never need another warp's partials, so there is
          nothing to merge -- the partial state stays in registers.""")
def check_03_4(fractions):
    """fractions: {W: share of the FA1 forward's shared-memory reads that read the split-K partials (m_w, l_w,
    O_w)} for W = 1, 2, 4, 8 at N = 1024, d = 64, Br = 16, Bc = 128."""
    require(isinstance(fractions, dict) and set(fractions) == {1, 2, 4, 8},
            "fractions must be a dict {1: ..., 2: ..., 4: ..., 8: ...}")
    counted, formula = _partials_counted()
    assert counted == formula, f"flashnb.stages.fa1 changed: the partials' shared reads are {counted}, not {formula}"
    for W in (1, 2, 4, 8):
        close(fractions[W], _partials_fraction(W), rel=0.02, what=f"fractions[{W}]")


@check_03_4.solves
def _():
    from flashnb.stages import fa1

    def fraction(W, N=1024, d=64, Br=16, Bc=128):
        steps = -(-N // Br) * -(-N // Bc)                    # inner iterations (one head)
        partials = steps * (4 * W * Br + 2 * W * Br * d)     # m_w x3, l_w x1 per row; weight + O_w per element
        return partials / fa1.model_forward(1, N, N, d, Br=Br, Bc=Bc, warps=W, check_fit=False)[1]["shared_reads"]

    return dict(fractions={W: fraction(W) for W in (1, 2, 4, 8)})


@check_03_4.fails
def _():
    from flashnb.stages import fa1

    def fraction(W):                                         # counts only the merge of m_w, l_w (forgets O_w)
        steps = 64 * 8
        return steps * 4 * W * 16 / fa1.model_forward(1, 1024, 1024, 64, Br=16, Bc=128, warps=W,
                                                      check_fit=False)[1]["shared_reads"]

    return dict(fractions={W: fraction(W) for W in (1, 2, 4, 8)})


# --------------------------------------------------------------------------- 03.5


def _gpt2_elements(**tiles):
    from ..stages import fa1

    BH, N, d = 64 * 16, 1024, 64
    return (_total(fa1.model_forward(BH, N, N, d, check_fit=False, **tiles))
            + _total(fa1.model_backward(BH, N, N, d, check_fit=False, **tiles)))


@exercise("03.5", "what 160 KiB of shared memory would buy", level=2, minutes=15,
          hint="""160 KiB of float32 is M = 160·1024/4 elements: fa1.tiles(64, M=M, check_fit=False) applies
          Alg. 1 line 1. For the traffic, sum reads + writes of fa1.model_forward and model_backward for GPT-2
          medium (B·H = 64·16, N = 1024, d = 64) with that M and with the default, and take the ratio.""",
          explain="""M = 40,960 elements gives B_c = ⌈M/4d⌉ = 160 (already a multiple of 4 warps) and B_r = min(160, d)
          = 64. T_c falls from 64 to ⌈1024/160⌉ = 7, so the terms ∝ T_c shrink about 9x, but K, V (and dK, dV)
          still cross HBM once and T_c = 7 is rounded up: the fwd+bwd traffic falls to about 12 % of today's,
          not 10 %. (A 160-key tile of K and V plus the backward's tiles would need more than the 48 KiB of static
          shared memory: only dynamic shared memory, up to 163 KiB per block on an A100, could hold it.)""")
def check_03_5(Bc, traffic_ratio):
    """Bc: the key-block size Alg. 1 line 1 gives (with fa1's rounding to 4 warps) for M = 160 KiB of float32
    at d = 64; traffic_ratio: GPT-2 medium's fwd+bwd element traffic with those tiles / with the default ones."""
    from ..stages import fa1

    big = fa1.tiles(64, M=160 * 1024 // 4, check_fit=False)
    close(Bc, big["Bc"], what="Bc")
    close(traffic_ratio, _gpt2_elements(M=big["M"]) / _gpt2_elements(), rel=0.01, what="traffic_ratio")
    return f"Br = {big['Br']}, Bc = {big['Bc']}"


@check_03_5.solves
def _():
    from flashnb.stages import fa1

    def total(model):
        return sum(sum(x["reads"].values()) + sum(x["writes"].values()) for x in model)

    M = 160 * 1024 // 4                                        # float32 elements
    BH, N, d = 64 * 16, 1024, 64

    def gpt2(**tiles):
        return (total(fa1.model_forward(BH, N, N, d, check_fit=False, **tiles))
                + total(fa1.model_backward(BH, N, N, d, check_fit=False, **tiles)))

    return dict(Bc=fa1.tiles(d, M=M, check_fit=False)["Bc"], traffic_ratio=gpt2(M=M) / gpt2())


@check_03_5.fails
def _():
    return dict(Bc=160, traffic_ratio=16 / 160)     # only the T_c terms: forgets what does not shrink


@check_03_5.fails
def _():
    return dict(Bc=640, traffic_ratio=0.123)        # M/d: forgets the four tiles Q_i, K_j, V_j, O_i
