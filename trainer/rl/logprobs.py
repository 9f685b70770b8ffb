"""Per-token log-probs of a packed batch under a model: the update's forward passes.

`response_logprobs` picks the pass: prompts that several samples of a group share run once
(`shared_prefix_logprobs`, through `trainer.fasttrain`'s fused passes on Llama-family models on CPU,
else the model's own forward with a KV cache), otherwise one pass per sequence (`token_logprobs`).
Every position after the prompt gets its log-prob, the environment's tokens included: the loss
mask, not this module, decides what is trained on.

The shared-prompt passes end at the final hidden states wherever the logits are the output head's
product and nothing more (`output_head`): `head_logprobs` then takes each response token's log-prob
(and entropy) from the head a block of rows at a time, forward and backward, so that no [samples x
tokens x vocabulary] tensor exists. Those were the update's largest: on SmolLM2 (vocabulary 49,152)
32 samples of 96 tokens made 604 MB each for the logits, their log-softmax, and each gradient.
"""

from __future__ import annotations

import contextlib

import torch

from trainer import fasttrain
from trainer.engine import one_writer_each
from trainer.inference.cpu import distinct, left_pad
from trainer.rl.trajectory import PackedBatch


HEAD_BLOCK_ELEMENTS = 1 << 24  # logits in a block of rows (64 MB in float32) on a CPU; rows = this // vocabulary
# On an accelerator each block is a dozen operators issued from the host, forward and backward, and
# the host's issuing is what bounds the update there (docs/gpu.md): 8x larger blocks (512 MB of
# float32 logits, about 1.5 GB while a block's backward runs), 6 blocks where 48 were on bench_ref's
# smollm2-gpu round. Fixed per device type, so a resumed run sums its blocks in the same order.
ACCELERATOR_HEAD_BLOCK_ELEMENTS = 1 << 27
# Where the update runs the shared-prompt layout (`shared_prefix_logprobs`): the prompts' pass, then
# the responses' on their keys and values. Elsewhere (a GPU) it takes one pass per sequence, as TRL
# does: a third more tokens computed on bench_ref's rounds, but each layer's operators issued once
# instead of twice, which is what an accelerator's update waits on (docs/gpu.md: 18,262 against 9,100
# operators for a bf16 update of a 30-layer model).
SHARED_PREFIX_DEVICES = ("cpu",)
# Where `_HeadLogprobs` takes each block's log-probs by logsumexp (the CPU's numbers, kept to the bit);
# elsewhere by torch's fused log_softmax and softmax, fewer passes over each block of logits.
LOGSUMEXP_DEVICES = ("cpu",)
PLAIN_HEAD_MODELS = ("llama", "qwen2", "qwen3", "mistral")  # logits = lm_head(final hidden), unscaled


def output_head(module: torch.nn.Module) -> torch.Tensor | None:
    """The output head's weight [V, H] when the model's logits are exactly hidden @ weight^T (a
    plain bias-free linear head on one of PLAIN_HEAD_MODELS, no adapters on it, not partitioned by
    ZeRO-3), else None: those run the model's own head."""
    from trainer.lora import inner

    model = inner(module)
    cfg = getattr(model, "config", None)
    if getattr(cfg, "model_type", None) not in PLAIN_HEAD_MODELS or not hasattr(model, "model"):
        return None
    if any(getattr(cfg, k, None) for k in ("final_logit_softcapping", "logit_scale", "logits_scaling")):
        return None
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return None  # a peft layer on the head, or a biased one
    if hasattr(head.weight, "ds_id"):
        return None  # ZeRO-3 partitions it, gathered only inside the module's own forward
    return head.weight


