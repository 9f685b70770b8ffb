"""Supervised fine-tuning on DeepSpeed: loss on assistant tokens only, AdamW with warmup + cosine,
gradient clipping and accumulation, checkpoints that resume exactly, and a save_pretrained export.

Run alone: `posttrain sft --preset tiny` (the CLI resolves the upstream stages from cache).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import PreTrainedTokenizerBase, get_cosine_schedule_with_warmup

from trainer import checkpoint, engine as ds, faults
from trainer.chat import encode_many
from trainer.config import RunConfig
from trainer.errors import InputError
from trainer.inference.cuda import fuse_norms
from trainer.progress import progress_bar
from trainer.tracking import MetricLogger, NullLogger

log = logging.getLogger(__name__)


@dataclass
class SFTResult:
    steps: int
    final_loss: float
    tokens_per_second: float
    train_seconds: float
    n_examples: int
    n_truncated: int
    resumed_from_step: int | None
    state_hash: str


def encode_dataset(tok: PreTrainedTokenizerBase, examples: list[dict], max_length: int):
    encoded = encode_many(tok, [ex["messages"] for ex in examples], max_length)
    n_truncated = sum(e.truncated for e in encoded)
    kept = [e for e in encoded if any(e.loss_mask)]  # truncation can cut every assistant token
    return kept, n_truncated


def collate(batch, pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(e.input_ids) for e in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    attn = torch.zeros((len(batch), width), dtype=torch.long)
    for i, e in enumerate(batch):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids)
        mask[i, :n] = torch.tensor(e.loss_mask)
        attn[i, :n] = 1
    return {"input_ids": ids, "loss_mask": mask, "attention_mask": attn}


# Architectures whose attention mask follows restarting position ids (transformers' packed-sequence
# masks, with no attention_mask and no cache), checked against padded batches in tests/test_sft.py.
PACKABLE = ("llama", "mistral", "qwen2", "qwen3")


def packing_unsupported(model: torch.nn.Module) -> str | None:
    kind = getattr(getattr(model, "config", None), "model_type", None)
    return None if kind in PACKABLE else f"model_type {kind!r} is not one of {list(PACKABLE)}"


def _first_fit(lengths: list[int], width: int) -> tuple[list[list[int]], list[int]]:
    """Rows of indices, longest first, each into the first row it fits; and each row's fill."""
    rows: list[list[int]] = []
    fill: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = lengths[i]
        r = next((r for r in range(len(rows)) if fill[r] + n <= width), None)
        if r is None:
            rows.append([])
            fill.append(0)
            r = len(rows) - 1
        rows[r].append(i)
        fill[r] += n
    return rows, fill


def slot_flops(model: torch.nn.Module) -> tuple[int, int]:
    """FLOPs a row slot costs a forward pass: (matrix products, attention per key position).

    The weights' products count every parameter but the input embedding's (the output head's
    included, tied or not); attention computes QK^T and PV over every key of its row, masked or
    not, in each layer."""
    emb, out = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    body = sum(p.numel() for p in model.parameters()) - emb.numel() - (0 if out is emb else out.numel())
    c = model.config
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    return 2 * (body + out.numel()), 4 * c.num_hidden_layers * heads * head_dim


