"""`--dry-run`: the GPU preset validates here (no GPU, no sglang) and prints its launch plan:
launch command lines with their ranks and SGLang server commands with their GPUs.
Bad paths are named; nothing is started or written."""

import re

import pytest

from flows.cli import main

GPU8 = ["--set", "sft.deepspeed.ranks_per_node=8", "--set", "grpo.deepspeed.ranks_per_node=4",
        "--set", "rollout.sglang.num_servers=4", "--set", "rollout.sglang.first_gpu=4"]


def dry(tmp_path, capsys, *extra: str, hub: bool = False) -> tuple[int, str]:
    """The GPU preset's dry run; its model a local folder unless `hub` (the preset's hub name)."""
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    local = [] if hub else ["--set", f"model.pretrained={model}"]
    code = main(["speedrun", "--preset", "qwen2.5-0.5b-gsm8k", "--dry-run",
                 "--set", f"artifact_root={tmp_path / 'art'}", *local, *extra])
    return code, capsys.readouterr().out


def test_gpu_preset_one_gpu_plan(tmp_path, capsys, monkeypatch):
    """As on a fresh clone with no hub (its address refused here, whatever this machine can reach): the
    plan is printed, and the hub model that cannot be fetched is the problem, named at once."""
    import huggingface_hub.constants

    for const, value in (("ENDPOINT", "http://127.0.0.1:9"),
                         ("HUGGINGFACE_CO_URL_TEMPLATE", "http://127.0.0.1:9/{repo_id}/resolve/{revision}/{filename}")):
        monkeypatch.setattr(huggingface_hub.constants, const, value)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    code, out = dry(tmp_path, capsys, hub=True)  # hub model and hub data, nothing beside it
    assert code == 2, out
    assert "sft" in out and "runs in the task's process: 1 rank, zero_stage=2 precision=bf16" in out
    assert "CUDA_VISIBLE_DEVICES=0" in out and "sglang_server.py --parent-pid" in out and "--model-path" in out
    assert "data: hub dataset openai/gsm8k" in out
    assert "model.pretrained: could not load 'Qwen/Qwen2.5-0.5B-Instruct': it is not in this machine's hub cache, " \
           "and the hub cannot be reached from here (ConnectError" in out
    assert not (tmp_path / "art").exists()  # nothing written


def test_gpu_preset_offline_override(tmp_path, capsys):
    """The documented offline form: GSM8K files on local disk (CI: ../shared/data/gsm8k)."""
    for split in ("train", "test"):
        (tmp_path / f"{split}.jsonl").write_text('{"question": "1+1?", "answer": "1+1=2\\n#### 2"}\n')
    model = tmp_path / "qwen"
    model.mkdir()
    (model / "config.json").write_text("{}")
    code, out = dry(tmp_path, capsys, "--set", "data.source=files", "--set", f"data.train={tmp_path / 'train.jsonl'}",
                    "--set", f"data.test={tmp_path / 'test.jsonl'}", "--set", f"model.pretrained={model}")
    assert code == 0, out
    assert f"data.train: {tmp_path / 'train.jsonl'} (found)" in out and f"model.pretrained: {model} (found)" in out


def test_gpu_preset_eight_gpu_plan(tmp_path, capsys):
    code, out = dry(tmp_path, capsys, *GPU8)
    assert code == 0, out
    assert "DeepSpeed: 8 ranks = 8 per node x 1 node(s)" in out
    assert "-m trainer.local_launch --nprocs 8 --master_addr 127.0.0.1 --master_port 29500 -- " in out
    assert "--nprocs 4" in out and "-m tasks.rank_main --spec" in out
    for gpu, port in zip(range(4, 8), range(30000, 30004)):
        assert f"CUDA_VISIBLE_DEVICES={gpu} " in out and f"--port {port}" in out
    assert "shared by training ranks" not in out


@pytest.mark.parametrize("override, named", [
    ("data.source=files data.train=/no/such/train.jsonl", "data.train: '/no/such/train.jsonl' does not exist"),
    ("model.pretrained=./no-such-model", "model.pretrained: './no-such-model' is not a model folder"),
    ("data.source=files data.train={tmp}", "data.train: '{tmp}' is a folder; point it at one .jsonl"),
    ("data.source=files data.train={tmp}/empty.jsonl", "data.train: '{tmp}/empty.jsonl' is empty; it needs rows"),
])
def test_dry_run_names_bad_paths(tmp_path, capsys, override, named):
    (tmp_path / "empty.jsonl").write_text("")
    override, named = override.format(tmp=tmp_path), named.format(tmp=tmp_path)
    code, out = dry(tmp_path, capsys, *[a for o in override.split() for a in ("--set", o)])
    assert code == 2
    assert f"PROBLEM: {named}" in out
    assert not (tmp_path / "art").exists()


