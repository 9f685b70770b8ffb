"""Chat-template tokenization with a loss mask on assistant tokens only (every assistant turn).

The mask is found by rendering the conversation turn by turn: the tokens that the template adds
for an assistant message (its content and end-of-turn marker) get 1, all else 0. This holds for
any template whose rendering of a shorter conversation is a token prefix of a longer one, which
`encode_chat` checks rather than assumes.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from trainer.errors import InputError


class ChatFormatError(InputError):
    pass


@dataclass
class Encoded:
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool


def render_ids(tok: PreTrainedTokenizerBase, messages: list[dict], add_generation_prompt: bool,
               tools: list[dict] | None = None) -> list[int]:
    """Token ids of a conversation as the chat template renders it (with `tools` where given)."""
    kwargs = {"tools": tools} if tools else {}
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)
    return tok(text, add_special_tokens=False)["input_ids"]


def encode_prompt(tok: PreTrainedTokenizerBase, messages: list[dict]) -> list[int]:
    """Token ids of a conversation followed by the assistant generation prompt."""
    return render_ids(tok, messages, add_generation_prompt=True)


def _render_plan(messages: list[dict]) -> list[tuple[int, bool]]:
    """The renderings encode_chat tokenizes, in order, as (number of leading messages,
    add_generation_prompt): per assistant turn, the conversation before it with the generation
    prompt, then the conversation up to and including the turn; the whole conversation once more
    if it ends on another role. Other turns need no rendering of their own: their tokens are 0 in
    the mask whatever they are, as long as every rendering extends the one before it."""
    plan = []
    for i, msg in enumerate(messages):
        if msg["role"] == "assistant":
            plan += [(i, True), (i + 1, False)]
    if not plan or messages[-1]["role"] != "assistant":
        plan.append((len(messages), False))
    return plan


def _render(tok: PreTrainedTokenizerBase, conversations: list[list[dict]],
            plans: list[list[tuple[int, bool]]]) -> list[list[str]]:
    """Each plan's texts, rendered in one batched apply_chat_template call per add_generation_prompt."""
    texts: list[list[str]] = [[""] * len(plan) for plan in plans]
    for gen in (True, False):
        where = [(c, j) for c, plan in enumerate(plans) for j, (_, g) in enumerate(plan) if g == gen]
        if where:
            batch = [conversations[c][: plans[c][j][0]] for c, j in where]
            for (c, j), text in zip(where, tok.apply_chat_template(batch, tokenize=False, add_generation_prompt=gen)):
                texts[c][j] = text
    return texts


def _tokenize(tok: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    """`tok(text, add_special_tokens=False)["input_ids"]` for each text, in one batched call (a fast
    tokenizer's Rust backend directly: the per-call overhead was most of encoding a dataset)."""
    if not texts:
        return []
    backend = getattr(tok, "backend_tokenizer", None) if getattr(tok, "is_fast", False) else None
    if backend is not None:
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
    return tok(texts, add_special_tokens=False)["input_ids"]


def _assemble(messages: list[dict], plan: list[tuple[int, bool]], tokenized: list[list[int]],
              max_length: int, row: int) -> Encoded:
    ids: list[int] = []
    mask: list[int] = []
    for (n, gen), full in zip(plan, tokenized):
        if full[: len(ids)] != ids:
            what = f"the generation prompt after message {n - 1}" if gen else f"message {n - 1}"
            raise ChatFormatError(
                f"conversation {row}: the chat template does not render {what} as an extension of the "
                "messages before it (their tokens change once it follows); the assistant-only loss mask "
                "needs a template that renders earlier turns the same whatever comes after them"
            )
        trained = not gen and messages[n - 1]["role"] == "assistant"
        mask.extend([int(trained)] * (len(full) - len(ids)))
        ids = full
    truncated = len(ids) > max_length
    return Encoded(ids[:max_length], mask[:max_length], truncated)


def encode_chat(tok: PreTrainedTokenizerBase, messages: list[dict], max_length: int) -> Encoded:
    return encode_many(tok, [messages], max_length)[0]


def encode_many(tok: PreTrainedTokenizerBase, conversations: list[list[dict]], max_length: int,
                chunk: int = 4096) -> list[Encoded]:
    """encode_chat for many conversations, rendered and tokenized in batches of `chunk`."""
    out: list[Encoded] = []
    for start in range(0, len(conversations), chunk):
        part = conversations[start: start + chunk]
        plans = [_render_plan(messages) for messages in part]
        renders = _render(tok, part, plans)
        flat = _tokenize(tok, [t for texts in renders for t in texts])
        pos = 0
        for k, (messages, plan) in enumerate(zip(part, plans)):
            out.append(_assemble(messages, plan, flat[pos: pos + len(plan)], max_length, start + k))
            pos += len(plan)
    return out
