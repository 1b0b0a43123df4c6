# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 09 · A transformer on flashnb: FlashAttention inside a PyTorch model
#
# The kernels of notebooks 05 and 06 are FlashAttention-2's forward (Alg. 1) and backward (Alg. 2). To train
# a model with them, PyTorch's autograd needs a `torch.autograd.Function` whose forward saves what
# FlashAttention saves — $Q, K, V$, the output $O$ and the row log-sum-exp $L$, **never** the $N \times N$
# matrix $P$ — and whose backward is the recompute backward (P rebuilt tile by tile as $\exp(S - L)$).
# `flashnb.pytorch` is that function, with the shapes of `torch.nn.functional.scaled_dot_product_attention`
# (SDPA): $(B, H, N, d)$.
#
# This notebook trains the same small character-level decoder twice from the same seed — once with SDPA,
# once with flashnb's FA2 on the simulator — and compares the loss curves, counts the attention traffic of
# one training step, and samples text. Then the same kernels inside `torch.compile(fullgraph=True)`, under
# PyTorch's `opcheck`, and as the attention of a Hugging Face transformers model. PyTorch is an optional extra:
# `pip install "flashnb[torch]"` (and `"flashnb[transformers]"` for the last part).

# %%
import inspect
import os
import time

import matplotlib.pyplot as plt
import numpy as np
import torch

os.environ["FLASHNB_DEVICE"] = "sim"  # counting traffic needs the simulator; GPU timings run in a process of their own
import flashnb  # noqa: F401  (selects the simulator first)
import flashnb.pytorch as ft
from flashnb import tiny_transformer as tt
from flashnb.instruments import bench, traffic
from flashnb.notebook import savefig
from flashnb.stages import fa1, fa2, naive

T0 = time.perf_counter()
print("kernels run on the Numba CUDA simulator; GPU timings:",
      "on this machine's GPU, in a separate process" if bench.gpu_available() else "none (no GPU here)")
print("torch", torch.__version__)

# %% [markdown]
# ## The autograd function
#
# The forward calls the impl's forward and saves five tensors; the backward calls the impl's backward with
# them. `once_differentiable`: there is no double backward (FlashAttention has none either).

# %%
print(inspect.getsource(ft.FlashAttentionFunction))

# %% [markdown]
# `flashnb.pytorch.attention(q, k, v, *, causal, scale, impl)` prepares the tensors (float32, contiguous,
# $(BH, N, d)$) and calls it. One caveat when swapping it for SDPA: **`causal=True` is aligned bottom-right**
# (FlashAttention's convention, `causal_lower_right`), while SDPA's `is_causal=True` is aligned top-left
# (`causal_upper_left`). They differ when $N_q \ne N_k$ — e.g. decoding with a KV cache — and agree in a
# decoder's self-attention, where $N_q = N_k$:

# %%
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 2, n, 8, generator=g) for n in (6, 10, 10))
sdpa_causal = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
diff_lr = (ft.attention(q, k, v, causal=True) - sdpa_causal).abs().max().item()
diff_ul = (ft.attention(q, k, v, causal="upper_left") - sdpa_causal).abs().max().item()
print(f"Nq=6, Nk=10: |causal=True - SDPA is_causal| = {diff_lr:.2f},  |causal='upper_left' - SDPA| = {diff_ul:.1e}")
assert diff_lr > 0.1 and diff_ul < 1e-5

# %% [markdown]
# ## The model and the text
#
# A GPT-style decoder: token and position embeddings, pre-LayerNorm blocks (causal self-attention, then an
# MLP), a linear head. The attention is a function passed in, so one model class runs with either. The text
# is the Zen of Python, which ships with Python (`import this`; nothing is downloaded). The model is tiny
# because the simulator runs every launch of a training step in Python on a CPU: two layers, width 16, two heads of
# $d = 8$, a context of 16 characters, one sequence per step.

