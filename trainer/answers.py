"""Answer extraction and checking (math-verify) for GSM8K `#### n` and `\\boxed{}` answers.

Checking is bounded in time for any string a policy can write: plain integers are compared here,
and everything that needs math-verify (whose sympy evaluation of `9**9**9` or `2^2^2^2^2^2` runs
for hours in C, where no signal reaches it) goes to a child process that is killed past
CHECK_SECONDS; an answer that could not be checked in time scores as wrong, with a warning.

So one check takes at most CHECK_SECONDS once a ready checker has the question, plus the kill of
an overrunning one, plus, when the checker before it was killed and the spare has not finished
starting, the rest of that start (importing sympy: about 0.5 s on a fast quiet machine, more on a
slow or loaded one; never more than START_SECONDS). `_Checker.last` holds that split for the
latest check. Extraction is linear in the response's length.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import select
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from trainer.data import extract_boxed

# each `####` and what follows it on its line, up to the next `####`
FINAL_RE = re.compile(r"####((?:(?!####)[^\n])*)")
# the last number of a text, as lm-eval's GSM8K "flexible-extract" takes it (signs, thousands commas, decimals)
LAST_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
# a number as a whole (`1,000`, `-3.5`, `.5`); two alternatives, so that a long run of digits that is
# not one backtracks in linear time (`[\d,]*\.?\d+` retried `\d+` from each digit: quadratic)
NUMBER_RE = re.compile(r"^-?(?:[\d,]*\.\d+|[\d,]*\d)$")
INTEGER_RE = re.compile(r"^-?[0-9]+$")
# Without the signal timeout math-verify warns on every call; our inputs are short and bounded.
logging.getLogger("math_verify").setLevel(logging.ERROR)
MAX_ANSWER_CHARS = 100  # math-verify runs without its signal timeout (tasks may run in threads)
CHECK_SECONDS = 0.9  # math-verify's time on one answer, in the checker's process
START_SECONDS = 60.0  # for a checker process to start (about 0.5 s on a quiet machine)
log = logging.getLogger(__name__)


def extract_answer(response: str, mode: str = "strict") -> str | None:
    """The final answer of a response.

    strict (what the math reward and `eval/accuracy` use): the last `#### x` wherever it stands
    (real models often add a line after it, as lm-eval's strict-match and verl's GSM8K scorer
    allow), else the last \\boxed{}. flexible: the last number anywhere in the text."""
    if mode == "flexible":
        numbers = LAST_NUMBER_RE.findall(response)
        return numbers[-1].rstrip(",") if numbers else None
    if mode != "strict":
        raise ValueError(f"unknown answer extraction {mode!r}; use strict or flexible")
    finals = [m.strip() for m in FINAL_RE.findall(response)]
    finals = [f for f in finals if f]
    if finals:
        return finals[-1]
    return extract_boxed(response)


def has_format(response: str) -> bool:
    """The response's last `####` is followed by a number (lines after it allowed, as in strict
    extraction), or it holds a \\boxed{} answer."""
    ans = extract_answer(response)
    return ans is not None and (bool(NUMBER_RE.match(ans.replace(" ", ""))) or "\\boxed{" in response)


def _parse(text: str):
    text = text.replace(",", "") if NUMBER_RE.match(text.replace(" ", "")) else text
    return parse(text, extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()],
                 parsing_timeout=None)


def _integer(text: str) -> int | None:
    """The value of a plain integer answer (`42`, `-7`, `1,000`), as `_parse` reads it; else None."""
    digits = text.replace(",", "")
    return int(digits) if INTEGER_RE.match(digits) and NUMBER_RE.match(text) else None


def is_correct(response: str, gold: str, mode: str = "strict") -> bool:
    """Whether the response's final answer (`extract_answer` in `mode`) equals the gold answer."""
    pred = extract_answer(response, mode)
    if pred is None or len(pred) > MAX_ANSWER_CHARS:
        return False
    # Two plain integers: math-verify compares them as sympy Integers, i.e. by value; doing that
    # here skips its parser, about a millisecond an answer (tests/test_answers.py checks the two agree)
    g, p = _integer(gold.strip()), _integer(pred)
    if g is not None and p is not None:
        return g == p
    return _checker.verify(pred, gold)


def _verified(pred: str, gold: str) -> bool:
    gold_parsed, pred_parsed = _parse(gold), _parse(pred)
    if not gold_parsed or not pred_parsed:
        return pred.strip() == gold.strip()
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