def test_several_nodes_need_a_hostfile_a_shared_store_and_this_machine_in_the_hostfile(tmp_path, capsys):
    code = main(["sft", "--preset", "tiny", "--dry-run", "--set", "sft.deepspeed.nodes=2"])
    assert code == 2
    assert "nodes=2 needs hostfile" in capsys.readouterr().err
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-1 slots=8\nworker-2 slots=8\n")
    nodes = ["--set", "sft.deepspeed.nodes=2", "--set", "sft.deepspeed.ranks_per_node=8",
             "--set", f"sft.deepspeed.hostfile={hostfile}"]
    code = main(["sft", "--preset", "tiny", "--dry-run", *nodes])
    assert code == 2
    assert "machines share no disk" in capsys.readouterr().err  # the artifact root must be a store
    s3 = ["--set", "artifact_root=memory://runs"]  # a store every machine would share (fsspec's, in-process)
    code = main(["sft", "--preset", "tiny", "--dry-run", *nodes, *s3])
    out = capsys.readouterr().out
    assert code == 2 and "does not list this machine" in out, out  # rank 0 runs where the task runs
    # this machine first, then the other: the command DeepSpeed runs, and the preflight's verdict on
    # each host (no sshd here: tests/test_cluster.py runs the real thing)
    hostfile.write_text("worker-2 slots=8\nlocalhost slots=8\n")
    code = main(["sft", "--preset", "tiny", "--dry-run", *nodes, *s3])
    out = capsys.readouterr().out
    assert code == 2, out
    assert "--num_nodes 2 --num_gpus 8" in out and "--module trainer.hosts rank" in out
    assert "16 ranks = 8 per node x 2 node(s)" in out
    assert "sft: 2 of the launch's 2 hosts cannot run its ranks" in out
    assert re.search(r"worker-2: ssh failed .*Could not resolve hostname", out), out


def test_tiny_preset_plan_is_in_process(capsys):
    assert main(["speedrun", "--preset", "tiny", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "in-process HF engine" in out and "1 rank, zero_stage=1 precision=fp32" in out


def test_bf16_at_stage_0_is_planned_as_what_it_runs(tmp_path, capsys):
    """bf16 at ZeRO stage 0 runs DeepSpeed's bf16 optimizer, which is stage 1's: the plan says so."""
    code, out = dry(tmp_path, capsys, "--set", "grpo.deepspeed.zero_stage=0")
    assert code == 0, out
    assert "zero_stage=0 precision=bf16 (DeepSpeed's bf16 optimizer, which is ZeRO stage 1's" in out


def test_sglang_cpu_servers_that_cannot_start_stop_the_run_before_any_stage(tmp_path, capsys):
    """rollout.sglang.device=cpu with the built SGLang environment as it is (no sgl_kernel CPU build
    on the registry): the run stops before its first stage, not at the eval after SFT has trained;
    the dry run lists it as a problem; commands whose stages launch no server run, `config` prints."""
    from pathlib import Path

    from tasks import stages
    from trainer.config import ConfigError, load_config

    standin = Path(__file__).parent / "sglang_cpu"  # the tests' plain-torch sgl_kernel (tests/test_sglang_server.py)

    cpu = ["--set", "rollout.engine=sglang", "--set", "rollout.sglang.device=cpu",
           "--set", f"artifact_root={tmp_path / 'art'}"]
    assert main(["speedrun", *cpu]) == 2
    err = capsys.readouterr().err
    assert "posttrain: rollout.sglang.device=cpu: SGLang's CPU mode imports compiled CPU kernels from sgl_kernel" in err
    assert not (tmp_path / "art").exists()  # nothing ran
    assert main(["speedrun", "--dry-run", *cpu]) == 2
    out = capsys.readouterr().out
    assert "PROBLEM: rollout.sglang.device=cpu" in out and "in CPU mode on this machine" in out
    assert "GPUs [0] are shared" not in out  # CPU servers take no GPU
    assert main(["config", *cpu]) == 0
    capsys.readouterr()
    cfg = load_config("tiny", [c for c in cpu if c != "--set"])
    stages.check_servers(cfg, "tokenizer")  # no stage up to the tokenizer launches a server
    with pytest.raises(ConfigError, match="sgl_kernel"):
        stages.check_servers(cfg, "eval (sft)")  # the eval of SFT answers through SGLang
    overrides = [c for c in cpu if c != "--set"]
    stages.check_servers(load_config("tiny", overrides + ["eval.engine=hf"]), "eval (sft)")  # HF answers it
    stages.check_servers(load_config("tiny", overrides + [f"rollout.sglang.env={{PYTHONPATH: {standin}}}"]), None)


def test_gpu_servers_on_a_machine_without_cuda_are_named(tmp_path, capsys):
    """rollout.engine=sglang as shipped (GPU servers) where there is no CUDA device: the run stops
    before any stage, saying so and how to run here (it said no CUDA SGLang environment was built,
    and `make sglang-env` builds the CPU one on such a machine; and it said so only at the eval after
    SFT had trained); the dry run notes it."""
    from trainer.config import SGLangConfig
    from trainer.inference.sglang import check_server_python, has_cuda_device

    if has_cuda_device():
        pytest.skip("this machine has a CUDA device: GPU servers can start here")
    no_cuda = "rollout.sglang.device=cuda: this machine has no CUDA device (torch sees none, and there is no nvidia-smi)"
    assert check_server_python(SGLangConfig()).startswith(no_cuda)
    small = ["--set", f"artifact_root={tmp_path / 'art'}", "--set", "sft.max_steps=3", "--set",
             "data.synthetic.n_train=200", "--set", "rollout.engine=sglang"]
    assert main(["eval", *small]) == 2
    err = capsys.readouterr().err
    assert f"posttrain: {no_cuda}; run the servers in CPU mode with rollout.sglang.device=cpu" in err, err[-2000:]
    assert not (tmp_path / "art").exists()  # before any stage: SFT does not train first only to fail at its eval
    code, out = dry(tmp_path, capsys)
    assert f"note: {no_cuda}" in out and code == 0
