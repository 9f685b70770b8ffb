"""Progress where no terminal watches (a Prefect worker's flow run, a log file, a rank's pipe): log
lines, sparser as the work goes on, and one at the end; the real SFT and eval stages' lines reach the
Prefect UI in tests/test_deployments.py and standard error in tests/test_cli_server.py."""

from __future__ import annotations

import logging

import pytest

from trainer.progress import MOST_SECONDS_BETWEEN_LINES, LogBar, progress_bar


class Clock:
    """Seconds the test sets (the bar's schedule is in seconds; a real clock would make the test wait)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "trainer.progress"]


def test_lines_come_at_30_60_120_240_s_then_every_300_s(caplog):
    caplog.set_level(logging.INFO, logger="trainer.progress")
    clock = Clock()
    bar = LogBar("sft", total=10_000, unit="steps", clock=clock)
    said_at = []
    for second in range(1, 1801):
        clock.now = 1000.0 + second
        before = len(lines(caplog))
        bar.update(1, loss=2.0 - second / 1000)
        if len(lines(caplog)) > before:
            said_at.append(second)
    assert said_at == [30, 90, 210, 450, 750, 1050, 1350, 1650]
    assert 2 * MOST_SECONDS_BETWEEN_LINES > 1650 - 1350 == MOST_SECONDS_BETWEEN_LINES
    # 30 steps in 30 s: 9,970 left at one a second
    assert lines(caplog)[0] == "sft: 30/10000 steps (0%), 0:30 elapsed, about 2:46:10 left  loss 1.97"


def test_the_estimate_counts_only_this_runs_work_and_the_end_is_said(caplog):
    """A stage resumed at step 600 of 850: 250 steps left, at the pace of the steps this run made."""
    caplog.set_level(logging.INFO, logger="trainer.progress")
    clock = Clock()
    bar = LogBar("sft", total=850, completed=600, unit="steps", clock=clock)
    clock.now += 40
    bar.update(50)  # 50 steps in 40 s: 200 left take 160 s
    assert lines(caplog) == ["sft: 650/850 steps (76%), 0:40 elapsed, about 2:40 left"]
    clock.now += 160
    bar.update(200, loss=0.5)
    bar.finish()
    assert lines(caplog)[-1] == "sft: 850/850 steps (100%), 3:20 elapsed  loss 0.5"


def test_off_a_terminal_the_bar_logs_its_end_and_not_after_a_failure(caplog):
    """pytest captures standard output: no terminal, so log lines, not a rich bar."""
    caplog.set_level(logging.INFO, logger="trainer.progress")
    with progress_bar("eval", total=3, unit="answers") as bar:
        bar.update(3)
    assert len(lines(caplog)) == 1 and lines(caplog)[0].startswith("eval: 3/3 answers (100%), 0:0")
    with pytest.raises(RuntimeError):
        with progress_bar("eval", total=3, unit="answers") as bar:
            bar.update(1)
            raise RuntimeError("the stage's own error says what happened")
    assert len(lines(caplog)) == 1
    with progress_bar("sft", total=3, enabled=False) as bar:  # ranks other than 0
        bar.update(3)
    assert len(lines(caplog)) == 1


def test_a_rounds_line_says_how_long_the_rest_should_take():
    """GRPO's round line ends with the rounds left at this run's pace: a run resumed at round 10 of
    30 that took 50 s for its 5 rounds has 15 left, 2:30; grpo.max_seconds caps it; none after the last."""
    import time
    from types import SimpleNamespace

    from trainer.loop import time_left

    def trainer(round_, max_seconds=None, spent=0.0):
        grpo = SimpleNamespace(rounds=30, max_seconds=max_seconds)
        return SimpleNamespace(cfg=SimpleNamespace(grpo=grpo), round=round_, resumed_from=10,
                               started=time.perf_counter() - 50.0, elapsed=lambda: spent)

    assert time_left(trainer(15)) == ", about 2:30 left"
    assert time_left(trainer(15, max_seconds=100.0, spent=60.0)) == ", about 0:40 left"
    assert time_left(trainer(30)) == "" and time_left(trainer(10)) == ""