def _products(x: torch.Tensor):
    """(x w^T, dy w, dy^T x) for x's device and dtype: the compiled products on CPU float32, else torch's."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        from trainer.kernels import ops

        op = ops()
        if op is not None:
            return (lambda a, w: op.linear_fwd(a, w, None)), op.linear_dx, op.linear_dw
    return (lambda a, w: a @ w.t()), (lambda dy, w: dy @ w), (lambda dy, a: dy.t() @ a)


class _HeadLogprobs(torch.autograd.Function):
    """log softmax(x w^T / T)[target] and the entropy of that softmax, row by row, from hidden
    states x [N, H] and the head's weight w [V, H]; the logits of `rows` rows at a time, made again
    in the backward pass rather than kept (the memory of one block, for one more head product).

    Each block's arithmetic is a chain of passes over [rows, V] (the products aside). On a CPU it
    is logsumexp, then exp(z - lse) in the backward: the numbers the CPU suite and the speedrun
    have always given. Elsewhere (`LOGSUMEXP_DEVICES`) each pass is a trip through the device's
    memory (reading or writing a 512 MB block of float32 takes about 0.18 ms on an H100), so the
    block takes torch's fused kernels instead: log_softmax forward, softmax backward, the one-hot
    subtracted before the gradient is scaled and cast in one product. Counting each float32 read or
    write of a block as a pass, a bf16 block at temperature 1 (where no division runs) takes 9.5
    passes forward and backward this way, 17.5 by logsumexp (docs/gpu.md)."""

    @staticmethod
    def forward(ctx, x, w, targets, temperature: float, with_entropy: bool, rows: int):
        fwd, _, _ = _products(x)
        few = x.device.type not in LOGSUMEXP_DEVICES
        N = x.shape[0]
        lse, logp = x.new_empty(0 if few else N, dtype=torch.float32), x.new_empty(N, dtype=torch.float32)
        ent = x.new_empty(N, dtype=torch.float32) if with_entropy else None
        for s in range(0, N, rows):
            z = _scaled(fwd(x[s : s + rows], w), temperature)
            ts = targets[s : s + rows, None]
            if few:
                z = torch.log_softmax(z, dim=-1)  # log p
                logp[s : s + rows] = z.gather(-1, ts).squeeze(-1)
            else:
                m = torch.logsumexp(z, dim=-1)
                lse[s : s + rows] = m
                logp[s : s + rows] = z.gather(-1, ts).squeeze(-1) - m
                if ent is not None:
                    z.sub_(m[:, None])  # log p
            if ent is not None:
                ent[s : s + rows] = -z.exp().mul_(z).sum(-1)
            del z  # before the next block's logits, not after
        ctx.save_for_backward(x, w, targets, lse, ent)
        ctx.temperature, ctx.rows, ctx.few = temperature, rows, few  # the backward takes the forward's way
        if ent is None:
            none = x.new_zeros(0, dtype=torch.float32)
            ctx.mark_non_differentiable(none)
            return logp, none
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        x, w, targets, lse, ent = ctx.saved_tensors
        fwd, dx_of, dw_of = _products(x)
        T, rows, few = ctx.temperature, ctx.rows, ctx.few
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx = torch.empty_like(x) if want_x else None
        dw = torch.zeros_like(w, dtype=torch.float32) if want_w else None
        g_logp = g_logp.float() if g_logp is not None else x.new_zeros(x.shape[0], dtype=torch.float32)
        with_ent = ent is not None and g_ent is not None
        for s in range(0, x.shape[0], rows):
            xs, gl, ts = x[s : s + rows], g_logp[s : s + rows], targets[s : s + rows, None]
            z = _scaled(fwd(xs, w), T)
            # d logp[t] / dz = onehot(t) - p;  d entropy / dz = -p * (log p + entropy)
            if few and not with_ent:
                p = torch.softmax(z, dim=-1)
                del z
                with one_writer_each():  # one add a row, at its target: exact without the mode's syncs
                    p.scatter_add_(-1, ts, p.new_full((len(xs), 1), -1.0))  # p - onehot(t)
                gz = p if x.dtype == torch.float32 else torch.empty(p.shape, dtype=x.dtype, device=p.device)
                torch.mul(p, (gl / -T)[:, None], out=gz)  # scaled, and cast to x's dtype, in one pass
            else:
                logq = torch.log_softmax(z, dim=-1) if few else z.sub_(lse[s : s + rows, None])  # log p
                del z
                p = logq.exp()
                if with_ent:
                    ge = g_ent[s : s + rows, None].float()
                    gz = logq.add_(ent[s : s + rows, None]).mul_(ge).add_(gl[:, None]).mul_(p).neg_()
                else:
                    gz = p.mul_(-gl[:, None])
                with one_writer_each():  # (the CPU's kernel is the same either way)
                    gz.scatter_add_(-1, ts, gl[:, None])
                gz = _scaled(gz, T).to(x.dtype)
            if want_x:
                dx[s : s + rows] = dx_of(gz, w)
            if want_w:
                dw += dw_of(gz, xs).float()
            del p, gz  # before the next block's logits, not after
        return dx, (dw.to(w.dtype) if want_w else None), None, None, None, None


def _scaled(z: torch.Tensor, temperature: float) -> torch.Tensor:
    """z in float32 divided by the temperature, in place where z is already float32; at temperature 1
    no division runs (x / 1 is x to the bit)."""
    z = z.float()
    return z if temperature == 1.0 else z.div_(temperature)


def head_logprobs(x: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                  with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's log-prob of its target under softmax(x w^T / temperature), and its entropy when
    asked: x [N, H] final hidden states, w [V, H] the output head's weight, targets [N]. Float32,
    differentiable in x and w; no [N, V] tensor is kept (`_HeadLogprobs`)."""
    block = HEAD_BLOCK_ELEMENTS if x.device.type == "cpu" else ACCELERATOR_HEAD_BLOCK_ELEMENTS
    rows = max(1, block // w.shape[0])
    lp, ent = _HeadLogprobs.apply(x.contiguous(), w, targets.contiguous(), float(temperature), with_entropy, rows)
    return lp, (ent if with_entropy else None)


def head_logprobs_at(hidden: torch.Tensor, real: torch.Tensor, targets: torch.Tensor, head: torch.Tensor,
                     temperature: float, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`head_logprobs` at the positions `real` marks (hidden [B, T, H], real and targets [B, T]),
    in the [B, T] layout with 0 elsewhere."""
    lp, ent = head_logprobs(hidden[real], head, targets[real], temperature, with_entropy)
    zeros = torch.zeros(real.shape, dtype=torch.float32, device=hidden.device)
    return zeros.masked_scatter(real, lp), (zeros.masked_scatter(real, ent) if with_entropy else None)


def token_logprobs(module: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor,
                   with_entropy: bool = False, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(ids[t] | ids[<t]) for t >= 1, shape [B, T-1]; and the per-position entropy.

    Under the sampling temperature: the policy being optimised is the one rollouts came from. A
    plain-head model (`output_head`) gives the log-probs of real tokens from its head a block of
    rows at a time, and 0 at padded positions."""
    head = output_head(module)
    if head is not None:
        from trainer.lora import inner

        # the last position would predict past the end: it is not run
        hidden = inner(module).model(input_ids=ids[:, :-1], attention_mask=attn[:, :-1]).last_hidden_state
        return head_logprobs_at(hidden, attn[:, 1:].bool(), ids[:, 1:], head, temperature, with_entropy)
    logits = module(input_ids=ids[:, :-1], attention_mask=attn[:, :-1]).logits.float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None
    return logp, entropy


def _hf_prefix_passes(run, field: str, pids: torch.Tensor, pmask: torch.Tensor, inverse: torch.Tensor,
                      rids: torch.Tensor, rmask: torch.Tensor, **prompt_kwargs) -> torch.Tensor:
    """The shared-prompt layout through a transformers forward `run`: the prompts' pass with a KV
    cache, copied out to the samples, then the responses' pass on it; `field` of each output
    (`logits` or `last_hidden_state`) at every response position."""
    R = rids.shape[1]
    out = run(input_ids=pids, attention_mask=pmask, position_ids=(pmask.cumsum(-1) - 1).clamp(min=0),
              use_cache=True, **prompt_kwargs)
    cache = out.past_key_values
    cache.batch_select_indices(inverse)
    first = getattr(out, field)[:, -1:].index_select(0, inverse)  # see fasttrain.prefix_hidden
    if R == 1:
        return first
    positions = pmask.sum(1)[inverse][:, None] + torch.arange(R - 1, device=pids.device)[None]
    resp = run(input_ids=rids[:, :-1], attention_mask=torch.cat([pmask[inverse], rmask[:, :-1]], 1),
               position_ids=positions, past_key_values=cache, use_cache=True)
    return torch.cat([first, getattr(resp, field)], 1)


def hf_prefix_logits(module: torch.nn.Module, pids: torch.Tensor, pmask: torch.Tensor, inverse: torch.Tensor,
                     rids: torch.Tensor, rmask: torch.Tensor) -> torch.Tensor:
    """`trainer.fasttrain.prefix_logits` through the model's own forward (any model, any device)."""
    return _hf_prefix_passes(module, "logits", pids, pmask, inverse, rids, rmask, logits_to_keep=1)


def hf_prefix_hidden(module: torch.nn.Module, pids: torch.Tensor, pmask: torch.Tensor, inverse: torch.Tensor,
                     rids: torch.Tensor, rmask: torch.Tensor) -> torch.Tensor:
    """`trainer.fasttrain.prefix_hidden` through the model's own layers (`hf_prefix_logits` without
    the head): the final normed hidden states, [B, R, H], for a model `output_head` accepts."""
    from trainer.lora import inner

    return _hf_prefix_passes(inner(module).model, "last_hidden_state", pids, pmask, inverse, rids, rmask)


def shared_prefix_logprobs(module: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor, prompt_len: torch.Tensor,
                           with_entropy: bool = False, temperature: float = 1.0, checkpoint: bool = False,
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs` at the response positions (0 elsewhere), each distinct prompt run once.

    The samples of a group share their prompt, and a prompt token never attends to what follows,
    so its hidden states are the same in every sample: the prompts go through the model once
    (left-padded), their keys and values reach the samples, and the responses run on them. The
    gradient reaches the prompt pass through them, summed over the group's samples: the same
    loss and gradients as one pass per sample, without the repeated prompt tokens (a third of a
    GRPO batch's tokens on the reference workload). Llama-family models on CPU run the passes
    through `trainer.fasttrain` (fused ops, same results up to rounding), others the model's own.
    `checkpoint` (fused passes only) recomputes each layer in the backward pass."""
    B, W = ids.shape
    plen = prompt_len.tolist()
    rlen = (attn.sum(1) - prompt_len).tolist()
    prompts = [ids[i, : plen[i]].tolist() for i in range(B)]
    rows, inverse = distinct(prompts)
    R = max(max(rlen), 1)
    pad = 0  # any id: padded positions are masked out
    dev = ids.device
    pids, pmask = left_pad([prompts[r] for r in rows], pad)
    pids, pmask, inverse = pids.to(dev), pmask.to(dev, attn.dtype), inverse.to(dev)
    rids = torch.full((B, R), pad, dtype=ids.dtype, device=dev)
    rmask = torch.zeros((B, R), dtype=attn.dtype, device=dev)
    for i in range(B):
        rids[i, : rlen[i]] = ids[i, plen[i] : plen[i] + rlen[i]]
        rmask[i, : rlen[i]] = 1
    # Response token j is predicted at the prompt's last position (j = 0) or the response's j - 1.
    fused = fasttrain.unsupported(module) is None
    head = output_head(module)
    if head is not None:
        # the head's log-probs on the real response tokens only, a block of rows at a time
        if fused:
            hidden = fasttrain.prefix_hidden(module, pids, pmask, inverse, rids, rmask, checkpoint)
        else:
            hidden = hf_prefix_hidden(module, pids, pmask, inverse, rids, rmask)
        lp, entropy = head_logprobs_at(hidden, rmask.bool(), rids, head, temperature, with_entropy)
    else:
        if fused:
            logits = fasttrain.prefix_logits(module, pids, pmask, inverse, rids, rmask, checkpoint)
        else:
            logits = hf_prefix_logits(module, pids, pmask, inverse, rids, rmask)
        logits = logits.float() / temperature
        logp_all = torch.log_softmax(logits, dim=-1)
        lp = logp_all.gather(-1, rids.unsqueeze(-1)).squeeze(-1) * rmask
        entropy = -(logp_all.exp() * logp_all).sum(-1) * rmask if with_entropy else None
    # back to the packed layout: response token j of sample i sits at position plen[i] - 1 + j
    index = prompt_len[:, None] - 1 + torch.arange(R, device=dev)[None]

    def unpack(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros((B, W - 1 + R), dtype=x.dtype, device=dev).scatter(1, index, x)[:, : W - 1]

    return unpack(lp), (unpack(entropy) if entropy is not None else None)


@contextlib.contextmanager
def hf_checkpointing(module: torch.nn.Module):
    """The model's own layers recompute their activations in the backward pass of what runs inside
    (transformers' gradient checkpointing, non-reentrant); the backward may run after the block."""
    from trainer.lora import inner

    model = inner(module)
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.23's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        off = model.activation_checkpointing_disable
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        off = model.gradient_checkpointing_disable
    try:
        yield
    finally:
        off()


def response_logprobs(module: torch.nn.Module, part: PackedBatch, temperature: float,
                      with_entropy: bool = False, checkpoint: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of a packed batch's response tokens: on a CPU prompts that several
    samples share run once (`shared_prefix_logprobs`), else, and off the CPU (SHARED_PREFIX_DEVICES),
    one pass per sequence (`token_logprobs`); the fused passes of `trainer.fasttrain` always take the
    shared layout (no padding computed).
    `checkpoint` (grpo.gradient_checkpointing): each layer's activations are made again in the
    backward pass instead of kept. The model's own layers drop the KV cache when they checkpoint,
    so there it takes one pass per sequence."""
    fused = fasttrain.unsupported(module) is None
    if checkpoint and not fused:
        with hf_checkpointing(module):
            return token_logprobs(module, part.ids, part.attn, with_entropy=with_entropy, temperature=temperature)
    if not fused and part.ids.device.type not in SHARED_PREFIX_DEVICES:
        return token_logprobs(module, part.ids, part.attn, with_entropy=with_entropy, temperature=temperature)
    plen = part.prompt_len.tolist()
    if fused or len({tuple(part.ids[i, : plen[i]].tolist()) for i in range(len(plen))}) < len(plen):
        return shared_prefix_logprobs(module, part.ids, part.attn, part.prompt_len, with_entropy, temperature,
                                      checkpoint)
    return token_logprobs(module, part.ids, part.attn, with_entropy=with_entropy, temperature=temperature)