# %%
print(inspect.getsource(tt.Block.forward))
text = tt.zen_text()
vocab = tt.Vocab(text)
data = vocab.encode(text)
print(f"{len(text)} characters, {len(vocab)} distinct; first line: {text.splitlines()[0]!r}")
CFG = dict(steps=10, batch=1, context=16, width=16, heads=2, layers=2, lr=1e-2, seed=0)
TILES = dict(Br=16, Bc=16, warps=1)   # one warp per block: the fastest fa2 configuration on the simulator
n_params = sum(p.numel() for p in tt.CharDecoder(len(vocab), context=16, width=16, heads=2, layers=2).parameters())
print(f"{n_params} parameters; config {CFG}")

# %% [markdown]
# ## Train with SDPA, then with flashnb's FA2, from the same seed
#
# Same initial weights, same batches, same optimiser (AdamW); only the attention differs.

# %%
t = time.perf_counter()
model_sdpa, loss_sdpa = tt.train(tt.attention_fn("sdpa"), data, len(vocab), **CFG)
t_sdpa = time.perf_counter() - t
t = time.perf_counter()
model_fa2, loss_fa2 = tt.train(tt.attention_fn("fa2", **TILES), data, len(vocab), **CFG)
t_fa2 = time.perf_counter() - t
delta = np.abs(np.array(loss_fa2) - np.array(loss_sdpa))
print(f"SDPA: {t_sdpa:.1f} s, flashnb fa2 on the simulator: {t_fa2:.1f} s for {CFG['steps']} steps")
print("step  loss (SDPA)  loss (fa2)   |difference|")
for i, (a, b) in enumerate(zip(loss_sdpa, loss_fa2)):
    print(f"{i:4d}  {a:11.7f}  {b:10.7f}   {abs(a - b):.1e}")
print(f"max |loss difference| = {delta.max():.1e}")
assert loss_fa2[-1] < loss_fa2[0] - 0.3          # it learns
assert delta.max() < 1e-4                        # and its losses are SDPA's to float32 rounding

# the weights after training, parameter by parameter (qkv.bias split into its q, k and v parts)
C = CFG["width"]
w_diff = {}
for (name, a), b in zip(model_fa2.named_parameters(), model_sdpa.parameters()):
    dd = (a - b).detach().abs()
    if name.endswith("qkv.bias"):
        for part, x in zip("qkv", dd.split(C)):
            w_diff[f"{name}[{part}]"] = x.max().item()
    else:
        w_diff[name] = dd.max().item()
key_bias = [n for n in w_diff if n.endswith("qkv.bias[k]")]
rest = max(x for n, x in w_diff.items() if n not in key_bias)
for n in sorted(w_diff, key=w_diff.get, reverse=True)[:3]:
    print(f"max |weight difference| {w_diff[n]:.1e} in {n}")
print(f"... every other parameter: <= {rest:.1e}")
grad_kb = max(blk.qkv.bias.grad[C:2 * C].abs().max().item() for blk in model_sdpa.blocks)
grad_qb = max(blk.qkv.bias.grad[:C].abs().max().item() for blk in model_sdpa.blocks)
print(f"last step's gradient (SDPA run): |d loss / d key bias| <= {grad_kb:.1e}, |d loss / d query bias| <= {grad_qb:.1e}")
assert grad_kb < 1e-3 * grad_qb

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
ax1.plot(loss_sdpa, "o-", label="SDPA (PyTorch)")
ax1.plot(loss_fa2, "x--", label="flashnb fa2 (simulator)")
ax1.set(xlabel="step", ylabel="cross-entropy", title="training loss, same seed")
ax1.legend()
ax2.semilogy(np.maximum(delta, 1e-10), "o-")
ax2.set(xlabel="step", ylabel="|loss(fa2) - loss(SDPA)|", title="difference (float32 rounding)")
fig.tight_layout()
savefig(fig, "09_loss_curves")
plt.show()