def _cheapest_fit(lengths: list[int], max_width: int, cost: tuple[int, int]):
    """(width, rows, fill) of the cheapest first fit: see pack_width."""
    linear, per_key = cost
    longest = max(lengths)
    widths = sorted({min(max_width, w) for w in range(-(-longest // 16) * 16, max_width + 16, 16)} | {longest})
    best = None
    for w in widths:
        rows, fill = _first_fit(lengths, w)
        flops = len(rows) * w * (linear + per_key * w)
        if best is None or flops < best[0]:  # ties keep the narrower width
            best = (flops, w, rows, fill)
    return best[1:]


def pack_width(lengths: list[int], max_width: int, cost: tuple[int, int]) -> int:
    """The row width that packs these examples for the fewest FLOPs, among multiples of 16 from the
    longest example up to `max_width`. Wide rows waste attention on the other examples' keys
    (each token attends to the whole row, masked), narrow ones waste padding (docs/performance.md has
    what it picks on the tiny preset). The loss and gradients stay the same (each example sees the
    same tokens whatever the width)."""
    return _cheapest_fit(lengths, max_width, cost)[0]


def pack(batch, width: int, pad_id: int, cost: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    """The examples laid end to end in rows of at most `width` tokens (first fit, longest first);
    given the model's `slot_flops`, in rows of the cheapest width up to it (`pack_width`).

    Position ids restart at 0 with each example, which makes transformers mask every example to
    itself: each token sees what it sees in a padded batch, so the loss and gradients are a padded
    batch's, without computing the padding. An example's first token is no target (it would be
    predicted from the previous example). Padding at a row's end is a block of its own."""
    lengths = [len(e.input_ids) for e in batch]
    rows, fill = _cheapest_fit(lengths, width, cost)[1:] if cost else _first_fit(lengths, width)
    w = max(fill)
    ids = torch.full((len(rows), w), pad_id, dtype=torch.long)
    pos = torch.zeros((len(rows), w), dtype=torch.long)
    mask = torch.zeros((len(rows), w), dtype=torch.long)
    for r, members in enumerate(rows):
        at = 0
        for i in members:
            e = batch[i]
            n = len(e.input_ids)
            ids[r, at:at + n] = torch.tensor(e.input_ids)
            pos[r, at:at + n] = torch.arange(n)
            mask[r, at + 1:at + n] = torch.tensor(e.loss_mask[1:])
            at += n
        pos[r, at:] = torch.arange(w - at)
    return {"input_ids": ids, "position_ids": pos, "loss_mask": mask}


def lm_forward(engine, batch: dict[str, torch.Tensor]):
    """The model's output on a padded (collate) or packed (pack) batch."""
    if "position_ids" in batch:  # no cache: with one, transformers would not mask the examples apart
        return engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    return engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])


def masked_lm_loss(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                   n_tokens: float | None = None) -> torch.Tensor:
    """Next-token cross-entropy summed over positions whose target token has loss_mask 1, divided
    by `n_tokens` (default: this batch's count, i.e. the mean). Passing the whole global batch's
    count makes micro-batches add up to its per-token mean, however their lengths differ."""
    targets = input_ids[:, 1:]
    weights = loss_mask[:, 1:].float()
    nll = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), targets.flatten(), reduction="none")
    return (nll * weights.flatten()).sum() / (n_tokens if n_tokens is not None else weights.sum().clamp(min=1.0))


def target_tokens(example) -> int:
    """Tokens an encoded example is trained to predict (its first token is never a target)."""
    return sum(example.loss_mask[1:])


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def planned_steps(cfg: RunConfig, n_examples: int) -> int:
    s = cfg.sft
    global_batch = s.micro_batch_size * s.grad_accum * ds.world_size()
    steps = math.ceil(s.epochs * n_examples / global_batch)
    return min(steps, s.max_steps) if s.max_steps else steps


def train_sft(
    cfg: RunConfig,
    model: torch.nn.Module,
    tok: PreTrainedTokenizerBase,
    examples: list[dict[str, Any]],
    work_dir: str | Path,
    logger: MetricLogger | None = None,
    fault_at_step: int | None = None,
    label: str = "sft",
) -> tuple[Any, SFTResult]:
    """Train; resumes from the newest committed checkpoint under `work_dir/checkpoints`.

    Returns (DeepSpeed engine, result). `fault_at_step` raises after that step (tests); `label`
    names the training in its progress."""
    s = cfg.sft
    logger = logger if ds.rank() == 0 and logger is not None else NullLogger()
    ds.fp32_matmul(cfg.model.tf32)
    data, n_truncated = encode_dataset(tok, examples, s.max_length)
    if not data:
        raise InputError("sft: no training example keeps an assistant token after truncation; "
                         f"raise sft.max_length (now {s.max_length})")
    if n_truncated:
        lost = len(examples) - len(data)  # truncation cut every answer token: nothing left to train on
        log.warning("sft: %d of %d examples truncated to max_length=%d%s", n_truncated, len(examples), s.max_length,
                    f"; {lost} of them kept no answer token and are left out, {len(data)} train (raise "
                    "sft.max_length)" if lost else "")
    total = planned_steps(cfg, len(data))
    if cfg.model.lora is not None:  # the adapters train, the rest is frozen
        from trainer import lora

        model = lora.wrap(model, cfg.model.lora)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": s.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # DeepSpeed drops an empty group (LoRA's adapters are all matrices) and the scheduler then miscounts
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=s.lr, betas=(0.9, 0.95))
    scheduler = get_cosine_schedule_with_warmup(optimizer, min(s.warmup_steps, total), total)
    fuse_norms(model)  # on a GPU: torch's fused RMSNorm in place of transformers' eight operators
    engine, _, _ = ds.initialize(model, optimizer, scheduler,
                                 ds.ds_config(s.deepspeed, s.micro_batch_size, s.grad_accum, s.grad_clip))
    ckpt_dir = Path(work_dir) / "checkpoints"
    state = checkpoint.load_latest(engine, ckpt_dir)
    step = state["step"] if state else 0
    epoch, pos = (state["epoch"], state["pos"]) if state else (0, 0)
    tokens_seen = state["tokens_seen"] if state else 0
    resumed = step if state else None
    seconds_before = state.get("seconds", 0.0) if state else 0.0  # max_seconds spans resumes
    if state is None:
        torch.manual_seed(cfg.seed)

    rank, world = ds.rank(), ds.world_size()
    per_rank = s.micro_batch_size
    packing = s.packing and packing_unsupported(model) is None
    cost = slot_flops(model) if packing else None
    if s.packing and not packing:
        log.info("sft: padded batches, not packed: %s", packing_unsupported(model))
    order = epoch_order(len(data), cfg.seed, epoch)
    loss_value, t0, tok_t0 = float("nan"), time.perf_counter(), 0
    engine.train()
    with progress_bar(label, total=total, completed=step, enabled=rank == 0, unit="steps") as bar:
        while step < total:
            if s.max_seconds is not None and ds.any_rank(seconds_before + time.perf_counter() - t0 > s.max_seconds):
                log.warning("sft: stopping at step %d of %d: max_seconds=%s reached", step, total, s.max_seconds)
                break
            # the step's global batch: grad_accum micro-batches on each rank
            global_mb = per_rank * world
            micro = []
            for _ in range(s.grad_accum):
                if pos + global_mb > len(order):
                    epoch, pos = epoch + 1, 0
                    order = epoch_order(len(data), cfg.seed, epoch)
                micro.append(order[pos: pos + global_mb])
                pos += global_mb
            # one per-token mean over the whole global batch: a micro-batch of short answers
            # weighs by its tokens, not as much as one of long answers
            n_tokens = max(sum(target_tokens(data[i]) for idx in micro for i in idx), 1)
            losses = []
            for everyone in micro:
                idx = everyone[rank * per_rank: (rank + 1) * per_rank]
                examples = [data[i] for i in idx]
                batch = (pack(examples, s.max_length, tok.pad_token_id, cost) if packing
                         else collate(examples, tok.pad_token_id))
                batch = {k: v.to(engine.device) for k, v in batch.items()}  # the rank's GPU, or the CPU
                out = lm_forward(engine, batch)
                loss = masked_lm_loss(out.logits, batch["input_ids"], batch["loss_mask"], n_tokens)
                # DeepSpeed divides by its accumulation steps and averages over ranks
                engine.backward(loss * s.grad_accum * world)
                ds.step(engine)
                losses.append(loss.item())
                tok_t0 += sum(len(e.input_ids) for e in examples) * world
            step += 1
            loss_value = ds.sum_across_ranks([sum(losses)])[0]
            bar.update(1, loss=loss_value)
            if step % s.log_every == 0 or step == total:
                elapsed = time.perf_counter() - t0
                logger.log_metrics({
                    "train/loss": loss_value,
                    "train/lr": engine.get_lr()[0],
                    "train/grad_norm": ds.grad_norm(engine),
                    "train/tokens_per_second": tok_t0 / max(elapsed, 1e-9),
                    "train/epoch": epoch + pos / len(order),
                }, step=step)
            faults.check("sft", step, {"sft": fault_at_step} if fault_at_step else None)
            if step % s.checkpoint_every == 0 and step < total:
                checkpoint.save(engine, ckpt_dir, step, {"epoch": epoch, "pos": pos, "tokens_seen": tokens_seen + tok_t0,
                                                         "seconds": seconds_before + time.perf_counter() - t0})
    elapsed = time.perf_counter() - t0
    result = SFTResult(
        steps=step, final_loss=loss_value, tokens_per_second=tok_t0 / max(elapsed, 1e-9),
        train_seconds=elapsed, n_examples=len(data), n_truncated=n_truncated,
        resumed_from_step=resumed, state_hash=ds.state_dict_hash(engine.module),
    )
    return engine, result
