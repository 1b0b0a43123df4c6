"""Typical mistakes in A1, each with the points it must lose (graded by tests/course/test_course.py)."""

from flashnb.course.bugs import Bug

Q2_OK = "q2: partial states of 2 rows x 100 in 3 chunks"

BUGS = [
    Bug("merge forgets to rescale d_b", cell=1, region="merge_state",
        replace=[("d_b * float32(math.exp(m_b - m))", "d_b")],
        loses=["q1: merge of random states matches float64",
               "q1: empty states: [-inf, 0] is neutral, two empties stay empty"],
        says="differ from the float64 reference",
        why="each partial sum d is relative to its own max; both must be rescaled to the new max m"),
    Bug("merge of two empty states gives NaN", cell=1, region="merge_state",
        replace=[("    if m == NEG_INF:\n        return m, ZERO\n", "")],
        loses=["q1: empty states: [-inf, 0] is neutral, two empties stay empty"],
        says="never written (still the NaN poison) or are NaN",
        why="e^(-inf - (-inf)) is NaN: the empty state [-inf, 0] needs its own case"),
    Bug("chunk loop reads every element of the row (not just its chunk)", cell=2, region="chunk-fold",
        replace=[("range(c * C + tid, min(n, (c + 1) * C), TPB)", "range(tid, n, TPB)")],
        loses=[Q2_OK] + [f"q2: {t}" for t in (
            "your kernel runs, not the library's", "IO budget: X read once, one state written per chunk",
            "race-free", "compiles for sm_80 and sm_90 (no float64, no spills)",
            "other shapes: one chunk, one element per chunk, empty last chunks")],
        says="differ from the float64 reference",
        why="block c owns elements c·C .. (c+1)·C - 1 of the row only"),
    Bug("imports flashnb's kernel instead of writing it", cell=2,
        append="from flashnb.stages.softmax import make_online_partials  # noqa",
        loses=[Q2_OK] + [f"q2: {t}" for t in (
            "your kernel runs, not the library's", "IO budget: X read once, one state written per chunk",
            "race-free", "compiles for sm_80 and sm_90 (no float64, no spills)",
            "other shapes: one chunk, one element per chunk, empty last chunks")],
        says="is flashnb's own factory (softmax.py), not yours",
        why="the grader runs the factory written in the answer cell; importing the library's scores nothing"),
    Bug("three passes: a separate max pass before the online pass (right answer, one read too many)", cell=3,
        region="online-pass",
        replace=[("        for j in range(tid, n, TPB):                       # pass 1",
                  "        for j in range(tid, n, TPB):\n            m = max(m, X[row, j])\n"
                  "        for j in range(tid, n, TPB):                       # pass 1")],
        loses=["q3: IO budget: X read twice, Y written once"],
        says="reads of 'X': counted 384, model 256",
        why="the point of the online softmax: max and normaliser in one pass, so X is read twice, not three times"),
    Bug("float64 literal in the kernel", cell=3, region="normalise",
        replace=[("inv_d = ONE / d if d > ZERO else ZERO", "inv_d = 1.0 / d if d > 0.0 else 0.0")],
        loses=["q3: compiles for sm_80 and sm_90 (no float64, no spills)"],
        says="float64",
        why="a Python float literal is a float64 constant: write float32(1) or the ONE/ZERO constants"),
]
