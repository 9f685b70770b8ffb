"""An MLflow model as the starting policy: `model.pretrained: models:/...`.

The forms of MLflow's own model URIs, looked up in the run's tracking store (MLFLOW_TRACKING_URI,
where posttrain logs and registers its policies):

    models:/<name>/<version>    a registered version          models:/posttrain-tiny/3
    models:/<name>@<alias>      the version an alias names    models:/posttrain-tiny@champion
    models:/<name>/latest       the newest version            models:/posttrain-tiny/latest
    models:/<model id>          a logged model                models:/m-0f3e...

The pipeline resolves it once, before any stage runs (`resolve`): an alias or `latest` is pinned to
the version it names now, and the model's files are downloaded once into this machine's cache
($POSTTRAIN_CACHE/mlflow-models/), keyed by the store and the model. The stages read that folder
like any local model folder (trainer/ never sees MLflow), and their cache keys hold its content.
The run's params and config.yaml hold the pinned URI and its tags the logged model; the stage that
starts from the model (SFT, or the start an `sft.enabled: false` run commits) lists it as its input,
so MLflow walks from a policy back to the one it was trained from.
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass
from pathlib import Path

from trainer import storage
from trainer.config import MLFLOW_MODEL_PREFIX as PREFIX, RunConfig, is_mlflow_model as is_model_uri
from trainer.errors import InputError

FIELD = "model.pretrained"
FORMS = ("models:/<name>/<version>, models:/<name>@<alias>, models:/<name>/latest or models:/<logged model id> "
         "(models:/posttrain-tiny/3)")


class ModelSourceError(InputError):
    pass


@dataclass(frozen=True)
class Parsed:
    model_id: str | None = None
    name: str | None = None
    version: str | None = None
    alias: str | None = None  # None with no version: the newest version ("latest")


def parse(ref: str) -> Parsed:
    """The parts of a models:/ URI, or a ModelSourceError that shows the forms."""
    body = ref[len(PREFIX):]
    parts = body.split("/")
    bad = ModelSourceError(f"{FIELD}: {ref!r} is not an MLflow model URI; write it as {FORMS}")
    if not body or len(parts) > 2 or not all(p.strip() for p in parts):
        raise bad
    if len(parts) == 2:
        name, suffix = parts
        if "@" in name:
            raise bad
        if suffix.isdigit():
            return Parsed(name=name, version=str(int(suffix)))
        if suffix.lower() == "latest":
            return Parsed(name=name)
        raise ModelSourceError(f"{FIELD}: {ref!r} names a registry stage ({suffix!r}), which MLflow has "
                               f"deprecated and posttrain does not follow; name a version (models:/{name}/3), an "
                               f"alias (models:/{name}@champion) or models:/{name}/latest")
    if "@" in body:
        name, _, alias = body.rpartition("@")
        if not name or not alias:
            raise bad
        return Parsed(name=name, alias=alias)
    return Parsed(model_id=body)


@dataclass(frozen=True)
class ModelSource:
    """What a models:/ URI names in one store, looked up once: `pinned` is the URI that names the same
    model for good (an alias or `latest` pinned to its version)."""

    ref: str
    pinned: str
    store: str
    download_uri: str
    model_id: str | None = None  # the logged model, where it is one (a version may point at a folder)
    model_name: str | None = None

    def describe(self) -> str:
        said = f"{self.ref} (now {self.pinned})" if self.pinned != self.ref else self.ref
        what = f"logged model {self.model_name} {self.model_id}" if self.model_id else f"files at {self.download_uri}"
        return f"{said}: {what}"

    def folder(self) -> Path:
        """Where this machine keeps its download: one folder per store and model."""
        identity = f"{self.store}|{self.model_id or self.pinned}|{self.download_uri}"
        return storage.posttrain_cache() / "mlflow-models" / hashlib.sha256(identity.encode()).hexdigest()[:16]


def _missing(exc) -> bool:
    return getattr(exc, "error_code", None) == "RESOURCE_DOES_NOT_EXIST"


def lookup(client, ref: str) -> ModelSource:
    """What `ref` names in `client`'s store (nothing downloaded). Errors name the field, what the
    store has instead and the fix."""
    from mlflow.exceptions import MlflowException

    from tasks.tracking import store_id

    p = parse(ref)
    store = store_id(client.tracking_uri)
    where = f"the MLflow store at {client.tracking_uri}"
    try:
        if p.model_id:
            return _logged(client, ref, ref, store, p.model_id, where)  # an id is pinned already
        try:
            registered = client.get_registered_model(p.name)
        except MlflowException as exc:
            if not _missing(exc):
                raise
            names = sorted(m.name for m in client.search_registered_models(max_results=20))
            raise ModelSourceError(
                f"{FIELD}: {ref!r}: {where} has no registered model {p.name!r} (its registered "
                f"models: {', '.join(names) or 'none'}); check the name, or "
                "MLFLOW_TRACKING_URI (the store posttrain registers its policies in)") from None
        if p.version:
            version = _version(client, ref, p, where)
        elif p.alias:
            aliases = registered.aliases or {}
            if p.alias in aliases:
                version = client.get_model_version(p.name, aliases[p.alias])
            else:
                raise ModelSourceError(
                    f"{FIELD}: {ref!r}: registered model {p.name!r} has no alias {p.alias!r} (its aliases: "
                    f"{', '.join(sorted(aliases)) or 'none'}); give a version, or set the alias in the MLflow UI or "
                    f"with MlflowClient().set_registered_model_alias({p.name!r}, {p.alias!r}, <version>)")
        else:
            versions = client.search_model_versions(f"name = '{p.name}'")
            if not versions:
                raise ModelSourceError(f"{FIELD}: {ref!r}: registered model {p.name!r} has no versions yet; "
                                       "register a policy first (a finished speedrun registers its final policy)")
            version = max(versions, key=lambda v: int(v.version))
        pinned = f"{PREFIX}{p.name}/{version.version}"
        # the logged model a version was made from (MLflow 3.17's SQL registry keeps it as the source only)
        model_id = version.model_id or (version.source[len(PREFIX):] if version.source.startswith(PREFIX) else None)
        if model_id:
            try:
                return _logged(client, ref, pinned, store, model_id, where)
            except ModelSourceError:
                pass  # a version of a logged model this store no longer has: its own source folder
        return ModelSource(ref, pinned, store, client.get_model_version_download_uri(p.name, version.version))
    except MlflowException as exc:
        raise ModelSourceError(f"{FIELD}: {ref!r}: could not read it from {where} ({exc.message}); check "
                               "MLFLOW_TRACKING_URI and that the store answers") from None


def _version(client, ref: str, p: Parsed, where: str):
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version(p.name, p.version)
    except MlflowException as exc:
        if not _missing(exc):
            raise
        have = sorted(int(v.version) for v in client.search_model_versions(f"name = '{p.name}'"))
        raise ModelSourceError(f"{FIELD}: {ref!r}: registered model {p.name!r} in {where} has no version {p.version} "
                               f"(its versions: {', '.join(map(str, have)) or 'none'}); name one of them") from None


def _logged(client, ref: str, pinned: str, store: str, model_id: str, where: str) -> ModelSource:
    from mlflow.entities import LoggedModelStatus
    from mlflow.exceptions import MlflowException

    try:
        model = client.get_logged_model(model_id)
    except MlflowException as exc:
        if not _missing(exc):
            raise
        raise ModelSourceError(f"{FIELD}: {ref!r}: {where} has no logged model {model_id!r}; copy the id from the "
                               "experiment's Models tab, or name a registered version (models:/<name>/<version>)"
                               ) from None
    if model.status != LoggedModelStatus.READY:
        raise ModelSourceError(f"{FIELD}: {ref!r}: logged model {model.name} {model_id} is {model.status} (its "
                               "stage did not commit it); start from a READY one")
    return ModelSource(ref, pinned, store, model.artifact_location, model_id, model.name)


def download(source: ModelSource, tracking_uri: str) -> Path:
    """The model's files in this machine's cache, downloaded the first time (whole or not at all;
    one process downloads, others wait). Not a transformers model folder: a ModelSourceError."""
    import mlflow

    from tasks.tracking import prefect_logger

    def fill(tmp: Path) -> None:
        prefect_logger().info("model.pretrained: downloading %s into %s", source.describe(), folder)
        got = Path(mlflow.artifacts.download_artifacts(artifact_uri=source.download_uri, dst_path=str(tmp / "dl"),
                                                       tracking_uri=tracking_uri))
        for item in got.iterdir():
            shutil.move(str(item), tmp / item.name)
        shutil.rmtree(tmp / "dl", ignore_errors=True)
        if not (tmp / "config.json").is_file():
            files = sorted(p.name for p in tmp.iterdir())[:8]
            raise ModelSourceError(f"{FIELD}: {source.describe()} is not a transformers model (no config.json among "
                                   f"its files: {', '.join(files) or 'none'}); posttrain starts from a "
                                   "save_pretrained folder, as each policy it logs is")

    folder = source.folder()
    folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        return storage.fill_once(folder, fill)
    except ModelSourceError:
        raise
    except Exception as exc:
        raise ModelSourceError(f"{FIELD}: could not download {source.describe()} ({type(exc).__name__}: {exc}); "
                               "check the artifact store's access (AWS_* settings for s3://)") from None


def resolve(cfg: RunConfig) -> tuple[RunConfig, ModelSource | None]:
    """`cfg` with a models:/ `model.pretrained` replaced by its downloaded folder, and what it named
    (None, and `cfg` as it is, for any other model source)."""
    if not is_model_uri(cfg.model.pretrained):
        return cfg, None
    from tasks.tracking import mlflow_client, tracking_uri

    uri = tracking_uri()
    source = lookup(mlflow_client(uri), cfg.model.pretrained)
    return with_folder(cfg, download(source, uri)), source


def with_folder(cfg: RunConfig, folder: Path) -> RunConfig:
    """`cfg` starting from the model in `folder` (a models:/ URI's download)."""
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"pretrained": str(folder)})})