# %% [markdown]
# **Why they differ, and by how much.** Both compute in float32, but not in the same order: SDPA (PyTorch's
# CPU path) forms the whole score row and normalises it; FA2 runs the online softmax over key tiles, rescales
# its accumulator, and in the backward sums dQ by atomic adds. Each order rounds differently, at the level of
# float32's unit roundoff (≈ 6e-8) times the length of the sums, so the losses agree to the size printed
# above — orders of magnitude below the change the model makes per step. A wrong mask or a missing gradient
# term would show up at the first step, at the size of the loss itself.
#
# The weights tell one more story: the largest differences sit in the **key bias** of the qkv projection.
# Adding a bias $b$ to every key adds $q_i \cdot b$ to every score of row $i$, and softmax ignores a constant
# added to a whole row — so the exact gradient of the loss with respect to the key bias is **zero**, and what
# either run computes there is rounding noise (printed above, a thousand times smaller than the query bias's
# gradient). AdamW divides each gradient by the root of its running square, so noise of any size becomes a
# step of about the learning rate, in a direction each kernel's rounding picks. Those weights drift apart —
# and the loss does not notice, because it does not depend on them.

# %% [markdown]
# ## A longer run, and what "the same" can mean
#
# Ten steps say little about training. A longer run -- 600 AdamW steps, batches of 8, context 32, width 32 -- takes
# seconds with SDPA, and its loss curve shows the model learning the text. Comparing *curves* over hundreds of
# steps would be the wrong test, though: training is chaotic. Restart SDPA itself at step 590 from weights
# perturbed by one part in $10^7$ (far below float32's rounding of a sum) and its losses leave the original's
# within a step or two. So flashnb is compared where a comparison means something: **step by step from the same
# state** -- at steps spread over the run, the loss and every parameter's gradient with flashnb's kernels, from
# the SDPA run's saved weights and that step's batch.

# %%
LONG = dict(steps=600, batch=8, context=32, width=32, heads=2, layers=2, lr=3e-3, seed=0)
checkpoints = list(range(0, 600, 75)) + [590]
state = dict.fromkeys(checkpoints)
t = time.perf_counter()
_, loss_long = tt.train(tt.attention_fn("sdpa"), data, len(vocab), state=state, **LONG)
print(f"SDPA, {LONG['steps']} steps in {time.perf_counter() - t:.1f} s: loss {loss_long[0]:.2f} -> {loss_long[-1]:.2f}")

w_again = tt.resume(tt.attention_fn("sdpa"), state[590], data, len(vocab), first=590, window=10, **LONG)
assert w_again == loss_long[590:600]                 # resuming from the saved state reproduces the run exactly
pg = torch.Generator().manual_seed(1)
noisy = ({n: w + 1e-7 * w.abs().max() * torch.randn(w.shape, generator=pg) for n, w in state[590][0].items()},
         state[590][1])
w_noisy = tt.resume(tt.attention_fn("sdpa"), noisy, data, len(vocab), first=590, window=10, **LONG)
print("SDPA resumed at step 590 from weights perturbed by 1e-7: |loss difference| per step",
      " ".join(f"{abs(a - b):.0e}" for a, b in zip(w_noisy, loss_long[590:600])))

rows_same = []
for s in checkpoints:
    l_s, g_s = tt.loss_and_grads(tt.attention_fn("sdpa"), state[s], data, len(vocab), at=s, **LONG)
    l_f, g_f = tt.loss_and_grads(tt.attention_fn("fa2", **TILES), state[s], data, len(vocab), at=s, **LONG)
    rel = max(((g_f[n] - g_s[n]).norm() / g_s[n].norm()).item() for n in g_s if g_s[n].norm() > 1e-3)
    rows_same.append((s, l_s, l_f, abs(l_f - l_s), rel))
print("step   loss (SDPA)  |loss(fa2) - loss(SDPA)|  max relative gradient difference (per parameter)")
for s, l_s, _, dl, rel in rows_same:
    print(f"{s:4d}   {l_s:10.4f}   {dl:22.1e}   {rel:.1e}")
