"""A small BPE tokenizer trained on the prepared text, saved as a HF tokenizer with a chat template.

Digits are split one per token so that arithmetic is learnable by a tiny model.
Pretrained models use their own tokenizer (`load_tokenizer`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from trainer.errors import InputError
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

BOS, EOS, PAD = "<|bos|>", "<|end|>", "<|pad|>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
SPECIAL_TOKENS = [PAD, BOS, EOS, *ROLE_TOKENS]

# Each turn: <|role|>content<|end|>. Generation stops at <|end|> (the EOS token).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | Path,
                    added_tokens: Iterable[str] = ()) -> PreTrainedTokenizerFast:
    """`added_tokens` become one token each after the trained vocabulary, and stay in decoded text
    (unlike the special tokens): a tool call's markers, so that a policy's turn stops on one token
    and the environment's tokens start on a token boundary."""
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        additional_special_tokens=ROLE_TOKENS,
    )
    hf.chat_template = CHAT_TEMPLATE
    if added_tokens:
        hf.add_tokens(list(added_tokens))
    hf.save_pretrained(str(out_dir))
    return hf


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if not getattr(tok, "chat_template", None):
        raise InputError(f"tokenizer at {path} has no chat template; use an instruct/chat model "
                         "or a tokenizer trained by the tokenizer stage")
    return tok
