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


@pytest.mark.slow
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


# Final answers a policy can write that sympy, asked to evaluate them, works on for minutes or
# hours (the first three never returned in 8 s before the checker ran in its own process).
HOSTILE = ["9**9**9**9", "2^2^2^2^2^2", "9^9^9", "10**10**10", "(9^9)^(9^9)", "10^{10^{10^{10}}}", "99**99**99",
           "1000000!", "(10!)!", "((5!)!)!", "factorial(10**7)", "\\Gamma(10^{9})", "binomial(10**9, 10**5)",
           "\\binom{10^9}{10^5}", "e^{e^{e^{e^{10}}}}", "(" * 45 + "1" + ")" * 45,
           "\\frac{1}{" * 12 + "2" + "}" * 12, "\\sqrt{" * 20 + "2" + "}" * 20, "9" * 99, "1" + "0" * 98,
           "0." + "3" * 97, "-" * 99, "\\" * 99, "{" * 99, "x^" * 33, "9!" * 33, "2**" * 30 + "2"]


def _fuzz(n: int, seed: int) -> list[str]:
    """Random strings of the pieces the hostile answers are made of, and printable garbage."""
    import random
    import string

    rng = random.Random(seed)
    pieces = ["9", "99", "^", "**", "!", "(", ")", "\\frac{", "}{", "}", "10", "e", "\\sqrt{", "{", "}", "x", "-", "/", "."]
    out = ["".join(rng.choice(pieces) for _ in range(rng.randint(3, 30)))[:100] for _ in range(n)]
    out += ["".join(rng.choice(string.printable) for _ in range(rng.randint(1, 100))) for _ in range(n)]
    return out


@pytest.mark.slow
def test_every_check_is_bounded_by_the_kill_time_plus_a_restart_whatever_the_answer():
    """A reward must never hang a round. What a check may take is CHECK_SECONDS once a ready
    checker has the question (math-verify's work is in a process killed past it), plus that kill,
    plus, after a kill, the rest of a replacement's start; the test checks each part against what
    it stands for, with margins that hold on a machine several times slower, never the sum against
    a second. An answer that cannot be checked scores as wrong, and the checker still answers
    ordinary questions afterwards."""
    import time

    from trainer.answers import CHECK_SECONDS, _checker

    assert is_correct("#### \\frac{14}{2}", "7")  # warm: a checker's first start is not an answer's time
    t0 = time.monotonic()  # what one checker's start costs on this machine, now
    probe = type(_checker)()
    assert probe.verify("\\frac{1}{2}", "0.5")
    start_cost = time.monotonic() - t0
    probe.close()
    killed, over = 0, []
    for answer in HOSTILE + _fuzz(40, 0):
        for response in (f"x\n#### {answer}", f"so \\boxed{{{answer}}}"):
            t0 = time.monotonic()
            result = is_correct(response, "42")
            seconds = time.monotonic() - t0
            assert result in (True, False)
            part = dict(_checker.last) if _checker.last else {"start": 0.0, "check": 0.0, "kill": 0.0}
            _checker.last = {}
            killed += part["kill"] > 0
            # the check itself: the select deadline, whatever the machine (0.5 s: scheduling on a loaded one)
            if part["check"] > CHECK_SECONDS + 0.5 or part["kill"] > 2.0:
                over.append((answer, "check", part))
            # waiting for a ready checker: part of one start, never more (3x and 2 s: load moves it)
            if part["start"] > 3 * start_cost + 2.0:
                over.append((answer, "start", part, start_cost))
            # nothing else in the call takes time of its own
            if seconds - sum(part.values()) > 0.5:
                over.append((answer, "rest", seconds, part))
    assert not over, over
    assert killed >= 10  # the hostile answers did run into the kill (else this tested nothing)
    assert is_correct("#### \\frac{14}{2}", "7") and is_correct("#### 7", "7") and not is_correct("#### 8", "7")


