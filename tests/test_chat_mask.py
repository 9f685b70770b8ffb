"""The loss mask covers assistant tokens only, in every assistant turn."""

from trainer.chat import encode_chat, encode_prompt


def _decode_masked(tok, enc, value):
    return tok.decode([t for t, m in zip(enc.input_ids, enc.loss_mask) if m == value])


def test_single_turn_mask_is_answer_and_end_marker(tiny_tokenizer):
    tok = tiny_tokenizer
    msgs = [{"role": "user", "content": "Ann has 3 pens. How many pens does Ann have now?"},
            {"role": "assistant", "content": "3+0=3\n#### 3"}]
    enc = encode_chat(tok, msgs, max_length=512)
    assert len(enc.input_ids) == len(enc.loss_mask)
    assert _decode_masked(tok, enc, 1) == "3+0=3\n#### 3<|end|>"
    unmasked = _decode_masked(tok, enc, 0)
    assert "Ann has 3 pens" in unmasked and "<|assistant|>" in unmasked
    # The masked span starts right after the generation prompt.
    prompt = encode_prompt(tok, msgs[:1])
    assert enc.input_ids[: len(prompt)] == prompt
    assert enc.loss_mask[: len(prompt)] == [0] * len(prompt)
    assert all(enc.loss_mask[len(prompt):])


def test_multi_turn_masks_every_assistant_turn_and_no_user_turn(tiny_tokenizer):
    tok = tiny_tokenizer
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Ben has 2 cups."},
            {"role": "assistant", "content": "#### 2"},
            {"role": "user", "content": "He buys 4 more."},
            {"role": "assistant", "content": "2+4=6\n#### 6"}]
    enc = encode_chat(tok, msgs, max_length=512)
    masked = _decode_masked(tok, enc, 1)
    assert masked == "#### 2<|end|>2+4=6\n#### 6<|end|>"
    unmasked = _decode_masked(tok, enc, 0)
    for text in ("Be brief.", "Ben has 2 cups.", "He buys 4 more."):
        assert text in unmasked
    # Exactly two contiguous masked runs.
    runs = sum(1 for i, m in enumerate(enc.loss_mask) if m and (i == 0 or not enc.loss_mask[i - 1]))
    assert runs == 2


def test_truncation_reports_and_cuts(tiny_tokenizer):
    msgs = [{"role": "user", "content": "Cal has 5 eggs. " * 10}, {"role": "assistant", "content": "#### 5"}]
    full = encode_chat(tiny_tokenizer, msgs, max_length=10_000)
    cut = encode_chat(tiny_tokenizer, msgs, max_length=20)
    assert not full.truncated and cut.truncated
    assert cut.input_ids == full.input_ids[:20] and cut.loss_mask == full.loss_mask[:20]
    assert not any(cut.loss_mask)  # the answer was cut off entirely


def test_batched_encoding_is_the_per_call_tokenization(tiny_tokenizer):
    """encode_many tokenizes every rendering in batches through the Rust backend; the ids are the
    ones `tok(text)` gives text by text, across chunk boundaries and mixed conversation shapes."""
    from trainer.chat import encode_many
    from trainer.config import SyntheticData
    from trainer.data import synthetic

    tok = tiny_tokenizer
    convs = [ex["messages"] for ex in synthetic(SyntheticData(n_train=40, n_test=5, worked_fraction=0.5), 1).train]
    convs += [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Ben has 2 cups."},
               {"role": "assistant", "content": "#### 2"}, {"role": "user", "content": "He buys 4 more."},
               {"role": "assistant", "content": "2+4=6\n#### 6"}],
              [{"role": "assistant", "content": "#### 1"}, {"role": "user", "content": "ok"}],  # starts, ends off the assistant
              [{"role": "user", "content": "Ben has 2 cups."}]]
    many = encode_many(tok, convs, max_length=48, chunk=7)
    assert len(many) == len(convs)
    for messages, enc in zip(convs, many):
        text = tok.apply_chat_template(messages, tokenize=False)
        full = tok(text, add_special_tokens=False)["input_ids"]
        assert enc.input_ids == full[:48] and enc.truncated == (len(full) > 48)
        masked = _decode_masked(tok, enc, 1)
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        if not enc.truncated:
            assert masked == "".join(a + "<|end|>" for a in answers)


def test_a_template_that_rewrites_earlier_turns_is_refused_naming_the_conversation(tiny_tokenizer):
    """A template that renders an earlier assistant turn differently once more follows (as
    reasoning templates do when they drop earlier <think> blocks) cannot give an exact mask."""
    import copy

    import pytest

    from trainer.chat import ChatFormatError, encode_many

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>"
        "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'].split('</think>')[-1] }}"
        "{% else %}{{ m['content'] }}{% endif %}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    fine = [{"role": "user", "content": "Ben has 2 cups."}, {"role": "assistant", "content": "#### 2"}]
    assert encode_many(tok, [fine], max_length=64)[0].loss_mask.count(1) > 0
    bad = fine[:1] + [{"role": "assistant", "content": "<think>2</think>#### 2"},
                      {"role": "user", "content": "He buys 4 more."}, {"role": "assistant", "content": "#### 6"}]
    with pytest.raises(ChatFormatError, match=r"conversation 1: .*generation prompt after message 2"):
        encode_many(tok, [fine, bad], max_length=64)
