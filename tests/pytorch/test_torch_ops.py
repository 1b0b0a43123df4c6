"""flashnb inside PyTorch's machinery: the custom operators ``torch.ops.flashnb.attention_forward`` /
``attention_backward`` (``torch.library.opcheck``), ``torch.compile(fullgraph=True)`` of modules that call
``flashnb.pytorch.attention``, the registry that carries Python arguments across the operator boundary, and
transformers models run with ``attn_implementation`` set to flashnb's registered name.

Tolerances.  Compiled against eager flashnb: the same kernels on the same inputs, so equal bit for bit
(``torch.equal``).  Against float64 SDPA: tests/pytorch/test_torch.py's TOL = 2e-5 (float32 rounding of sums of <= 64
O(1) terms).  transformers against ``"eager"``: both in float32, flashnb's online softmax against eager's
materialised softmax; logits are sums through two layers of hidden size 32, so 1e-5 (abs) is ~100x the float32
rounding seen and far below what a wrong mask or head grouping gives (O(0.1)); parameter gradients 1e-5 likewise.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import flashnb.pytorch as ft  # noqa: E402
from flashnb import flex, rng  # noqa: E402
from flashnb.pytorch import ops  # noqa: E402

TOL = 2e-5
SMALL = dict(Br=16, Bc=16, warps=1)
OPTS = ops.encode_options(SMALL)


def _qkv(seed, B=1, H=2, H_kv=2, Nq=16, Nk=16, d=8, dtype=torch.float32, grad=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Nq, d, generator=g).to(dtype)
    k, v = (torch.randn(B, H_kv, Nk, d, generator=g).to(dtype) for _ in range(2))
    if grad:
        for t in (q, k, v):
            t.requires_grad_(True)
    return q, k, v


def _sdpa64(q, k, v, causal, scale=None, dropout_mask=None):
    """float64 SDPA by definition (GQA by repeating K/V heads), for flashnb's causal names."""
    q, k, v = (t.detach().double() for t in (q, k, v))
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    s = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    Nq, Nk = s.shape[-2:]
    if causal:
        i, j = torch.arange(Nq)[:, None], torch.arange(Nk)[None, :]
        s = s.masked_fill(~(j <= i + (0 if causal == "upper_left" else Nk - Nq)), float("-inf"))
    p = torch.softmax(s, dim=-1)
    if dropout_mask is not None:
        p = p * dropout_mask
    return p @ v


# --------------------------------------------------------------------------- the operators

OPCHECK_CASES = {
    "dense": dict(causal="none", dtype=torch.float32, H_kv=2, Nq=16, Nk=16),
    "lower-right-gqa": dict(causal="lower_right", dtype=torch.float32, H_kv=1, Nq=12, Nk=20),
    "upper-left-bf16": dict(causal="upper_left", dtype=torch.bfloat16, H_kv=2, Nq=20, Nk=12),
}


@pytest.mark.parametrize("case", OPCHECK_CASES, ids=list(OPCHECK_CASES))
def test_opcheck_forward_and_backward(case):
    c = OPCHECK_CASES[case]
    q, k, v = _qkv(1, H_kv=c["H_kv"], Nq=c["Nq"], Nk=c["Nk"], dtype=c["dtype"], grad=True)
    args = (q, k, v, None, c["causal"], None, 0.0, "flash", OPTS)
    torch.library.opcheck(torch.ops.flashnb.attention_forward.default, args)
    o, lse = torch.ops.flashnb.attention_forward(*args)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(c["dtype"])
    torch.library.opcheck(torch.ops.flashnb.attention_backward.default,
                          (do, q.detach(), k.detach(), v.detach(), o.detach(), lse.detach(), None, c["causal"],
                           None, 0.0, "flash", OPTS))


def test_opcheck_with_dropout_and_a_score_mod():
    q, k, v = _qkv(3, grad=True)
    seed = torch.tensor([12345], dtype=torch.int64)
    opts = ops.encode_options(dict(SMALL, score_mod=flex.softcap(5.0)))
    args = (q, k, v, seed, "lower_right", 0.5, 0.25, "flash", opts)
    torch.library.opcheck(torch.ops.flashnb.attention_forward.default, args)


def test_operator_outputs_are_the_reference():
    q, k, v = _qkv(4, H_kv=1, Nq=12, Nk=20)
    o, lse = torch.ops.flashnb.attention_forward(q, k, v, None, "lower_right", None, 0.0, "flash", OPTS)
    want = _sdpa64(q, k, v, "lower_right")
    assert torch.allclose(o.double(), want, atol=TOL, rtol=TOL)
    assert lse.dtype == torch.float32 and lse.shape == (1, 2, 12)


