"""GRPO's log-prob passes for Llama-family models on CPU, without the model's per-op machinery.

The update's forward and backward on a small model spend as long around the matrix products as in
them: HF's layer runs RMSNorm, rotary and SwiGLU as 3 to 10 torch ops each, forward and backward,
every one a trip through memory. Here the same layer runs on the model's own parameters with

- every linear layer's forward and both gradients as `trainer/csrc/gemm.h`'s products on the
  weights as stored ([out, in]); q/k/v and gate/up share one call with their outputs written side
  by side, their input gradient is one sum over all their columns (each layer's product added where
  the one before left it), and each weight's gradient comes back as its own tensor (nothing
  concatenated or split);
- RMSNorm, rotary and SwiGLU each one pass forward and one backward, compiled
  (`trainer/csrc/train_ops.cpp`, wrapped below as autograd Functions);
- attention as torch's SDPA on the same masks as the model's, query heads reading their shared KV
  head in place (`enable_gqa`) rather than from repeated copies.

`prefix_hidden` (and `prefix_logits`, the head on it) is the shared-prompt layout of
`trainer.rl.logprobs.shared_prefix_logprobs`: distinct prompts run once, their K/V reach each
sample's response pass, and gradients flow back through them. Results are the model's own forward
up to float rounding: `tests/test_fasttrain.py` holds the log-probs, the loss and every
parameter's gradient to the HF path's. `unsupported()` names why a
model falls back to that path (another architecture, a GPU, q/k norms, dropout, no compiler).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainer.inference.cpu import signed_sin, unsupported as decoder_unsupported


def unsupported(model: torch.nn.Module) -> str | None:
    """Why these passes cannot run `model` (None when they can). LoRA adapters (peft's layers) they
    run: the frozen base through the compiled products, the adapters beside it (`_project`)."""
    from trainer.lora import inner

    model = inner(model)
    reason = decoder_unsupported(model, adapters=True)
    if reason is not None:
        return reason
    cfg = model.config
    first = model.model.layers[0]
    if getattr(first.self_attn, "q_norm", None) is not None:
        return "q/k norms (Qwen3)"
    if getattr(cfg, "attention_dropout", 0.0) and model.training:
        return "attention dropout"
    if next(model.parameters()).dtype != torch.float32:
        return "weights are not float32"
    if getattr(cfg, "_attn_implementation", "sdpa") not in ("sdpa", "eager"):
        return f"attention implementation {cfg._attn_implementation!r}"
    from trainer.kernels import ops

    if ops() is None:
        return "the compiled kernels did not build"
    return None


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x = x.contiguous()
        y, rstd = torch.ops.posttrain.rms_norm_fwd(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = torch.ops.posttrain.rms_norm_bwd(dy.contiguous(), x, weight, rstd)
        return dx, dw, None


class _Rotary(torch.autograd.Function):
    """Rotate the first `rotated` heads of each row (q and k; v passes through)."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotated: int, hd: int) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.rotated, ctx.hd = rotated, hd
        return torch.ops.posttrain.rotary(qkv, cos, sin, rotated, hd, False)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return torch.ops.posttrain.rotary(dy.contiguous(), cos, sin, ctx.rotated, ctx.hd, True), None, None, None, None


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gu: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gu)
        return torch.ops.posttrain.swiglu_fwd(gu)

    @staticmethod
    def backward(ctx, dact: torch.Tensor):
        (gu,) = ctx.saved_tensors
        return torch.ops.posttrain.swiglu_bwd(dact.contiguous(), gu)


