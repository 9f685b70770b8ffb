"""Batched decoding for Llama-family models without `generate`'s per-token machinery.

HF `generate` on a small model on CPU spends most of each token outside the matmuls: the cache
object, the attention-mask construction, rotary embeddings recomputed, logits processors. This
decoder runs the same layers with the same weights as plain tensor code:

- a preallocated KV cache per layer, written in place: keys transposed ([B, kv_heads, head_dim,
  prompt + max_new]: a query's scores over the cache are one vector sweep a dimension), values
  [B, kv_heads, prompt + max_new, head_dim];
- the weights read as the model stores them ([out, in]), nothing copied or packed per call; with
  the compiled kernels every product runs `trainer/csrc/gemm.h`'s dot form, else `F.linear`;
- the samples of one prompt share its prefill;
- rotary cos/sin from the model's own rotary module, computed once for every position;
- grouped-query attention as SDPA over [B, kv_heads, groups, head_dim] queries (no K/V repeat);
- finished sequences leave the batch, so a round whose answers end early stops paying for them;
- sampling by inverse CDF, one uniform number a row (`sample`), and the decoding mask built once a
  step for every layer;
- each decoding step's layer as one call of a compiled C++ kernel (`trainer/csrc/decode_layer.cpp`,
  built by `trainer/kernels.py`): the ~25 small ops between its four matrix products fused into one
  pass over each row. Where it cannot be built, the same step runs as torch ops (`_block`).

It covers Llama, Mistral (no sliding window), Qwen2 and Qwen3 on CPU; `unsupported()` names why
any other model falls back to `generate`. The results are the model's own forward up to float
rounding: `tests/test_fastgen.py` checks greedy tokens identical to HF `generate`'s and sampling
log-probabilities against the trainer's forward.
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

SUPPORTED = {"llama", "mistral", "qwen2", "qwen3"}
STATIC_ROPE = {"default", "linear", "llama3", "yarn"}  # cos/sin depend on the position alone
COMPACT_FRACTION = 0.25  # drop finished rows once this share of the live batch has finished


def unsupported(model: torch.nn.Module, adapters: bool = False, devices: tuple[str, ...] = ("cpu",)) -> str | None:
    """Why the fast decoder cannot run `model` (None when it can). `adapters`: the caller computes
    LoRA adapters itself (trainer.fasttrain); the decoder reads the weights alone, so it needs them
    merged in. `devices`: where the weights may be (the fixed-shape decoder also runs on CUDA)."""
    from trainer.lora import unmerged

    if not adapters and unmerged(model):
        return "LoRA adapters not merged into the weights"
    cfg = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", None)
    if kind not in SUPPORTED:
        return f"model_type {kind!r} is not one of {sorted(SUPPORTED)}"
    where = next(model.parameters()).device.type
    if where not in devices:
        return f"the model is on {where}, not {' or '.join(devices)}"
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        # ZeRO-3 keeps each weight partitioned, gathered only inside the modules' own forward hooks
        return "DeepSpeed ZeRO-3 partitions the weights"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r}"
    if getattr(cfg, "mlp_bias", False):
        return "mlp_bias"
    if getattr(cfg, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1"
    if getattr(cfg, "use_sliding_window", False) or (kind == "mistral" and cfg.sliding_window is not None):
        return "sliding-window attention"
    rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope not in STATIC_ROPE:
        return f"rope_type {rope!r} depends on the sequence length"
    return None


def left_pad(seqs: list[list[int]] | list[tuple[int, ...]], pad: int, room: int = 0,
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids right-aligned in a [n, width] tensor, and their [n, width + room] 0/1 mask."""
    width = max(len(q) for q in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width + room), dtype=torch.long)
    for r, q in enumerate(seqs):
        ids[r, width - len(q):] = torch.tensor(q, dtype=torch.long)
        mask[r, width - len(q):width] = 1
    return ids, mask


