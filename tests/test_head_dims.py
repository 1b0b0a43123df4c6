"""Every head dim, for every impl on CUDA cores: forward and backward against float64, at the head dims where each
kernel's geometry changes (and a rotating sample of the others; the exhaustive sweep is ``slow``).  The tensor-core
kernel's sweep is tests/kernels/test_flash_tc_head_dims.py; the machinery is tests/sweep.py."""

import pytest
import sweep

import flashnb

pytestmark = pytest.mark.skipif(flashnb.MODE != "sim", reason="simulator sweep")

IMPLS = [("naive", ["float32"]), ("onepass", ["float32"]), ("fa1", ["float32"]), ("fa2", ["float32"]),
         ("fa2-rows", ["float32"]), ("fa2-splitq", ["float32"]), ("fa2-sparse", ["float32"]),
         ("fa2-fast", ["float32"]), ("flash-decoding", ["float32"]),
         ("flash", ["float32", "float16", "bfloat16"])]
CI, EXHAUSTIVE = sweep.cases(IMPLS, boundary_k=6, other_k=1)


def test_every_cuda_core_impl_is_swept():
    from flashnb import registry
    swept = {name for name, _ in IMPLS}
    assert swept == set(registry.IMPLS) - {"fa2-tc"}, "a new impl joins the head-dim sweep"


@pytest.mark.parametrize("impl, storage, d, causal", CI)
def test_head_dim(rng, impl, storage, d, causal):
    sweep.check_head_dim(rng, impl, storage, d, causal)


@pytest.mark.slow
@pytest.mark.parametrize("impl, storage, d, causal", EXHAUSTIVE)
def test_head_dim_exhaustive(rng, impl, storage, d, causal):
    sweep.check_head_dim(rng, impl, storage, d, causal)
