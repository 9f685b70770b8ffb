"""Greedy eval's memory does not grow with vocabulary x new tokens.

A tiny Llama with a 65,536-token vocabulary (a word-level tokenizer of that size), 16 prompts,
64 new tokens: one [batch, tokens, vocab] fp32 copy of the logits is 268 MB. The peak resident
memory of `evaluate` is measured in a fresh process (ru_maxrss), after a warm-up call."""

import json
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, resource
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trainer.config import EvalConfig
from trainer.evaluate import evaluate

V = 65536
raw = Tokenizer(models.WordLevel({f"w{i}": i for i in range(V)}, unk_token="w0"))
raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="w0", pad_token="w1", eos_token="w2")
tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w3 {% endif %}"
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                                     pad_token_id=1, eos_token_id=2, bos_token_id=3)).eval()
examples = [{"id": str(i), "answer": "1", "messages": [{"role": "user", "content": f"w{10 + i} w{20 + i} w{30 + i}"},
                                                     {"role": "assistant", "content": "w5"}]} for i in range(16)]
evaluate(model, tok, examples[:2], EvalConfig(max_new_tokens=4, batch_size=16))  # warm-up
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
result = evaluate(model, tok, examples, EvalConfig(max_new_tokens=64, batch_size=16))
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"peak_growth_mb": (after - before) / 1024, "mean_tokens": result.mean_response_tokens}))
"""

LOGITS_COPY_MB = 16 * 64 * 65536 * 4 / 2**20  # 256 MiB


@pytest.mark.slow
def test_greedy_eval_peak_memory_does_not_grow_with_vocab_times_tokens():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"\neval peak growth {measured['peak_growth_mb']:.0f} MiB (one logits copy: {LOGITS_COPY_MB:.0f} MiB)")
    assert measured["mean_tokens"] > 32  # the sequences really ran long
    assert measured["peak_growth_mb"] < LOGITS_COPY_MB / 4
