"""The public API: shapes, dtypes, layouts and every bad input of issue 2 item 4."""

import numpy as np
import pytest
from conftest import assert_close, qkv

import flashnb
from flashnb import reference

# float32 compute vs float64 reference on N <= 24, d <= 8: each output is a sum of <= 24 products of
# O(1) numbers, so rounding stays near 24 * 2**-24 ~ 1.5e-6; 1e-5 leaves room without hiding real bugs.
TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", [(5, 3), (2, 5, 3), (1, 2, 5, 3)])
def test_accepts_2d_3d_4d_and_returns_same_layout(rng, shape):
    q, k, v = qkv(rng, shape, 7)
    o, lse = flashnb.attention_forward(q, k, v)
    assert o.shape == q.shape and o.dtype == np.float32
    assert lse.shape == q.shape[:-1] and lse.dtype == np.float32
    o_ref, lse_ref = reference.attention_forward(q, k, v)
    assert_close(o, o_ref, **TOL, what="o")
    assert_close(lse, lse_ref, **TOL, what="lse")
    assert_close(flashnb.attention(q, k, v), o_ref, **TOL, what="attention()")


def test_non_contiguous_and_other_dtypes(rng):
    base = rng.standard_normal((2, 9, 12))
    q = base[:, :, ::2]                      # strided view, d = 6
    k = np.asfortranarray(rng.standard_normal((2, 11, 6)))
    v = rng.standard_normal((2, 6, 11)).transpose(0, 2, 1)  # transposed view
    assert not q.flags.c_contiguous and not v.flags.c_contiguous
    o = flashnb.attention(q.astype(np.float16).astype(np.float64), k.astype(np.float32), v)
    o_ref, _ = reference.attention_forward(q.astype(np.float16).astype(np.float64), k, v)
    assert_close(o, o_ref, **TOL, what="o (non-contiguous)")
    ints = rng.integers(-3, 4, size=(4, 3))
    assert_close(flashnb.attention(ints, ints, ints), reference.attention_forward(ints, ints, ints)[0], **TOL,
                 what="o (integer inputs)")


def test_scale_is_used(rng):
    q, k, v = qkv(rng, (6, 4), 5)
    assert_close(flashnb.attention(q, k, v, scale=0.7), reference.attention_forward(q, k, v, scale=0.7)[0], **TOL,
                 what="o (scale=0.7)")


def _good(rng):
    return qkv(rng, (2, 3, 4), 5)


@pytest.mark.parametrize(
    "mutate, exc, words",
    [
        (lambda q, k, v: (q[0, 0], k, v), ValueError, "ndim"),                     # 1-D q
        (lambda q, k, v: (q[None, None], k[None, None], v[None, None]), ValueError, "ndim"),  # 5-D
        (lambda q, k, v: (q, k, v[:, :4]), ValueError, "k and v"),                 # Nk mismatch
        (lambda q, k, v: (q, k[..., :3], v[..., :3]), ValueError, "head dim"),     # d mismatch
        (lambda q, k, v: (np.stack([q, q]), k[None], v[None]), ValueError, "leading"),   # batch mismatch
        (lambda q, k, v: (q[:1], k, v), ValueError, "multiple of k's and v's heads"),   # heads: no GQA group
        (lambda q, k, v: (q[:, :0], k, v), ValueError, "empty"),                   # Nq = 0
        (lambda q, k, v: (q, k[:, :0], v[:, :0]), ValueError, "empty"),            # Nk = 0
        (lambda q, k, v: (q.astype(complex), k, v), TypeError, "real"),            # complex
        (lambda q, k, v: (q, k.astype(object), v), TypeError, "real"),             # object
        (lambda q, k, v: (q, k, np.array([["a"]])), TypeError, "real"),            # strings
        (lambda q, k, v: (np.where(q > 0, np.nan, q), k, v), ValueError, "NaN"),   # non-finite input
    ],
)
def test_bad_inputs_raise_naming_the_argument(rng, mutate, exc, words):
    q, k, v = mutate(*_good(rng))
    with pytest.raises(exc, match=words):
        flashnb.attention(q, k, v)


@pytest.mark.parametrize("d", [0, 129, 200])
def test_head_dim_range(rng, d):
    q = rng.standard_normal((3, d)) if d else np.ones((3, 0))
    with pytest.raises(ValueError):
        flashnb.attention(q, q, q)


def test_head_dim_128_is_accepted(rng):
    q, k, v = qkv(rng, (2, 128), 3)
    assert_close(flashnb.attention(q, k, v), reference.attention_forward(q, k, v)[0], **TOL, what="o (d=128)")


@pytest.mark.parametrize("scale, exc", [(1e39, ValueError), (-1e39, ValueError), (float("nan"), ValueError),
                                        (float("inf"), ValueError), ("0.5", TypeError), (True, TypeError)])
def test_bad_scale(rng, scale, exc):
    q, k, v = _good(rng)
    with pytest.raises(exc, match="scale"):
        flashnb.attention(q, k, v, scale=scale)


def test_unknown_impl_and_option(rng):
    q, k, v = _good(rng)
    with pytest.raises(ValueError, match="impl must be one of"):
        flashnb.attention(q, k, v, impl="flash3")
    with pytest.raises(TypeError, match="option"):
        flashnb.attention(q, k, v, impl="naive", Br=16)


def test_backward_validates_o_lse_do(rng):
    q, k, v, do = qkv(rng, (2, 3, 4), 5, do=True)
    o, lse = flashnb.attention_forward(q, k, v)
    with pytest.raises(ValueError, match="do must have"):
        flashnb.attention_backward(q, k, v, o, lse, do[:, :2])
    with pytest.raises(ValueError, match="lse must have"):
        flashnb.attention_backward(q, k, v, o, lse[:, :2], do)
    with pytest.raises(ValueError, match="o must have"):
        flashnb.attention_backward(q, k, v, o[..., :2], lse, do)
    with pytest.raises(ValueError, match="lse"):
        flashnb.attention_backward(q, k, v, o, np.full_like(lse, np.nan), do)


