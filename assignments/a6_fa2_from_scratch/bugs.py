"""Typical mistakes in A6 (FA2's forward and its launch grid from a blank cell), each with the points it must lose
(graded by tests/course/test_course_a6.py).

The student writes the whole cell, so every bug is an edit of the master's answer through a region of it: a pair
of ``# region NAME`` / ``# endregion NAME`` markers in the kernel (``tiles``, ``tile-count``, ``kv-barrier``,
``scores``, ``online-update``, ``epilogue``) or a function by its name (``launch_forward``) -- a whole body
replaced (``regions=``, written without indentation: it gets the region's), or one expression within one region
(``replace=``), never text that depends on the lines' layout."""

from flashnb.course.bugs import Bug

PUBLIC = "q1: non-causal, 1 head, 32 x 48, d = 16 (O and L)"
CAUSAL = "q1: causal (bottom-right, Nq < Nk), 2 heads, 32 x 48, d = 8"
GRID = "q1: the grid covers every row: Nq = 40 with Br = 16 (a partial last query block)"
ONE_LAUNCH = "q1: one launch, of your own kernel"
IO = "q1: IO budget, causal 48 x 64: Q once, each visited K/V tile once per query block, O and L once"
RACE = "q1: race-free (2 warps per block, 3 K/V tiles)"
COMPILES = "q1: compiles for sm_80 and sm_90 (no float64, shared memory within 48 KiB, no spills)"
NQ_GT_NK = "q1: bottom-right causal with Nq > Nk: rows and whole query blocks that see no key (O = 0, L = -inf)"
SHAPES = "q1: d not a power of two, 3 heads, N = 1, partial blocks and tiles, other tiles"
ALL = [PUBLIC, CAUSAL, GRID, ONE_LAUNCH, IO, RACE, COMPILES, NQ_GT_NK, SHAPES]

#: line 8 with each row reading K_j straight from HBM (the staged tile K_j unused)
SCORES_FROM_HBM = """\
m_new = m
for c in range(Bc):
    sc = NEG_INF
    if j0 + c < Nk and not (causal and j0 + c > i + diag):
        acc = ZERO
        for x in range(dd):
            acc += q[x] * K[z, j0 + c, x]
        sc = scale * acc
    s[c] = sc
    m_new = max(m_new, sc)
"""

#: lines 9-10 as the paper writes them, with no case for a row whose maximum is still -inf
UNGUARDED = """\
alpha = float32(math.exp(m - m_new))
rs = ZERO
for c in range(Bc):
    p = float32(math.exp(s[c] - m_new))
    s[c] = p
    rs += p
l = alpha * l + rs
for x in range(dd):
    o[x] *= alpha
"""

#: lines 9-10 with l rescaled but O~ not
NO_O_RESCALE = """\
alpha = ONE
if m_new != NEG_INF:
    alpha = float32(math.exp(m - m_new))
rs = ZERO
for c in range(Bc):
    p = ZERO
    if s[c] != NEG_INF:
        p = float32(math.exp(s[c] - m_new))
    s[c] = p
    rs += p
l = alpha * l + rs
"""

