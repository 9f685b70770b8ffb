"""End to end: the tiny speedrun flow on a small budget against a real (ephemeral) Prefect server
and MLflow on SQLite; cache hits on re-run; bad input through the CLI."""

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SMALL = ["data.synthetic.n_train=600", "data.synthetic.n_test=40", "sft.max_steps=12",
         "sft.checkpoint_every=5", "sft.micro_batch_size=16", "model.hidden_size=32",
         "model.num_layers=1", "model.intermediate_size=64", "eval.max_new_tokens=24",
         "sft.log_every=1", "grpo.rounds=4", "rollout.prompts_per_round=4", "rollout.n_samples_per_prompt=4",
         "rollout.max_response_tokens=24", "grpo.eval_every=2", "grpo.eval_examples=10", "grpo.pass_k=2",
         "grpo.checkpoint_every=2", "grpo.sample_table_every=2", "grpo.micro_batch_size=8",
         "rollout.dynamic_filter=none", "control.enabled=false"]  # the control: this file's first_run
STAGES = ["prepare_data", "tokenizer", "sft", "eval", "grpo", "eval", "control", "eval"]


def task_runs(flow_run_id, done, artifacts: bool = False):
    """The flow run's task runs, oldest first (and with `artifacts`, the artifacts they published),
    read until `done(tasks[, artifacts])` or about 30 s: Prefect records task runs and artifacts
    from events, asynchronously, so a finished flow's last ones may not be there yet."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterTaskRunId, FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.sorting import TaskRunSort

    async def fetch():
        async with get_client() as client:
            for _ in range(60):
                # limit and sort are passed explicitly: prefect 3.8's client sends null defaults
                # that its own server rejects (422).
                got = [await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
                                                   limit=200, sort=TaskRunSort.EXPECTED_START_TIME_ASC)]
                if artifacts:
                    got.append(await client.read_artifacts(artifact_filter=ArtifactFilter(
                        task_run_id=ArtifactFilterTaskRunId(any_=[t.id for t in got[0]])), limit=200))
                if done(*got):
                    break
                await asyncio.sleep(0.5)
            return got if artifacts else got[0]

    return asyncio.run(fetch())


PROGRESS: list[str] = []  # first_run's progress lines (no terminal under pytest: log lines)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    import logging

    from flows.speedrun import speedrun

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            PROGRESS.append(record.getMessage())

    root = tmp_path_factory.mktemp("artifacts")
    overrides = SMALL + [f"artifact_root={root}", "control.enabled=true"]
    said, logger = Lines(), logging.getLogger("trainer.progress")
    logger.addHandler(said)
    try:
        return root, overrides, speedrun(preset="tiny", overrides=overrides)
    finally:
        logger.removeHandler(said)


def test_the_dry_run_has_the_keys_of_the_run(first_run):
    """`--dry-run` walks the stage table as the run does: the same rows, with the same keys, all
    cached after the run."""
    from tasks.plan import dry_run, walk
    from trainer.config import load_config

    root, overrides, result = first_run
    cfg = load_config("tiny", overrides)
    plan = walk(cfg)
    assert list(plan.keys.values()) == [s["key"] for s in result["stages"]]
    assert list(plan.keys) == ["prepare_data", "tokenizer", "sft", "eval (sft)", "grpo", "eval (grpo)", "control",
                               "eval (control)"]
    text, problems = dry_run(cfg)
    assert not problems and text.count("(cached)") == len(result["stages"]), text


def test_speedrun_runs_every_stage_and_commits_manifests(first_run):
    root, _, result = first_run
    assert [s["stage"] for s in result["stages"]] == STAGES
    assert not any(s["cache_hit"] for s in result["stages"])
    for s in result["stages"]:
        manifest = json.loads((Path(s["uri"]) / "manifest.json").read_text())
        assert manifest["key"] == s["key"] and manifest["stage"] == s["stage"]
    sft = next(s for s in result["stages"] if s["stage"] == "sft")
    assert (Path(sft["uri"]) / "model" / "config.json").is_file()
    assert (Path(sft["uri"]) / "model" / "tokenizer.json").is_file()
    assert sft["metrics"]["sft/steps"] == 12 and sft["metrics"]["sft/tokens_per_second"] > 0
    grpo = next(s for s in result["stages"] if s["stage"] == "grpo")
    assert grpo["metrics"]["grpo/rounds"] == 4
    assert (Path(grpo["uri"]) / "model" / "model.safetensors").is_file()
    history = [json.loads(x) for x in (Path(grpo["uri"]) / "history.jsonl").read_text().splitlines()]
    assert [h["round"] for h in history] == [1, 2, 3, 4]
    for key in ("reward/mean", "reward/std", "rollout/accuracy", "update/kl", "update/clip_frac",
                "update/entropy", "rollout/response_length", "rollout/groups_kept", "rollout/groups_filtered",
                "time/generate_seconds", "time/reward_seconds", "time/update_seconds", "time/sync_seconds"):
        assert key in history[-1], key
    assert "eval/accuracy" in history[1] and "eval/pass_at_2" in history[1]
    head = result["headline"]
    evals = [s for s in result["stages"] if s["stage"] == "eval"]
    assert head["sft_accuracy"] == evals[0]["metrics"]["eval/accuracy"]
    assert head["final_accuracy"] == evals[1]["metrics"]["eval/accuracy"]
    assert {"grpo_fixed", "grpo_broken", "mcnemar_z"} <= set(head)
    assert head["control_accuracy"] == evals[2]["metrics"]["eval/accuracy"]
    assert {"vs_control_fixed", "vs_control_broken", "vs_control_mcnemar_z"} <= set(head)
    for name, ev in zip(("sft", "final", "control"), evals):  # 40 held-out rows; 500 seen, of 600 trained on
        assert ev["metrics"]["eval/n"] == 40 and ev["metrics"]["eval/seen_n"] == 500
        assert head[f"{name}_seen_accuracy"] == ev["metrics"]["eval/seen_accuracy"]
    assert (root / "runs" / result["mlflow_run_id"] / "config.yaml").is_file()


def test_each_stage_names_itself_in_its_progress(first_run):
    """Off a terminal each stage's progress lines say which stage, and which of its evals, they count:
    the eval stages as the summary names them, GRPO's periodic evals by round, the control as itself."""
    _, _, result = first_run
    control_steps = int(next(s for s in result["stages"] if s["stage"] == "control")["metrics"]["control/steps"])
    ends = [line.split(", ")[0] for line in PROGRESS if "(100%)" in line]  # each bar's last line
    assert ends == ["sft: 12/12 steps (100%)",
                    "eval (sft) held-out: 40/40 answers (100%)", "eval (sft) seen: 500/500 answers (100%)",
                    "round 2 eval: 10/10 answers (100%)", "round 2 pass@2: 20/20 answers (100%)",
                    "round 4 eval: 10/10 answers (100%)", "round 4 pass@2: 20/20 answers (100%)",
                    "eval (grpo) held-out: 40/40 answers (100%)", "eval (grpo) seen: 500/500 answers (100%)",
                    f"control: {control_steps}/{control_steps} steps (100%)",
                    "eval (control) held-out: 40/40 answers (100%)", "eval (control) seen: 500/500 answers (100%)"], PROGRESS


