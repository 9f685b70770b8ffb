"""Batched decoding for Llama-family models without `generate`'s per-token machinery.

HF `generate` on a small model on CPU spends most of each token outside the matmuls: the cache
object, the attention-mask construction, rotary embeddings recomputed, logits processors. This
decoder runs the same layers with the same weights as plain tensor code:

- a preallocated KV cache per layer, written in place: keys transposed ([B, kv_heads, head_dim,
  prompt + max_new]: a query's scores over the cache are one vector sweep a dimension), values
  [B, kv_heads, prompt + max_new, head_dim];
- the weights read as the model stores them ([out, in]), nothing copied or packed per call; with
  the compiled kernels every product runs `trainer/csrc/gemm.h`'s dot form, else `F.linear`;
- the samples of one prompt share its prefill, and a long prefix every prompt shares (few-shot
  examples) is prefilled once;
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
from typing import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

SUPPORTED = {"llama", "mistral", "qwen2", "qwen3"}
STATIC_ROPE = {"default", "linear", "llama3", "yarn"}  # cos/sin depend on the position alone
COMPACT_FRACTION = 0.25  # drop finished rows once this share of the live batch has finished
# a prefix every prompt of a batch shares is prefilled once from this many tokens on: a few-shot
# eval's examples (about 1,000 tokens on GSM8K); shorter ones (a chat template's system turn) cost
# little to prefill a row at a time
SHARED_PREFIX_MIN = 128


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


def left_pad(seqs: list[list[int]] | list[tuple[int, ...]], pad: int, room: int = 0, width: int = 0,
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids right-aligned in a [n, width] tensor (the longest's width, or `width` if wider), and
    their [n, width + room] 0/1 mask."""
    width = max(width, max(len(q) for q in seqs))
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


def shared_prefix(seqs) -> int:
    """How many leading tokens every sequence shares, leaving each at least one of its own."""
    first, n = seqs[0], min(len(q) for q in seqs) - 1
    for q in seqs[1:]:
        i = 0
        while i < n and q[i] == first[i]:
            i += 1
        n = i
    return max(n, 0)


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


def pick(scores: torch.Tensor, greedy: bool, top_p: float | torch.Tensor | None,
         draw: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """One token per row from scores [rows, V] (already divided by the temperature, EOS already
    masked where it may not come yet): the argmax when greedy, else `draw` (one token per row with
    probability softmax of its argument: `sample` here, `race` in the GPU's captured step). With
    top_p (a number, or a tensor a captured step reads) the distribution is HF's TopPLogitsWarper's:
    the low tail whose mass is at most 1 - top_p dropped, drawn in sorted order and mapped back by a
    gather (no scatter, which a captured step would have to run under torch's deterministic mode).
    Both decoders choose through this one function."""
    if greedy:
        return scores.argmax(-1)
    if top_p is None:
        return draw(scores)
    ordered, order = torch.sort(scores, descending=False)
    drop = ordered.softmax(-1).cumsum(-1) <= 1 - top_p
    drop[:, -1] = False
    return order.gather(1, draw(ordered.masked_fill(drop, float("-inf")))[:, None]).squeeze(1)


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
        if c:  # the three products written side by side (no torch.cat)
            qkv = ops.linears_fwd(x.reshape(B * S, H), [L.wq, L.wk, L.wv], [L.bq, L.bk, L.bv]).view(B, S, -1)
        else:
            qkv = torch.cat([F.linear(x, L.wq, L.bq), F.linear(x, L.wk, L.bk), F.linear(x, L.wv, L.bv)], dim=-1)
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
            gu = ops.linears_fwd(x, [L.wg, L.wu], [None, None])
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
        nxt = pick(scores, temperature <= 0, top_p if top_p < 1.0 else None, sample)
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
        # Samples of one prompt (a GRPO group) share its prefill: each distinct prompt runs once and
        # its cache rows are copied out to the samples.
        rows, inverse = distinct(prompts)
        U = len(rows)
        # Prompts that all open with the same long prefix (few-shot examples, a long system turn)
        # prefill it once: it fills cache columns [0, P) of one row, copied to the others, and each
        # prompt's own tokens follow it, left-padded, at columns [P, width). Positions count tokens,
        # not columns, so each token's position is the one it has in its own prompt.
        P = shared_prefix(prompts) if U > 1 else 0
        if P < SHARED_PREFIX_MIN:
            P = 0
        own, valid = left_pad([p[P:] for p in prompts], pad, room=max_new)
        width = P + own.shape[1]  # the longest prompt's length, as without a shared prefix
        if width + max_new > self.max_positions:
            max_new = max(0, self.max_positions - width)  # as the model itself could not go further
            valid = valid[:, : own.shape[1] + max_new]
        valid = torch.cat([torch.ones(B, P, dtype=torch.bool), valid.bool()], dim=1)
        positions = (valid[:, :width].long().cumsum(-1) - 1).clamp(min=0)
        dtype = self.embed.dtype
        caches = [(torch.zeros(U, self.kv_heads, self.head_dim, width + max_new, dtype=dtype),
                   torch.zeros(U, self.kv_heads, width + max_new, self.head_dim, dtype=dtype)) for _ in self.layers]
        if P:
            causal = torch.ones(P, P, dtype=torch.bool).tril()
            first = [(kc[:1], vc[:1]) for kc, vc in caches]  # views: the prefill writes into row 0
            self._forward(torch.tensor(prompts[0][:P])[None], positions[:1, :P], first, 0, causal[None, None])
            for kc, vc in caches:
                kc[1:, :, :, :P] = kc[:1, :, :, :P]
                vc[1:, :, :P] = vc[:1, :, :P]
        S = width - P
        causal = torch.ones(S, S, dtype=torch.bool).tril()
        # a left pad attends to itself only (no all-masked row); real tokens never see a pad
        mask = (causal & valid[rows, None, P:width]) | torch.eye(S, dtype=torch.bool)
        if P:
            mask = torch.cat([torch.ones(U, S, P, dtype=torch.bool), mask], dim=2)
        logits = self._forward(own[rows], positions[rows, P:], caches, P, mask[:, None])
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
