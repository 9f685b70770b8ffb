"""The sandbox for policy-written code, against programs that try to get out of it.

Every hostile program below is a real one, run in the real sandbox (namespaces where this process
is root, as here and in CI); each must be scored incorrect, stop at the limit it hit, leave no
process and no file behind, and never hold the caller past the wall clock."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from trainer.problems import sandbox
from trainer.problems.sandbox import Limits

ROOT = Path(__file__).resolve().parents[1]
TIGHT = Limits(wall_s=4.0, cpu_s=2, memory_mb=256, processes=16, output_bytes=64 << 10)
INPUTS, EXPECTED = [[1], [2], [3]], [2, 4, 6]
SLOW = 3  # a machine three times slower than this one still passes


def left_behind(run: sandbox.Execution) -> list[str]:
    """What of `run` outlived it: processes of its user (the kernel reaps a namespace a moment after
    its first process ends), its folder on this machine."""
    found = []
    deadline = time.monotonic() + 10
    while True:
        found = []
        for d in Path("/proc").iterdir():
            if d.name.isdigit() and run.user is not None:
                try:
                    uid = int((d / "status").read_text().split("\nUid:\t")[1].split()[0])
                except (OSError, IndexError, ValueError):
                    continue
                if uid == run.user:
                    found.append(f"process {d.name}")
        if not found or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return found + ([f"folder {run.folder}"] if Path(run.folder).exists() else [])


def contained(run: sandbox.Execution, limits: Limits = TIGHT) -> sandbox.Execution:
    assert run.wall_s < limits.wall_s * SLOW + 5, f"the execution held its caller {run.wall_s:.1f} s"
    assert left_behind(run) == [], run
    return run


def judge(program: str, limits: Limits = TIGHT) -> sandbox.Execution:
    return contained(sandbox.run(program, "f", INPUTS, limits), limits)


def test_a_correct_program_passes_and_a_partly_correct_one_gets_partial_credit():
    assert sandbox.isolation() == ("root" if os.geteuid() == 0 else sandbox.isolation())
    good = judge("def f(x):\n    return 2 * x\n")
    assert good.passed(EXPECTED) == [True, True, True] and good.ended == "exit", good
    part = judge("def f(x):\n    return 2 * x if x < 3 else 0\n")
    assert part.passed(EXPECTED) == [True, True, False], part
    # True is not 1, "2" is not 2, a set is no JSON value (that input errs), floats within 1e-6 pass
    assert sandbox.same(2.0000000001, 2) and not sandbox.same(True, 1) and not sandbox.same("2", 2)
    odd = judge("def f(x):\n    return {x} if x == 1 else (2.0 * x if x == 2 else str(2 * x))\n")
    assert odd.passed(EXPECTED) == [False, True, False], odd
    assert "TypeError" in odd.values[0]["error"], odd


def test_a_program_that_does_not_load_is_incorrect_with_its_error():
    run = judge("def f(x) return x\n")
    assert run.ended == "load" and "SyntaxError" in run.detail and run.passed(EXPECTED) == [False] * 3, run
    run = judge("def g(x):\n    return 2 * x\n")  # no function of the expected name
    assert run.ended == "load" and "KeyError" in run.detail, run


@pytest.mark.skipif(os.geteuid() != 0, reason="the namespaces need root here; without it isolation() says which")
def test_the_sandbox_runs_as_a_user_of_its_own_with_no_network_and_an_empty_folder():
    run = judge("import os, socket\n"
                "def f(x):\n"
                "    if x == 1: return [os.getuid(), os.getpid(), os.getppid()]\n"
                "    if x == 2: return sorted(os.listdir('.')) + [os.getcwd()]\n"
                "    return [n for _, n in socket.if_nameindex()]\n")
    uid, pid, ppid = run.values[0]["value"]
    assert uid >= 100000 and pid == 1 and ppid == 0, run  # its own PID namespace: it is the first process
    assert run.values[1]["value"] == ["/box"], run
    assert run.values[2]["value"] == ["lo"], run


HOSTILE = {
    # name: (program, what must have stopped it)
    # the CPU limit (2 s) or, on a machine busy enough that 4 s of wall clock give it less, the wall clock
    "infinite loop": ("def f(x):\n    while True:\n        pass\n", {"cpu", "wall"}),
    "sleeps forever": ("import time\ndef f(x):\n    time.sleep(10_000)\n", {"wall"}),
    "fork bomb": ("import os\ndef f(x):\n    while True:\n        try:\n            os.fork()\n"
                  "        except OSError:\n            pass\n", {"wall", "cpu"}),
    "20 GB allocation": ("def f(x):\n    b = bytearray(20 << 30)\n    return 2 * x\n", {"memory"}),
    "prints 1 GB": ("import sys\ndef f(x):\n    for _ in range(1024):\n        sys.stdout.write('x' * (1 << 20))\n",
                    {"output"}),
    "returns 1 GB": ("def f(x):\n    return ['x' * (1 << 20)] * 1024\n", {"output"}),
    "os._exit mid-test": ("import os\ndef f(x):\n    if x == 2:\n        os._exit(0)\n    return 2 * x + 1\n", {"exit"}),
    "exits 0 early": ("import os\nos._exit(0)\ndef f(x):\n    return 2 * x\n", {"exit"}),
    "prints a fake pass": ("import sys\nprint('3 passed')\nprint('{\"i\": 0, \"value\": 2}')\n"
                           "def f(x):\n    print('ok'); sys.exit(0)\n", {"exit"}),
    "patches assert and the harness": (
        "import builtins, json\nbuiltins.AssertionError = type('A', (Exception,), {})\n"
        "json.dumps = lambda *a, **k: '{\"i\": 0, \"passed\": true, \"value\": \"passed\"}'\n"
        "def f(x):\n    assert False\n    return 0\n", {"exit"}),
    "forges the result channel": (
        "import os\nfor fd in range(3, 20):\n    try:\n        os.write(fd, b'{\"i\": 0, \"value\": true}\\n{\"i\": 1, \"passed\": true}\\n'\n"
        "                 b'{\"i\": 2, \"value\": \"passed\"}\\n{\"tests\": \"all passed\"}\\n')\n"
        "    except OSError:\n        pass\ndef f(x):\n    return -1\n", {"exit"}),
    "kills its parent and everyone": (
        f"import os, signal\ndef f(x):\n    for pid in (os.getppid(), {os.getpid()}, {os.getppid()}, -1):\n"
        "        try:\n            os.kill(pid, signal.SIGKILL)\n        except OSError:\n            pass\n",
        {"exit", "signal"}),  # this test's process and its parent are not even visible to it
    "setsid child outlives it": ("import os, time\ndef f(x):\n    if x == 1 and os.fork() == 0:\n        os.setsid()\n"
                                 "        time.sleep(10_000)\n    return 2 * x + 1\n", {"exit"}),
}


@pytest.mark.slow  # each runs to its limit (seconds)
@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_program_is_contained_scored_incorrect_and_leaves_nothing(name):
    program, stopped_by = HOSTILE[name]
    run = judge(program)
    assert not any(run.passed(EXPECTED)), f"{name}: a test scored correct: {run}"
    assert run.ended in stopped_by, f"{name}: ended by {run.ended!r} ({run.detail}), expected {stopped_by}"
    assert len(run.stdout) <= TIGHT.output_bytes and len(run.stderr) <= TIGHT.output_bytes


@pytest.mark.skipif(os.geteuid() != 0, reason="the namespaces need root here; without it isolation() says which")
def test_it_reads_nothing_of_the_system_the_project_or_home_and_writes_nowhere_but_its_folder(tmp_path):
    secret = ROOT / "pyproject.toml"
    home = Path.home() / ".cache"
    reads = [["/etc/shadow"], ["/etc/passwd"], [str(secret)], [str(home)], ["/proc/1/environ"], ["/root"]]
    run = contained(sandbox.run("import os\ndef f(p):\n    if os.path.isdir(p):\n        return os.listdir(p)\n"
                                "    return open(p).read()\n", "f", reads, TIGHT))
    assert len(run.values) == len(reads), run
    # the one thing under /root it sees is the path to the interpreter's standard library
    toward_python = Path(os.path.realpath(sys.base_prefix)).relative_to("/").parts
    for (path,), got in zip(reads, run.values):
        if "value" in got:
            assert path == "/root" and got["value"] == [toward_python[1]], (path, got)
        else:
            assert "FileNotFoundError" in got["error"], (path, got)
    target = tmp_path / "written-by-the-sandbox"
    writes = [[str(target)], ["/tmp/x"], ["/usr/x"], ["/box/../etc/x"], [str(ROOT / "x")], ["/dev/x"]]
    run = contained(sandbox.run("def f(p):\n    open(p, 'w').write('x')\n    return 'wrote'\n", "f", writes, TIGHT))
    assert all("error" in v for v in run.values), run
    assert not target.exists() and not (ROOT / "x").exists() and not Path("/usr/x").exists()
    inside = contained(sandbox.run("def f(n):\n    open('a', 'wb').write(b'x' * n)\n"
                                   "    return len(open('a', 'rb').read())\n",
                                   "f", [[1000], [64 << 20]], TIGHT))
    assert inside.values[0] == {"value": 1000} and "error" in inside.values[1], inside  # its folder is small


@pytest.mark.skipif(os.geteuid() != 0, reason="the namespaces need root here; without it isolation() says which")
def test_it_reaches_no_socket_of_the_machine_it_runs_on():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    reached = []

    def accept():
        end = time.monotonic() + TIGHT.wall_s + 1
        while time.monotonic() < end:
            try:
                reached.append(listener.accept())
            except OSError:
                pass

    t = threading.Thread(target=accept)
    t.start()
    run = contained(sandbox.run("import socket\ndef f(host, port):\n"
                                "    s = socket.create_connection((host, port), timeout=1)\n"
                                "    return 'connected'\n", "f",
                                [["127.0.0.1", port], ["198.18.0.1", 80], ["1.1.1.1", 53]], TIGHT))
    t.join()
    listener.close()
    assert reached == [] and all("error" in v for v in run.values), run
    assert all(("OSError" in v["error"] or "unreachable" in v["error"] or "refused" in v["error"])
               for v in run.values), run


@pytest.mark.slow
def test_the_caller_is_held_no_longer_than_the_wall_clock_however_many_run_at_once():
    """Two hostile programs and two honest ones at once (2 cores): each ends by its own limit."""
    programs = [HOSTILE["fork bomb"][0], HOSTILE["sleeps forever"][0], "def f(x):\n    return 2 * x\n",
                "def f(x):\n    return 2 * x\n"]
    with ThreadPoolExecutor(4) as pool:
        runs = list(pool.map(lambda p: sandbox.run(p, "f", INPUTS, TIGHT), programs))
    assert [all(r.passed(EXPECTED)) for r in runs] == [False, False, True, True], runs
    for r in runs:
        contained(r)


# ---------------------------------------------------------------- the code grader over the sandbox

def test_the_code_in_a_response_is_its_last_fenced_block_found_in_linear_time():
    from trainer.problems.code import code_of

    assert code_of("def f(x):\n    return x\n") == "def f(x):\n    return x\n"
    assert code_of("First:\n```python\nA\n```\nbetter:\n```py\nB\n```\ndone") == "B\n"
    assert code_of("```\nC\n```") == "C\n"
    assert code_of("cut off:\n```python\ndef f(x):\n    return") == "def f(x):\n    return"
    assert code_of("```x = 1\n```") == "x = 1\n"  # no tag line: the first line is code
    from tests.growth import assert_linear

    # a policy's pathological output: fences and no newlines, then a long tail
    assert_linear(code_of, lambda n: "```" * n + "x" * n, 20_000, "code_of on fences without newlines")


def test_a_code_row_is_checked_and_graded_with_partial_credit():
    from trainer.problems.code import CodeRowError, check_row, grade, reward

    row = {"entry": "f", "tests": [{"args": [1], "expected": 2}, {"args": [2], "expected": 4},
                                   {"args": [3], "expected": 6}]}
    check_row(row, "train.jsonl row 3")
    assert grade("```python\ndef f(x):\n    return x * 2\n```", row) == (1.0, True)
    assert grade("```python\ndef f(x):\n    return x * 2 if x < 3 else 0\n```", row) == (2 / 3, False)
    assert reward("def f(x) return", row) == 0.0
    for bad, named in (({"entry": "2f", "tests": row["tests"]}, "'entry'"), ({"entry": "f", "tests": []}, "'tests'"),
                       ({"entry": "f", "tests": [{"args": 1, "expected": 2}]}, r"tests\[0\]")):
        with pytest.raises(CodeRowError, match=named) as e:
            check_row(bad, "train.jsonl row 3")
        assert "train.jsonl row 3" in str(e.value) and '"expected"' in str(e.value)
