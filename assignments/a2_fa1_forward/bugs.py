"""Typical mistakes in A2 (the FA1 forward), each with the points it must lose (graded by
tests/course/test_course.py)."""

from flashnb.course.bugs import Bug

PUBLIC = "q1: non-causal, 1 head, 48 x 48, d = 16 (3 x 3 tiles)"
RACE = "q1: race-free"
ALL = [PUBLIC] + [f"q1: {t}" for t in (
    "causal, 2 heads, 40 x 40, d = 8 (a partial last tile)", "your kernel runs, not the library's",
    "IO budget: HBM and shared traffic equal fa1.model_forward", "race-free",
    "compiles for sm_80 and sm_90 (no float64, no spills)",
    "bottom-right causal with Nq != Nk (Nq > Nk: rows that see no key)",
    "N = 1, odd d, 3 heads, 4 warps, Nk not a multiple of Bc")]

BUGS = [
    Bug("the old O_i is not rescaled by e^(m_i - m_new)", cell=1, region="statistics",
        replace=[("a_i[r] = lo * eo * inv", "a_i[r] = lo * inv")],
        loses=ALL,
        says="differ from the float64 reference",
        why="O_i was normalised with the old maximum m_i; once a later key tile raises the maximum, the old O_i "
            "must be scaled by l_i·e^(m_i - m_new)/l_new (line 12), not by l_i/l_new. The error appears as soon as "
            "a row's maximum changes between key tiles, which is why tile 0 of a row can still look right"),
    Bug("causal mask aligned top-left (key c <= query r) instead of bottom-right", cell=1, region="scores",
        replace=[("(causal and not causal_allowed(i * Br + r, j * Bc + c, diag))",
                  "(causal and j * Bc + c > i * Br + r)")],
        loses=["q1: bottom-right causal with Nq != Nk (Nq > Nk: rows that see no key)"],
        says="differ from the float64 reference",
        why="flashnb (like FlashAttention >= 2.1) aligns the causal mask to the bottom-right corner: query r sees "
            "keys c <= r + (Nk - Nq). Both alignments agree when Nq == Nk, so only a test with Nq != Nk finds it: "
            "use causal_allowed(row, col, diag) with the diag the launcher passes"),
    Bug("the keys past Nk in the last tile are not masked (non-causal)", cell=1, region="scores",
        replace=[("if j * Bc + c >= Nk or (causal and", "if (causal and")],
        loses=["q1: N = 1, odd d, 3 heads, 4 warps, Nk not a multiple of Bc"],
        says="differ from the float64 reference",
        why="the last key tile is zero-filled past Nk, so a padding key scores 0, not -inf, and adds e^(0 - m) to "
            "the row sum. Causal rows never see those keys (they lie after the last query), and Nk = 48 is a whole "
            "number of tiles, so only a non-causal test with Nk not a multiple of Bc catches it"),
    Bug("K_j, V_j loaded once per Q block (inside the inner loop): right answer, Tr times the K/V reads", cell=1,
        region="loop-nest",
        replace=[("            load_rows(K, z, j * Bc, K_j, tid, NT)                 # line 6: K_j, V_j -> SRAM, once\n"
                  "            load_rows(V, z, j * Bc, V_j, tid, NT)\n"
                  "            for i in range((Nq + Br - 1) // Br):                  # line 7\n",
                  "            for i in range((Nq + Br - 1) // Br):                  # line 7\n"
                  "                load_rows(K, z, j * Bc, K_j, tid, NT)\n"
                  "                load_rows(V, z, j * Bc, V_j, tid, NT)\n")],
        loses=["q1: IO budget: HBM and shared traffic equal fa1.model_forward"],
        says="reads of 'K': counted 2,304, model 768",
        why="Alg. 1 puts K/V in the outer loop so that each K_j, V_j crosses HBM once (line 6); it is Q_i, O_i, "
            "l_i, m_i that are re-read per key tile. Loading K_j inside the loop over i gives the same numbers "
            "and Tr times the K and V traffic"),
    Bug("no barrier between the statistics (line 11) and the O_i update (line 12)", cell=1,
        region="weights-barrier", replace=[("                cuda.syncthreads()\n", "")],
        loses=[RACE],
        says="data race",
        why="line 12 is element-parallel and reads the weights a_i[r], l_w[v, r] that one thread per row wrote in "
            "line 11: without cuda.syncthreads() between them a thread may read a row's weights before they are "
            "written. The simulator runs a block's threads in lockstep, statement by statement, so every weight is "
            "written before any is read and the numbers come out right; on a GPU the warps are not in lockstep and "
            "the race comes and goes with timing. The race checker, which records every access, names both"),
    Bug("float64 literals in the statistics update", cell=1, region="statistics",
        replace=[("inv = float32(1.0) / ln if ln > float32(0.0) else float32(0.0)",
                  "inv = 1.0 / ln if ln > 0.0 else 0.0")],
        loses=["q1: compiles for sm_80 and sm_90 (no float64, no spills)"],
        says="float64",
        why="a Python float literal is a float64 constant, and 1.0 / ln then computes in float64 (slow on a GPU, "
            "and refused by the PTX guard): write float32(1.0), or the ZERO constant"),
]
