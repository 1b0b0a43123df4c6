"""Typical mistakes in A3 (the FA2 forward), each with the points it must lose (graded by
tests/course/test_course.py)."""

from flashnb.course.bugs import Bug

PUBLIC = "q1: non-causal, 1 head, 48 x 48, d = 16 (o and lse)"
IO = "q1: IO budget, causal 64 x 64: only the visited K/V tiles (fa2.model_forward)"
RACE = "q1: race-free"
NQ_NK = "q1: bottom-right causal with Nq != Nk (Nq > Nk: rows and blocks that see no key)"
ALL = [PUBLIC, "q1: causal, 2 heads, 40 x 40, d = 8 (a partial last tile)", "q1: your kernel runs, not the library's",
       IO, RACE, "q1: compiles for sm_80 and sm_90 (no float64, no spills)", NQ_NK,
       "q1: N = 1, odd d, 3 heads, 1 and 4 warps, Nk not a multiple of Bc"]

GUARDED = """\
            alpha = ONE
            rs = ZERO
            if m_new != NEG_INF:
                alpha = float32(math.exp(m[a] - m_new))
                for b in range(TN):
                    pb = float32(math.exp(S[a, b] - m_new))
                    S[a, b] = pb
                    rs += pb
            else:                                    # nothing seen yet: P~ = 0
                for b in range(TN):
                    S[a, b] = ZERO
"""
UNGUARDED = """\
            alpha = float32(math.exp(m[a] - m_new))
            rs = ZERO
            for b in range(TN):
                pb = float32(math.exp(S[a, b] - m_new))
                S[a, b] = pb
                rs += pb
"""

BUGS = [
    Bug("no causal block skipping: every K/V tile is visited and masked (right answer, too much IO)", cell=1,
        regions={"causal-skip": ""},
        loses=[IO],
        says="reads of 'K': counted 2,048, model 1,280",
        why="a K/V tile whose keys all lie after the last key the block's rows may see contributes nothing (every "
            "score is masked to -inf), so FA2 never loads it: under causal it visits 10 of the 16 tiles of a 4 x 4 "
            "grid. The mask alone gives the right numbers and 1.6 times the K/V traffic (and FLOPs)"),
    Bug("block skipping ignores diag (top-left alignment): the last tiles of a row are skipped when Nq < Nk", cell=1,
        region="causal-skip", replace=[("last = min(i0 + Br, Nq) - 1 + diag", "last = min(i0 + Br, Nq) - 1")],
        loses=[NQ_NK, "q1: N = 1, odd d, 3 heads, 1 and 4 warps, Nk not a multiple of Bc"],
        says="o (BH=2, Nq=20, Nk=44",
        why="with bottom-right alignment query r sees keys up to r + diag (diag = Nk - Nq), so the last tile a "
            "block needs depends on diag; without it a block with Nq < Nk stops before keys its rows may see. "
            "Nq == Nk (diag = 0) hides it, so only the hidden tests with Nq < Nk find it (with Nq > Nk it visits "
            "tiles it could skip, and the mask keeps the numbers right)"),
    Bug("online update without the empty-row guard: e^(-inf - (-inf)) = NaN", cell=1, region="online-update",
        replace=[(GUARDED, UNGUARDED)],
        loses=[NQ_NK],
        says="never written (still the NaN poison) or are NaN",
        why="a row that has seen no allowed key yet has m_old = m_new = -inf, and exp(-inf - (-inf)) is NaN, which "
            "then spreads to l, O and L. With bottom-right causal and Nq > Nk the first Nq - Nk rows see no key at "
            "all, and a block can hold such rows beside rows that do: P~ = 0 and alpha = 1 while m_new = -inf"),
    Bug("O~ not rescaled by alpha = e^(m_old - m_new) when the maximum grows", cell=1, region="online-update",
        replace=[("            for c in range(DN):                      "
                  "# line 10: O~ = diag(e^(m_old - m_new)) O~ ...\n                Oi[a, c] *= alpha\n", "")],
        loses=ALL,
        says="differ from the float64 reference",
        why="the unnormalised O~ holds sum_j e^(s_j - m_old) v_j; when a tile raises the maximum, every earlier term "
            "must be multiplied by e^(m_old - m_new), as l is. Delayed rescaling postpones only the division by l"),
    Bug("L written by all 8 lanes of the row group (no 'if lc == 0')", cell=1, region="epilogue",
        replace=[("                if lc == 0:\n                    L[z, row] = m[a]",
                  "                L[z, row] = m[a]")],
        loses=[IO, RACE],
        says="writes of 'L': counted 512, model 64",
        why="after the butterfly every lane of the row group holds the row's l and m, and each of the 8 writes L: "
            "the same value, 8 times the writes, and a write/write race the race checker reports (on a GPU the "
            "value survives by luck of equal values). One lane (lc == 0) writes L, the lanes split O's columns"),
    Bug("float64 literals in the epilogue", cell=1, region="epilogue",
        replace=[("inv = ONE / ls if ls > ZERO else ZERO", "inv = 1.0 / ls if ls > 0.0 else 0.0")],
        loses=["q1: compiles for sm_80 and sm_90 (no float64, no spills)"],
        says="float64",
        why="a Python float literal is a float64 constant, and 1.0 / ls then divides in float64: use ONE and ZERO "
            "(or float32(...))"),
    Bug("no barrier before loading the next K_j, V_j", cell=1, region="kv-barrier",
        replace=[("            cuda.syncthreads()                       # every warp is done with K_{j-1}, V_{j-1}\n",
                  "")],
        loses=[RACE],
        says="data race",
        why="a warp that finishes tile j-1 first overwrites K_j, V_j in shared memory while another warp still "
            "reads them; the barrier at the top of the loop waits for every warp. The simulator runs a block's "
            "threads in lockstep, so every read of tile j-1 happens before the next load and the numbers come out "
            "right; on a GPU the warps drift apart and the race comes and goes with timing. The race checker, "
            "which records every access, names both"),
]