assert loss_long[-1] < loss_long[0] - 2                # it learns
assert all(dl < 1e-5 and rel < 1e-3 for *_, dl, rel in rows_same)

fig, ax = plt.subplots(figsize=(7, 3.2))
ax.plot(loss_long, lw=1, label="SDPA, 600 steps")
ax.plot([r[0] for r in rows_same], [r[2] for r in rows_same], "x", color="C3",
        label="flashnb fa2 from the same state (its loss)")
ax.set(xlabel="step", ylabel="cross-entropy", title="a longer run, compared step by step from the same state")
ax.legend()
savefig(fig, "09_long_run")
plt.show()

# %% [markdown]
# ## Attention traffic of one training step
#
# One training step runs, per layer, one attention forward and one backward at $(B, H, N, d) = (1, 2, 16, 8)$.
# FA2's traffic is counted on the simulator (and equals its model); naive and FA1 come from their traffic
# models, which their tests check equal to counts.

# %%
B, H, N, d, L = CFG["batch"], CFG["heads"], CFG["context"], CFG["width"] // CFG["heads"], CFG["layers"]
qkv = [torch.randn(B, H, N, d, generator=g, requires_grad=True) for _ in range(3)]
with traffic.count() as t_fwd:
    o = ft.attention(*qkv, causal=True, impl="fa2", **TILES)
with traffic.count() as t_bwd:
    o.backward(torch.randn(B, H, N, d, generator=g))
assert t_fwd.summary() == fa2.model_forward(B * H, N, N, d, causal=True, **TILES)
assert t_bwd.summary() == fa2.model_backward(B * H, N, N, d, causal=True, **TILES)


def hbm_bytes(model):
    return 4 * sum(sum(x["reads"].values()) + sum(x["writes"].values()) + sum(x["atomics"].values()) for x in model)


per_step = {
    "naive": L * hbm_bytes(naive.model_forward(B * H, N, N, d, causal=True) + naive.model_backward(B * H, N, N, d,
                                                                                                  causal=True)),
    "fa1": L * hbm_bytes(fa1.model_forward(B * H, N, N, d, causal=True) + fa1.model_backward(B * H, N, N, d,
                                                                                            causal=True)),
    "fa2 (counted)": L * hbm_bytes(t_fwd.summary() + t_bwd.summary()),
}
for name, nbytes in per_step.items():
    print(f"{name:14s} {nbytes:8,d} HBM bytes of attention per training step ({L} layers, forward + backward)")
assert per_step["fa2 (counted)"] < per_step["naive"]

# %% [markdown]
# At this size (N = 16) everything fits in one tile, so the counts mostly show the fixed costs: naive
# attention writes and rereads S and P ($N^2$ per head), FA2 reads Q, K, V, O, dO and L and writes the
# gradients. The $N^2$ term that FlashAttention removes grows quadratically with the context; notebooks 05
# and 06 count it at larger N.
#
# ## Text from the two models
#
# Sampling from the same prompt with the same seeded generator. After ten steps on one sequence each the
# model has learnt little more than which characters are frequent, so the text is not English; the point is
# that the two models, trained with different attention kernels, write the same text. The flashnb model
# decodes its first characters with flashnb's FA2 too.

# %%
prompt = vocab.encode("Beautiful is ")
gen_sdpa = tt.generate(model_sdpa, tt.attention_fn("sdpa"), prompt, 60, seed=1)
gen_fa2 = tt.generate(model_fa2, tt.attention_fn("sdpa"), prompt, 60, seed=1)
gen_fa2_on_fa2 = tt.generate(model_fa2, tt.attention_fn("fa2", **TILES), prompt, 3, seed=1)
print("SDPA-trained model:        ", repr(vocab.decode(gen_sdpa)))
print("fa2-trained model:         ", repr(vocab.decode(gen_fa2)))
print("fa2-trained, fa2 decoding: ", repr(vocab.decode(gen_fa2_on_fa2)))
assert torch.equal(gen_fa2_on_fa2, gen_fa2[:len(gen_fa2_on_fa2)])
print(f"identical text from both models: {torch.equal(gen_sdpa, gen_fa2)}")

