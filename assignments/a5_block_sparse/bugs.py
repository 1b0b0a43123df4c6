"""Typical mistakes in A5, each with the points it must lose (graded by tests/course/test_course.py)."""

from flashnb.course.bugs import Bug

Q1 = [f"q1: {t}" for t in (
    "block-sparse forward matches float64 (N = 64, d = 16, 16x16 tiles)", "causal, sliding-window mask",
    "your kernel runs, not the library's", "IO budget: only the allowed K/V tiles are loaded",
    "IO budget, causal: no tile above the diagonal is loaded or tested", "race-free",
    "compiles for sm_80 and sm_90 (no float64, no spills)",
    "Nq != Nk, a block row with no allowed tile (o = 0, lse = -inf), two heads with their own masks",
    "causal with Nq > Nk (query blocks that see no key) and Nq < Nk")]
IO, IO_CAUSAL = Q1[3], Q1[4]

# the skip as the library writes it: the body of region block-skip (the second TODO of answer cell 1)
SKIP = ("            if sparse:                               "
        "# FA1 Alg. 5: if M_ij != 0 (lane 0 reads, the warp shares)\n"
        "                if cuda.shfl_sync(FULL_MASK, int32(M[z, cuda.blockIdx.x, jt]) "
        "if lane == 0 else int32(0), 0) == 0:\n"
        "                    continue                         # block-uniform: K_j, V_j never loaded\n")
LOADED = "            cuda.syncthreads()\n"      # the last line of region kv-load: K_j, V_j are in shared memory

BUGS = [
    Bug("loads every K/V tile, then skips the compute of the masked ones (right answer, the IO of dense FA2)",
        cell=1,
        replace=[("block-skip", SKIP, ""), ("kv-load", LOADED, LOADED + SKIP)],
        loses=[IO, IO_CAUSAL],
        says="reads of 'K': counted",
        why="the mask is tested after K_j, V_j are already in shared memory: the output is right (the tile is "
            "never used) but every tile is loaded, so block sparsity saves compute and no IO; test M_ij before "
            "the load"),
    Bug("mask read transposed: M[z, jt, i] instead of M[z, i, jt]", cell=1, region="block-skip",
        replace=[("int32(M[z, cuda.blockIdx.x, jt])", "int32(M[z, jt, cuda.blockIdx.x])")],
        loses=Q1,
        says="differ from the float64 reference",
        why="M has shape (BH, Tr, Tc): the row index is the query block (blockIdx.x), the column the K/V tile jt; "
            "transposed, each query block visits the tiles of another (and with Tr != Tc reads out of bounds)"),
    Bug("every thread reads M_ij itself (no shuffle)", cell=1, region="block-skip",
        replace=[("cuda.shfl_sync(FULL_MASK, int32(M[z, cuda.blockIdx.x, jt]) if lane == 0 else int32(0), 0) == 0",
                  "M[z, cuda.blockIdx.x, jt] == 0")],
        loses=[IO, IO_CAUSAL],
        says="reads of 'M': counted",
        why="right answer, but 32 one-byte reads of the same entry per warp per tile: the model (and a GPU's "
            "memory system) wants one read per warp, broadcast with cuda.shfl_sync"),
    Bug("no causal limit: the loop runs over every K/V tile and lets the mask in fa2_tile zero the scores", cell=1,
        regions={"causal-skip": ""},
        loses=[IO_CAUSAL],
        says="reads of 'K': counted",
        why="tiles above the diagonal contribute nothing (every score is -inf) but are loaded and their M_ij "
            "read: stop the loop at the tile of the last key the block's last row may see"),
    Bug("causal limit without diag (top-left alignment): right when Nq = Nk, keys missing when Nq < Nk", cell=1,
        region="causal-skip", replace=[("last = min(i0 + Br, Nq) - 1 + diag", "last = min(i0 + Br, Nq) - 1")],
        loses=[Q1[8]],
        says="differ from the float64 reference",
        why="causal=True is bottom-right aligned: row r sees keys up to r + diag, diag = Nk - Nq; without diag "
            "the loop stops too early when Nq < Nk (and visits tiles of no use when Nq > Nk). The public tests "
            "have Nq = Nk, where diag = 0: only the hidden test with Nq != Nk catches it"),
    Bug("float64: the tile count by true division", cell=1, region="tile-count",
        replace=[("n_tiles = cdiv_dev(Nk, Bc)", "n_tiles = int(math.ceil(Nk / Bc))")],
        loses=[Q1[6]],
        says="float64",
        why="Nk / Bc is a float64 division on the GPU (and math.ceil a float64 instruction): integer ceiling "
            "division is (Nk + Bc - 1) // Bc, i.e. cdiv_dev"),
    Bug("Q2: the window counted as `window` key blocks (forgets that Br = 2 Bc puts the diagonal in two)", cell=2,
        replace=[("min(window + 1, 2 * I + 2)", "min(window, 2 * I + 2)")],
        loses=["q2: (a) K and V bytes of the block-sparse forward", "q2: (b) all bytes, block-sparse / dense causal"],
        says="kv_bytes: 1.01581e+06 is not within 0.01",
        why="with Br = 64 and Bc = 32 the rows of query block I have their diagonal keys in key blocks 2I and 2I+1: "
            "the causal window of 4 blocks spans window + 1 = 5 key tiles (fewer in the first block rows)"),
    Bug("Q2: the ratio of the K/V bytes only (forgets Q, O, L and the mask)", cell=2,
        replace=[("traffic_ratio = sparse_total / dense_total",
                  "traffic_ratio = kv_bytes / (2 * causal_tiles * Bc * d * 4)")],
        loses=["q2: (b) all bytes, block-sparse / dense causal"],
        says="traffic_ratio: 0.279412 is not within 0.01",
        why="the Nd term (Q read, O and L written once) does not shrink with the mask: the ratio of all bytes "
            "is well above the ratio of visited tiles (and the mask adds one byte per warp per tested tile)"),
    Bug("Q2 (c): the density where K alone (not K and V) equals Q + O", cell=2,
        replace=[("s_star = (2 * N * d) / (2 * Tr * Tc * Bc * d)", "s_star = (2 * N * d) / (Tr * Tc * Bc * d)")],
        loses=["q2: (c) the density where K + V bytes equal Q + O bytes"],
        says="s_star: 0.125 is not within 0.01",
        why="each visited tile reads K_j and V_j, 2 Bc d elements: at density s that is 2 s Tr Tc Bc d = 2 s Tr N d, "
            "equal to the 2 N d of Q and O at s* = 1 / Tr -- below it, the Nd term is most of the traffic"),
]
