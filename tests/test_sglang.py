"""SGLangEngine's handling of what cannot be produced on demand from a real server: malformed
replies, nothing listening, a server process that died, and the launch command and environment.
Everything a real server sends is tested against real servers in tests/test_sglang_server.py.

The reply below was recorded from sglang 0.5.23 (CPU mode, `/generate` with `input_ids`,
`return_logprob: true`), trimmed to the fields the client reads plus a few it ignores.
"""

import os
import subprocess
import sys
import time

import pytest

from trainer.config import SGLangConfig
from trainer.inference.engines import SamplingParams
from trainer.inference.sglang import (CPU_DEFAULT_MAX_TOTAL_TOKENS, SERVER_WRAPPER, SGLangEngine, SGLangError, _Server,
                            env_dir, launch_command, parse_generation, server_env)

RECORDED = {
    "text": "nnn",
    "output_ids": [83, 83, 83],
    "meta_info": {"id": "3cfb038188b248cab083a9fbcf9d4058", "finish_reason": {"type": "length", "length": 3},
                  "prompt_tokens": 5, "weight_version": "default", "num_retractions": 0, "input_token_logprobs": [],
                  "output_token_logprobs": [[-4.614398002624512, 83, None], [-4.613404273986816, 83, None],
                                            [-4.6251139640808105, 83, None]],
                  "output_token_logprobs_length": 3, "completion_tokens": 3, "cached_tokens": 0,
                  "e2e_latency": 0.049145159000090644},
}
# and its answer to /update_weights_from_disk with a path that does not exist: HTTP 400 with
# {"success": false, "message": "Failed to get weights iterator: [Errno -2] Name or service not known.",
#  "num_paused_requests": 0} (it took the path for a hub name); tested live in test_sglang_server.py


class Tok:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(96 + i % 26) for i in ids)


def test_recorded_reply_parses():
    g = parse_generation(RECORDED, [1, 4, 38, 83, 83], Tok())
    assert g.token_ids == [83, 83, 83] and g.logprobs == [-4.614398002624512, -4.613404273986816, -4.6251139640808105]
    assert g.finish_reason == "length" and g.text == "nnn" and g.prompt_ids == [1, 4, 38, 83, 83]


def test_a_groups_samples_go_to_one_server_and_groups_round_robin():
    from trainer.inference.sglang import route

    a, b, c = [1, 2], [3, 4, 5], [6]
    prompts = [a, a, a, b, b, b, c, c, c, a]  # the last: another copy of a (a carried-over group's prompt)
    assert route(prompts, 2) == [[0, 1, 2, 6, 7, 8, 9], [3, 4, 5]]
    assert route(prompts, 1) == [list(range(10))]
    assert route(prompts, 5) == [[0, 1, 2, 9], [3, 4, 5], [6, 7, 8], [], []]
    assert route([], 2) == [[], []]


def test_a_servers_share_splits_into_near_equal_runs_in_order():
    from trainer.inference.sglang import _split

    assert _split(list(range(10)), 4) == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert _split([3, 9], 8) == [[3], [9]]  # never an empty request
    assert _split([5, 6, 7], 1) == [[5, 6, 7]]
    assert _split([], 8) == []


def test_missing_logprob_is_an_error_not_zero():
    reply = {**RECORDED, "meta_info": {**RECORDED["meta_info"],
                                       "output_token_logprobs": [[-1.0, 3, None], [None, 4, None]]}}
    with pytest.raises(SGLangError, match=r"no logprob for generated token\(s\) at \[1\]"):
        parse_generation(reply, [1], Tok(), "http://s:1")


def test_malformed_and_aborted_replies():
    with pytest.raises(SGLangError, match="return_logprob"):
        parse_generation({"text": "x", "meta_info": {}}, [1], Tok())
    with pytest.raises(SGLangError, match="finish_reason"):
        parse_generation({"text": "x", "meta_info": {"output_token_logprobs": [], "finish_reason": {"type": "abort"}}},
                         [1], Tok())


@pytest.mark.slow
def test_unreachable_server_names_url_and_fix_within_bounded_time():
    engine = SGLangEngine([_Server("http://127.0.0.1:9")], Tok(), request_timeout_s=2)
    t0 = time.perf_counter()
    with pytest.raises(SGLangError, match=r"127.0.0.1:9 unreachable.*rollout.sglang.urls"):
        engine.generate([[1]], SamplingParams(max_new_tokens=2))
    with pytest.raises(SGLangError, match="not healthy after 1s"):
        SGLangEngine.from_config(SGLangConfig(urls=["http://127.0.0.1:9"], startup_timeout_s=1), "m", Tok())
    assert time.perf_counter() - t0 < 10