# %% [markdown]
# ## In a compiled graph, and in Hugging Face transformers
#
# Underneath `ft.attention` are two custom operators, `torch.ops.flashnb.attention_forward` and
# `attention_backward` (`torch.library.custom_op`, each with a *fake* implementation that only says the shapes and
# dtypes of its outputs). To `torch.compile` and `torch.export` flashnb is therefore one opaque node per direction:
# the graph around it is traced and optimised, the kernel itself is called as it is. `fullgraph=True` asks for the
# whole function as one graph: it fails if anything in it forces a break back to Python.
# (`backend="aot_eager"` traces forward and backward graphs as inductor would, then runs them eagerly, so this
# cell spends no time compiling PyTorch's own small ops into C++; the default backend sees the same graph.)

# %%
print(torch.ops.flashnb.attention_forward.default._schema)
qc, kc, vc = (torch.randn(1, 2, 24, 8, generator=torch.Generator().manual_seed(s), requires_grad=True)
              for s in (1, 2, 3))


def head_loss(q, k, v):          # attention inside other ops: one graph, flashnb an opaque node in it
    return (ft.attention(q, k, v, causal=True, **TILES) * 0.5).tanh().sum()


loss_eager = head_loss(qc, kc, vc)
grads_eager = torch.autograd.grad(loss_eager, (qc, kc, vc))
compiled = torch.compile(head_loss, fullgraph=True, backend="aot_eager")
loss_compiled = compiled(qc, kc, vc)
grads_compiled = torch.autograd.grad(loss_compiled, (qc, kc, vc))
# the compiled graph calls the same kernels on the same inputs: equal to the bit, not merely close
print(f"eager {loss_eager.item():.7f}, compiled {loss_compiled.item():.7f};",
      "gradients identical:", all(torch.equal(a, b) for a, b in zip(grads_eager, grads_compiled)))
assert torch.equal(loss_eager, loss_compiled)
assert all(torch.equal(a, b) for a, b in zip(grads_eager, grads_compiled))

# %% [markdown]
# `torch.library.opcheck` is PyTorch's own test of a custom operator: it runs the operator against its fake
# implementation, checks the schema (no input mutated that the schema does not declare), and checks the
# registration for autograd and for `torch.compile`'s fake tensors. It raises on the first problem; silence is a
# pass. The last argument carries tile options as a string (Python values cross the operator boundary encoded).

# %%
from flashnb.pytorch import ops  # noqa: E402

args = (qc.detach(), kc.detach(), vc.detach(), None, "lower_right", None, 0.0, "fa2", ops.encode_options(TILES))
torch.library.opcheck(torch.ops.flashnb.attention_forward.default, args)
o_op, lse_op = torch.ops.flashnb.attention_forward(*args)
torch.library.opcheck(torch.ops.flashnb.attention_backward.default,
                      (torch.ones_like(o_op), *args[:3], o_op, lse_op, *args[3:]))
print("opcheck passed for attention_forward and attention_backward; outputs", tuple(o_op.shape),
      "and the log-sum-exp", tuple(lse_op.shape))

# %% [markdown]
# **In transformers.** `register_transformers()` adds flashnb to transformers' `AttentionInterface` under a name
# (`"fnb"`: transformers reserves names containing "flash" for its own FlashAttention loaders); any model that
# takes `attn_implementation` then runs its attention on flashnb's kernels. A one-layer Llama with
# grouped-query attention (4 query heads sharing 2 K/V heads), random weights, nothing downloaded; the same
# weights with transformers' SDPA give the reference logits:

# %%
import copy  # noqa: E402
import importlib.util  # noqa: E402


