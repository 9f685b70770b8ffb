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


def _ids(tok: PreTrainedTokenizerBase, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tok(text, add_special_tokens=False)["input_ids"]


def encode_prompt(tok: PreTrainedTokenizerBase, messages: list[dict]) -> list[int]:
    """Token ids of a conversation followed by the assistant generation prompt."""
    return _ids(tok, messages, add_generation_prompt=True)


def _renders(tok: PreTrainedTokenizerBase, messages: list[dict]) -> list[str]:
    """The texts encode_chat tokenizes, in order: per turn, the generation-prompt prefix before an
    assistant message, then the conversation up to and including the turn."""
    out = []
    for i, msg in enumerate(messages):
        if msg["role"] == "assistant":
            out.append(tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True))
        out.append(tok.apply_chat_template(messages[: i + 1], tokenize=False, add_generation_prompt=False))
    return out


def _tokenize(tok: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    """`tok(text, add_special_tokens=False)["input_ids"]` for each text, in one batched call (a fast
    tokenizer's Rust backend directly: the per-call overhead was most of encoding a dataset)."""
    if not texts:
        return []
    backend = getattr(tok, "backend_tokenizer", None) if getattr(tok, "is_fast", False) else None
    if backend is not None:
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
    return tok(texts, add_special_tokens=False)["input_ids"]


def _assemble(messages: list[dict], tokenized: list[list[int]], max_length: int) -> Encoded:
    ids: list[int] = []
    mask: list[int] = []
    pieces = iter(tokenized)
    for i, msg in enumerate(messages):
        prefix = next(pieces) if msg["role"] == "assistant" else ids
        full = next(pieces)
        if full[: len(ids)] != ids or full[: len(prefix)] != prefix:
            raise ChatFormatError(
                f"chat template does not render turn {i} as an extension of the turns before it; "
                "the assistant-only loss mask needs a prefix-stable template"
            )
        mask.extend([0] * (len(prefix) - len(ids)) + [int(msg["role"] == "assistant")] * (len(full) - len(prefix)))
        ids = full
    truncated = len(ids) > max_length
    return Encoded(ids[:max_length], mask[:max_length], truncated)


def encode_chat(tok: PreTrainedTokenizerBase, messages: list[dict], max_length: int) -> Encoded:
    return encode_many(tok, [messages], max_length)[0]


def encode_many(tok: PreTrainedTokenizerBase, conversations: list[list[dict]], max_length: int,
                chunk: int = 4096) -> list[Encoded]:
    """encode_chat for many conversations, their renderings tokenized in batches of `chunk`."""
    out: list[Encoded] = []
    for start in range(0, len(conversations), chunk):
        part = conversations[start: start + chunk]
        renders = [_renders(tok, messages) for messages in part]
        flat = _tokenize(tok, [t for texts in renders for t in texts])
        pos = 0
        for messages, texts in zip(part, renders):
            out.append(_assemble(messages, flat[pos: pos + len(texts)], max_length))
            pos += len(texts)
    return out