def test_values_beyond_float32_and_non_bool_causal(rng):
    q, k, v = _good(rng)
    with pytest.raises(ValueError, match="float32 range"):
        flashnb.attention(q * 1e39, k, v)          # finite in float64, inf in float32
    with pytest.raises(TypeError, match="causal"):
        flashnb.attention(q, k, v, causal="no")


def test_launch_refuses_arrays_the_guard_never_compiled(rng):
    """A float64 or strided device array would make numba compile an unguarded specialisation."""
    from numba import cuda

    from flashnb import common
    from flashnb.stages import naive

    q64 = cuda.to_device(rng.standard_normal((1, 4, 4)))
    with pytest.raises(TypeError, match="float32"):
        naive.forward(q64, q64, q64, causal=False, scale=1.0)
    strided = cuda.to_device(rng.standard_normal((1, 4, 8)).astype(np.float32))[:, :, ::2]  # a device view
    ok = common.to_device(rng.standard_normal((1, 4, 4)))
    with pytest.raises(TypeError, match="C-contiguous"):
        naive.forward(strided, ok, ok, causal=False, scale=1.0)


# ----------------------------------------------------------------- the public surface and kernel_options


def test_all_is_the_small_surface():
    """``flashnb.__all__`` holds what users call; plumbing modules and compatibility maps stay attributes."""
    assert flashnb.__all__ == ["attention", "attention_forward", "attention_backward", "create_block_mask",
                               "BlockMask", "MODE"]
    for name in flashnb.__all__:
        assert getattr(flashnb, name) is not None
    from flashnb import flex, masks

    assert flashnb.create_block_mask is flex.create_block_mask and flashnb.BlockMask is masks.BlockMask
    for name in ("registry", "common", "instruments", "stages", "kernels", "MOVED", "RENAMED", "__version__"):
        assert name not in flashnb.__all__ and getattr(flashnb, name) is not None


def test_kernel_options_is_the_keywords(rng):
    q, k, v = qkv(rng, (2, 20, 8), 20)
    knobs = dict(Br=16, Bc=16, warps=1)
    o1, lse1 = flashnb.attention_forward(q, k, v, causal=True, impl="fa2", kernel_options=knobs)
    o2, lse2 = flashnb.attention_forward(q, k, v, causal=True, impl="fa2", **knobs)
    assert np.array_equal(o1, o2) and np.array_equal(lse1, lse2)
    assert np.array_equal(flashnb.attention(q, k, v, causal=True, impl="fa2", kernel_options=knobs), o1)
    do = rng.standard_normal(o1.shape)
    g1 = flashnb.attention_backward(q, k, v, o1, lse1, do, causal=True, impl="fa2", kernel_options=knobs)
    g2 = flashnb.attention_backward(q, k, v, o1, lse1, do, causal=True, impl="fa2", **knobs)
    for a, b in zip(g1, g2):
        assert np.array_equal(a, b)
    o3 = flashnb.attention(q[0], k[0], v[0], impl="naive", kernel_options={"tile": 8})
    assert_close(o3, reference.attention_forward(q[0], k[0], v[0])[0], **TOL, what="naive, tile=8")


@pytest.mark.parametrize("call", ["attention", "attention_forward", "attention_backward"])
def test_kernel_options_unknown_key_is_named(rng, call):
    q, k, v = qkv(rng, (6, 4), 6)
    args = (q, k, v) if call != "attention_backward" else (q, k, v, q, q[:, 0], q)
    with pytest.raises(ValueError, match=r"unknown key 'block_mask'.*allowed keys: \['Br', 'Bc', 'warps'"):
        getattr(flashnb, call)(*args, kernel_options={"block_mask": None})
    with pytest.raises(ValueError, match="'Br' is also given as a keyword"):
        getattr(flashnb, call)(*args, Br=16, kernel_options={"Br": 16})
    with pytest.raises(TypeError, match="kernel_options must be a dict"):
        getattr(flashnb, call)(*args, kernel_options=[("Br", 16)])


def test_kernel_options_an_impl_does_not_take(rng):
    q, k, v = qkv(rng, (6, 4), 6)
    with pytest.raises(TypeError, match=r"unexpected option\(s\) \['num_splits'\]"):
        flashnb.attention(q, k, v, impl="fa2", kernel_options={"num_splits": 2})


def test_import_defers_the_kernels():
    """``import flashnb`` loads the surface only; impls are imported when asked for, and listings see them all."""
    import subprocess
    import sys

    code = ("import sys, flashnb\n"
            "loaded = sorted(m for m in sys.modules if m.startswith(('flashnb.stages', 'flashnb.kernels', "
            "'flashnb.flex')))\n"
            "assert not loaded, loaded\n"
            "assert flashnb.registry.impl_entry('fa2') is not None and 'flashnb.stages.fa2' in sys.modules\n"
            "assert not [m for m in sys.modules if m.startswith('flashnb.kernels.launch')]\n"
            "import flashnb.fa2 as old\n"
            "assert old is sys.modules['flashnb.stages.fa2'] and flashnb.traffic is flashnb.instruments.traffic\n"
            "names = list(flashnb.registry.IMPLS)\n"
            "assert names[:4] == ['naive', 'onepass', 'fa1', 'fa2'] and 'flash' in names, names\n"
            "assert len(flashnb.registry.KERNELS) > 40\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