def distinct(seqs) -> tuple[list[int], torch.Tensor]:
    """The index of each distinct sequence's first occurrence, and each sequence's distinct number."""
    number: dict[tuple[int, ...], int] = {}
    rows, inverse = [], []
    for i, q in enumerate(seqs):
        key = tuple(q)
        if key not in number:
            number[key] = len(rows)
            rows.append(i)
        inverse.append(number[key])
    return rows, torch.tensor(inverse)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The models' RMSNorm, in their order of operations (float32 inside, weight after the cast back).
    In float32 there is no cast, and torch's fused kernel gives the same floats in one op (bit for bit
    on every shape we compared, 64 to 1000 wide)."""
    dtype = x.dtype
    if dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _fast_rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`_rms` in fewer kernels for the GPU's decoding step: torch's fused RMSNorm on the float32
    values, then the cast back and the weight (HF's order of casts; the sum of squares in the fused
    kernel's own order, which may differ from `pow().mean()` in the last bit of float32)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """cat(-sin1, sin2) over the last dimension: rotate-half's sign folded into the sine (see `_rotate`)."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half rotary, x * cos + cat(-x2, x1) * sin, with the sign folded into the sine
    (`signed_sin` = cat(-sin1, sin2)): the products are the same floats, one negation fewer."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def sample(scores: torch.Tensor) -> torch.Tensor:
    """One token per row with probability softmax(scores): inverse-CDF sampling from one uniform
    number a row. The same distribution as `torch.multinomial(scores.softmax(-1), 1)`, whose CPU
    kernel draws an exponential variate for every vocabulary entry. A token of probability 0
    (-inf score) is never drawn: its interval of the CDF is empty."""
    cdf = scores.softmax(-1).double().cumsum(-1)
    u = torch.rand((scores.shape[0], 1), dtype=torch.float64, device=scores.device) * cdf[:, -1:]  # in [0, total): never past the end
    return torch.searchsorted(cdf, u, right=True).squeeze(1)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, compiled: bool) -> torch.Tensor:
    """x @ W^T (+ b) over x's last dimension, W [out, in]: the compiled dot-form product, else F.linear."""
    if not compiled:
        return F.linear(x, weight, bias)
    return torch.ops.posttrain.linear_fwd(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], -1)


class _Layer:
    __slots__ = ("ln1", "ln2", "wq", "wk", "wv", "bq", "bk", "bv", "wo", "bo", "wg", "wu", "wd", "qn", "kn")


