"""Typical mistakes in A4, each with the points it must lose (graded by tests/course/test_course.py)."""

from flashnb.course.bugs import Bug

Q1 = ["q1: D = rowsum(dO∘O) and dQ = 0, 2 heads x 9 rows, d = 40",
      "q1: IO budget: O and dO read once, D and dQ written once",
      "q1: compiles for sm_80 and sm_90 (no float64, no spills)",
      "q1: other shapes: d = 1, d = 70 (three columns per lane), one row, 3 heads"]
Q2_DKDQ = "q2: dK and dQ, dS = P∘(dP − D), dQ summed over 4 column blocks (same problem)"
Q2_CAUSAL = "q2: causal, Nq = Nk = 20, d = 8 (the last Q and K/V tiles are partial)"
Q2_RAN = "q2: your kernel runs, not the library's"
Q2_RACE = "q2: race-free (4 column blocks add into the same dQ rows)"
Q2_IO = "q2: IO budget: exactly fa2.model_backward at the same tiles"
Q2_COMPILE = "q2: compiles for sm_80 and sm_90 (no float64, no spills)"
Q2_HIDDEN = "q2: causal Nq ≠ Nk (bottom-right, fully masked rows), N = 1, odd d, 3 heads"
# everything but dV: what a wrong dS or dQ loses (the IO, race and compile points wait for correctness)
NOT_DV = [Q2_DKDQ, Q2_CAUSAL, Q2_RAN, Q2_RACE, Q2_IO, Q2_COMPILE, Q2_HIDDEN]

BUGS = [
    Bug("preprocessing forgets to zero dQ", cell=1, region="rowsum",
        replace=[("                dQ[z, i, e] = ZERO\n", "")],
        loses=Q1,
        says="never written (still the NaN poison)",
        why="the main kernel only adds into dQ (atomics): someone must zero it first, and the preprocessing "
            "kernel already visits every element of dQ's rows"),
    Bug("dS without D: dS = P ∘ dP", cell=2, region="ds",
        replace=[("dP[a, b] = pv * (dP[a, b] - Dr)", "dP[a, b] = pv * dP[a, b]")],
        loses=NOT_DV,
        says="dk (not causal, BH = 1, Nq = 32",
        why="the softmax Jacobian is diag(P) - P Pᵀ, so dS = P ∘ (dP - D) with D_i = Σ_j P_ij dP_ij = "
            "rowsum(dO∘O); dV (which needs only P) is still right, dK and dQ are not"),
    Bug("dQ without the softmax scale", cell=2, region="dq-update",
        replace=[("cuda.atomic.add(dQ, (z, i0 + r, k), scale * acc)", "cuda.atomic.add(dQ, (z, i0 + r, k), acc)")],
        loses=NOT_DV,
        says="dq (not causal, BH = 1, Nq = 32",
        why="S = scale · Q Kᵀ, so dQ = scale · dS K (and dK = scale · dSᵀ Q); only dQ is off, by the factor "
            "scale = 1/sqrt(d)"),
    Bug("dQ added with a plain += (no atomic): column blocks race", cell=2, region="dq-update",
        replace=[("cuda.atomic.add(dQ, (z, i0 + r, k), scale * acc)", "dQ[z, i0 + r, k] += scale * acc")],
        loses=[Q2_DKDQ, Q2_RAN, Q2_RACE, Q2_IO, Q2_COMPILE, Q2_HIDDEN],
        says="differ from the float64 reference",
        why="every column block (thread block) adds into the same dQ_i; on a GPU they run at the same time and a "
            "read-modify-write loses updates. The simulator runs the grid's blocks in lockstep, as a GPU may, so "
            "each block reads dQ before the others have written it and all but one update is lost: dQ is wrong, "
            "and the tests scored only once the answer is right score 0 with it. The race checker names the "
            "read-modify-write; cuda.atomic.add is the fix"),
    Bug("causal mask aligned top-left (key > row) instead of bottom-right", cell=2, region="recompute-p",
        replace=[("causal and key > i0 + r + diag", "causal and key > i0 + r")],
        loses=[Q2_HIDDEN],
        says="differ from the float64 reference",
        why="the forward (and L) use FlashAttention's bottom-right alignment, query i sees keys 0 .. i + Nk - Nq; "
            "with Nq = Nk both agree, which is why only the hidden Nq ≠ Nk cases catch it"),
    Bug("P = exp(scale·S - L) also where L = -inf (padding rows, rows that see no key)", cell=2,
        region="recompute-p", replace=[("if Lr != NEG_INF and key < Nk and", "if key < Nk and")],
        loses=[Q2_CAUSAL, Q2_HIDDEN],
        says="never written (still the NaN poison) or are NaN",
        why="a query row past Nq (the padding of the last Q tile) has L = -inf, as has a row the causal mask "
            "hides entirely: exp(scale·S + inf) = inf, and inf · 0 = NaN in dV.  Such rows have P = 0.  The "
            "non-causal 32 x 32 problem has neither, so only the tests with partial tiles see it"),
    Bug("K_j re-read from HBM in the dQ loop (not from the shared tile)", cell=2, region="dq-update",
        replace=[("acc += dSs[c, r] * KsT[k, c]",
                  "acc += dSs[c, r] * (K[z, j0 + c, k] if j0 + c < Nk else ZERO)")],
        loses=[Q2_IO],
        says="reads of 'K'",
        why="K_j is already in shared memory (KsT); reading it from HBM for every dQ element reads the whole K_j "
            "tile again for each of the Br query rows of every visited tile: right values, Br·d·Bc extra reads of K "
            "per tile (and fewer shared reads), so the counts differ from the model"),
    Bug("float64 literal in the kernel", cell=2, region="recompute-p",
        replace=[("                pv = ZERO\n", "                pv = 0.0\n")],
        loses=[Q2_COMPILE],
        says="float64",
        why="a Python float literal is a float64 constant, and pv = 0.0 makes pv (and dS) float64: write ZERO or "
            "float32(0)"),
]
