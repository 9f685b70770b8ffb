"""`model.pretrained: models:/...`: an MLflow model as the starting policy (tasks/sources.py), looked
up in a real SQLite store: each URI form, what it pins to, the download, and the errors, which name
the field, what the store has and the fix, and leave no download behind. The whole pipeline starting
from a registered policy: tests/test_reports.py."""

from pathlib import Path

import pytest

from tasks.sources import ModelSourceError, Parsed, download, lookup, parse


def test_the_uri_forms():
    assert parse("models:/posttrain-tiny/3") == Parsed(name="posttrain-tiny", version="3")
    assert parse("models:/posttrain-tiny/03") == Parsed(name="posttrain-tiny", version="3")
    assert parse("models:/posttrain-tiny@champion") == Parsed(name="posttrain-tiny", alias="champion")
    assert parse("models:/posttrain-tiny/latest") == parse("models:/posttrain-tiny/LATEST") == Parsed(name="posttrain-tiny")
    assert parse("models:/m-0f3e") == Parsed(model_id="m-0f3e")
    for bad in ("models:/", "models:/a/b/c", "models:/a/", "models:/a@", "models:/@b", "models:/a@b/3"):
        with pytest.raises(ModelSourceError, match=r"model.pretrained: .* is not an MLflow model URI; write it as "
                                                   r"models:/<name>/<version>, models:/<name>@<alias>"):
            parse(bad)
    with pytest.raises(ModelSourceError, match=r"names a registry stage \('Production'\), which MLflow has deprecated.*"
                                               r"models:/a@champion"):
        parse("models:/a/Production")


def test_the_ml_core_names_the_way_outside_the_pipeline():
    """trainer/ knows no MLflow: given a models:/ URI it says how to download it, not that the hub lacks it."""
    from trainer.model import ModelLoadError, pretrained_kind, resolve_pretrained

    assert pretrained_kind("models:/posttrain-tiny/1") == "mlflow"
    with pytest.raises(ModelLoadError, match=r"is an MLflow model URI, which the pipeline .* downloads before its stages "
                                             r"run; outside it, .*mlflow artifacts download --artifact-uri "
                                             r"models:/posttrain-tiny/1 -d DIR"):
        resolve_pretrained("models:/posttrain-tiny/1")
    with pytest.raises(ModelLoadError, match=r"grpo.rewards\[\].path: 'models:/rm/1' is an MLflow model URI, which "
                                             r"posttrain downloads for model.pretrained only; here, download the model"):
        resolve_pretrained("models:/rm/1", field="grpo.rewards[].path")


@pytest.fixture()
def store(tmp_path, monkeypatch):
    """A SQLite store with a registered model: version 1 a READY logged model (a save_pretrained-like
    folder), version 2 a FAILED one, version 3 files that are no transformers model; alias champion on 1."""
    from mlflow import MlflowClient
    from mlflow.entities import LoggedModelStatus

    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))
    # the process's store, as in a run (MLflow's SQL registry looks a models:/ source up there)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    client = MlflowClient()
    experiment = client.create_experiment("sources", artifact_location=str(tmp_path / "artifacts"))
    run = client.create_run(experiment).info.run_id
    models = []
    for name, status, files in (("tiny-grpo", LoggedModelStatus.READY, {"config.json": "{}", "model.safetensors": "w"}),
                                ("tiny-sft", LoggedModelStatus.FAILED, {"config.json": "{}"}),
                                ("other", LoggedModelStatus.READY, {"model.pkl": "x"})):
        folder = tmp_path / name
        folder.mkdir()
        for f, text in files.items():
            (folder / f).write_text(text)
        model = client.create_logged_model(experiment, name=name, source_run_id=run)
        client.log_model_artifacts(model.model_id, str(folder))
        client.finalize_logged_model(model.model_id, status)
        models.append(model.model_id)
    client.create_registered_model("policy")
    for model_id in models:
        client.create_model_version("policy", f"models:/{model_id}", run_id=run, model_id=model_id)
    client.set_registered_model_alias("policy", "champion", "1")
    return client, models


@pytest.mark.slow
def test_each_form_names_one_model_pinned(store):
    client, (ready, failed, other) = store
    for ref in ("models:/policy/1", "models:/policy@champion", f"models:/{ready}"):
        source = lookup(client, ref)
        assert (source.model_id, source.model_name) == (ready, "tiny-grpo")
        assert source.pinned == (f"models:/{ready}" if ref.startswith("models:/m-") else "models:/policy/1")
        assert source.download_uri == client.get_logged_model(ready).artifact_location
    assert lookup(client, "models:/policy/latest").pinned == "models:/policy/3"
    assert lookup(client, "models:/policy@champion").describe() == (
        f"models:/policy@champion (now models:/policy/1): logged model tiny-grpo {ready}")
    # one download per model, whichever URI named it; whole, and the stages read it like any folder
    folders = {download(lookup(client, ref), client.tracking_uri) for ref in ("models:/policy/1", f"models:/{ready}")}
    [folder] = folders
    assert sorted(p.name for p in folder.iterdir()) == [".complete", "config.json", "model.safetensors"]


@pytest.mark.slow
def test_errors_name_what_the_store_has_and_leave_nothing_behind(store, tmp_path):
    client, (ready, failed, other) = store
    where = f"the MLflow store at {client.tracking_uri}"
    cases = {
        "models:/policy/9": r"registered model 'policy' in .* has no version 9 \(its versions: 1, 2, 3\); name one",
        "models:/policy@best": r"registered model 'policy' has no alias 'best' \(its aliases: champion\); give a "
                               r"version, or set the alias .*set_registered_model_alias\('policy', 'best', <version>\)",
        "models:/nope/1": rf"{where} has no registered model 'nope' \(its registered models: policy\); check the name, "
                          r"or MLFLOW_TRACKING_URI",
        "models:/m-0123": rf"{where} has no logged model 'm-0123'; copy the id from the experiment's Models tab",
        f"models:/{failed}": rf"logged model tiny-sft {failed} is FAILED \(its stage did not commit it\); start from a "
                             "READY one",
    }
    for ref, message in cases.items():
        with pytest.raises(ModelSourceError, match=rf"^model.pretrained: '{ref}': {message}"):
            lookup(client, ref)
    # a version of a FAILED model is still what the registry points at: its files
    assert lookup(client, "models:/policy/2").model_id is None
    with pytest.raises(ModelSourceError, match=r"model.pretrained: models:/policy/3: logged model other .* is not a "
                                               r"transformers model \(no config.json among its files: model.pkl\); "
                                               r"posttrain starts from a save_pretrained folder"):
        download(lookup(client, "models:/policy/3"), client.tracking_uri)
    cache = Path(tmp_path / "cache" / "mlflow-models")
    assert not [p for p in cache.iterdir() if not p.name.endswith(".lock")]  # no half-written download
