"""Every head dim of the tensor-core kernel (impl="fa2-tc"), forward and backward, float16, bfloat16 and float32
(TF32), against float64 with FlashAttention's rule: every boundary of its geometry -- the padded width, the copy
path, dQ_i's column parts, K_j's fragments kept in registers, the default tiles -- is in the CI run, and a rotating
sample of the rest; the exhaustive sweep is ``slow`` (tests/sweep.py)."""

import pytest
import sweep

import flashnb

pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(flashnb.MODE != "sim", reason="simulator sweep")

CI, EXHAUSTIVE = sweep.cases([("fa2-tc", ["float16", "bfloat16", "float32"])], boundary_k=48, other_k=2)


def test_the_dq_parts_tile_every_padded_width():
    """dQ_i's parts cover each padded width exactly once, in whole pairs of n-tiles (what the kernel's loop over
    ``range(0, NDQ, 2)`` and its atomics assume), for every head dim and every tile choice the launcher makes."""
    from flashnb.kernels.tensorcore import geometry
    for storage in ("float16", "bfloat16"):
        for d in range(1, 129):
            for static in (False, True):
                t = geometry.bwd_default_tiles(d, storage, static=static)
                g = geometry.bwd_geometry(storage, d, **t)
                covered = sorted(c0 + c for c0 in range(0, g["CPT"] * g["NDQ"] * 8, g["NDQ"] * 8)
                                 for c in range(g["NDQ"] * 8))
                assert covered == list(range(g["Dp"])) and g["NDQ"] % 2 == 0, (storage, d, t, g["CPT"], g["NDQ"])


@pytest.mark.parametrize("impl, storage, d, causal", CI)
def test_head_dim(rng, impl, storage, d, causal):
    sweep.check_head_dim(rng, impl, storage, d, causal)


@pytest.mark.slow
@pytest.mark.parametrize("impl, storage, d, causal", EXHAUSTIVE)
def test_head_dim_exhaustive(rng, impl, storage, d, causal):
    sweep.check_head_dim(rng, impl, storage, d, causal)
