"""MLflow and Prefect logging for the stages: the pipeline run's tracking reference, the MLflow
logger every stage logs through (trainer.tracking.MetricLogger's MLflow side) and the Prefect run logger."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.errors import InputError

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"


@dataclass(frozen=True)
class TrackingRef:
    """What every stage of one pipeline run shares (picklable, small): the MLflow parent run it
    logs under, the Prefect flow run, the stages this run must recompute despite the cache, and the
    MLflow logged model a models:/ model.pretrained named (the stage that starts from it lists it)."""

    tracking_uri: str
    experiment_id: str
    parent_run_id: str
    flow_run_id: str | None = None
    recompute: frozenset[str] = frozenset()
    pretrained_model_id: str | None = None


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI", DEFAULT_TRACKING_URI)


def store_id(uri: str) -> str:
    """A tracking URI as one name per store (a relative SQLite path as the absolute one)."""
    if uri.startswith("sqlite:///"):
        return "sqlite:///" + os.path.abspath(uri[len("sqlite:///"):])
    return uri.rstrip("/")


def same_store(a: str, b: str) -> bool:
    """Whether two tracking URIs name one store."""
    return store_id(a) == store_id(b)


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


class MlflowLogger:
    """trainer.tracking.MetricLogger on one MLflow run, through MlflowClient (thread-safe)."""

    def __init__(self, client, run_id: str) -> None:
        self.client, self.run_id = client, run_id

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, json.dumps(v) if isinstance(v, (list, dict)) else str(v))
                 for k, v in flatten(params).items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def log_metrics(self, metrics: dict[str, float], step: int | None = None, model_id: str | None = None,
                    dataset: tuple[str, str] | None = None) -> None:
        """`model_id`: the metrics are also that logged model's (the policy they measure), measured on
        `dataset` (its (name, digest), as `dataset_name` names a prepared split)."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        name, digest = dataset or (None, None)
        items = [Metric(k, float(v), now, step or 0, model_id=model_id, dataset_name=name, dataset_digest=digest)
                 for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=items)

    def log_model(self, name: str, folder: Path, params: dict[str, Any], tags: dict[str, Any],
                  description: str) -> str:
        """The policy in `folder` (a save_pretrained folder) as an MLflow logged model this run
        outputs, the folder its artifacts: the experiment's *Models* tab lists it, the evals' metrics
        attach to it (log_metrics' `model_id`) and a registered version points at it. It stays PENDING
        until `finalize_model`; an upload that fails marks it FAILED. Returns its id."""
        from mlflow.entities import LoggedModelStatus

        if not Path(folder).is_dir():  # MLflow would log an empty model
            raise FileNotFoundError(f"the policy folder {folder} does not exist: nothing to log as MLflow model {name}")
        experiment = self.client.get_run(self.run_id).info.experiment_id
        model = self.client.create_logged_model(
            experiment, name=name, source_run_id=self.run_id, model_type="posttrain-policy",
            params={k: json.dumps(v) if isinstance(v, (list, dict)) else str(v) for k, v in flatten(params).items()},
            tags={**{k: str(v) for k, v in tags.items()}, "mlflow.note.content": description})
        try:
            self.log_output(model.model_id)
            self.client.log_model_artifacts(model.model_id, str(folder))
        except BaseException:
            self.client.finalize_logged_model(model.model_id, LoggedModelStatus.FAILED)
            raise
        return model.model_id

    def log_output(self, model_id: str) -> None:
        """The logged model `model_id` as an output of this run (its page then shows the model and
        the registered versions made from it; the model's source run stays the one that made it)."""
        from mlflow.entities import LoggedModelOutput

        self.client.log_outputs(self.run_id, [LoggedModelOutput(model_id, step=0)])

    def finalize_model(self, model_id: str, ok: bool) -> None:
        """READY once the stage's result is committed, else FAILED."""
        from mlflow.entities import LoggedModelStatus

        self.client.finalize_logged_model(model_id, LoggedModelStatus.READY if ok else LoggedModelStatus.FAILED)

    def known_model(self, model_id: str | None):
        """The logged model `model_id` if this store has it, else None (a result computed while
        tracking in another store, or before posttrain logged its policies as models)."""
        from mlflow.exceptions import MlflowException

        if not model_id:
            return None
        try:
            return self.client.get_logged_model(model_id)
        except MlflowException:
            return None

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        path = Path(path)
        if path.is_dir():
            self.client.log_artifacts(self.run_id, str(path), artifact_path)
        else:
            self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_table(self, rows: list[dict[str, Any]], name: str) -> None:
        if rows:
            columns = {k: [r.get(k) for r in rows] for k in rows[0]}
            self.client.log_table(self.run_id, data=columns, artifact_file=name)

    def log_text(self, text: str, name: str) -> None:
        self.client.log_text(self.run_id, text, name)

    def set_tags(self, tags: dict[str, Any]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_data(self, data: dict[str, Any] | None, reads: dict[str, str]) -> None:
        """The prepared splits this run reads (`data`: prepare_data's manifest) as MLflow dataset inputs."""
        if data and reads:
            self.client.log_inputs(self.run_id, datasets=data_inputs(data, reads))

    def run_link(self, run_id: str) -> str:
        """A link, inside the MLflow UI, to a run's page in its model-training view: `#/runs/<id>`
        alone opens in the GenAI view in a browser that never chose one (MLflow 3.17's default),
        and only the experiment's run route keeps `workflowType` (docs/serving.md)."""
        from mlflow.exceptions import MlflowException

        try:
            experiment = self.client.get_run(run_id).info.experiment_id
        except MlflowException:  # a run this store no longer has: the short route, which says so
            return f"#/runs/{run_id}"
        return f"#/experiments/{experiment}/runs/{run_id}?workflowType=machine_learning"

    def log_source(self, source) -> None:
        """The MLflow model a models:/ model.pretrained named (tasks/sources.py), as tags of the
        pipeline's run: as configured, pinned, and its logged model. (The sft stage's run lists the
        model as its input: on the pipeline's run, MLflow's *Registered models* would show the
        starting policy's version beside the one the run registers.)"""
        tags = {"posttrain.pretrained": source.ref, "posttrain.pretrained_uri": source.pinned}
        if source.model_id:
            tags["posttrain.pretrained_model_id"] = source.model_id
        self.set_tags(tags)

    def log_reads(self, inputs: dict[str, dict[str, Any] | None], reads: dict[str, str], cached_from: str | None = None,
                  policy: str | None = None, pretrained: str | None = None, cached_model: str | None = None) -> None:
        """What a stage's run read (`inputs`: its input name -> that stage's result; `reads`: the
        prepared splits it reads -> what for): the splits as MLflow datasets; each input as tags,
        `posttrain.input.<name>` (the result's key) and `posttrain.input_run.<name>` (the MLflow run
        that computed it); and both as links in the run's description, so the MLflow UI walks from an
        eval back through GRPO and SFT to the data (`cached_from`: a cache hit's computing run;
        `cached_model`: the logged model that run made of the result, which the cache hit's run then
        lists as its output too, so its page shows the policy it stands for). The
        input named `policy` (whose weights the stage reads) also as the MLflow logged model it is, and
        so the logged model `pretrained` a models:/ model.pretrained named (for the stage that starts
        from it)."""
        self.log_data(inputs.get("data"), reads)
        tags, lines = {}, []
        if cached_from:
            line = f"From cache: the result of run [{cached_from}]({self.run_link(cached_from)})"
            if made := self.known_model(cached_model):
                self.log_output(made.model_id)
                line += f", logged model [{made.name}]({model_link(made)})"
            lines += [line + ".", ""]
        read = {name: m for name, m in inputs.items() if m}
        models = []
        if start := self.known_model(pretrained):
            models.append(start.model_id)
            tags["posttrain.pretrained_model_id"] = start.model_id
            by = start.source_run_id
            lines += [f"Starts from logged model [{start.name}]({model_link(start)}) (model.pretrained)"
                      + (f", computed by run [{by}]({self.run_link(by)})." if by else "."), ""]
        if read:
            lines += ["Reads:", ""]
        for name, m in read.items():
            source = m.get("source_run_id") or m.get("mlflow_run_id")
            tags[f"posttrain.input.{name}"] = m["key"]
            line = f"- {name}: {m['stage']} `{m['key']}`"
            if source:
                tags[f"posttrain.input_run.{name}"] = source
                line += f", computed by run [{source}]({self.run_link(source)})"
            if name == policy and (model := self.known_model(m.get("mlflow_model_id"))):
                models.append(model.model_id)
                line += f", logged model [{model.name}]({model_link(model)})"
            lines.append(line)
        if models:
            from mlflow.entities import LoggedModelInput

            self.client.log_inputs(self.run_id, models=[LoggedModelInput(m) for m in models])
        if lines:
            self.set_tags({**tags, "mlflow.note.content": "\n".join(lines)})


def model_link(model) -> str:
    """A link, inside the MLflow UI, to a logged model's page in the model-training view."""
    return f"#/experiments/{model.experiment_id}/models/{model.model_id}?workflowType=machine_learning"


def data_inputs(data: dict[str, Any], reads: dict[str, str]) -> list:
    """MLflow dataset inputs for the prepared splits a run reads (`reads`: split -> the context the
    runs table's Dataset column and the run page show, "training", "evaluation", ...). A split is
    named by where its rows came from and the split ("gsm8k-train", "synthetic-test",
    "openai/gsm8k-train") and digested by the prepared file's content hash, so runs that read the
    same rows show the same dataset (MLflow keeps one per experiment), and runs that did not, two.
    Its source is the prepared file under the artifact root; its profile, the row count and where the
    rows came from."""
    from mlflow.entities import Dataset, DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    from trainer import storage

    conf = data.get("config", {}).get("data", {})
    source = conf.get("source", "synthetic")
    inputs = []
    for split, context in reads.items():
        uri = storage.join(data["uri"], f"{split}.jsonl")
        if not storage.is_remote(uri):
            uri = os.path.abspath(uri)
        name, digest = dataset_name(data, split)
        if source == "hub":
            label = name[: -len(split) - 1]
            named = conf.get(f"hub_{split}_split")
            origin = f"hub {label}, split {named or conf.get('hub_train_split')}" + ("" if named else ", rows held out")
        elif source == "files":
            origin = conf.get(split) or f"{conf['train']}, rows held out"
        else:
            origin = "generated by posttrain (data.synthetic)"
        profile = {"num_rows": data.get("metrics", {}).get(f"data/n_{split}"), "from": origin,
                   "prepare_data_key": data["key"]}
        dataset = Dataset(name=name, digest=digest, source_type=uri.split("://")[0] if storage.is_remote(uri) else "local",
                          source=json.dumps({"uri": uri}), profile=json.dumps(profile))
        inputs.append(DatasetInput(dataset, tags=[InputTag(MLFLOW_DATASET_CONTEXT, context)]))
    return inputs


def dataset_name(data: dict[str, Any], split: str) -> tuple[str, str]:
    """A prepared split's MLflow dataset (name, digest) (`data`: prepare_data's manifest): named by
    where its rows came from and the split, digested by the prepared file's content hash (a result
    committed before that was recorded: the stage's key)."""
    from pathlib import PurePosixPath

    conf = data.get("config", {}).get("data", {})
    source = conf.get("source", "synthetic")
    if source == "hub":
        label = conf["hub_name"] + (f":{conf['hub_config']}" if conf.get("hub_config") else "")
    elif source == "files":
        path = PurePosixPath(conf["train"].split("://", 1)[-1])
        label = path.parent.name or path.stem
    else:
        label = "synthetic"
    return f"{label}-{split}", (data.get("sha256", {}).get(f"{split}.jsonl") or data["key"])[:12]


_ready: set[str] = set()


def ended_status(exc: BaseException) -> str:
    """The MLflow status of a run that `exc` ended: KILLED for a stop from outside (Ctrl-C, a
    cancellation from the Prefect UI, which Prefect raises as a signal), FAILED for anything else."""
    from mlflow.entities import RunStatus
    from prefect.exceptions import ExternalSignal

    stopped = isinstance(exc, (KeyboardInterrupt, ExternalSignal))
    return RunStatus.to_string(RunStatus.KILLED if stopped else RunStatus.FAILED)


class TrackingError(InputError):
    pass


def check_server(uri: str, attempts: int = 3, timeout_s: float = 3.0) -> None:
    """An http(s) tracking URI must answer before a run starts: MLflow's client retries a server that
    is down for about 4 minutes, then fails with a traceback. Any HTTP answer will do (a proxy may
    ask for credentials at /health), and so will a TLS handshake whose certificate this check does
    not trust (MLFLOW_TRACKING_INSECURE_TLS and MLFLOW_TRACKING_SERVER_CERT_PATH are MLflow's to
    apply); no connection after `attempts` tries a second apart raises TrackingError naming the URI
    and the fix."""
    import ssl
    import urllib.error
    import urllib.request

    url = f"{uri.rstrip('/')}/health"
    for attempt in range(attempts):
        try:
            with urllib.request.urlopen(url, timeout=timeout_s):
                return
        except urllib.error.HTTPError:
            return  # it answered
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, ssl.SSLError):
                return  # it answered TLS: whether to trust its certificate is MLflow's setting to apply
            problem = exc
        except (OSError, ValueError) as exc:
            problem = exc
        if attempt + 1 < attempts:
            time.sleep(1.0)
    raise TrackingError(f"MLflow tracking server {uri} (MLFLOW_TRACKING_URI) does not answer ({problem}); start it "
                        f"(`make serve` starts one on http://127.0.0.1:5000), or unset MLFLOW_TRACKING_URI to track "
                        f"in {DEFAULT_TRACKING_URI}")


