"""FlashAttention's rule for half precision, shared by the tensor-core tests and the head-dim sweep: against the
float64 reference of the (upcast) half inputs, an output's error is at most 2x, and a gradient's at most 3x, those of
the same attention computed by PyTorch in the same half dtype (what a user of half precision accepts already)."""

import numpy as np
import pytest

from flashnb import common, reference

torch = pytest.importorskip("torch")

HALF = {"float16": (np.float16, torch.float16), "bfloat16": (np.uint16, torch.bfloat16)}


def half_inputs(rng, storage, shape_q, Nk, do=True):
    """Random half q, k, v (and do): what fa2-tc gets (NumPy: float16, or uint16 bfloat16 bits), the same values
    as float64 (the reference's inputs) and as torch tensors of the half dtype."""
    *lead, Nq, d = shape_q
    arrays = [rng.standard_normal(s) for s in (shape_q, (*lead, Nk, d), (*lead, Nk, d), shape_q)[:4 if do else 3]]
    if storage == "float16":
        held = [a.astype(np.float16) for a in arrays]
        exact = [h.astype(np.float64) for h in held]
    else:
        held = [common.to_bfloat16(a) for a in arrays]
        exact = [common.from_bfloat16(h).astype(np.float64) for h in held]
    tensors = [torch.tensor(e, dtype=HALF[storage][1]) for e in exact]
    return held, exact, tensors


def values(a, storage):
    """float64 values of what fa2-tc returned in ``storage``."""
    return (common.from_bfloat16(a) if storage == "bfloat16" else np.asarray(a)).astype(np.float64)


def torch_half(q, k, v, do, causal, scale, group=1, W=None, score_fn=None, mask=None):
    """Attention computed by PyTorch in the half dtype of its inputs (matmuls, softmax and all), with autograd;
    ``group``: query heads per K/V head (GQA: K, V repeated in the graph along the head axis, so their gradients sum
    over each group); ``W``: dropout factors ``Z / (1-p)`` multiplying the softmax (as FA1 Alg. 2 applies them);
    ``score_fn(s, h, q, k)``: a score_mod on the scaled scores (its derivative by autograd), ``mask`` a boolean
    mask broadcast to the scores, beside the causal one."""
    q, k0, v0 = (t.clone().requires_grad_(True) for t in (q, k, v))
    k, v = k0.repeat_interleave(group, dim=-3), v0.repeat_interleave(group, dim=-3)
    s = (q @ k.transpose(-1, -2)) * scale
    Nq, Nk = s.shape[-2:]
    if score_fn is not None:
        h = torch.arange(s.shape[-3])[:, None, None]
        s = score_fn(s, h, torch.arange(Nq)[:, None], torch.arange(Nk)[None, :])
    if causal or mask is not None:
        allowed = torch.tensor(reference._allowed(tuple(s.shape), causal, mask))
        s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)     # a row with no key: o = 0 (flashnb's and FlashAttention's rule)
    if W is not None:
        p = p * torch.tensor(W, dtype=p.dtype)
    o = p @ v
    o.backward(do)
    return [x.detach().double().numpy() for x in (o, q.grad, k0.grad, v0.grad)]


def maxerr(a, b):
    finite = np.isfinite(b)
    return float(np.abs(np.asarray(a)[finite] - b[finite]).max())