BUGS = [
    Bug("every row reads K from HBM (the shared tile K_j loaded but unused): right answer, Br times the K traffic",
        cell=1, regions={"scores": SCORES_FROM_HBM},
        loses=[IO],
        says="reads of 'K': counted 16,704, model 1,152",
        why="the point of the shared tile: the block's Br threads load K_j once and every row reads it from shared "
            "memory. A row that reads K[z, j0 + c, :] itself fetches every key it sees once per row instead of once "
            "per block of Br = 16 rows: the numbers are right and HBM sees 14.5 times the model's K traffic here "
            "(V, still read from its tile, stays on the model)"),
    Bug("grid rounded down: Nq // Br query blocks, the last partial block never launched", cell=1,
        region="launch_forward", replace=[("cdiv(Nq, Br)", "Nq // Br")],
        loses=[GRID, NQ_GT_NK, SHAPES],
        says="rows 32..39 of O and L were never written: your grid has 2 query block(s)",
        why="the grid needs ceil(Nq / Br) blocks; Nq // Br drops the last, partial one, whose rows keep the NaN "
            "poison (and for Nq < Br no block is launched at all). Every shape with Nq a multiple of Br hides it, "
            "so a test with a partial last block is the one that finds it; inside the kernel, `i < Nq` guards "
            "that partial block's idle threads"),
    Bug("no barrier before loading the next K_j, V_j", cell=1, regions={"kv-barrier": ""},
        loses=[RACE],
        says="data race",
        why="a warp that finishes tile j-1 first overwrites K_j, V_j in shared memory while another warp still "
            "reads them; the barrier at the top of the loop waits for every thread. The simulator runs a block's "
            "threads in lockstep, so the numbers come out right; on a GPU the warps drift apart and the race comes "
            "and goes with timing. The race checker, which records every access, names both lines"),
    Bug("online update without the -inf guard: e^(-inf - (-inf)) = NaN", cell=1,
        regions={"online-update": UNGUARDED},
        loses=[NQ_GT_NK],
        says="never written (still the NaN poison) or are NaN",
        why="a row that has seen no visible key yet has m_old = m_new = -inf, and exp(-inf - (-inf)) is NaN, which "
            "then spreads to l, O and L. With bottom-right causal and Nq > Nk the first Nq - Nk rows see no key at "
            "all, and a block can hold such rows beside rows that do, so it visits tiles where they see nothing: "
            "P~ = 0 and alpha = 1 while m_new = -inf"),
    Bug("O~ not rescaled by alpha = e^(m_old - m_new) when the maximum grows (l is)", cell=1,
        regions={"online-update": NO_O_RESCALE},
        loses=ALL,
        says="differ from the float64 reference",
        why="the unnormalised O~ holds sum_j e^(s_j - m_old) v_j; when a tile raises the maximum, every earlier "
            "term must be multiplied by e^(m_old - m_new), as l is. Delayed rescaling postpones only the division "
            "by l, never the rescale"),
    Bug("L = m + l instead of m + log l", cell=1, region="epilogue",
        replace=[("m + float32(math.log(l))", "m + l")],
        loses=ALL,
        says="lse (BH=1, Nq=32, Nk=48",
        why="L is the log-sum-exp of the row's scaled scores, log(sum_j e^(s_j)) = m + log(l) with l = sum_j "
            "e^(s_j - m); the backward recomputes P = e^(S - L) from it. O is right (it needs only l), so the "
            "grader's message is about lse"),
    Bug("causal mask aligned top-left (diag = 0): wrong whenever Nq != Nk", cell=1,
        region="launch_forward", replace=[("diag = Nk - Nq", "diag = 0")],
        loses=[CAUSAL, IO, NQ_GT_NK, SHAPES],
        says="o (BH=2, Nq=32, Nk=48, d=8, causal=True",
        why="flashnb's causal mask (FlashAttention >= 2.1) is aligned to the bottom-right corner: query r sees keys "
            "up to r + Nk - Nq, so the last query sees every key. diag = 0 is SDPA's is_causal (top-left): the same "
            "when Nq = Nk, and for Nq < Nk it hides keys the rows should see -- and skips the tiles that hold them, "
            "so the traffic is off too"),
    Bug("no causal block skipping: every K/V tile is loaded and masked (right answer, too much IO)", cell=1,
        regions={"tile-count": "n_tiles = (Nk + Bc - 1) // Bc"},
        loses=[IO],
        says="reads of 'K': counted 1,536, model 1,152",
        why="a K/V tile whose keys all lie after the last key the block's rows may see contributes nothing (every "
            "score is masked to -inf), so FA2 never loads it: here 9 of the 12 (query block, tile) pairs. The mask "
            "alone gives the right numbers with a third more K/V traffic (and FLOPs)"),
    Bug("float64 literals in the epilogue", cell=1, region="epilogue",
        replace=[("ONE / l if l > ZERO else ZERO", "1.0 / l if l > 0.0 else 0.0")],
        loses=[COMPILES],
        says="float64",
        why="a Python float literal is a float64 constant, and 1.0 / l then divides in float64 (slow on every GPU "
            "but the data-centre ones): use ONE and ZERO (or float32(...))"),
    Bug("shared tiles sized for the largest head dim, (Bc, 128): 64 KiB at Bc = 64", cell=1,
        regions={"tiles": "K_j = cuda.shared.array((Bc, 128), float32)\nV_j = cuda.shared.array((Bc, 128), float32)"},
        loses=[COMPILES],
        says="65536 bytes static shared memory > 49152 (48 KiB)",
        why="2 tiles x 64 rows x 128 floats x 4 bytes = 64 KiB, over the 48 KiB a block may declare statically, so "
            "the kernel does not compile at Bc = 64 (the simulator has no such limit). Size the tiles by the "
            "compile-time d the factory is given: (Bc, d)"),
    Bug("imports flashnb's one-thread-per-row kernel instead of writing it", cell=1,
        append="from flashnb.stages.fa2_steps import make_rows_forward as make_forward",
        loses=ALL,
        says="ran flashnb's own kernel",
        why="the grader checks that every launch runs a kernel whose code comes from the answer cell; "
            "fa2_steps.make_rows_forward has the same interface and the right numbers, and scores nothing"),
]