@pytest.mark.parametrize("bad, err, words", [
    (dict(q=torch.zeros(1, 2, 16, 8, dtype=torch.float64)), TypeError, "k has dtype torch.float32 but q has"),
    ({n: torch.zeros(1, 2, 16, 8, dtype=torch.float64) for n in "qkv"}, TypeError,
     "q has dtype torch.float64; the operator takes float32, float16 or bfloat16"),
    (dict(k=torch.zeros(1, 2, 8, 8, dtype=torch.float16)), TypeError, "k has dtype torch.float16 but q"),
    (dict(v=torch.zeros(1, 2, 8)), ValueError, "v must have shape (B, H, N, d)"),
    (dict(k=torch.zeros(1, 3, 8, 8), v=torch.zeros(1, 3, 8, 8)), ValueError, "multiple of k's"),
    (dict(causal="diagonal"), ValueError, "causal must be one of"),
    (dict(dropout_p=0.1), ValueError, "needs a seed tensor"),
    (dict(seed=torch.tensor([1.0]), dropout_p=0.1), TypeError, "seed must be an int64 tensor"),
    (dict(options="{not json"), ValueError, "options must be the JSON string"),
    (dict(impl="no-such-impl"), ValueError, "no-such-impl"),
])
def test_operator_refuses_bad_arguments_naming_them(bad, err, words):
    q, k, v = _qkv(5)
    args = dict(q=q, k=k, v=v, seed=None, causal="none", scale=None, dropout_p=0.0, impl="flash", options=OPTS)
    args.update(bad)
    with pytest.raises(err, match=words.replace("(", r"\(").replace(")", r"\)")):
        torch.ops.flashnb.attention_forward(*args.values())


def test_a_handle_from_another_process_or_evicted_is_refused():
    q, k, v = _qkv(6)
    foreign = '{"score_mod":{"$flashnb":"score_mod#0123456789ab.1"}}'
    with pytest.raises(ValueError, match="another process"):
        torch.ops.flashnb.attention_forward(q, k, v, None, "none", None, 0.0, "flash", foreign)
    small = ops.Registry(size=1)
    first = small.handle("score_mod", flex.softcap(3.0))
    small.handle("score_mod", flex.softcap(4.0))                      # evicts the first
    with pytest.raises(ValueError, match="dropped"):
        small.lookup(first, "score_mod", "attention_forward", "forward")


# --------------------------------------------------------------------------- torch.compile(fullgraph=True)


class Block(torch.nn.Module):
    """A projection, flashnb attention, a projection: what a model layer does around the operator."""

    def __init__(self, d, **kw):
        super().__init__()
        self.inp, self.out, self.kw = torch.nn.Linear(d, d), torch.nn.Linear(d, d), kw

    def forward(self, q, k, v):
        return self.out(ft.attention(self.inp(q), k, v, **self.kw, **SMALL))


COMPILE_CASES = {
    "causal-gqa": dict(shape=dict(H_kv=1, Nq=12, Nk=20), kw=dict(causal=True)),
    "upper-left-f16": dict(shape=dict(Nq=20, Nk=12, dtype=torch.float16), kw=dict(causal="upper_left")),
    "dropout": dict(shape={}, kw=dict(causal=True, dropout_p=0.3, seed=99)),
    "score-mod": dict(shape={}, kw=dict(score_mod=flex.alibi(2))),
    "block-mask": dict(shape=dict(Nq=32, Nk=32), kw=dict(block_mask=flex.create_block_mask(
        flex.sliding_window(8), None, None, 32, 32, Br=16, Bc=16))),
}


@pytest.mark.parametrize("case", COMPILE_CASES, ids=list(COMPILE_CASES))
def test_compiled_fullgraph_equals_eager(case):
    c = COMPILE_CASES[case]
    torch.manual_seed(0)
    q, k, v = _qkv(7, grad=True, **c["shape"])
    m = Block(q.shape[-1], **c["kw"]).to(q.dtype)
    outs = {}
    for mode in ("eager", "compiled"):
        m.zero_grad()
        for t in (q, k, v):
            t.grad = None
        fn = m if mode == "eager" else torch.compile(m, fullgraph=True, backend="aot_eager")
        y = fn(q, k, v)
        y.float().square().sum().backward()
        outs[mode] = [y.detach(), q.grad, k.grad, v.grad] + [p.grad for p in m.parameters()]
    for a, b in zip(outs["eager"], outs["compiled"]):
        assert torch.equal(a, b)