def test_control_is_sft_continued_for_grpo_time(first_run):
    """The control starts from the SFT policy (not from scratch) and takes as many SFT steps as
    GRPO's training seconds at the SFT stage's measured seconds per step."""
    from mlflow import MlflowClient

    _, _, result = first_run
    by = {s["label"]: s for s in result["stages"]}
    sft, grpo, control = (json.loads((Path(by[k]["uri"]) / "manifest.json").read_text()) for k in ("sft", "grpo", "control"))
    per_step = sft["result"]["train_seconds"] / sft["result"]["steps"]
    history = [json.loads(x) for x in (Path(by["grpo"]["uri"]) / "history.jsonl").read_text().splitlines()]
    trained = sum(h[f"time/{k}_seconds"] for h in history for k in ("generate", "reward", "update"))
    assert grpo["metrics"]["grpo/train_seconds"] == pytest.approx(trained)
    assert trained < grpo["metrics"]["grpo/seconds"]  # evals, checkpoints and syncs are not counted
    steps = max(1, round(grpo["metrics"]["grpo/train_seconds"] / per_step))
    assert control["metrics"]["control/steps"] == steps == control["result"]["steps"]
    assert control["inputs"] == {"data": by["prepare_data"]["key"], "sft": sft["key"], "grpo": grpo["key"]}
    assert by["eval (control)"]["metrics"]["eval/n"] == 40
    client = MlflowClient()
    sft_loss = [m.value for m in sorted(client.get_metric_history(sft["mlflow_run_id"], "train/loss"),
                                        key=lambda m: m.step)]
    control_first = min(client.get_metric_history(control["mlflow_run_id"], "train/loss"), key=lambda m: m.step).value
    # from the SFT weights: the control's first loss is where SFT ended, not where it started
    assert sft_loss[0] - sft_loss[-1] > 0.3, sft_loss
    assert abs(control_first - sft_loss[-1]) < 0.3 * (sft_loss[0] - sft_loss[-1]), (sft_loss, control_first)


