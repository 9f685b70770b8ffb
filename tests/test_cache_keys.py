"""tasks/keys.py's table, a test per rule: a change that alters a stage's result changes its key;
one that does not (how or where the work runs) keeps it; files are keyed by content, not by name;
more GRPO rounds continue from the last checkpoint instead of training again from SFT."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tasks.keys import resolve, stage_key
from tasks.stages import rule_for, rules
from trainer import storage
from trainer.config import load_config

GSM8K = Path(__file__).parent / "data" / "gsm8k"
INPUTS = {"data": {"key": "d"}, "sft": {"key": "s"}, "tokenizer": {"key": "t"}}
GRPO = rule_for("grpo")

# a different value for every field the table leaves out
UNKEYED_CHANGES = {
    "sft.log_every": "sft.log_every=7",
    "sft.checkpoint_every": "sft.checkpoint_every=3",
    "sft.deepspeed.timeout_s": "sft.deepspeed.timeout_s=99",
    "grpo.rounds": "grpo.rounds=7",
    "grpo.checkpoint_every": "grpo.checkpoint_every=3",
    "grpo.checkpoint_min_seconds": "grpo.checkpoint_min_seconds=30",
    "grpo.sample_table_every": "grpo.sample_table_every=3",
    "grpo.eval_every": "grpo.eval_every=3",
    "grpo.eval_examples": "grpo.eval_examples=3",
    "grpo.pass_k": "grpo.pass_k=2",
    "grpo.deepspeed.timeout_s": "grpo.deepspeed.timeout_s=99",
    "rollout.sglang": "rollout.sglang.urls=[http://10.0.0.5:30000]",
    "eval.engine": "eval.engine=hf",
}
KEYED_CHANGES = [("prepare_data", "data.calculator_annotations=strip"), ("prepare_data", "data.synthetic.n_train=10"),
                 ("tokenizer", "tokenizer.vocab_size=300"), ("sft", "sft.lr=1e-4"), ("sft", "model.dtype=bfloat16"),
                 ("sft", "model.tf32=true"), ("control", "model.tf32=true"),
                 ("sft", "sft.max_seconds=30"), ("grpo", "grpo.lr=1e-4"), ("grpo", "rollout.temperature=0.5"),
                 ("grpo", "rollout.engine=sglang"), ("control", "control.lr=1e-4"),
                 ("sft", "model.lora.rank=8"), ("grpo", "model.lora.rank=8"), ("control", "model.lora.rank=8"),
                 ("control", "control.time_factor=2"), ("eval", "eval.max_new_tokens=10"),
                 ("eval", "eval.seen_examples=100")]


def key(stage: str, *overrides: str) -> str:
    return stage_key(load_config("tiny", list(overrides)), stage, rule_for(stage), INPUTS)


def test_the_table_names_only_real_fields():
    assert set(UNKEYED_CHANGES) == {f for rule in rules().values() for f in rule.unkeyed}
    for stage in rules():
        key(stage)  # every unkeyed path exists in the config


@pytest.mark.parametrize("field", sorted(UNKEYED_CHANGES))
def test_a_field_that_does_not_change_the_result_keeps_the_key(field):
    stage = next(s for s, rule in rules().items() if field in rule.unkeyed)
    assert key(stage, UNKEYED_CHANGES[field]) == key(stage)


@pytest.mark.parametrize("stage, override", KEYED_CHANGES)
def test_a_field_that_changes_the_result_changes_the_key(stage, override):
    assert key(stage, override) != key(stage)


def test_sglang_ports_and_timeouts_are_not_keyed():
    base = key("grpo", "rollout.engine=sglang")
    assert key("grpo", "rollout.engine=sglang", "rollout.sglang.base_port=31000",
               "rollout.sglang.request_timeout_s=5", "rollout.sglang.startup_timeout_s=5") == base


def test_an_eval_is_keyed_by_the_engine_that_answers_it():
    """eval.engine=hf under rollout.engine=sglang answers as the hf rollout engine's evals do (same key);
    answers from SGLang servers are another result."""
    by_hf = key("eval", "rollout.engine=hf")
    assert key("eval", "rollout.engine=sglang", "eval.engine=hf") == by_hf
    assert key("eval", "rollout.engine=sglang") != by_hf
    assert key("eval", "rollout.engine=sglang", "eval.engine=rollout") == key("eval", "rollout.engine=sglang")


def test_data_files_are_keyed_by_content_not_path(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "moved" / "b.jsonl"
    b.parent.mkdir()
    shutil.copy(GSM8K / "test.jsonl", a)
    shutil.copy(GSM8K / "test.jsonl", b)
    files = ["data.source=files"]
    k_a = key("prepare_data", *files, f"data.train={a}")
    assert key("prepare_data", *files, f"data.train={b}") != k_a  # the path is a field: keyed
    # the same path, new content: a new key (the name alone would have hit the old result)
    lines = a.read_text().splitlines()
    a.write_text("\n".join(lines[:-1]) + "\n")
    assert key("prepare_data", *files, f"data.train={a}") != k_a


def test_a_pretrained_folder_is_keyed_by_content(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"a": 1}))
    (folder / "model.safetensors").write_bytes(b"\0" * 64)
    pretrained = [f"model.pretrained={folder}", "tokenizer.train=false"]
    k = key("sft", *pretrained)
    assert key("sft", *pretrained) == k
    (folder / "model.safetensors").write_bytes(b"\1" * 64)  # fine-tuned in place
    assert key("sft", *pretrained) != k


def test_a_downloaded_model_is_keyed_by_its_place_in_the_cache_not_where_the_cache_is(tmp_path, monkeypatch):
    """A models:/ URI's download (tasks/sources.py) on two machines whose caches are elsewhere: one key."""
    keys = []
    for machine in ("a", "b"):
        cache = tmp_path / machine / "cache"
        folder = cache / "mlflow-models" / "0123456789abcdef"
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps({"a": 1}))
        monkeypatch.setenv("POSTTRAIN_CACHE", str(cache))
        keys.append(key("sft", f"model.pretrained={folder}", "tokenizer.train=false"))
    assert keys[0] == keys[1]
    other = tmp_path / "b" / "elsewhere"  # the same files outside the cache: a folder keyed by its path too
    shutil.copytree(tmp_path / "b" / "cache" / "mlflow-models" / "0123456789abcdef", other)
    assert key("sft", f"model.pretrained={other}", "tokenizer.train=false") != keys[1]