def test_compiled_dynamic_true_takes_python_numbers_as_arguments():
    """Before: ``torch.compile(dynamic=True)`` failed at the first call ("assume_constant_result argument conversion
    failed"): dynamo makes Python ints and floats symbolic there, including the defaults of ``attention``.  Here the
    scale, the dropout probability and seed and a tile size are arguments of the compiled function: forward and
    gradients equal eager's at two sequence lengths, and another scale or seed gives eager's answer for it (the
    graph is guarded on their values, never served stale)."""
    def f(q, k, v, scale, p, seed, Bc):
        return ft.attention(q, k, v, causal=True, scale=scale, dropout_p=p, seed=seed, Br=16, Bc=Bc, warps=1)

    g = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")
    for n, (N, scale, seed) in enumerate([(16, 0.4, 3), (24, 0.4, 3), (24, 0.9, 3), (24, 0.9, 8)]):
        got, want = [], []
        for fn, out in ((g, got), (f, want)):
            q, k, v = _qkv(20 + n, Nq=N, Nk=N, grad=True)
            y = fn(q, k, v, scale, 0.25, seed, 16)
            y.square().sum().backward()
            out += [y.detach(), q.grad, k.grad, v.grad]
        for name, a, b in zip(("o", "dq", "dk", "dv"), got, want):
            assert torch.equal(a, b), (N, scale, seed, name)


def test_compiled_through_the_rehearsed_cuda_tensor_path():
    """The operators on CUDA tensors take the zero-copy path (numba views of torch's memory, torch's stream):
    rehearsed here, where CPU tensors take it inside ``pretend_gpu`` + ``rehearse_cuda``.  Compiled there equals
    eager on the host path."""
    from flashnb.instruments.rehearsal import pretend_gpu

    q, k, v = _qkv(11, H_kv=1, grad=True)
    m = Block(8, causal=True)
    y = m(q, k, v)
    y.square().sum().backward()
    want = [y.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone()]
    for t in (q, k, v):
        t.grad = None
    with pretend_gpu(), ft.rehearse_cuda() as bridge:
        m.zero_grad()
        y = torch.compile(m, fullgraph=True, backend="aot_eager")(q, k, v)
        y.square().sum().backward()
    assert bridge.streams                             # the kernels ran on the bridge's streams
    for a, b in zip(want, [y.detach(), q.grad, k.grad, v.grad]):
        assert torch.equal(a, b)


def test_compiled_with_inductor_matches_float64_sdpa():
    """The default backend (inductor compiles the projections around the opaque operator): o and gradients
    against float64 SDPA of the same layer."""
    torch.manual_seed(0)
    q, k, v = _qkv(8, H_kv=1, Nq=12, Nk=20, grad=True)
    m = Block(8, causal=True)
    y = torch.compile(m, fullgraph=True)(q, k, v)
    y.square().sum().backward()
    got = [y.detach(), q.grad, k.grad, v.grad]
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    m64 = Block(8).double()
    m64.load_state_dict(m.state_dict())
    y64 = m64.out(_sdpa64_diff(m64.inp(q64), k64, v64))
    y64.square().sum().backward()
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, [y64.detach(), q64.grad, k64.grad, v64.grad]):
        assert torch.allclose(a.double(), b, atol=1e-4, rtol=1e-4), name   # two projections around TOL's sums


def _sdpa64_diff(q, k, v):
    G = q.shape[1] // k.shape[1]
    i, j = torch.arange(q.shape[2])[:, None], torch.arange(k.shape[2])[None, :]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1),
                                          attn_mask=j <= i + (k.shape[2] - q.shape[2]))


def test_compiled_dropout_draws_the_seed_inside_the_graph():
    """Without ``seed``, the seed is drawn from torch's generator as part of the graph: two calls draw two masks,
    ``torch.manual_seed`` repeats them, and the mask is flashnb's Philox mask of that seed."""
    q, k, v = _qkv(9)
    fn = torch.compile(lambda q, k, v: ft.attention(q, k, v, dropout_p=0.5, **SMALL), fullgraph=True,
                       backend="aot_eager")
    torch.manual_seed(5)
    a, b = fn(q, k, v), fn(q, k, v)
    torch.manual_seed(5)
    assert torch.equal(fn(q, k, v), a) and not torch.equal(a, b)
    torch.manual_seed(5)
    seed = ft._draw_seed()
    mask = torch.from_numpy(rng.dropout_scale_np(seed, 0.5, 2, 16, 16).reshape(1, 2, 16, 16))
    assert torch.allclose(a.double(), _sdpa64(q, k, v, False, dropout_mask=mask), atol=2 * TOL, rtol=2 * TOL)


