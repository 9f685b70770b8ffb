import pytest

from trainer.answers import extract_answer, has_format, is_correct


@pytest.mark.parametrize("response,gold,ok", [
    ("3+4=7\n#### 7", "7", True),
    ("#### 7.0", "7", True),
    ("#### 1,234", "1234", True),
    ("so the answer is \\boxed{1,000}", "1000", True),
    ("\\boxed{\\frac{1}{2}}", "0.5", True),
    ("#### -3", "-3", True),
    ("#### 8", "7", False),
    ("7", "7", False),  # no final-answer marker: not graded as correct
    ("", "7", False),
    ("#### 7\n#### 9", "9", True),  # the closing line counts
])
def test_is_correct(response, gold, ok):
    assert is_correct(response, gold) is ok


def test_extract_and_format():
    assert extract_answer("a\n#### 42") == "42"
    assert extract_answer("x \\boxed{a{b}c} y") == "a{b}c"
    assert extract_answer("nothing") is None
    assert has_format("1+1=2\n#### 2")
    assert not has_format("the answer is 2")
    assert not has_format("#### two")


def test_long_garbage_is_not_parsed():
    assert is_correct("#### " + "9" * 500, "9") is False


def test_integer_answers_are_graded_as_math_verify_grades_them():
    """is_correct compares two plain integers itself instead of through math-verify's parser; on
    every pair below (signs, commas, leading zeros, spaces, decimals, real GSM8K answers and the
    synthetic generator's) it must say what math-verify says."""
    import json
    import random
    from pathlib import Path

    from trainer.answers import _verified
    from trainer.config import SyntheticData
    from trainer.data import synthetic

    rng = random.Random(0)
    golds = ["0", "7", "-3", "12", "1000", "1,000", "007", "-0", "123456789012345678901234567890", "10\n"]
    preds = ["0", "7", "7.0", "-3", "- 3", "12", "012", "1,000", "1,0,0,0", "1000", ",5", "-,5", "1 000",
             "0.0", "-0", "123456789012345678901234567890", "123456789012345678901234567891", "1e3",
             "7%", "\\frac{14}{2}", "٧", "1_000"]
    rows = [json.loads(line) for line in (Path(__file__).parent / "data" / "gsm8k" / "test.jsonl").read_text().splitlines()]
    real = [r["answer"].split("####")[-1].strip() for r in rows]
    golds += real[:40]
    preds += [str(int(a.replace(",", "")) + rng.choice([-1, 0, 0, 1])) for a in real[:40]]
    syn = synthetic(SyntheticData(n_train=50, n_test=5), 0).train
    golds += [ex["answer"] for ex in syn[:20]]
    preds += [ex["answer"] for ex in syn[20:40]]
    pairs = [(g, p) for g in golds for p in preds]
    assert sum(is_correct(f"#### {p}", g) for g, p in pairs) > 40  # the pairs include equal answers
    for gold, pred in pairs:
        response = f"x\n#### {pred}"
        assert is_correct(response, gold) == _verified(extract_answer(response), gold), (gold, pred)