class _Linear(torch.autograd.Function):
    """x @ [W_1; ...; W_n]^T (+ biases): the n weights' outputs side by side along the last dimension.
    Called as apply(x, n, W_1..W_n, b_1..b_n), a bias None where there is none; x [rows, in]."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, n: int, *weights_biases: torch.Tensor | None) -> torch.Tensor:
        ws, bs = weights_biases[:n], weights_biases[n:]
        x = x.contiguous()
        ctx.save_for_backward(x, *ws)
        ctx.widths, ctx.biased = [w.shape[0] for w in ws], [b is not None for b in bs]
        return torch.ops.posttrain.linears_fwd(x, list(ws), list(bs))  # written side by side: no torch.cat

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, *ws = ctx.saved_tensors
        n = len(ws)
        dy = dy.contiguous()
        parts = dy.split(ctx.widths, dim=-1)  # views: the kernels read rows at dy's stride
        # one sum over all the parts' columns (not a sum of n products)
        dx = torch.ops.posttrain.linears_dx(dy, list(ws)) if ctx.needs_input_grad[0] else None
        dws = [torch.ops.posttrain.linear_dw(p, x) if ctx.needs_input_grad[2 + i] else None
               for i, p in enumerate(parts)]
        dbs = [p.sum(0) if biased and ctx.needs_input_grad[2 + n + i] else None
               for i, (p, biased) in enumerate(zip(parts, ctx.biased))]
        return dx, None, *dws, *dbs


def _adapter_delta(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """What peft's LoRA layer `m` adds to its base layer's output for x (None: a plain linear layer,
    or adapters merged into the weight or switched off): the active adapters' scale * B(A(dropout(x))),
    as peft's own forward computes it."""
    if getattr(m, "lora_A", None) is None or m.merged or m.disable_adapters:
        return None
    out = None
    for name in m.active_adapters:
        if name not in m.lora_A:
            continue
        # the scale on the rank-wide product, not the layer-wide one: one pass over [rows, r]
        d = F.linear(F.linear(m.lora_dropout[name](x), m.lora_A[name].weight) * m.scaling[name], m.lora_B[name].weight)
        out = d if out is None else out + d
    return out


def _project(x: torch.Tensor, *layers: torch.nn.Module) -> torch.Tensor:
    """x through the linear layers side by side (`_Linear`), each LoRA layer's adapters added to its
    part: the base weights, frozen, take the compiled products, the small adapter products autograd."""
    y = _Linear.apply(x, len(layers), *(m.weight for m in layers), *(getattr(m, "bias", None) for m in layers))
    deltas = [_adapter_delta(m, x) for m in layers]
    if all(d is None for d in deltas):
        return y
    if len(layers) == 1:
        return y + deltas[0]
    return y + torch.cat([d if d is not None else x.new_zeros(x.shape[0], m.weight.shape[0])
                          for d, m in zip(deltas, layers)], dim=-1)


def _rotary_tables(inner: torch.nn.Module, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and rotate-half-signed sin at each row's position, [rows, head_dim] (the model's own rotary module)."""
    cos, sin = inner.rotary_emb(h, position_ids=positions)
    return cos.reshape(-1, cos.shape[-1]).contiguous(), signed_sin(sin).reshape(-1, cos.shape[-1]).contiguous()


def _layer(block: torch.nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
           heads: int, kv_heads: int, hd: int, past: tuple[torch.Tensor, torch.Tensor] | None = None,
           ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """One decoder layer on h [B, S, H]; mask [B, 1, S, keys] bool. With `past` ([B, kv, P, hd] keys and
    values before these positions) attention also reads them. Returns h and this call's own K/V."""
    B, S, H = h.shape
    a, m = block.self_attn, block.mlp
    ln1, ln2 = block.input_layernorm, block.post_attention_layernorm
    x = _RMSNorm.apply(h.reshape(B * S, H), ln1.weight, ln1.variance_epsilon)
    qkv = _project(x, a.q_proj, a.k_proj, a.v_proj)
    qkv = _Rotary.apply(qkv, cos, sin, heads + kv_heads, hd)
    q, k, v = qkv.view(B, S, heads + 2 * kv_heads, hd).transpose(1, 2).split([heads, kv_heads, kv_heads], dim=1)
    own = (k, v)
    if past is not None:
        k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
    # query heads share their KV head inside the kernel (HF repeats K/V into copies, and sums their gradients)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=a.scaling, enable_gqa=heads != kv_heads)
    o = o.transpose(1, 2).reshape(B * S, heads * hd)
    h = h + _project(o, a.o_proj).view(B, S, H)
    x = _RMSNorm.apply(h.reshape(B * S, H), ln2.weight, ln2.variance_epsilon)
    gu = _project(x, m.gate_proj, m.up_proj)
    h = h + _project(_SwiGLU.apply(gu), m.down_proj).view(B, S, H)
    return h, own