class FastDecoder:
    devices: tuple[str, ...] = ("cpu",)

    def __init__(self, model: torch.nn.Module) -> None:
        reason = unsupported(model, devices=self.devices)
        if reason is not None:
            raise ValueError(f"fast decoding does not support this model: {reason}")
        self.model = model
        cfg = model.config
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.groups = self.heads // self.kv_heads  # query heads per KV head
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.max_positions = cfg.max_position_embeddings
        self.cos = self.sin = None
        self.kernel = None

    # -- weights
    def _pack(self) -> None:
        """The weights as they are now (references, no copies). Taken at every decode call: an
        optimizer (DeepSpeed's among them) may replace a parameter's `.data`."""
        inner = self.model.model
        layers = []
        with torch.no_grad():
            for block in inner.layers:
                a, m = block.self_attn, block.mlp
                L = _Layer()
                L.ln1 = (block.input_layernorm.weight.detach(), block.input_layernorm.variance_epsilon)
                L.ln2 = (block.post_attention_layernorm.weight.detach(), block.post_attention_layernorm.variance_epsilon)
                L.wq, L.wk, L.wv, L.wo = (p.weight.detach().contiguous() for p in (a.q_proj, a.k_proj, a.v_proj, a.o_proj))
                L.bq, L.bk, L.bv, L.bo = (p.bias.detach() if p.bias is not None else None
                                          for p in (a.q_proj, a.k_proj, a.v_proj, a.o_proj))
                L.wg, L.wu, L.wd = (p.weight.detach().contiguous() for p in (m.gate_proj, m.up_proj, m.down_proj))
                qn, kn = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
                L.qn = (qn.weight.detach(), qn.variance_epsilon) if qn is not None else None
                L.kn = (kn.weight.detach(), kn.variance_epsilon) if kn is not None else None
                layers.append(L)
            self.layers = layers
            self.embed = inner.embed_tokens.weight.detach()
            self.norm = (inner.norm.weight.detach(), inner.norm.variance_epsilon)
            head = self.model.get_output_embeddings()
            self.head = head.weight.detach().contiguous()
            self.head_bias = head.bias.detach() if getattr(head, "bias", None) is not None else None
            self.scaling = inner.layers[0].self_attn.scaling
            if self.cos is None:
                pos = torch.arange(self.max_positions, device=self.embed.device)[None]
                cos, sin = inner.rotary_emb(self.embed[None, :1], position_ids=pos)
                self.cos = cos[0]  # [positions, head_dim]
                self.sin = signed_sin(sin[0])

    def _kernel(self):
        """The compiled decoding step when it applies: float32 weights throughout, and it builds."""
        if self.embed.dtype != torch.float32 or self.head_dim % 2:
            return None
        from trainer.kernels import decode_layer

        return decode_layer()

    # -- the forward pass
    def _qkv(self, L: _Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A layer's rotated queries [B, S, heads, hd] and keys and its values [B, S, kv_heads, hd]."""
        B, S, H = h.shape
        nh, nkv, hd = self.heads, self.kv_heads, self.head_dim
        # with the compiled kernels (the prefill of the compiled path), norms, rotary and SwiGLU are one
        # compiled pass each (`trainer/csrc/train_ops.cpp`), as the decoding steps' are
        ops = torch.ops.posttrain if self.kernel is not None else None
        c = ops is not None
        x = _rms(h, *L.ln1) if ops is None else ops.rms_norm_fwd(h.reshape(B * S, H), *L.ln1)[0].view(B, S, H)
        qkv = torch.cat([_linear(x, L.wq, L.bq, c), _linear(x, L.wk, L.bk, c), _linear(x, L.wv, L.bv, c)], dim=-1)
        fused_rotary = ops is not None and L.qn is None  # q/k norms come between the product and rotary
        if fused_rotary:
            qkv = ops.rotary(qkv.view(B * S, -1), cos.reshape(B * S, hd), sin.reshape(B * S, hd), nh + nkv, hd,
                             False).view(B, S, -1)
        qk, v = qkv.split([(nh + nkv) * hd, nkv * hd], dim=-1)
        qk, v = qk.view(B, S, nh + nkv, hd), v.view(B, S, nkv, hd)
        if L.qn is not None:
            qk = torch.cat([_rms(qk[:, :, :nh], *L.qn), _rms(qk[:, :, nh:], *L.kn)], dim=2)
        if not fused_rotary:
            qk = _rotate(qk, cos, sin)  # q and k rotate together: one set of ops for both
        return qk[:, :, :nh], qk[:, :, nh:], v

    def _out_mlp(self, L: _Layer, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """The layer's output from its attention's `o` [B, S, heads * hd]: projection, residual, SwiGLU."""
        B, S, H = h.shape
        if self.kernel is not None:
            ops = torch.ops.posttrain
            h = h + _linear(o, L.wo, L.bo, True)
            x = ops.rms_norm_fwd(h.reshape(B * S, H), *L.ln2)[0]
            gu = torch.cat([ops.linear_fwd(x, L.wg, None), ops.linear_fwd(x, L.wu, None)], dim=-1)
            return h + ops.linear_fwd(ops.swiglu_fwd(gu), L.wd, None).view(B, S, H)
        h = h + F.linear(o, L.wo, L.bo)
        x = _rms(h, *L.ln2)
        return h + F.linear(F.silu(F.linear(x, L.wg)) * F.linear(x, L.wu), L.wd)

    def _block(self, L: _Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kcache: torch.Tensor,
               vcache: torch.Tensor, start: int, mask: torch.Tensor) -> torch.Tensor:
        """h [B, S, H] (S new positions written at cache columns start:start+S; keys [B, kv, hd, T],
        values [B, kv, T, hd]); mask: prefill [B, 1, S, start+S] bool, decoding (S = 1)
        [B * kv_heads, groups, start+1] additive."""
        B, S, H = h.shape
        nh, nkv, hd = self.heads, self.kv_heads, self.head_dim
        q, k, v = self._qkv(L, h, cos, sin)
        end = start + S
        kcache[:, :, :, start:end] = k.permute(0, 2, 3, 1)
        vcache[:, :, start:end] = v.transpose(1, 2)
        g = self.groups
        # queries grouped under their KV head: [B, kv, g*S, hd] attend [B, kv, end, hd]
        qg = q.view(B, S, nkv, g, hd).permute(0, 2, 3, 1, 4).reshape(B, nkv, g * S, hd)
        if S == 1:  # one query row per head: plain matmuls beat the SDPA kernel's set-up on CPU
            scores = torch.baddbmm(mask, qg.reshape(B * nkv, g, hd), kcache[..., :end].reshape(B * nkv, hd, end),
                                   alpha=self.scaling)
            o = (torch.softmax(scores, dim=-1) @ vcache[:, :, :end].reshape(B * nkv, end, hd)).view(B, nkv, g, hd)
        else:
            m = mask if g == 1 else mask.expand(B, 1, S, end).repeat(1, 1, g, 1)
            o = F.scaled_dot_product_attention(qg, kcache[..., :end].transpose(2, 3), vcache[:, :, :end], attn_mask=m,
                                               scale=self.scaling)
        o = o.view(B, nkv, g, S, hd).permute(0, 3, 1, 2, 4).reshape(B, S, nh * hd)
        return self._out_mlp(L, h, o)

    def _step_compiled(self, ids: torch.Tensor, positions: torch.Tensor, caches, col: int,
                       valid: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] of one new token a row, each layer one call of the compiled kernel
        (`trainer/kernels.py`); `valid` [B, >col] bool marks the cache columns each row attends."""
        h = F.embedding(ids, self.embed)  # [B, H]
        for L, (kc, vc) in zip(self.layers, caches):
            self.kernel(h, L.ln1[0], L.ln1[1], L.wq, L.wk, L.wv, L.bq, L.bk, L.bv, L.wo, L.bo, L.ln2[0], L.ln2[1],
                        L.wg, L.wu, L.wd, L.qn[0] if L.qn else None, L.qn[1] if L.qn else 0.0, L.kn[0] if L.kn else None,
                        L.kn[1] if L.kn else 0.0, self.cos, self.sin, positions, kc, vc, col, valid, self.scaling,
                        self.heads, self.kv_heads)
        return torch.ops.posttrain.linear_fwd(torch.ops.posttrain.rms_norm_fwd(h, *self.norm)[0], self.head,
                                              self.head_bias)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, caches, start: int,
                 mask: torch.Tensor) -> torch.Tensor:
        """Logits of the last of the S new positions, [B, V]."""
        h = F.embedding(ids, self.embed)
        cos, sin = self.cos[positions].unsqueeze(2), self.sin[positions].unsqueeze(2)  # [B, S, 1, hd]
        for L, (kc, vc) in zip(self.layers, caches):
            h = self._block(L, h, cos, sin, kc, vc, start, mask)
        return _linear(_rms(h[:, -1], *self.norm), self.head, self.head_bias, self.kernel is not None)

    @classmethod
    def _sample_step(cls, logits: torch.Tensor, t: int, eos: int, temperature: float, top_p: float, min_new: int,
                     logprobs: bool) -> tuple[torch.Tensor, list[int], list[float] | None]:
        """Step t's tokens (sampled, or greedy at temperature 0) and their log-probs, as lists."""
        nxt, lp = cls._choose(logits, t, eos, temperature, top_p, min_new, logprobs)
        return nxt, nxt.tolist(), lp.tolist() if lp is not None else None

    @staticmethod
    def _choose(logits: torch.Tensor, t: int, eos: int, temperature: float, top_p: float, min_new: int,
                logprobs: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Step t's tokens (sampled, or greedy at temperature 0) and their log-probs, as torch ops on
        the logits' device."""
        scores = logits.float()
        if temperature > 0:
            scores = scores / temperature
        lp_all = torch.log_softmax(scores, dim=-1) if logprobs else None
        if t < min_new:
            scores[:, eos] = float("-inf")
        if temperature > 0:
            if top_p < 1.0:  # HF's TopPLogitsWarper: drop the low tail whose mass is at most 1 - top_p
                sorted_scores, order = torch.sort(scores, descending=False)
                drop = sorted_scores.softmax(-1).cumsum(-1) <= 1 - top_p
                drop[:, -1] = False
                scores = scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))
            nxt = sample(scores)
        else:
            nxt = scores.argmax(-1)
        return nxt, lp_all.gather(1, nxt[:, None]).squeeze(1) if lp_all is not None else None

    # -- decoding
    @torch.no_grad()
    def decode(self, prompts: list[list[int]], max_new: int, eos: int, pad: int, temperature: float = 0.0,
               top_p: float = 1.0, min_new: int = 0, logprobs: bool = True,
               stop: Callable[[list[int]], bool] | None = None,
               ) -> tuple[list[list[int]], list[list[float]]]:
        """New tokens of each prompt (ending at EOS, which is kept, at a token after which `stop` of
        the row's new tokens is true, also kept, or at max_new) and their log-probs under
        softmax(logits / T) (greedy: T = 1)."""
        self._pack()
        self.kernel = self._kernel()
        B = len(prompts)
        width = max(len(p) for p in prompts)
        if width + max_new > self.max_positions:
            max_new = max(0, self.max_positions - width)  # as the model itself could not go further
        ids, valid = left_pad(prompts, pad, room=max_new)
        valid = valid.bool()
        positions = (valid[:, :width].long().cumsum(-1) - 1).clamp(min=0)
        # Samples of one prompt (a GRPO group) share its prefill: each distinct prompt runs once and
        # its cache rows are copied out to the samples.
        rows, inverse = distinct(prompts)
        U = len(rows)
        dtype = self.embed.dtype
        caches = [(torch.zeros(U, self.kv_heads, self.head_dim, width + max_new, dtype=dtype),
                   torch.zeros(U, self.kv_heads, width + max_new, self.head_dim, dtype=dtype)) for _ in self.layers]
        causal = torch.ones(width, width, dtype=torch.bool).tril()
        # a left pad attends to itself only (no all-masked row); real tokens never see a pad
        mask = (causal & valid[rows, None, :width]) | torch.eye(width, dtype=torch.bool)
        logits = self._forward(ids[rows], positions[rows], caches, 0, mask[:, None])
        if U < B:
            logits = logits[inverse]
            caches = [(kc[inverse], vc[inverse]) for kc, vc in caches]
        out_tok = [[] for _ in range(B)]
        out_lp = [[] for _ in range(B)]
        live = torch.arange(B)  # rows of the original batch still in the cache, in cache order
        finished = [False] * B     # per cache row: EOS (or a stop) already sampled (it decodes on until compaction)
        next_pos = positions[:, -1] + 1
        # the compiled path samples in one op a step (no top-p: its sort stays in torch ops)
        fused_sampling = self.kernel is not None and temperature > 0 and top_p >= 1.0 and dtype == torch.float32
        for t in range(max_new):
            if fused_sampling:
                # the same uniform draws as `sample`'s, from the same generator
                u = torch.rand((logits.shape[0],), dtype=torch.float64)
                nxt, lp_next = torch.ops.posttrain.sample_rows(logits.contiguous(), temperature, eos, t < min_new, u)
                toks = nxt.tolist()
                lps = lp_next.tolist() if logprobs else None
            else:
                nxt, toks, lps = self._sample_step(logits, t, eos, temperature, top_p, min_new, logprobs)
            for j, row in enumerate(live.tolist()):
                if finished[j]:
                    continue
                out_tok[row].append(toks[j])
                if lps is not None:
                    out_lp[row].append(lps[j])
                finished[j] = toks[j] == eos or (stop is not None and stop(out_tok[row]))
            n_done = sum(finished)
            if t == max_new - 1 or n_done == len(finished):
                break
            col = width + t
            if n_done and n_done >= COMPACT_FRACTION * len(finished):
                keep = torch.tensor([j for j, f in enumerate(finished) if not f])
                live, nxt, next_pos, valid = live[keep], nxt[keep], next_pos[keep], valid[keep]
                caches = [(kc[keep], vc[keep]) for kc, vc in caches]
                finished = [False] * len(keep)
            valid[:, col] = True
            if self.kernel is not None:
                logits = self._step_compiled(nxt, next_pos, caches, col, valid)
                next_pos = next_pos + 1
                continue
            # additive, shared by every layer and in baddbmm's layout: 0 where a key is visible, -inf where not
            step_mask = torch.zeros((len(live), self.heads, col + 1), dtype=dtype).masked_fill_(
                ~valid[:, None, : col + 1], float("-inf")).view(len(live) * self.kv_heads, self.groups, col + 1)
            logits = self._forward(nxt[:, None], next_pos[:, None], caches, col, step_mask)
            next_pos = next_pos + 1
        return out_tok, out_lp


# ------------------------------------------------------------------ fixed shapes: the CUDA path

GRAPHS_ENV = "POSTTRAIN_CUDA_GRAPHS"  # "0": the fixed-shape decoder runs its step eagerly on CUDA too
WIDTH_STEP = 64  # cache widths round up to a multiple of this: few shapes, so captured graphs are reused
MAX_GRAPHS = 4   # captured shapes kept (each holds its KV cache: layers x 2 x rows x width x kv x head_dim)
CHECK_EVERY = 8  # without stop strings, how many steps between the host's look at whether all rows ended


def bucket(n: int) -> int:
    """A batch of n rows decodes as the next power of two (filler rows beside it, their tokens dropped):
    at most a few shapes a run, each captured once."""
    return 1 << max(0, (n - 1).bit_length())


class _Fixed:
    """One shape's decoding state, in place across steps (a captured graph reads these tensors):
    the KV caches, each row's last token and its position, the cache column the step writes, and
    which columns each row sees."""

    def __init__(self, dec: "StaticDecoder", rows: int, width: int) -> None:
        dev, dtype = dec.embed.device, dec.embed.dtype
        self.caches = [(torch.zeros(rows, dec.kv_heads, dec.head_dim, width, dtype=dtype, device=dev),
                        torch.zeros(rows, dec.kv_heads, width, dec.head_dim, dtype=dtype, device=dev))
                       for _ in dec.layers]
        self.tok = torch.zeros(rows, dtype=torch.long, device=dev)
        self.pos = torch.zeros(rows, dtype=torch.long, device=dev)
        self.col = torch.zeros(1, dtype=torch.long, device=dev)
        self.valid = torch.zeros(rows, width, dtype=torch.bool, device=dev)
        self.graph = None
        self.logits: torch.Tensor | None = None  # the captured step's output, rewritten by each replay


class StaticDecoder(FastDecoder):
    """The decoder at fixed shapes, for GPUs: a decoding step is launch-bound there (a 135M model
    reads its weights in about 0.1 ms; its few hundred small kernels take milliseconds to launch from
    Python), so each step is captured once as a CUDA graph and replayed.

    - The batch runs as a power-of-two bucket of rows and the KV cache as a width rounded up to
      `WIDTH_STEP`; each step attends over the whole width with a mask (no per-step slicing), writes
      its keys and values at a cache column held in a tensor, and reads positions from a tensor:
      nothing in a step depends on a Python number, so one captured graph serves every step and
      every later call of the same shape.
    - A prompt shared by a group's samples is prefilled once (eagerly: one call a batch), its cache
      rows copied to the samples.
    - Sampling, the sampler's log-probs, EOS and `min_new` run on the device; without stop strings
      the host looks every `CHECK_EVERY` steps whether every row has ended (one sync), with them
      every step (the text is decoded on the host).
    - Finished rows decode on (fixed shapes); their tokens past EOS or a stop are dropped.
    - The graph reads the weights where they were at capture: a weight whose storage moved (a
      resume's `load_state_dict` into new tensors, DeepSpeed replacing `.data`) is noticed at the
      next call, and every shape is captured again.

    Off CUDA, or with POSTTRAIN_CUDA_GRAPHS=0, the same step runs eagerly: that is how the CPU tests
    check it against HF `generate` and the trainer's forward (the CPU itself uses `FastDecoder`).
    Replaying a graph runs the same kernels on the same shapes, so decoding stays reproducible run to
    run under torch's deterministic mode."""

    devices = ("cpu", "cuda")

    def __init__(self, model: torch.nn.Module, graphs: bool | None = None) -> None:
        super().__init__(model)  # (kept by `decoder_for` for the model's lifetime: it holds no reference to it)
        on_cuda = next(model.parameters()).device.type == "cuda"
        self.use_graphs = on_cuda and os.environ.get(GRAPHS_ENV, "1") != "0" if graphs is None else graphs
        if self.use_graphs and not on_cuda:
            raise ValueError("CUDA graphs need the model on a CUDA device")
        self.masked_writes: bool | None = None  # None: one-hot column writes on CUDA under deterministic mode
        self.fuse = True  # q, k, v as one product and gate, up as one, from weights copied at each call
        self.fused: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] = []  # per layer: wqkv, bqkv, wgu
        self._fused_shape: tuple | None = None
        self.shapes: dict[tuple[int, int], _Fixed] = {}  # in order of last use
        self.weights_at_capture: tuple[int, ...] = ()
        self.pool = None

    @property
    def model(self) -> torch.nn.Module:
        model = self._model()
        if model is None:
            raise RuntimeError("the decoder's model was freed")
        return model

    @model.setter
    def model(self, model: torch.nn.Module) -> None:
        self._model = weakref.ref(model)

    def _refresh_fused(self) -> None:
        """Each layer's q, k and v projections as one [(heads + 2 kv_heads) * hd, H] matrix (and bias),
        gate and up as one [2 I, H]: one product each instead of three and two (on a GPU a decoding
        step is a few hundred small kernels, and each is time). They are buffers of the decoder's own,
        allocated once and refilled from the policy's weights at every call (a device-to-device copy
        of about two thirds of them), so the captured graphs keep reading the same storage and the
        call decodes with the weights as they were when it began."""
        shape_of = lambda L: (L.wq.dtype, L.wq.device, L.wq.shape[0] + L.wk.shape[0] + L.wv.shape[0], L.wg.shape[0])
        if not self.fused or shape_of(self.layers[0]) != self._fused_shape:
            self.fused = []
            for L in self.layers:
                wqkv = torch.empty(L.wq.shape[0] + L.wk.shape[0] + L.wv.shape[0], L.wq.shape[1], dtype=L.wq.dtype,
                                   device=L.wq.device)
                bqkv = torch.empty(wqkv.shape[0], dtype=L.bq.dtype, device=L.bq.device) if L.bq is not None else None
                wgu = torch.empty(2 * L.wg.shape[0], L.wg.shape[1], dtype=L.wg.dtype, device=L.wg.device)
                self.fused.append((wqkv, bqkv, wgu))
            self._fused_shape = shape_of(self.layers[0])
        for L, (wqkv, bqkv, wgu) in zip(self.layers, self.fused):
            torch.cat([L.wq, L.wk, L.wv], out=wqkv)
            if bqkv is not None:
                torch.cat([L.bq, L.bk, L.bv], out=bqkv)
            torch.cat([L.wg, L.wu], out=wgu)

    def _weight_pointers(self) -> tuple[int, ...]:
        ts = [self.embed, self.head, self.norm[0], self.cos, self.sin]
        for L in self.layers:
            ts += [L.ln1[0], L.ln2[0], L.wo, L.wd] + ([] if self.fuse else [L.wq, L.wk, L.wv, L.wg, L.wu])
            ts += [t for t in (L.bq, L.bk, L.bv, L.bo) if t is not None]
            ts += [n[0] for n in (L.qn, L.kn) if n is not None]
        if self.fuse:
            ts += [t for layer in self.fused for t in layer if t is not None]
        return tuple(t.data_ptr() for t in ts)

    def _fixed(self, rows: int, width: int) -> _Fixed:
        """The state of that shape, its step captured (CUDA graphs) the first time it is asked for."""
        key = (rows, width)
        st = self.shapes.pop(key, None)
        if st is None:
            if len(self.shapes) >= MAX_GRAPHS:
                self.shapes.pop(next(iter(self.shapes)))  # the least recently used shape
            st = _Fixed(self, rows, width)
            if self.use_graphs:
                try:
                    self._capture(st)
                except RuntimeError as e:  # an op this torch cannot capture: the same step, eagerly
                    log.warning("CUDA graph capture failed, decoding steps run eagerly from now on "
                                "(%s=0 skips the attempt): %s", GRAPHS_ENV, e)
                    self.use_graphs, st.graph = False, None
                    torch.cuda.synchronize()
        self.shapes[key] = st
        return st

    def _capture(self, st: _Fixed) -> None:
        """Capture the step of st's shape. Under torch's deterministic mode the step is captured with
        the mode off, which changes one op: the cache write keeps CUDA's plain index_copy_ kernel
        (its deterministic form is an index_put_ that checks the indices on the host, a sync a graph
        cannot hold; the eager step writes by a one-hot select instead, a pass over the whole cache a
        layer). One column, one writer per element: the plain kernel stores the same values every
        replay. The mode is restored before anything else runs (capture is synchronous, on this thread)."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()  # the shapes' graphs share one memory pool
        strict = torch.are_deterministic_algorithms_enabled()
        warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
        torch.use_deterministic_algorithms(False)
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up on a side stream, as capture requires (lazy inits)
                for _ in range(2):
                    self._step(st)
            torch.cuda.current_stream().wait_stream(side)
            st.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(st.graph, pool=self.pool):
                st.logits = self._step(st)
        finally:
            torch.use_deterministic_algorithms(strict, warn_only=warn_only)

    def _run(self, st: _Fixed) -> torch.Tensor:
        if st.graph is None:
            return self._step(st)
        st.graph.replay()
        return st.logits

    def _step(self, st: _Fixed) -> torch.Tensor:
        """Logits [rows, V] of the next token of every row: `st.tok` at position `st.pos`, its keys
        and values written at cache column `st.col`, attending the columns `st.valid` marks."""
        rows, width = st.valid.shape
        h = F.embedding(st.tok, self.embed)[:, None]  # [rows, 1, H]
        cos, sin = self.cos[st.pos][:, None, None], self.sin[st.pos][:, None, None]  # [rows, 1, 1, hd]
        # additive, shared by every layer: 0 where a key is visible, -inf where not
        mask = torch.zeros((rows, self.heads, width), dtype=h.dtype, device=h.device).masked_fill_(
            ~st.valid[:, None], float("-inf")).view(rows * self.kv_heads, self.groups, width)
        # Under torch's deterministic mode, CUDA's index_copy_ becomes an index_put_ that checks its
        # indices' range on the host (a sync each layer); eagerly, a one-hot select of the column
        # writes the same values with an elementwise op (one more pass over the cache). `_capture`
        # captures with the mode off, so graphs keep index_copy_.
        sel = (torch.arange(width, device=h.device) == st.col) if self._masked_writes(h.device) else None
        fused = self.fused if self.fuse else [None] * len(self.layers)
        for L, (kc, vc), fz in zip(self.layers, st.caches, fused):
            h = self._fixed_block(L, h, cos, sin, kc, vc, st.col, mask, sel, fz)
        return _linear(_fast_rms(h[:, -1], *self.norm), self.head, self.head_bias, False)

    def _masked_writes(self, device: torch.device) -> bool:
        if self.masked_writes is not None:
            return self.masked_writes
        return device.type == "cuda" and torch.are_deterministic_algorithms_enabled()

    def _fixed_block(self, L: _Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kc: torch.Tensor,
                     vc: torch.Tensor, col: torch.Tensor, mask: torch.Tensor,
                     sel: torch.Tensor | None = None, fused=None) -> torch.Tensor:
        """One layer of a decoding step at fixed shapes: `_block`'s arithmetic for one new position,
        its keys and values written at the cache column `col` holds (or `sel`, that column's one-hot
        over the width, marks), attending the cache's whole width; `fused` (`_refresh_fused`'s
        buffers of this layer) makes q, k, v one product and gate, up another."""
        B = h.shape[0]
        nkv, hd, width = self.kv_heads, self.head_dim, kc.shape[-1]
        q, k, v = self._qkv(L, h, cos, sin) if fused is None else self._qkv_fused(L, h, cos, sin, fused)
        k, v = k.permute(0, 2, 3, 1), v.transpose(1, 2)  # [B, kv, hd, 1], [B, kv, 1, hd]
        if sel is None:
            kc.index_copy_(3, col, k)
            vc.index_copy_(2, col, v)
        else:
            torch.where(sel, k, kc, out=kc)
            torch.where(sel[:, None], v, vc, out=vc)
        scores = torch.baddbmm(mask, q.reshape(B * nkv, self.groups, hd), kc.view(B * nkv, hd, width),
                               alpha=self.scaling)
        o = torch.softmax(scores, dim=-1) @ vc.view(B * nkv, width, hd)
        o = o.view(B, 1, self.heads * hd)
        if fused is None:
            return self._out_mlp(L, h, o)
        h = h + F.linear(o, L.wo, L.bo)
        gate, up = F.linear(_fast_rms(h, *L.ln2), fused[2]).chunk(2, dim=-1)
        return h + F.linear(F.silu(gate) * up, L.wd)

    def _qkv_fused(self, L: _Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`_qkv` with the three projections as one product (`_refresh_fused`)."""
        B, S, _ = h.shape
        nh, nkv, hd = self.heads, self.kv_heads, self.head_dim
        qkv = F.linear(_fast_rms(h, *L.ln1), fused[0], fused[1])
        qk, v = qkv.split([(nh + nkv) * hd, nkv * hd], dim=-1)
        qk, v = qk.view(B, S, nh + nkv, hd), v.view(B, S, nkv, hd)
        if L.qn is not None:
            qk = torch.cat([_fast_rms(qk[:, :, :nh], *L.qn), _fast_rms(qk[:, :, nh:], *L.kn)], dim=2)
        qk = _rotate(qk, cos, sin)
        return qk[:, :, :nh], qk[:, :, nh:], v

    @torch.no_grad()
    def decode(self, prompts: list[list[int]], max_new: int, eos: int, pad: int, temperature: float = 0.0,
               top_p: float = 1.0, min_new: int = 0, logprobs: bool = True,
               stop: Callable[[list[int]], bool] | None = None,
               ) -> tuple[list[list[int]], list[list[float]]]:
        """As `FastDecoder.decode`: the new tokens of each prompt (ending at EOS or at a token after
        which `stop` is true, both kept, or at max_new) and their log-probs under softmax(logits / T)."""
        self._pack()
        self.kernel = None  # torch ops: the compiled kernels are CPU code
        if self.fuse:
            self._refresh_fused()
        if self.use_graphs:
            pointers = self._weight_pointers()
            if pointers != self.weights_at_capture:
                self.shapes.clear()  # captured against weights that moved: capture again
                self.weights_at_capture = pointers
        B = len(prompts)
        out_tok: list[list[int]] = [[] for _ in range(B)]
        out_lp: list[list[float]] = [[] for _ in range(B)]
        width = max(len(p) for p in prompts)
        max_new = min(max_new, max(0, self.max_positions - width))
        if max_new == 0:
            return out_tok, out_lp
        dev = self.embed.device
        rows_n = bucket(B)
        cols = min(-(-(width + max_new) // WIDTH_STEP) * WIDTH_STEP, self.max_positions)
        st = self._fixed(rows_n, cols)
        padded = list(prompts) + [prompts[0]] * (rows_n - B)  # filler rows share row 0's prefill
        ids, valid = left_pad(padded, pad, room=cols - width)
        ids, valid = ids.to(dev), valid.bool().to(dev)
        positions = (valid[:, :width].long().cumsum(-1) - 1).clamp(min=0)
        rows, inverse = distinct(padded)
        inverse = inverse.to(dev)
        caches = [(torch.zeros(len(rows), self.kv_heads, self.head_dim, width, dtype=self.embed.dtype, device=dev),
                   torch.zeros(len(rows), self.kv_heads, width, self.head_dim, dtype=self.embed.dtype, device=dev))
                  for _ in self.layers]
        causal = torch.ones(width, width, dtype=torch.bool, device=dev).tril()
        mask = (causal & valid[rows, None, :width]) | torch.eye(width, dtype=torch.bool, device=dev)
        logits = self._forward(ids[rows], positions[rows], caches, 0, mask[:, None])[inverse]
        for (kc, vc), (ku, vu) in zip(st.caches, caches):
            kc[..., :width].copy_(ku[inverse])
            vc[:, :, :width].copy_(vu[inverse])
        del caches
        st.valid.copy_(valid)
        st.pos.copy_(positions[:, -1] + 1)
        tokens = torch.zeros(rows_n, max_new, dtype=torch.long, device=dev)
        lps = torch.zeros(rows_n, max_new, dtype=torch.float32, device=dev)
        ended = torch.zeros(rows_n, dtype=torch.bool, device=dev)
        stopped = [False] * B  # stop strings: rows whose text ended, as the host decodes it
        steps = max_new
        for t in range(max_new):
            nxt, lp = self._choose(logits, t, eos, temperature, top_p, min_new, logprobs)
            tokens[:, t] = nxt
            if lp is not None:
                lps[:, t] = lp
            ended |= nxt == eos
            if stop is not None:
                for r, tok in enumerate(nxt[:B].tolist()):
                    if not stopped[r]:
                        out_tok[r].append(tok)
                        stopped[r] = tok == eos or stop(out_tok[r])
            if t == max_new - 1:
                break
            if all(stopped) if stop is not None else (t + 1) % CHECK_EVERY == 0 and bool(ended[:B].all()):
                steps = t + 1
                break
            st.tok.copy_(nxt)
            st.col.fill_(width + t)
            st.valid[:, width + t] = True
            logits = self._run(st)
            st.pos += 1
        toks = tokens[:B, :steps].tolist()
        got = lps[:B, :steps].tolist() if logprobs else None
        for r in range(B):
            n = len(out_tok[r]) if stop is not None else (toks[r].index(eos) + 1 if eos in toks[r] else steps)
            out_tok[r] = toks[r][:n]
            out_lp[r] = got[r][:n] if got is not None else []
        return out_tok, out_lp
