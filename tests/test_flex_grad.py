"""``d score_mod / d score`` derived from the modifier's source (flashnb.flex_grad): the derived derivatives equal
the gallery's hand-written ones and hand-written NumPy derivatives of user modifiers on random points; a modifier
with no derivative trains with both FA2 impls against the float64 reference; a hand-written ``score_mod_grad``
still overrides; constructs outside the subset are refused naming the construct and its line; the derived
functions compile for a GPU as float32 code (``numba.cuda.compile_ptx`` in a child process)."""

import inspect
import math

import numpy as np
import pytest
from conftest import assert_close, qkv
from numba import float32, int32

import flashnb
from flashnb import flex, reference
from flashnb.flex import NotDifferentiable
from flashnb.instruments import traffic

TILES = dict(Br=16, Bc=16, warps=1)
# As in test_flex: the backward chains four float32 products of sums over <= 32 O(1) terms and adds dQ by atomics;
# the modifier and its derivative add one float32 rounding each per score.  A wrong derivative moves the
# gradients by O(0.01 - 1) (checked below: the derivative 1 instead of the true one).
BWD = dict(atol=1e-4, rtol=1e-4)

# A captured bias table indexed by h and kv_idx (random, float32, seeded: never zeros).
BIAS = np.random.default_rng(7).standard_normal((2, 32)).astype(np.float32)


# --------------------------------------------------------------------------- user modifiers without a derivative


def capped_bias(score, b, h, q_idx, kv_idx):
    """A tanh soft-cap written inline, a captured bias by (h, kv_idx), and a conditional expression."""
    s = float32(4) * float32(math.tanh(score / float32(4)))
    return s + BIAS[h, kv_idx] if kv_idx <= q_idx else s * float32(0.5)


def capped_bias_np(s, b, h, q, kv):          # the same in float64 NumPy, for the reference
    t = 4 * np.tanh(s / 4)
    return np.where(kv <= q, t + BIAS.astype(np.float64)[h, kv], 0.5 * t)


def capped_bias_grad_np(s, b, h, q, kv):     # its derivative, by hand
    d = 1 - np.tanh(s / 4) ** 2
    return np.where(kv <= q, d, 0.5 * d)


def branches(score, b, h, q_idx, kv_idx):
    """if/else, reassignment, an augmented assignment, min, abs, powers and division."""
    x = score * float32(0.5)
    if x > float32(0):
        y = x * x
    else:
        y = -x
    y += BIAS[h, kv_idx]
    return min(y, float32(3)) + abs(score) / (float32(1) + score ** 2)


def branches_grad_np(s, b, h, q, kv):
    x = 0.5 * s
    y = np.where(x > 0, x * x, -x) + BIAS.astype(np.float64)[h, kv]
    dy = np.where(x > 0, 2 * x * 0.5, -0.5)
    u, du = np.abs(s), np.sign(s)
    w, dw = 1 + s ** 2, 2 * s
    return np.where(y <= 3, dy, 0.0) + (du * w - u * dw) / w ** 2


def smooth(score, b, h, q_idx, kv_idx):
    """exp, log, sqrt, max of three, and a constant sub-expression of the indices."""
    rel = float32(kv_idx - q_idx) * float32(0.125)
    e = math.exp(score * float32(0.25))
    return max(score, rel, float32(0)) + float32(math.log(e + float32(1))) + float32(math.sqrt(e + rel * rel))


def smooth_grad_np(s, b, h, q, kv):
    rel = (kv - q) * 0.125
    e, de = np.exp(0.25 * s), 0.25 * np.exp(0.25 * s)
    dmax = np.where((s >= rel) & (s >= 0), 1.0, 0.0)
    return dmax + de / (e + 1) + de / (2 * np.sqrt(e + rel * rel))


def early_exit(score, b, h, q_idx, kv_idx):
    """An early return, elif reassigning the score itself, a negative integer power."""
    if score > float32(2):
        return score * float32(3) + BIAS[h, kv_idx]
    elif score < float32(-2):
        score = -score
    return (score * score + float32(1)) ** -1 + score * float32(0.25)


def early_exit_grad_np(s, b, h, q, kv):
    u = np.where(s < -2, -s, s)
    du = np.where(s < -2, -1.0, 1.0)
    return np.where(s > 2, 3.0, (-2 * u / (u * u + 1) ** 2 + 0.25) * du)


USER = {"capped_bias": (capped_bias, capped_bias_grad_np), "branches": (branches, branches_grad_np),
        "smooth": (smooth, smooth_grad_np), "early_exit": (early_exit, early_exit_grad_np)}


def _points(rng, n=400, H=2, N=32, score=6.0):
    """Random float32 scores in [-score, score] and int32 indices inside (B=2, H, N, N)."""
    s = rng.uniform(-score, score, n).astype(np.float32)
    b = rng.integers(0, 2, n).astype(np.int32)
    h = rng.integers(0, H, n).astype(np.int32)
    qi = rng.integers(0, N, n).astype(np.int32)
    ki = rng.integers(0, N, n).astype(np.int32)
    return s, b, h, qi, ki