def test_a_captured_array_changed_after_tracing_is_an_error():
    bias = np.linspace(-1, 1, 16).astype(np.float32)

    def biased(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx]

    biased.grad = lambda score, b, h, q_idx, kv_idx: np.float32(1.0)
    q, k, v = _qkv(10)
    fn = torch.compile(lambda q, k, v: ft.attention(q, k, v, score_mod=biased, **SMALL), fullgraph=True,
                       backend="aot_eager")
    fn(q, k, v)
    bias[3] = 7.0
    with pytest.raises(ValueError, match="captures arrays that changed in place"):
        fn(q, k, v)


# --------------------------------------------------------------------------- transformers


transformers = pytest.importorskip("transformers")


def _model(cls_name, attn, **cfg):
    config_cls = getattr(transformers, cls_name.replace("ForCausalLM", "Config"))
    config = config_cls(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=64, **cfg)
    torch.manual_seed(1)
    model = getattr(transformers, cls_name)._from_config(config, attn_implementation=attn)
    return model.train(False)


def _run(model, ids, mask):
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=mask).logits
    logits[mask.bool()].square().mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


MODELS = {
    "llama-gqa": ("LlamaForCausalLM", dict(num_key_value_heads=2)),
    "mistral-window": ("MistralForCausalLM", dict(num_key_value_heads=1, sliding_window=5)),
    "qwen2-mha": ("Qwen2ForCausalLM", dict(num_key_value_heads=4)),
}


@pytest.fixture(scope="module")
def fnb():
    return ft.register_transformers(**SMALL)


@pytest.mark.parametrize("padding", ["none", "left", "right"])
@pytest.mark.parametrize("model", MODELS, ids=list(MODELS))
def test_transformers_models_match_eager(fnb, model, padding):
    """Logits at the real (unpadded) positions and every parameter's gradient, against ``"eager"``."""
    cls_name, cfg = MODELS[model]
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 16, dtype=torch.long)
    if padding == "left":
        mask[1, :5] = 0
    elif padding == "right":
        mask[1, 11:] = 0
    want = _run(_model(cls_name, "eager", **cfg), ids, mask)
    got = _run(_model(cls_name, fnb, **cfg), ids, mask)
    real = mask.bool()
    assert torch.allclose(got[0][real], want[0][real], atol=1e-5, rtol=1e-5)
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        assert torch.allclose(got[1][name], want[1][name], atol=1e-5, rtol=1e-5), name


def test_transformers_masks_flashnb_cannot_express_are_refused():
    from flashnb.pytorch.transformers import attention_forward, fit_documents, fit_mask

    doc = torch.zeros(1, 1, 8, 8, dtype=torch.bool)             # two packed documents of 4 tokens
    for a, b in ((0, 4), (4, 8)):
        doc[0, 0, a:b, a:b] = torch.tril(torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="attention_mask is not causal"):
        fit_mask(doc, 1, 2, 8, 8)                                # as one mask: no; as packed documents: yes
    assert fit_documents(doc, 1, 2, 8, 8) == [0, 4, 8]
    assert fit_documents(doc.expand(2, 1, 8, 8), 2, 2, 8, 8) == [0, 4, 8, 12, 16]     # the B·N flattened tokens
    prefix = doc.clone()
    prefix[0, 0, :4, :4] = True                                 # a bidirectional prefix: neither
    for m in (prefix, doc.transpose(-1, -2)):
        with pytest.raises(ValueError, match="attention_mask is not causal"):
            fit_mask(m, 1, 2, 8, 8)
        with pytest.raises(ValueError, match="attention_mask is not causal"):
            attention_forward(None, *_qkv(0, H=2, Nq=8, Nk=8), m, options=SMALL)
    bias = torch.zeros(1, 1, 8, 8)
    bias[..., 0] = 0.5
    with pytest.raises(ValueError, match="additive values other than 0 and -inf"):
        fit_mask(bias, 1, 2, 8, 8)
    with pytest.raises(ValueError, match="contains 'flash'|containing 'flash'"):
        ft.register_transformers("flashnb")


DOCS = (5, 9, 3)


