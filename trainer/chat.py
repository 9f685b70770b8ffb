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


def encode_chat(tok: PreTrainedTokenizerBase, messages: list[dict], max_length: int) -> Encoded:
    ids: list[int] = []
    mask: list[int] = []
    for i, msg in enumerate(messages):
        if msg["role"] == "assistant":
            prefix = _ids(tok, messages[:i], add_generation_prompt=True)
            full = _ids(tok, messages[: i + 1], add_generation_prompt=False)
        else:
            prefix = ids
            full = _ids(tok, messages[: i + 1], add_generation_prompt=False)
        if full[: len(ids)] != ids or full[: len(prefix)] != prefix:
            raise ChatFormatError(
                f"chat template does not render turn {i} as an extension of the turns before it; "
                "the assistant-only loss mask needs a prefix-stable template"
            )
        new_mask = [0] * (len(prefix) - len(ids)) + [int(msg["role"] == "assistant")] * (len(full) - len(prefix))
        mask.extend(new_mask)
        ids = full
    truncated = len(ids) > max_length
    return Encoded(ids[:max_length], mask[:max_length], truncated)