def _scalar(fn, s, b, h, qi, ki):
    """``fn`` evaluated in Python, element by element (as the simulator runs a device function)."""
    return np.array([float(fn(s[n], int(b[n]), int(h[n]), int(qi[n]), int(ki[n]))) for n in range(s.size)])


# --------------------------------------------------------------------------- (a) derived == hand-written


# The gallery's score modifiers (those with a hand-written .grad); the mask modifiers have no derivative.
GALLERY_SCORE = {"alibi": flex.alibi(4), "softcap": flex.softcap(3.0)}
GALLERY_MASK = {"causal": flex.causal(), "sliding_window": flex.sliding_window(8),
                "document": flex.document(np.arange(32) // 8), "prefix_lm": flex.prefix_lm(4)}


def test_gallery_covers_every_score_modifier():
    assert set(GALLERY_SCORE) | set(GALLERY_MASK) == set(flex.GALLERY)
    assert all(hasattr(m, "grad") for m in GALLERY_SCORE.values())
    assert not any(hasattr(m, "grad") or len(inspect.signature(m).parameters) != 4 for m in GALLERY_MASK.values())


@pytest.mark.parametrize("name", list(GALLERY_SCORE))
def test_derived_equals_hand_written_gallery_grad(rng, name):
    """Both run in float32 (the derived ``(1/c)·(1 - t²)·c`` rounds up to 3 more times than the hand-written
    ``1 - t²``: a few ulps, ~2e-7 relative): rtol 1e-6, atol 1e-7 for values near 0 (``1 - t²`` at |score| >> cap)."""
    sm = GALLERY_SCORE[name]
    pts = _points(rng, H=4, N=128, score=12.0)
    derived = flex.derivative(sm)
    assert derived.py_func is not sm.grad
    assert_close(_scalar(derived, *pts), _scalar(sm.grad, *pts), atol=1e-7, rtol=1e-6, what=f"d {name} / d score")


@pytest.mark.parametrize("name", list(USER))
def test_derived_equals_hand_written_numpy_derivative(rng, name):
    """The derived derivative (float32) against the derivative written by hand in float64 NumPy, at random points:
    a chain of a few float32 roundings, each ~6e-8 relative, through terms of magnitude <= ~10: rtol 2e-5,
    atol 2e-6.  A wrong rule (a sign, a missing chain factor, the other branch) is off by O(0.1)."""
    fn, grad_np = USER[name]
    pts = _points(rng)
    got = _scalar(flex.derivative(fn), *pts)
    s, b, h, qi, ki = pts
    want = grad_np(s.astype(np.float64), b, h, qi, ki)
    assert_close(got, want, atol=2e-6, rtol=2e-5, what=f"d {name} / d score")


def test_kinks_take_the_documented_side():
    """abs' derivative is 0 at 0 (as torch.abs); a tie of min/max takes the first argument's derivative."""
    d = flex.derivative(branches)
    # score = 0: x = 0 takes the else branch (d y = -0.5), abs contributes 0, y = BIAS[0, 1] <= 3
    assert float(d(np.float32(0), 0, 0, 0, 1)) == pytest.approx(-0.5, abs=1e-7)
    dmax = flex.derivative(smooth)
    # score = rel = 0 at q_idx == kv_idx: max's tie takes score's derivative 1 (plus the smooth terms)
    want = 1 + 0.25 * 1 / 2 + 0.25 / 2
    assert float(dmax(np.float32(0), 0, 0, 5, 5)) == pytest.approx(want, abs=1e-6)


def test_derivative_source_is_shown_and_overrides_are_kept():
    src = flex.derivative_source(flex.alibi(2))
    assert src.splitlines()[1] == "def alibi_bias_dscore(score, b, h, q_idx, kv_idx):"
    assert "return _fnb_float32(1)" in src                       # score + slopes[h]·(...): derivative 1
    assert "d_s" in flex.derivative_source(capped_bias)           # the tangent of the local s
    sm = flex.softcap(3.0)
    assert flex.score_mod_grad_of(sm) is sm.grad                  # .grad overrides the derivation
    assert flex.score_mod_grad_of(capped_bias, flex.alibi(2).grad).__name__ == "alibi_grad"
    assert flex.score_mod_grad_of(capped_bias) == flex.derivative(capped_bias)
    assert flex.score_mod_grad_of(None) is None


# --------------------------------------------------------------------------- (b) it trains, on both impls


def one(score, b, h, q_idx, kv_idx):
    return float32(1)


def _derived_pairs():
    return [(flex.derivative(fn), "score_mod_grad") for fn in (*(f for f, _ in USER.values()),
                                                                *GALLERY_SCORE.values())]


@pytest.fixture(scope="module", autouse=True)
def checked():
    """Every modifier the launches below use, and every derived function, compiled for a GPU once, in one batch
    (one child process, ~3 s), before any test launches."""
    flex.check_many([(capped_bias, "score_mod"), (one, "score_mod_grad"), (f64_grad, "score_mod_grad"),
                     *_derived_pairs()], strict=False)


@pytest.fixture(scope="module")
def problem():
    rng = np.random.default_rng(11)
    q, k, v, do = qkv(rng, (1, 2, 32, 16), 32, do=True)
    return q, k, v, do


@pytest.mark.parametrize("impl", ["flash"])
def test_modifier_without_grad_trains(problem, impl):
    """``capped_bias`` has no ``.grad`` and no ``score_mod_grad`` is given: the backward derives it."""
    q, k, v, do = problem
    o, lse = flashnb.attention_forward(q, k, v, impl=impl, score_mod=capped_bias, **TILES)
    grads = flashnb.attention_backward(q, k, v, o, lse, do, impl=impl, score_mod=capped_bias, **TILES)
    ref = reference.attention_backward(q, k, v, do, score_mod=capped_bias_np, score_mod_grad=capped_bias_grad_np)
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, ref):
        assert_close(g, g_ref, **BWD, what=f"{name} ({impl})")


def test_score_mod_grad_overrides_the_derivation(problem):
    """A given score_mod_grad is used as given (here the wrong derivative 1): the gradients follow it, and differ
    from the true ones by far more than the tolerance (so the test above can fail)."""
    q, k, v, do = problem
    o, lse = flashnb.attention_forward(q, k, v, score_mod=capped_bias, **TILES)
    dq = flashnb.attention_backward(q, k, v, o, lse, do, score_mod=capped_bias, score_mod_grad=one, **TILES)[0]
    unit = reference.attention_backward(q, k, v, do, score_mod=capped_bias_np,
                                        score_mod_grad=lambda s, *_: np.ones_like(s))[0]
    true = reference.attention_backward(q, k, v, do, score_mod=capped_bias_np, score_mod_grad=capped_bias_grad_np)[0]
    assert_close(dq, unit, **BWD, what="dq (score_mod_grad = 1)")
    assert np.abs(unit - true).max() > 100 * BWD["atol"]


# --------------------------------------------------------------------------- (c) refusals


def while_loop(score, b, h, q_idx, kv_idx):
    while score > float32(1):   # refused
        score = score * float32(0.5)
    return score


def unknown_call(score, b, h, q_idx, kv_idx):
    s = score * float32(2)
    return s + np.sinh(s)   # refused


def index_by_score(score, b, h, q_idx, kv_idx):
    return score + BIAS[h, int32(score)]   # refused


def floor_division(score, b, h, q_idx, kv_idx):
    return score // float32(2)   # refused


def _line(fn):
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, ln in enumerate(lines) if "# refused" in ln)


