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