def test_dead_server_process_is_reported():
    proc = subprocess.Popen([sys.executable, "-c", "print('CUDA error: no GPU'); raise SystemExit(3)"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    proc.wait()
    server = _Server("http://127.0.0.1:9", proc)  # no wait: check_alive waits for the last lines
    with pytest.raises(SGLangError, match=r"exited with code 3(.|\n)*CUDA error: no GPU"):
        server.check_alive()


def test_launch_command_and_environment(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cuda = SGLangConfig(gpus_per_server=2, first_gpu=2, extra_args=["--dtype", "bfloat16"])
    cmd = launch_command(cuda, "/m", 30001, "bfloat16", parent_pid=42)
    assert cmd[0] == str(env_dir("cuda") / "bin" / "python")  # the SGLang environment, not this one
    assert cmd[1:5] == [str(SERVER_WRAPPER), "--parent-pid", "42", "--"]
    assert cmd[cmd.index("--model-path") + 1] == "/m" and cmd[cmd.index("--port") + 1] == "30001"
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--tp") + 1] == "2"
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16"
    assert cmd[-2:] == ["--dtype", "bfloat16"] and "--device" not in cmd and "--max-total-tokens" not in cmd
    assert server_env(cuda, 1) == {"CUDA_VISIBLE_DEVICES": "4,5"}

    cpu = SGLangConfig(device="cpu", python="/envs/sgl/bin/python", env={"PYTHONPATH": "/x"})
    cmd = launch_command(cpu, "/m", 30000, "float32")
    assert cmd[0] == "/envs/sgl/bin/python" and cmd[cmd.index("--dtype") + 1] == "float32"
    assert cmd[cmd.index("--device") + 1] == "cpu"
    assert "--skip-server-warmup" in cmd  # readiness is wait_healthy's, within startup_timeout_s
    assert cmd[cmd.index("--max-total-tokens") + 1] == str(CPU_DEFAULT_MAX_TOTAL_TOKENS)
    assert server_env(cpu, 0) == {"SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": "/x"}


def test_cpu_servers_split_the_cores_between_them(monkeypatch):
    """Each CPU-mode server gets its own share of the cores: two thread pools on the same cores ran
    a round 15x slower (see server_cpus). One server, or GPU servers, keep what they were given."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})
    two = SGLangConfig(device="cpu", num_servers=2)
    assert [server_env(two, i)["POSTTRAIN_SERVER_CPUS"] for i in (0, 1)] == ["0,1", "2,3,4"]
    three = SGLangConfig(device="cpu", num_servers=3, cpus=[4, 5, 6, 7, 8, 9])
    assert [server_env(three, i)["POSTTRAIN_SERVER_CPUS"] for i in (0, 1, 2)] == ["4,5", "6,7", "8,9"]
    assert "POSTTRAIN_SERVER_CPUS" not in server_env(SGLangConfig(device="cpu"), 0)  # one server: unpinned
    assert server_env(SGLangConfig(device="cpu", cpus=[1]), 0)["POSTTRAIN_SERVER_CPUS"] == "1"
    crowded = SGLangConfig(device="cpu", num_servers=3, cpus=[0, 1])  # fewer cores than servers: all share them
    assert {server_env(crowded, i)["POSTTRAIN_SERVER_CPUS"] for i in range(3)} == {"0,1"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    gpu = SGLangConfig(num_servers=2, cpus=[0, 1, 2, 3])
    assert {server_env(gpu, i)["POSTTRAIN_SERVER_CPUS"] for i in (0, 1)} == {"0,1,2,3"}


def test_servers_take_their_gpus_from_the_inherited_visible_list(monkeypatch):
    """A worker pinned to GPUs 5-7 (or a SLURM allocation): first_gpu and gpus_per_server count in
    that list, whose entries (numbers or UUIDs) pass through as written; past its end is refused
    with the fields to change. The dry run shows the same and reports the problem."""
    cfg = SGLangConfig(num_servers=2, gpus_per_server=1, first_gpu=1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,6,7")
    assert [server_env(cfg, i)["CUDA_VISIBLE_DEVICES"] for i in range(2)] == ["6", "7"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaa, GPU-bbb")
    assert server_env(SGLangConfig(gpus_per_server=2), 0)["CUDA_VISIBLE_DEVICES"] == "GPU-aaa,GPU-bbb"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,6")
    with pytest.raises(SGLangError, match=r"server 1 needs GPU positions 2\.\.2 .*CUDA_VISIBLE_DEVICES='5,6' lists 2 "
                                          r"GPU\(s\); lower rollout.sglang.first_gpu"):
        server_env(cfg, 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU at all
    with pytest.raises(SGLangError, match="lists 0 GPU"):
        server_env(cfg, 0)

    from tasks.plan import dry_run
    from trainer.config import load_config

    run = load_config("qwen2.5-0.5b-gsm8k", ["rollout.sglang.num_servers=2", "rollout.sglang.first_gpu=1"])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,4,5")
    text, problems = dry_run(run)
    assert "CUDA_VISIBLE_DEVICES=4 " in text and "CUDA_VISIBLE_DEVICES=5 " in text, text
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,4")
    text, problems = dry_run(run)
    assert any("server 1 needs GPU positions 2..2" in p for p in problems), problems


def test_env_dir_is_keyed_by_the_pins(tmp_path, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_SGLANG_HOME", str(tmp_path))
    cpu, cuda = env_dir("cpu"), env_dir("cuda")
    assert cpu.parent == tmp_path and cpu.name.startswith("sglang-cpu-") and cuda.name.startswith("sglang-cuda-")
    assert env_dir("cpu") == cpu  # stable


def test_weights_go_as_a_folder_unless_tensor_is_asked_for():
    from trainer.inference.sglang import syncs_by_tensor

    assert syncs_by_tensor(SGLangConfig()) is False
    assert syncs_by_tensor(SGLangConfig(device="cpu", weight_sync="tensor")) is True
    with pytest.raises(ValueError, match="weight_sync"):
        SGLangConfig(weight_sync="ipc")