def test_mlflow_parent_and_child_runs(first_run):
    from mlflow import MlflowClient

    _, _, result = first_run
    client = MlflowClient()
    parent = client.get_run(result["mlflow_run_id"])
    assert parent.info.status == "FINISHED"
    # MLflow's UI opens the experiment in its model-training view, not the GenAI one
    assert client.get_experiment(parent.info.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"
    assert {"sft_accuracy", "final_accuracy", "wall_seconds"} <= set(parent.data.metrics)
    assert parent.data.params["sft.max_steps"] == "12"
    assert parent.data.tags["prefect.flow_run_id"] == result["flow_run_id"]
    assert "config.yaml" in {a.path for a in client.list_artifacts(parent.info.run_id)}
    children = client.search_runs([parent.info.experiment_id],
                                  f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    by_stage = {c.data.tags["posttrain.stage"]: c for c in children}
    assert set(by_stage) == {"prepare_data", "tokenizer", "sft", "grpo", "control", "eval"}
    assert len([c for c in children if c.data.tags["posttrain.stage"] == "eval"]) == 3
    assert {"control_accuracy", "vs_control_mcnemar_z", "sft_seen_accuracy", "final_seen_accuracy"} <= set(
        parent.data.metrics)
    sft = by_stage["sft"]
    losses = client.get_metric_history(sft.info.run_id, "train/loss")
    assert len(losses) >= 10 and losses[-1].value < losses[0].value
    for name in ("train/lr", "train/grad_norm", "train/tokens_per_second"):
        assert client.get_metric_history(sft.info.run_id, name)
    grpo = by_stage["grpo"]
    assert len(client.get_metric_history(grpo.info.run_id, "reward/mean")) == 4
    artifacts = {a.path for a in client.list_artifacts(grpo.info.run_id)}
    assert "rollouts" in artifacts and "history.jsonl" in artifacts  # the model: a logged model (below)
    ev = by_stage["eval"]
    assert "eval/accuracy" in ev.data.metrics and "eval/format_rate" in ev.data.metrics
    assert {"eval_results.json", "eval_seen_results.json"} <= {a.path for a in client.list_artifacts(ev.info.run_id)}


def test_each_policy_is_an_mlflow_logged_model_with_its_evals(first_run):
    """SFT's, GRPO's and the control's policies are MLflow logged models of the runs that made them
    (the experiment's *Models* tab): READY, the exported folder as their artifacts (not the runs'
    too), the stage's config as params; each eval's metrics are its model's as well, the held-out
    ones on the test split's dataset, the seen ones on the training split's; the runs that read a
    policy name it as an input."""
    from mlflow import MlflowClient
    from mlflow.entities import LoggedModelStatus

    _, _, result = first_run
    client = MlflowClient()
    by = {s["label"]: json.loads((Path(s["uri"]) / "manifest.json").read_text()) for s in result["stages"]}
    sha = {split: by["prepare_data"]["sha256"][f"{split}.jsonl"][:12] for split in ("train", "test")}
    for stage in ("sft", "grpo", "control"):
        made = by[stage]
        model = client.get_logged_model(made["mlflow_model_id"])
        assert model.name == f"tiny-{stage}" and model.status == LoggedModelStatus.READY
        assert model.source_run_id == made["mlflow_run_id"]
        assert [o.model_id for o in client.get_run(made["mlflow_run_id"]).outputs.model_outputs] == [model.model_id]
        assert model.tags["posttrain.key"] == made["key"] and model.tags["posttrain.stage"] == stage
        assert model.tags["posttrain.uri"] == str(Path(made["uri"]).resolve() / "model")
        assert model.params[f"{stage}.lr"] == str(made["config"][stage]["lr"])
        files = {a.path for a in client.list_logged_model_artifacts(model.model_id)}
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= files, files
        assert "model" not in {a.path for a in client.list_artifacts(made["mlflow_run_id"])}  # stored once
        ev = by[f"eval ({stage})"]
        on_model = {(m.key, m.dataset_name, m.dataset_digest): m.value for m in model.metrics}
        assert on_model[("eval/accuracy", "synthetic-test", sha["test"])] == ev["metrics"]["eval/accuracy"]
        assert on_model[("eval/seen_accuracy", "synthetic-train", sha["train"])] == ev["metrics"]["eval/seen_accuracy"]
        assert on_model[("eval/memorisation_gap", None, None)] == ev["metrics"]["eval/memorisation_gap"]
        assert {m.run_id for m in model.metrics} == {ev["mlflow_run_id"]}
        assert [i.model_id for i in client.get_run(ev["mlflow_run_id"]).inputs.model_inputs] == [model.model_id]
    # GRPO and the control start from the SFT policy: its model is their input, linked in their description
    for stage in ("grpo", "control"):
        run = client.get_run(by[stage]["mlflow_run_id"])
        assert [i.model_id for i in run.inputs.model_inputs] == [by["sft"]["mlflow_model_id"]]
        assert "logged model [tiny-sft](#/experiments/" in run.data.tags["mlflow.note.content"]


def datasets(client, run_id: str) -> dict[str, tuple[str, str]]:
    """A run's MLflow dataset inputs: name -> (digest, context), as the runs table's Dataset column
    and the run page show them."""
    return {d.dataset.name: (d.dataset.digest, {t.key: t.value for t in d.tags}["mlflow.data.context"])
            for d in client.get_run(run_id).inputs.dataset_inputs}


def test_every_run_names_the_data_it_read_as_mlflow_datasets(first_run):
    """The prepared splits are dataset inputs: the parent run's, and each stage's that reads them,
    digested by the prepared file's content (the digest of the rows it read, not a name)."""
    from mlflow import MlflowClient

    _, _, result = first_run
    client = MlflowClient()
    prepared = next(s for s in result["stages"] if s["stage"] == "prepare_data")
    manifest = json.loads((Path(prepared["uri"]) / "manifest.json").read_text())
    train = (manifest["sha256"]["train.jsonl"][:12], "training")
    test = (manifest["sha256"]["test.jsonl"][:12], "evaluation")
    assert datasets(client, result["mlflow_run_id"]) == {"synthetic-train": train, "synthetic-test": test}
    children = {}
    for c in client.search_runs([result["mlflow_experiment_id"]], f"tags.mlflow.parentRunId = '{result['mlflow_run_id']}'"):
        children.setdefault(c.data.tags["posttrain.stage"], []).append(datasets(client, c.info.run_id))
    assert children["prepare_data"] == [{}]
    for stage in ("tokenizer", "sft", "control"):
        assert children[stage] == [{"synthetic-train": train}], stage
    assert children["grpo"] == [{"synthetic-train": train, "synthetic-test": test}]  # its periodic evals
    assert children["eval"] == [{"synthetic-test": test, "synthetic-train": (train[0], "evaluation (seen)")}] * 3
    parent = client.get_run(result["mlflow_run_id"])
    ds = {d.dataset.name: d.dataset for d in parent.inputs.dataset_inputs}
    assert json.loads(ds["synthetic-train"].profile) == {"num_rows": 600, "from": "generated by posttrain (data.synthetic)",
                                                         "prepare_data_key": manifest["key"]}
    # MLflow keeps one dataset per name and digest in an experiment: its source is where those rows
    # were first prepared (this run's folder, or an earlier run's on another root), a file that
    # holds them: the digest is the file's
    import hashlib

    source = json.loads(ds["synthetic-test"].source)["uri"]
    assert source.endswith("/test.jsonl") and Path(source).is_file()
    assert hashlib.sha256(Path(source).read_bytes()).hexdigest()[:12] == test[0]


def test_each_stage_run_links_the_runs_that_computed_what_it_read(first_run):
    """Lineage inside MLflow: a stage's run tags each input's key and computing run, and its
    description links them, so the UI walks from the final eval back through GRPO and SFT to the data."""
    from mlflow import MlflowClient

    _, _, result = first_run
    client = MlflowClient()
    runs = {s["label"]: s for s in result["stages"]}
    children = {c.info.run_id: c for c in client.search_runs(
        [result["mlflow_experiment_id"]], f"tags.mlflow.parentRunId = '{result['mlflow_run_id']}'")}
    by_key = {(c.data.tags["posttrain.stage"], c.data.tags.get("cache_key")): c for c in children.values()}
    stage_run = {label: by_key[(s["stage"], s["key"])] for label, s in runs.items()}
    final_eval = stage_run["eval (grpo)"]
    tags = final_eval.data.tags
    assert tags["posttrain.input.model"] == runs["grpo"]["key"]
    assert tags["posttrain.input_run.model"] == stage_run["grpo"].info.run_id
    assert tags["posttrain.input_run.data"] == stage_run["prepare_data"].info.run_id
    grpo = stage_run["grpo"].data.tags
    assert (grpo["posttrain.input.sft"], grpo["posttrain.input_run.sft"]) == (runs["sft"]["key"], stage_run["sft"].info.run_id)
    note = tags["mlflow.note.content"]
    # the run's page in the experiment's model-training view (`#/runs/<id>` opened the GenAI view)
    grpo_id, exp = stage_run["grpo"].info.run_id, result["mlflow_experiment_id"]
    assert f"- model: grpo `{runs['grpo']['key']}`, computed by run [{grpo_id}]" \
           f"(#/experiments/{exp}/runs/{grpo_id}?workflowType=machine_learning)" in note
    assert "posttrain.input.data" not in stage_run["prepare_data"].data.tags  # it reads nothing


def test_a_run_on_data_files_names_them_by_their_folder(tmp_path):
    """Real GSM8K from files, with no test file: the held-out rows are split off train, and the
    dataset's profile says so."""
    from mlflow import MlflowClient

    from flows.speedrun import flow_for

    gsm8k = Path(__file__).parent / "data" / "gsm8k" / "train.jsonl"
    result = flow_for("prepare-data")(preset="tiny", overrides=[
        f"artifact_root={tmp_path}", "data.source=files", f"data.train={gsm8k}", "data.test_size=30",
        "data.max_train=200"])
    client = MlflowClient()
    assert set(datasets(client, result["mlflow_run_id"])) == {"gsm8k-train", "gsm8k-test"}
    ds = {d.dataset.name: d.dataset for d in client.get_run(result["mlflow_run_id"]).inputs.dataset_inputs}
    assert json.loads(ds["gsm8k-train"].profile)["from"] == str(gsm8k)
    assert json.loads(ds["gsm8k-test"].profile)["from"] == f"{gsm8k}, rows held out"
    assert [json.loads(ds[n].profile)["num_rows"] for n in ("gsm8k-train", "gsm8k-test")] == [200, 30]


def test_prefect_flow_run_completed_with_a_task_per_stage(first_run):
    import asyncio

    from prefect.client.orchestration import get_client

    _, _, result = first_run

    async def flow_run():
        async with get_client() as client:
            return await client.read_flow_run(result["flow_run_id"])

    run = asyncio.run(flow_run())
    tasks = task_runs(run.id, lambda tasks: len(tasks) >= 19 and all(t.state and t.state.is_final() for t in tasks))
    assert run.state.is_completed()
    names = [t.name for t in tasks]
    for stage in ("prepare_data", "tokenizer", "sft", "eval"):
        assert any(n.startswith(stage + "-") for n in names), (stage, names)
    for r in range(1, 5):
        for step in ("rollout", "reward", "update"):
            assert f"{step}-r{r}" in names, (step, r, names)
    assert "grpo-eval-r2" in names and "checkpoint-r2" in names
    assert all(t.state.is_completed() for t in tasks)


def test_each_stage_task_run_shows_its_config_and_inputs_in_prefect(first_run):
    """What a user reading a (failed) run in the Prefect UI needs: on each stage's task run, its
    parameters (Task Inputs) and a markdown artifact with the keyed config and the input keys."""
    _, _, result = first_run
    keys = {s["label"]: s["key"] for s in result["stages"]}

    def stages_of(tasks):
        return [t for t in tasks if t.name.split("-")[0] in ("prepare_data", "tokenizer", "sft", "eval", "control")]

    tasks, arts = task_runs(result["flow_run_id"], lambda tasks, arts: len(stages_of(tasks)) == 7 and len(arts) == 7,
                            artifacts=True)
    stage_runs = stages_of(tasks)
    assert len(stage_runs) == 7 and all(set(t.task_inputs) == {"config", "inputs"} for t in stage_runs), stage_runs
    by_run = {a.task_run_id: a.data for a in arts}
    sft = next(t for t in stage_runs if t.name.startswith("sft-"))
    text = by_run[sft.id]
    assert "max_steps: 12" in text and "micro_batch_size: 16" in text  # the sft section as it ran
    assert f"| data | {keys['prepare_data']} |" in text and f"| tokenizer | {keys['tokenizer']} |" in text
    control = next(t for t in stage_runs if t.name.startswith("control-"))
    assert f"| grpo | {keys['grpo']} |" in by_run[control.id] and "warmup_steps: 10" in by_run[control.id]


def test_async_rounds_show_the_next_rollout_beside_the_update_in_prefect_and_log_lag_to_mlflow(first_run):
    """rollout.async_steps=1 through the real flow: the GRPO stage only (upstream from cache); in
    the Prefect UI the task `rollout-r{r+1}` starts before `update-r{r}` ends, and the GRPO child run
    in MLflow has staleness, queue wait and version lag for every round."""
    from mlflow import MlflowClient

    from flows.speedrun import speedrun

    _, overrides, _ = first_run
    heavier = ["rollout.prompts_per_round=16", "rollout.n_samples_per_prompt=8", "rollout.max_response_tokens=64",
               "rollout.min_response_tokens=64", "grpo.micro_batch_size=64",
               "grpo.eval_every=100", "grpo.checkpoint_every=100"]  # a checkpoint waits for the batches in flight
    result = speedrun(preset="tiny", overrides=overrides + heavier + ["rollout.async_steps=1", "control.enabled=false"])
    hits = {s["label"]: s["cache_hit"] for s in result["stages"]}
    assert hits["sft"] and not hits["grpo"]

    def rollouts_ended(tasks):
        named = {t.name: t for t in tasks}
        return all(f"rollout-r{r}" in named and named[f"rollout-r{r}"].end_time for r in range(1, 5))

    named = {t.name: t for t in task_runs(result["flow_run_id"], rollouts_ended)}
    for r in range(1, 4):
        rollout, update = named[f"rollout-r{r + 1}"], named[f"update-r{r}"]
        assert rollout.state.is_completed() and update.state.is_completed()
        # requested before the update ended (a synchronous round starts the next rollout after it); whether
        # they also overlap depends on which side is slower: on a loaded machine the trainer's own passes
        # before the update (reward, log-probs) outlasted the next batch's generation
        assert rollout.start_time < update.end_time, (
            r, rollout.start_time, rollout.end_time, update.start_time, update.end_time)
    grpo = json.loads((Path(next(s for s in result["stages"] if s["stage"] == "grpo")["uri"]) / "manifest.json").read_text())
    client = MlflowClient()
    for name in ("rollout/staleness_mean", "rollout/queue_wait_seconds", "rollout/version_lag"):
        history = sorted(client.get_metric_history(grpo["mlflow_run_id"], name), key=lambda m: m.step)
        assert [m.step for m in history] == [1, 2, 3, 4], name
    lag = sorted(client.get_metric_history(grpo["mlflow_run_id"], "rollout/version_lag"), key=lambda m: m.step)
    assert [m.value for m in lag] == [0, 1, 1, 1]


def test_rerun_is_all_cache_hits(first_run):
    from flows.speedrun import speedrun

    _, overrides, result = first_run
    again = speedrun(preset="tiny", overrides=overrides)
    assert all(s["cache_hit"] for s in again["stages"])
    from mlflow import MlflowClient  # cached stages read the same rows: the same MLflow datasets

    client = MlflowClient()
    assert datasets(client, again["mlflow_run_id"]) == datasets(client, result["mlflow_run_id"])
    same = {d.dataset.name: d.dataset for d in client.get_run(again["mlflow_run_id"]).inputs.dataset_inputs}
    first = {d.dataset.name: d.dataset for d in client.get_run(result["mlflow_run_id"]).inputs.dataset_inputs}
    assert all(same[n].source == first[n].source for n in first)
    sft = client.search_runs([again["mlflow_experiment_id"]], f"tags.mlflow.parentRunId = '{again['mlflow_run_id']}' "
                             "and tags.`posttrain.stage` = 'sft'")
    assert sft[0].data.tags["cache_hit"] == "True" and set(datasets(client, sft[0].info.run_id)) == {"synthetic-train"}
    computed = sft[0].data.tags["source_run_id"]
    assert client.get_run(computed).data.tags["cache_key"] == next(s["key"] for s in result["stages"] if s["stage"] == "sft")
    # the cache hit's run stands for the policy the computing run logged: it lists that model as its output
    made = json.loads((Path(next(s for s in result["stages"] if s["stage"] == "sft")["uri"]) / "manifest.json")
                      .read_text())["mlflow_model_id"]
    model = client.get_logged_model(made)
    assert [o.model_id for o in client.get_run(sft[0].info.run_id).outputs.model_outputs] == [made]
    assert model.source_run_id == computed  # still the run that trained it
    assert sft[0].data.tags["mlflow.note.content"].startswith(
        f"From cache: the result of run [{computed}](#/experiments/{client.get_run(computed).info.experiment_id}/runs/"
        f"{computed}?workflowType=machine_learning), logged model [{model.name}](#/experiments/{model.experiment_id}"
        f"/models/{made}?workflowType=machine_learning).")
    evals = client.search_runs([again["mlflow_experiment_id"]], f"tags.mlflow.parentRunId = '{again['mlflow_run_id']}' "
                               "and tags.`posttrain.stage` = 'eval'")
    assert evals and all(not client.get_run(r.info.run_id).outputs.model_outputs for r in evals)  # evals make none
    assert [s["key"] for s in again["stages"]] == [s["key"] for s in result["stages"]]
    assert again["headline"]["sft_accuracy"] == result["headline"]["sft_accuracy"]


def test_changing_eval_settings_reuses_upstream(first_run):
    from flows.speedrun import speedrun

    _, overrides, _ = first_run
    changed = speedrun(preset="tiny", overrides=overrides + ["eval.max_examples=10"])
    hits = [(s["stage"], s["cache_hit"]) for s in changed["stages"]]
    assert hits == [("prepare_data", True), ("tokenizer", True), ("sft", True), ("eval", False),
                    ("grpo", True), ("eval", False), ("control", True), ("eval", False)]


def test_changing_only_grpo_settings_reuses_sft(first_run):
    from flows.speedrun import speedrun

    _, overrides, result = first_run
    changed = speedrun(preset="tiny", overrides=overrides + ["grpo.lr=1e-5"])
    hits = [(s["stage"], s["cache_hit"]) for s in changed["stages"]]
    assert hits == [("prepare_data", True), ("tokenizer", True), ("sft", True), ("eval", True),
                    ("grpo", False), ("eval", False), ("control", False), ("eval", False)]
    sft_key = next(s["key"] for s in result["stages"] if s["stage"] == "sft")
    assert next(s["key"] for s in changed["stages"] if s["stage"] == "sft") == sft_key


def test_recompute_forces_a_stage_and_its_descendants(first_run):
    from flows.speedrun import speedrun

    _, overrides, result = first_run
    again = speedrun(preset="tiny", overrides=overrides, recompute=["sft"])
    hits = [(s["stage"], s["cache_hit"]) for s in again["stages"]]
    assert hits == [("prepare_data", True), ("tokenizer", True), ("sft", False), ("eval", False),
                    ("grpo", False), ("eval", False), ("control", False), ("eval", False)]
    assert [s["key"] for s in again["stages"]] == [s["key"] for s in result["stages"]]
    # deterministic on CPU: the recomputed result is the same
    assert again["headline"]["final_accuracy"] == result["headline"]["final_accuracy"]


def test_an_artifact_root_that_cannot_hold_results_stops_the_run_before_it_starts(tmp_path, capsys):
    """A local artifact_root under a file (a typo, a path swapped with a file's): exit 2 naming the
    setting and the fix, before an MLflow run is made, and listed by the dry run (was a
    NotADirectoryError traceback, and an MLflow run that failed). A folder this user may not write in
    is found the same way (the next test)."""
    from mlflow import MlflowClient

    from flows.cli import main

    afile = tmp_path / "results.txt"
    afile.write_text("")
    experiment = f"unusable-root-{tmp_path.name}"
    for root in (afile, afile / "art"):
        args = ["--set", f"artifact_root={root}", "--set", f"tracking.experiment={experiment}"]
        assert main(["prepare-data", *args]) == 2
        err = capsys.readouterr().err
        assert (f"posttrain: artifact_root: '{root}' cannot hold results: {afile} is a file, not a folder; point "
                "artifact_root at a folder") in err, err[-2000:]
        assert main(["speedrun", "--dry-run", *args]) == 2
        assert f"PROBLEM: artifact_root: '{root}' cannot hold results" in capsys.readouterr().out
    exp = MlflowClient().get_experiment_by_name(experiment)
    assert exp is None or not MlflowClient().search_runs([exp.experiment_id])
    assert afile.read_text() == ""


def test_an_artifact_root_this_user_may_not_write_in_or_reach_is_named(tmp_path):
    """A folder another user owns: one this user may read but not write in, and one it may not even
    search (its results folder behind it cannot be looked at: was a PermissionError traceback from
    the dry run and the run; then a failed flow run on a temporary Prefect server). The tests run as
    root, who may write anywhere: the commands run as root without the capabilities that let it
    (setpriv), as a user without them would."""
    import os
    import shutil
    import subprocess
    import sys

    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root (to give a folder to another user) and setpriv (to run without root's access)")
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/m.db"}
    env.pop("PREFECT_API_URL", None)
    unprivileged = ["setpriv", "--bounding-set=-dac_override,-dac_read_search",
                    "--inh-caps=-dac_override,-dac_read_search", "--"]
    for mode in (0o755, 0o700):  # readable by this user, and not even searchable
        folder = tmp_path / f"theirs-{mode:o}"
        folder.mkdir()
        os.chown(folder, 65534, 65534)  # nobody's
        folder.chmod(mode)
        root = folder / "art"
        for command in (["speedrun", "--dry-run"], ["prepare-data"]):
            proc = subprocess.run([*unprivileged, sys.executable, "-m", "flows.cli", *command, "--set",
                                   f"artifact_root={root}"], env=env, capture_output=True, text=True, timeout=300)
            said = f"artifact_root: '{root}' cannot hold results: this user may not write in {folder}; point artifact_root at a folder"
            assert proc.returncode == 2 and said in proc.stdout + proc.stderr, proc.stdout[-2000:] + proc.stderr[-2000:]
            assert "PermissionError" not in proc.stdout + proc.stderr
            # said before anything starts: no Prefect server started for it, no failed flow run's traceback
            assert "Prefect server" not in proc.stdout + proc.stderr and "Traceback" not in proc.stdout + proc.stderr
        assert not root.exists()


def test_cli_bad_data_path_stops_cleanly(tmp_path, capsys):
    from flows.cli import main

    code = main(["prepare-data", "--set", "data.source=files", "--set", f"data.train={tmp_path}/missing.jsonl",
                 "--set", f"artifact_root={tmp_path / 'art'}"])
    assert code == 2
    err = capsys.readouterr().err
    assert "data.train" in err and "missing.jsonl" in err and "does not exist" in err
    assert not list((tmp_path / "art").rglob("manifest.json"))  # nothing committed
    assert not list((tmp_path / "art" / "prepare_data").iterdir())  # nor an empty key folder left behind


def test_cli_bad_config_value(capsys):
    from flows.cli import main

    assert main(["speedrun", "--set", "sft.micro_batch_size=0"]) == 2
    assert "sft.micro_batch_size = 0" in capsys.readouterr().err


def test_a_tool_run_reports_tool_use_through_prefect_and_mlflow(tmp_path):
    """The tiny-calculator preset (shrunk) through the real flow: GRPO's rounds log the episodes'
    metrics and rollout tables with each turn; the evals play greedy episodes and also answer alone;
    the headline, the printed summary and the parent MLflow run carry the tool-use figures."""
    from mlflow import MlflowClient

    from flows.speedrun import speedrun
    from tasks.report import accuracy_lines

    overrides = SMALL + [f"artifact_root={tmp_path}", "control.enabled=true", "data.synthetic.digits=2",
                         "rollout.environment.max_tokens=64"]
    result = speedrun(preset="tiny-calculator", overrides=overrides)
    grpo = next(s for s in result["stages"] if s["stage"] == "grpo")
    history = [json.loads(x) for x in (Path(grpo["uri"]) / "history.jsonl").read_text().splitlines()]
    for key in ("rollout/turns_mean", "rollout/tool_calls_mean", "rollout/tool_errors", "rollout/tool_success_rate",
                "rollout/staleness_mean"):
        assert key in history[-1], key
    evals = [s for s in result["stages"] if s["stage"] == "eval"]
    for ev in evals:
        assert {"eval/tool_use_rate", "eval/tool_calls_mean", "eval/accuracy_without_tools"} <= set(ev["metrics"])
    head = result["headline"]
    for name in ("sft", "final", "control"):
        assert f"{name}_tool_calls_mean" in head and f"{name}_accuracy_without_tools" in head
    assert "rollout_tool_calls_mean" in head
    assert any(line.startswith("tool use") for line in accuracy_lines(head))
    client = MlflowClient()
    parent = client.get_run(result["mlflow_run_id"])
    assert {"final_accuracy", "vs_control_mcnemar_z", "rollout_tool_calls_mean"} <= set(parent.data.metrics)
    grpo_run = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}' "
                                  "and tags.`posttrain.stage` = 'grpo'")[0]
    table = json.loads(Path(client.download_artifacts(grpo_run.info.run_id, "rollouts/round_0002.json",
                                                      str(tmp_path / "dl"))).read_text())
    assert {"turns", "tool_calls", "tool_errors", "ended"} <= set(table["columns"])
    assert all(row[table["columns"].index("turns")].startswith("[assistant] ") for row in table["data"])