def _final_norm(model: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    inner = model.model
    B, S, H = h.shape
    return _RMSNorm.apply(h.reshape(B * S, H), inner.norm.weight, inner.norm.variance_epsilon).view(B, S, H)


def prefix_logits(model: torch.nn.Module, pids: torch.Tensor, pmask: torch.Tensor, inverse: torch.Tensor,
                  rids: torch.Tensor, rmask: torch.Tensor | None = None, checkpoint: bool = False) -> torch.Tensor:
    """Logits predicting each response token, [B, R, V]: the output head on `prefix_hidden`."""
    from trainer.lora import inner as unwrapped

    h = prefix_hidden(model, pids, pmask, inverse, rids, rmask, checkpoint)
    B, R, H = h.shape
    return _project(h.reshape(B * R, H), unwrapped(model).get_output_embeddings()).view(B, R, -1)


def prefix_hidden(model: torch.nn.Module, pids: torch.Tensor, pmask: torch.Tensor, inverse: torch.Tensor,
                  rids: torch.Tensor, rmask: torch.Tensor | None = None, checkpoint: bool = False) -> torch.Tensor:
    """The final (normed) hidden states predicting each response token, [B, R, H]: distinct prompts
    pids [U, P] (left-padded, pmask 1 on real tokens) run once; sample i continues prompt inverse[i]
    with response rids[i] (right-padded; position j's state comes from the prompt's last token for
    j = 0, else from response token j - 1, so the last response token is not run). The responses'
    pads (rmask 0) need no mask: they come after every real token, which attends causally. A peft
    model runs as the model inside it, its adapters computed beside the weights. `checkpoint`: each
    layer keeps only its input for the backward pass and runs again there (torch's non-reentrant
    checkpoint): the activations' memory of one layer instead of all, for one more forward pass."""
    from torch.utils.checkpoint import checkpoint as recompute

    from trainer.lora import inner as unwrapped

    def layer(*args, **kwargs):
        if checkpoint and torch.is_grad_enabled():
            return recompute(_layer, *args, use_reentrant=False, **kwargs)
        return _layer(*args, **kwargs)

    model = unwrapped(model)
    inner = model.model
    cfg = model.config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    embed = inner.embed_tokens
    U, P = pids.shape
    B, R = rids.shape
    dev = pids.device
    valid = pmask.bool()
    positions = (pmask.cumsum(-1) - 1).clamp(min=0)
    causal = torch.ones(P, P, dtype=torch.bool, device=dev).tril()
    # a left pad attends to itself only (no all-masked row); real tokens never see a pad
    mask = ((causal & valid[:, None, :]) | torch.eye(P, dtype=torch.bool, device=dev))[:, None]
    h = F.embedding(pids, embed.weight, embed.padding_idx)
    cos, sin = _rotary_tables(inner, h, positions)
    cached = []
    for block in inner.layers:
        h, kv = layer(block, h, cos, sin, mask, heads, kv_heads, hd)
        cached.append(kv)
    # index_select, not [inverse]: its backward adds each sample's gradient in index order, where
    # indexing's (index_put_ with accumulate) adds from several threads in arrival order
    first = _final_norm(model, h[:, -1:]).index_select(0, inverse)
    if R == 1:
        return first
    S = R - 1
    # each sample's response attends to its prompt's real tokens and causally to itself (its pads
    # come after its last real token, so no real token sees them)
    rmask = torch.cat([valid[inverse][:, None, :].expand(B, S, P),
                       torch.ones(S, S, dtype=torch.bool, device=dev).tril().expand(B, S, S)], dim=-1)[:, None]
    rpos = pmask.sum(1)[inverse][:, None] + torch.arange(S, device=dev)[None]
    h = F.embedding(rids[:, :-1], embed.weight, embed.padding_idx)
    cos, sin = _rotary_tables(inner, h, rpos)
    for block, (k, v) in zip(inner.layers, cached):
        past = (k.index_select(0, inverse), v.index_select(0, inverse))
        h, _ = layer(block, h, cos, sin, rmask, heads, kv_heads, hd, past=past)
    return torch.cat([first, _final_norm(model, h)], dim=1)