@pytest.mark.parametrize("name,make", [
    ("many final lines", lambda n: "#### 1\n" * n),
    ("hashes, no newline", lambda n: "#" * (4 * n)),
    ("an unclosed box", lambda n: "\\boxed{" + "{" * n),
    ("boxes in boxes", lambda n: "\\boxed{" * n + "}" * n),
    ("numbers", lambda n: "1,2.3 -4 " * n),
    ("a long final non-number", lambda n: "#### " + "1" * n + "x"),  # the format check's regex: was quadratic
    ("a long final decimal", lambda n: "#### -" + "1," * n + "." + "1" * n + "x"),
])
def test_extracting_an_answer_is_linear_in_the_response(name, make):
    """Strict and flexible extraction, and the format check, on what a policy could write."""
    from tests.growth import assert_linear

    def extract(text):
        extract_answer(text), extract_answer(text, "flexible"), has_format(text), is_correct(text, "7")

    assert_linear(extract, make, 2000, f"answer extraction on {name}")


def test_labelled_gsm8k_solutions_are_scored_correct():
    """OpenAI's labelled solutions (worked text with <<a*b=c>> annotations, then #### n) against
    their own answers, through the checker's process where the answer is not a plain integer."""
    import json
    from pathlib import Path

    folder = Path(__file__).parent / "data" / "gsm8k"
    rows = [json.loads(x) for f in ("train.jsonl", "test.jsonl") for x in (folder / f).read_text().splitlines()]
    assert len(rows) == 400
    for row in rows:
        gold = row["answer"].split("####")[-1].strip()
        assert is_correct(row["answer"], gold), row["answer"][-80:]
        assert is_correct(row["answer"].rsplit("####", 1)[0] + "#### " + gold + ".0", gold)  # via math-verify


@pytest.mark.slow
def test_no_checker_process_outlives_its_parent(tmp_path):
    """The checker's processes die with the process that uses them, even one SIGKILLed while its
    checker is deep in a hostile answer."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    script = ("import sys, threading\nfrom trainer import answers\nanswers.is_correct('#### \\\\frac{1}{2}', '0.5')\n"
              "c = answers._checker\nprint(c.proc.pid, c.spare.pid, flush=True)\n"
              "threading.Thread(target=answers.is_correct, args=('#### 9**9**9**9', '1')).start()\n"
              "import time\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pids = [int(x) for x in proc.stdout.readline().split()]
    assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
    time.sleep(0.3)  # the hostile answer is being worked on
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                                              for p in pids):
        time.sleep(0.05)
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]


@pytest.mark.parametrize("response,strict,flexible", [
    # a real model's closing line after the answer (SmolLM2-135M-Instruct's first GSM8K response)
    ("Dee has 3 pens and buys 1 more.\n#### 4\nThe answer is: 4", "4", "4"),
    ("#### 1,234 apples\nDone.", "1,234 apples", "1,234"),
    ("first #### 5 then #### 6", "6", "6"),
    ("#### \n#### 7", "7", "7"),
    ("The total is $1,200.50.", None, "1,200.50"),
    ("so 3 + 4 = 7, and the answer is \\boxed{7}. Check: 7 - 4 = 3", "7", "3"),
    ("no numbers here", None, None),
    ("-5 degrees, then it fell to -12.", None, "-12"),
])
def test_strict_takes_the_last_final_line_anywhere_and_flexible_the_last_number(response, strict, flexible):
    assert extract_answer(response) == strict
    assert extract_answer(response, "flexible") == flexible


def test_strict_and_flexible_scoring():
    assert is_correct("Dee has 3 pens.\n#### 4\nThe answer is: 4", "4")
    assert not is_correct("The answer is 4.", "4") and is_correct("The answer is 4.", "4", "flexible")
    assert is_correct("It costs $1,200.", "1200", "flexible")
    with pytest.raises(ValueError, match="strict or flexible"):
        extract_answer("#### 4", "loose")