def llama_on_flashnb(name):
    """A one-layer Llama run with attention ``name`` and with SDPA, same weights: (logits error, launches)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    # a model keeps its config object and writes its attention choice into it: one config each
    llama_fnb = LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation=name).eval()
    llama_sdpa = LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation="sdpa").eval()
    llama_sdpa.load_state_dict(llama_fnb.state_dict())
    ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), traffic.count() as t_llama:
        logits_fnb = llama_fnb(input_ids=ids).logits
    with torch.no_grad():
        logits_sdpa = llama_sdpa(input_ids=ids).logits
    assert llama_fnb.config._attn_implementation == name
    return (logits_fnb - logits_sdpa).abs().max().item(), [x["launch"] for x in t_llama.summary()]


if importlib.util.find_spec("transformers") is None:
    print('transformers is not installed here: pip install "flashnb[transformers]" to run this cell')
else:
    name = ft.register_transformers(**TILES)
    err, launches = llama_on_flashnb(name)
    print(f"attn_implementation={name!r}: flashnb launches {launches}; max |logits - SDPA's| = {err:.1e}")
    # float32 both ways, summed in another order (online softmax over key tiles): differences of a few float32
    # units in the last place of logits of size ~1; a wrong mask or head mapping would differ by 1e-2 or more
    assert launches and err < 1e-4

# %% [markdown]
# ## On a GPU: one training step with each attention
#
# On a machine with a GPU, a separate process trains a larger model (context 256, width 128, 4 heads, batch 8)
# on CUDA tensors — flashnb's kernels read and write torch's memory directly and run on torch's stream — and
# times one training step (forward, backward, AdamW) with CUDA events (notebook 00, A.5).

# %%
gpu_rows = bench.on_gpu("flashnb.tiny_transformer:measure_gpu")
print(bench.table(gpu_rows, ["impl", "median_ms", "q1_ms", "q3_ms", "context", "width", "gpu_name"]))

# %% [markdown]
# ## Exercises
#
# Each exercise has a check: fill in the `...` and run its cell (`...` means "not attempted yet"). Stuck?
# `exercises.hint("09.1")` gives a hint and `exercises.answer("09.1")` the worked answer -- try first.
#
# **09.1 · Three kernels, one loss curve** (★★, ~15 min) Train with `impl="fa1"` and `impl="naive"` too
# (`tt.attention_fn`, `CFG` as above). How large is the largest of the three differences from SDPA's losses
# (each the max over the steps), are the three within a factor of 10 of each other, and why are they all so small?

# %%
from flashnb import exercises  # noqa: E402

largest_difference = ...   # a number
same_order = ...           # True or False
passed = exercises.check("09.1", largest_difference=largest_difference, same_order=same_order)

# %% [markdown]
# **09.2 · Train in float64** (★★, ~15 min) `tt.train(..., dtype=torch.float64)` with SDPA and with
# `tt.attention_fn("fa2", allow_float64=True, **TILES)`: the max loss difference, and whether what remains is
# flashnb's float32 attention.

# %%
diff64 = ...
float32_inside = ...   # True or False
passed = exercises.check("09.2", diff64=diff64, float32_inside=float32_inside)

# %% [markdown]
# **09.3 · Decoding with a KV cache** (★, ~10 min) The newest query ($N_q = 1$) attends to all $N_k$ cached keys.
# Which causal alignment gives the right answer, `causal=True` or `"upper_left"`, and how many keys does the
# other one let the query see?

# %%
right = ...                # True or "upper_left"
keys_seen_by_other = ...
passed = exercises.check("09.3", right=right, keys_seen_by_other=keys_seen_by_other)

# %% [markdown]
# **09.4 · When does naive attention move ten times more bytes?** (★★, ~15 min) With the models of the traffic
# cell above (fa2's equal its counts), find the smallest context, a multiple of 16, at which one training
# step's attention moves at least ten times more HBM bytes with naive attention than with fa2.

# %%
context_10x = ...
passed = exercises.check("09.4", context_10x=context_10x)

# %%
print(f"notebook ran in {time.perf_counter() - T0:.1f} s")