class _Checker:
    """math-verify in a child process, one question at a time, killed when it overruns.

    A spare child is started beside the one in use, so that after a kill the next question finds a
    warm one (a start takes about half a second, mostly importing sympy). The children exit with
    this process (SIGKILL on the parent's death, EOF on their input) and are capped in memory."""

    def __init__(self) -> None:
        self.last: dict[str, float] = {}  # the latest check's seconds: waiting for a ready child, the check, a kill
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.spare: subprocess.Popen | None = None
        self.ready: set[int] = set()  # pids that have said they are ready
        self.spawner: ThreadPoolExecutor | None = None

    def _start(self) -> subprocess.Popen:
        # Started from one long-lived thread: a child's death signal fires when the thread that
        # started it ends, and the caller's may be a short-lived task thread.
        if self.spawner is None:
            self.spawner = ThreadPoolExecutor(1, thread_name_prefix="answer-checker")
        return self.spawner.submit(
            subprocess.Popen, [sys.executable, "-m", "trainer.answers", "--serve", str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1,
            start_new_session=True,  # a Ctrl-C to the run's process group is not its business
        ).result()

    def _read_line(self, proc: subprocess.Popen, deadline: float) -> str | None:
        """The child's next line, or None when it is gone or the deadline passes first."""
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
            return None
        line = proc.stdout.readline()
        return line or None

    def _kill(self, proc: subprocess.Popen | None) -> None:
        if proc is not None:
            proc.kill()
            proc.wait()
            self.ready.discard(proc.pid)

    def _worker(self) -> subprocess.Popen | None:
        """A ready child (promoting the spare, starting a new spare), or None if none starts.

        Waiting for a start is bounded by START_SECONDS, not by CHECK_SECONDS: how long a start
        takes depends on the machine's load, and must not decide whether an answer scores."""
        if self.proc is None or self.proc.poll() is not None:
            self._kill(self.proc)
            alive = self.spare is not None and self.spare.poll() is None
            self.proc, self.spare = (self.spare if alive else self._start()), None
        if self.spare is None:
            self.spare = self._start()
        if self.proc.pid not in self.ready:
            if self._read_line(self.proc, time.monotonic() + START_SECONDS) != "ready\n":
                self._kill(self.proc)
                self.proc = None
                return None
            self.ready.add(self.proc.pid)
        return self.proc

    def verify(self, pred: str, gold: str) -> bool:
        with self.lock:
            self.last = {"start": 0.0, "check": 0.0, "kill": 0.0}
            for _ in range(2):  # a child found dead when asked (EOF on its input) is replaced once
                t0 = time.monotonic()
                proc = self._worker()
                t1 = time.monotonic()
                self.last["start"] += t1 - t0
                if proc is None:
                    log.warning("the answer checker's process did not start within %.0fs; %r scored as wrong",
                                START_SECONDS, pred[:60])
                    return False
                try:
                    proc.stdin.write(json.dumps([pred, gold]) + "\n")
                except OSError:
                    self._kill(proc)
                    self.proc = None
                    continue
                answer = self._read_line(proc, time.monotonic() + CHECK_SECONDS)
                t2 = time.monotonic()
                self.last["check"] = t2 - t1
                if answer in ("1\n", "0\n"):
                    return answer == "1\n"
                overran = proc.poll() is None
                self._kill(proc)
                self.proc = None
                self.last["kill"] = time.monotonic() - t2
                log.warning("answer %r %s while checked against %r; scored as wrong", pred[:60],
                            f"ran past {CHECK_SECONDS}s" if overran else "ended the checker's process (memory cap)",
                            gold[:60])
                return False
        return False

    def close(self) -> None:
        with self.lock:
            for proc in (self.proc, self.spare):
                self._kill(proc)
            self.proc = self.spare = None


_checker = _Checker()
atexit.register(_checker.close)


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies, even mid-computation."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        pass


def serve(parent: int) -> None:
    """The checker child: a JSON [pred, gold] a line in, "1" or "0" a line out."""
    import resource
    import signal

    _die_with_parent()
    if os.getppid() != parent:  # the parent died before the line above
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # a huge integer costs memory as well as time: past 1 GiB the child fails, and is replaced
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
    _verified("\\frac{1}{2}", "0.5")  # import and warm math-verify, sympy and the LaTeX parser first
    print("ready", flush=True)
    for line in sys.stdin:
        pred, gold = json.loads(line)
        try:
            ok = _verified(pred, gold)
        except Exception:  # noqa: BLE001 -- an unparseable answer is a wrong one
            ok = False
        print("1" if ok else "0", flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--serve":
        serve(int(sys.argv[2]))