def mlflow_client(uri: str):
    """An MlflowClient on `uri`. A process's first use of a SQLite store runs under a file lock beside
    the database: MLflow creates a fresh store's tables on first use, and two processes doing that at
    once fail ("No such index ..."). A server-backed store is set up by its server, which must answer
    (`check_server`) the first time a process uses it."""
    import fcntl

    from mlflow import MlflowClient

    if uri.startswith(("http://", "https://")) and uri not in _ready:
        check_server(uri)
        _ready.add(uri)
    if not uri.startswith("sqlite:///") or uri in _ready:
        return MlflowClient(tracking_uri=uri)
    db = Path(uri[len("sqlite:///"):]).expanduser()
    # a folder is named before MLflow tries it: MLflow retries opening one for a minute and a half
    problem = f"{db} is a folder, not a SQLite file" if db.is_dir() else None
    if problem is None:
        try:
            db.parent.mkdir(parents=True, exist_ok=True)
            with open(db.with_name(db.name + ".lock"), "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                client = MlflowClient(tracking_uri=uri)  # creates or migrates the tracking tables
                client.search_experiments(max_results=1)
                client.search_registered_models(max_results=1)  # ... and the model registry's
        except Exception as exc:
            problem = _store_problem(db, exc)
            if problem is None:
                raise
    if problem is not None:
        raise TrackingError(f"MLFLOW_TRACKING_URI={uri}: {problem}; point it at a SQLite file in a folder you can "
                            f"write in (sqlite:////abs/path/mlflow.db), or unset it to track in {DEFAULT_TRACKING_URI}") \
            from None
    _ready.add(uri)
    return client


def artifact_store_problem(problem: object) -> str:
    """An unusable tracking.artifact_location (`problem`: why), as the run and the dry run name it."""
    return (f"tracking.artifact_location (the experiment's artifact store): {problem} (MLflow's S3 endpoint: "
            "MLFLOW_S3_ENDPOINT_URL, else AWS_ENDPOINT_URL)")


def _store_problem(db: Path, exc: BaseException) -> str | None:
    """What keeps a SQLite tracking store from being used, for the errors a path or file causes."""
    if isinstance(exc, OSError):
        from trainer.storage import folder_problem

        return f"cannot keep a tracking store at {db}: {folder_problem(db.parent) or exc.strerror or exc}"
    try:
        from sqlalchemy.exc import DatabaseError
    except ImportError:
        return None
    if isinstance(exc, DatabaseError):
        reason = str(getattr(exc, "orig", None) or exc).splitlines()[0]
        if "locked" in reason:  # another process holds the store: nothing wrong with the path; raised as is
            return None
        return f"cannot open {db} as an MLflow SQLite store ({reason})"
    return None


def client_for(ref: TrackingRef):
    return mlflow_client(ref.tracking_uri)


def child_logger(ref: TrackingRef, stage: str, tags: dict[str, Any]) -> MlflowLogger:
    client = client_for(ref)
    run = client.create_run(ref.experiment_id, run_name=stage, tags={
        "mlflow.parentRunId": ref.parent_run_id, "posttrain.stage": stage,
        **({"prefect.flow_run_id": ref.flow_run_id} if ref.flow_run_id else {}),
        **{k: str(v) for k, v in tags.items()},
    })
    return MlflowLogger(client, run.info.run_id)


def prefect_logger():
    """The Prefect run logger inside a task, else a std logger (tests calling .fn directly)."""
    import logging

    from prefect import get_run_logger
    from prefect.exceptions import MissingContextError

    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("posttrain")