def test_a_custom_reward_is_keyed_by_its_module_source(tmp_path, monkeypatch):
    module = tmp_path / "my_reward.py"
    module.write_text("def score(response, example):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = "grpo.rewards=[{name: my_reward.score}]"
    k = key("grpo", spec)
    module.write_text("def score(response, example):\n    return 0.5\n")
    assert key("grpo", spec) != k


def test_a_reward_model_folder_is_keyed_by_content(tmp_path):
    folder = tmp_path / "rm"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    spec = f"grpo.rewards=[{{name: reward_model, path: {folder}}}]"
    k = key("grpo", spec)
    (folder / "config.json").write_text('{"changed": true}')
    assert key("grpo", spec) != k


def test_rounds_resolve_to_a_hit_a_continuation_or_a_folder_of_their_own(tmp_path):
    cfg4 = load_config("tiny", [f"artifact_root={tmp_path}", "grpo.rounds=4"])
    where = resolve(cfg4, "grpo", GRPO, INPUTS)
    assert where.manifest is None and where.continues_from is None
    storage.commit_manifest(where.folder, {"stage": "grpo", "key": where.key, "extent": 4})
    assert resolve(cfg4, "grpo", GRPO, INPUTS).manifest is not None  # the same rounds: a hit
    cfg6 = load_config("tiny", [f"artifact_root={tmp_path}", "grpo.rounds=6"])
    more = resolve(cfg6, "grpo", GRPO, INPUTS)
    assert (more.folder, more.manifest, more.continues_from) == (where.folder, None, 4)
    assert more.key != where.key  # downstream stages see a different result
    cfg2 = load_config("tiny", [f"artifact_root={tmp_path}", "grpo.rounds=2"])
    fewer = resolve(cfg2, "grpo", GRPO, INPUTS)
    assert fewer.folder != where.folder and fewer.manifest is None and fewer.continues_from is None


@pytest.mark.slow
def test_more_rounds_continue_from_the_last_checkpoint(tmp_path):
    """2 rounds, then the same run asked for 4: SFT is a cache hit, GRPO resumes at round 2 and ends
    with exactly the weights of a 4-round run from scratch; asking for 4 again is a hit."""
    from flows.speedrun import grpo_flow
    from tests.test_pipeline import SMALL

    base = [o for o in SMALL if not o.startswith(("grpo.rounds=", "grpo.checkpoint_every="))] + [
        "grpo.checkpoint_every=3"]  # the 2-round run's only checkpoint is the one at its end

    def run(root: Path, rounds: int) -> dict:
        return grpo_flow(preset="tiny", overrides=base + [f"artifact_root={root}", f"grpo.rounds={rounds}"])

    def grpo(result: dict) -> dict:
        summary = next(s for s in result["stages"] if s["stage"] == "grpo")
        return {**json.loads((Path(summary["uri"]) / "manifest.json").read_text()), **summary}

    short = run(tmp_path / "a", 2)
    longer = run(tmp_path / "a", 4)
    assert next(s for s in longer["stages"] if s["stage"] == "sft")["cache_hit"]
    g = grpo(longer)
    assert not g["cache_hit"] and g["resumed_from_round"] == 2 and g["metrics"]["grpo/rounds"] == 4
    assert g["uri"] == grpo(short)["uri"] and g["key"] != grpo(short)["key"]
    history = [json.loads(x) for x in (Path(g["uri"]) / "history.jsonl").read_text().splitlines()]
    assert [h["round"] for h in history] == [1, 2, 3, 4]
    scratch = grpo(run(tmp_path / "b", 4))
    assert scratch["state_hash"] == g["state_hash"]
    again = grpo(run(tmp_path / "a", 4))
    assert again["cache_hit"] and again["key"] == g["key"]


def test_where_the_ranks_run_is_not_keyed_how_many_is():
    """Two ranks on one machine and one rank on each of two machines give the same weights
    (tests/test_cluster.py): one key. Another number of ranks splits the batch otherwise: another key."""
    root = "artifact_root=s3://bucket/runs"
    for stage in ("sft", "grpo"):
        one_host = key(stage, root, f"{stage}.deepspeed.ranks_per_node=2")
        assert key(stage, root, f"{stage}.deepspeed.nodes=2", f"{stage}.deepspeed.hostfile=/etc/hostfile",
                   f"{stage}.deepspeed.interface=eth1", f"{stage}.deepspeed.master_addr=10.0.0.1",
                   f"{stage}.deepspeed.master_port=29600", f"{stage}.deepspeed.collective_timeout_s=30") == one_host
        assert key(stage, root) != one_host