@pytest.mark.parametrize("fn, construct", [
    (while_loop, r"a loop \(`while`\)"),
    (unknown_call, r"a call of `np\.sinh` on a value that depends on score \(`np\.sinh\(s\)`\)"),
    (index_by_score, r"indexing by a value that depends on score \(`BIAS\[h, int32\(score\)\]`\)"),
    (floor_division, r"the operator `//` on a value that depends on score \(`score // float32\(2\)`\)"),
], ids=["while", "unknown-call", "index-by-score", "floor-division"])
def test_outside_the_subset_is_refused_naming_construct_and_line(fn, construct):
    match = (rf"score_mod '{fn.__name__}' cannot be differentiated automatically: {construct}, at line "
             rf"{_line(fn)} of .*test_flex_grad\.py, is outside the subset.*pass score_mod_grad")
    with pytest.raises(NotDifferentiable, match=match):
        flex.derivative(fn)


@pytest.mark.parametrize("impl", ["flash"])
def test_backward_refuses_before_any_launch(problem, impl):
    q, k, v, do = problem
    o, lse = reference.attention_forward(q, k, v, score_mod=flex.numpy_modifier(floor_division))
    with traffic.count() as t, pytest.raises(NotDifferentiable, match="floor_division"):
        flashnb.attention_backward(q, k, v, o, lse, do, impl=impl, score_mod=floor_division, check_forward=False)
    assert t.summary() == []


# --------------------------------------------------------------------------- float32 device code for a GPU


def test_derived_functions_compile_for_a_gpu_as_float32():
    """Each derived function compiled alone with ``numba.cuda.compile_ptx`` for sm_80 (in the ``checked`` batch):
    it compiles, has no ``.f64`` instruction and returns float32 -- else check_many raises, naming it."""
    flex.check_many(_derived_pairs())


def test_the_gpu_check_sees_a_float64_derivative():
    """The check above can fail: a derivative with a Python float literal (as a careless rule would write) is
    refused for its .f64 instructions."""
    with pytest.raises(flex.ModifierError, match=r"score_mod_grad 'f64_grad' computes in float64"):
        flex.check_many([(f64_grad, "score_mod_grad")])


def f64_grad(score, b, h, q_idx, kv_idx):
    return float32(score * 0.1)