def _packed_llama(fnb, seed=2):
    """docs/pytorch.md's tiny Llama twice with the same random weights: on flashnb, and on SDPA."""
    cfg = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
               num_key_value_heads=2)
    torch.manual_seed(seed)
    models = [transformers.LlamaForCausalLM._from_config(transformers.LlamaConfig(**cfg), attn_implementation=a)
              for a in (fnb, "sdpa")]                           # one config each: _from_config sets its attn
    models[1].load_state_dict(models[0].state_dict())
    return [m.train(False) for m in models]


@pytest.mark.parametrize("path", ["position_ids", "cu_seq_lens", "mask"])
def test_transformers_packed_documents_are_each_attended_alone(fnb, path, monkeypatch):
    """transformers' padding-free batch (``DataCollatorWithFlattening``: one row, ``position_ids`` restarting at each
    document) on flashnb against each document run alone on SDPA: logits, every parameter's gradient, and the
    kernels' counted bytes equal to the documents' own.  The three ways the documents reach the attention function:
    ``position_ids`` with no mask (a model with a cache: transformers builds no packed mask then), the collator's
    ``cu_seq_lens_q/k`` kwargs, and transformers' block-diagonal causal mask (``use_cache=False``).

    Tolerance 1e-5 as for the models above: float32 both ways, flashnb's online softmax against SDPA's, one layer;
    a document attending to another's keys moves logits by O(0.1)."""
    from flashnb.instruments import traffic
    from flashnb.pytorch import transformers as backend

    fitted = []
    fit = backend.fit_documents
    monkeypatch.setattr(backend, "fit_documents", lambda *a: fitted.append(fit(*a)) or fitted[-1])
    g = torch.Generator().manual_seed(4)
    docs = [torch.randint(0, 64, (n,), generator=g).tolist() for n in DOCS]
    batch = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=path == "cu_seq_lens")(
        [{"input_ids": d} for d in docs])
    assert batch["input_ids"].shape == (1, sum(DOCS))
    assert batch["position_ids"].tolist() == [[i for n in DOCS for i in range(n)]]
    del batch["labels"]
    packed, alone = _packed_llama(fnb)

    with traffic.count() as t:
        logits = packed(**batch, use_cache=path != "mask").logits
        logits.square().sum().backward()
    assert fitted == ([[0, 5, 14, 17]] if path == "mask" else [])
    got = logits.detach(), {n: p.grad for n, p in packed.named_parameters()}
    want = [alone(input_ids=torch.tensor([d])).logits for d in docs]
    sum(w.square().sum() for w in want).backward()
    assert torch.allclose(got[0], torch.cat(want, dim=1).detach(), atol=1e-5, rtol=1e-5)
    for name, p in alone.named_parameters():
        assert torch.allclose(got[1][name], p.grad, atol=1e-5, rtol=1e-5), name

    def counted(tr):
        return tr.global_read_bytes + tr.global_write_bytes + 4 * tr.atomics

    packed.zero_grad()
    own = 0
    for d in docs:                                              # each document alone, on flashnb
        with traffic.count() as td:
            packed(input_ids=torch.tensor([d])).logits.square().sum().backward()
        own += counted(td)
    assert counted(t) == own                                    # only real tokens, no other document's keys


def test_compiled_score_mod_without_a_derivative_trains():
    """A score_mod with no ``.grad`` and no ``score_mod_grad``: the backward derives ``d score_mod / d score``
    from its source (:func:`flashnb.flex.derivative`); compiled, o and dq, dk, dv against float64 autograd of the
    same modified attention."""
    import math

    from numba import float32

    def capped(score, b, h, q_idx, kv_idx):
        return float32(4.0) * float32(math.tanh(score / float32(4.0)))

    q, k, v = _qkv(12, grad=True)
    fn = torch.compile(lambda q, k, v: ft.attention(q, k, v, score_mod=capped, **SMALL), fullgraph=True,
                       backend="aot_eager")
    o = fn(q, k, v)
    o.square().sum().backward()
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    s = 4 * torch.tanh((q64 @ k64.transpose(-1, -2)) * 8 ** -0.5 / 4)
    o64 = torch.softmax(s, dim=-1) @ v64
    o64.square().sum().backward()
    for name, a, b in zip(("o", "dq", "dk", "dv"), (o, q.grad, k.grad, v.grad), (o64, q64.grad, k64.grad, v64.grad)):
        assert torch.allclose(a.double(), b, atol=1e-4, rtol=1e-4), name   # tests/test_flex.py's backward bound
