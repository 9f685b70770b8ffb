"""Cache keys: one table of what each stage's result depends on.

A stage's key = hash(the config fields that change its result, the seed, its inputs' result keys,
the pipeline's code version, and the content of what it reads from outside: data files, a
pretrained model folder, a custom reward's module, a reward-model folder). Fields that only say
how or where the work runs (timeouts, ports, server addresses, logging and checkpoint cadence) are
left out, so changing them reuses the result.

Each row of the stage table (tasks/stages.py) holds its `KeyRule`; the functions here compute keys
from the rule they are given, and never read the table (only the table imports this module).

GRPO's round count is left out of its folder's key: asking for more rounds continues from the
last checkpoint in that folder instead of training again from SFT. Its result key (what
downstream stages and the manifest carry) still counts the rounds.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from trainer import storage
from trainer.config import RunConfig



@functools.cache
def code_version() -> str:
    """Hash of the pipeline's own source (trainer/ and tasks/, the C++ kernels and their header included):
    any change invalidates caches, and every host of a launch must run the same (trainer.hosts)."""
    from trainer.hosts import source_version

    return source_version()


# ---------------------------------------------------------------- content fingerprints

_memo: dict[tuple[str, int, int], str] = {}


def _file_digest(path: Path) -> str:
    st = path.stat()
    memo_key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if memo_key not in _memo:
        _memo[memo_key] = storage.file_sha256(path)
    return _memo[memo_key]


def fingerprint(ref: str | None) -> str | None:
    """What a data file or model folder holds, not what it is called.

    Local files and folders: sha256 of every file (memoised by path, size and mtime). s3:// and
    other remote URIs: each object's ETag and size (the store's own content hash). A hub name is
    kept as is: its content cannot be read without the hub."""
    if not ref:
        return None
    if storage.is_remote(ref):
        try:
            fs, path = storage.fs_for(ref)
            info = fs.info(path)
            objects = [info] if info.get("type") != "directory" else sorted(
                fs.find(path, detail=True).values(), key=lambda i: i["name"])
        except Exception:  # missing or unreachable: the stage that reads it says so, by field
            return f"unreadable:{ref}"
        return hashlib.sha256(json.dumps(
            [(i["name"][len(path):], i.get("ETag") or i.get("etag") or i.get("md5"), i.get("size")) for i in objects]
        ).encode()).hexdigest()[:16]
    p = Path(ref).expanduser()
    if p.is_file():
        return _file_digest(p)[:16]
    if p.is_dir():
        h = hashlib.sha256()
        for f in sorted(x for x in p.rglob("*") if x.is_file() and not x.name.startswith(".")):
            h.update(f.relative_to(p).as_posix().encode() + b"\0" + _file_digest(f).encode())
        return h.hexdigest()[:16]
    return f"name:{ref}"  # a hub name (or a path that is not there: the stage itself reports that)


def data_content(cfg: RunConfig) -> dict[str, Any]:
    d = cfg.data
    return {"train": fingerprint(d.train), "test": fingerprint(d.test)} if d.source == "files" else {}


def model_content(cfg: RunConfig) -> dict[str, Any]:
    return {"pretrained": fingerprint(cfg.model.pretrained)} if cfg.model.pretrained else {}


def _module_source(module: str) -> str | None:
    """The fingerprint of a module's source file (None: not importable; the stage names it)."""
    try:
        origin = importlib.util.find_spec(module).origin
    except (ImportError, AttributeError, ValueError):
        origin = None
    return fingerprint(origin) if origin and os.path.isfile(origin) else None


def environment_content(cfg: RunConfig) -> dict[str, Any]:
    """A multi-turn environment: its settings, and a custom one's module by its source."""
    env = cfg.rollout.environment
    if not env.multi_turn:
        return {}
    out: dict[str, Any] = {"environment": env.model_dump()}
    if ":" in env.name:
        out["environment_source"] = _module_source(env.name.split(":")[0])
    return out


def task_content(cfg: RunConfig) -> dict[str, Any]:
    """A grader of the user's by its module's source (the built-in ones are part of the code version)."""
    module, sep, _ = cfg.task.grader.partition(":")
    return {"grader_source": _module_source(module)} if sep else {}


def reward_content(cfg: RunConfig) -> dict[str, Any]:
    """Custom rewards by their module's source, reward models by their folder (built-in rewards are
    part of the code version)."""
    from trainer.rl.rewards import BUILTIN, split_dotted

    out = {}
    for spec in cfg.grpo.rewards:
        if spec.name in BUILTIN:
            continue
        if spec.name == "reward_model":
            out[f"reward_model:{spec.path}"] = fingerprint(spec.path)
            continue
        out[spec.name] = _module_source(split_dotted(spec.name)[0])  # None: the stage names it
    return {**out, **environment_content(cfg), **task_content(cfg)}


def grpo_content(cfg: RunConfig) -> dict[str, Any]:
    """GRPO's rewards and environment, and its adapters (model.lora, a section of the model's that
    changes how GRPO trains; the SFT key it reads carries it too, this keeps it keyed when it does not)."""
    lora = {"lora": cfg.model.lora.model_dump()} if cfg.model.lora is not None else {}
    return {**reward_content(cfg), **lora}


# ---------------------------------------------------------------- key rules (each row of tasks/stages.py holds one)

@dataclass(frozen=True)
class KeyRule:
    sections: tuple[str, ...]
    unkeyed: dict[str, str] = field(default_factory=dict)  # dotted field -> why it does not change the result
    content: Callable[[RunConfig], dict[str, Any]] = lambda cfg: {}
    extends: str | None = None  # a field whose increase continues the stage's result


SFT_UNKEYED = {
    "sft.log_every": "how often metrics are logged",
    "sft.checkpoint_every": "resume from any checkpoint is exact",
    "sft.deepspeed.timeout_s": "how long the launch may take",
}

# A training stage's placement: the same ranks on one machine or on several give the same weights, bit for
# bit (tests/test_cluster.py), so a result made on one is a cache hit for the other.
PLACEMENT = ("ranks_per_node", "nodes", "hostfile", "master_port", "master_addr", "interface", "collective_timeout_s")


def keyed_config(cfg: RunConfig, rule: KeyRule, world_size: int | None = None) -> dict[str, Any]:
    """The rule's config sections without the fields that do not change the stage's result. A model
    in this machine's cache (a models:/ URI's download, tasks/sources.py) is keyed by its place in the
    cache, not by where the cache is: machines sharing an artifact root and a tracking server share
    the result. `world_size`: the config as it would be on that many ranks."""
    out = {s: cfg.to_dict()[s] for s in rule.sections}
    model = out.get("model") or {}
    cache = str(storage.posttrain_cache()) + "/"
    if (model.get("pretrained") or "").startswith(cache):
        model["pretrained"] = "$POSTTRAIN_CACHE/" + model["pretrained"][len(cache):]
    for section in out.values():
        if isinstance(section, dict) and isinstance(section.get("deepspeed"), dict):
            ds = section["deepspeed"]
            # where the ranks run is not the result; how many there are is (the batch splits by rank)
            ds["world_size"] = world_size or ds.get("ranks_per_node", 1) * ds.get("nodes", 1)
            for placement in PLACEMENT:
                ds.pop(placement, None)
    for dotted in rule.unkeyed:
        *parents, leaf = dotted.split(".")
        node = out
        for p in parents:
            node = node[p]
        node.pop(leaf)
    return out


def _hash(payload: Any) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def stage_key(cfg: RunConfig, stage: str, rule: KeyRule, inputs: dict[str, dict | None],
              world_size: int | None = None) -> str:
    """The key of the stage's folder (`stage`: its kind, `rule`: its row's key rule; `world_size`:
    the key the same stage has on that many ranks)."""
    return _hash({
        "stage": stage,
        "config": keyed_config(cfg, rule, world_size),
        "content": rule.content(cfg),
        "seed": cfg.seed,
        "inputs": {k: (v or {}).get("key") for k, v in sorted(inputs.items())},
        "code": code_version(),
    })


def extent(cfg: RunConfig, rule: KeyRule) -> int | None:
    """The value of the rule's `extends` field (GRPO: its rounds), else None."""
    dotted = rule.extends
    if dotted is None:
        return None
    value: Any = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return int(value)


def result_key(cfg: RunConfig, rule: KeyRule, folder_key: str) -> str:
    """The key of the stage's result: its folder's key, plus its extent where it has one."""
    n = extent(cfg, rule)
    return folder_key if n is None else _hash({"folder": folder_key, "extent": n})


@dataclass
class Resolved:
    folder: str
    key: str                    # the result key (the manifest's "key")
    manifest: dict | None       # a committed result with this key, else None
    continues_from: int | None  # a committed result of a smaller extent that this run extends


def resolve(cfg: RunConfig, stage: str, rule: KeyRule, inputs: dict[str, dict | None]) -> Resolved:
    """Where the stage's result lives and whether it is there.

    For a stage that extends (GRPO): the folder of its key holds one result of some round count.
    The same count is a hit; fewer done there are continued in place; more done there means this
    shorter run gets a folder of its own (named by its result key)."""
    folder_key = stage_key(cfg, stage, rule, inputs)
    key = result_key(cfg, rule, folder_key)
    folder = storage.join(cfg.artifact_root, stage, folder_key)
    manifest = storage.read_manifest(folder)
    if manifest is None or manifest.get("key") == key:
        return Resolved(folder, key, manifest, None)
    done = manifest.get("extent")
    wanted = extent(cfg, rule)
    if done is not None and wanted is not None and done < wanted:
        return Resolved(folder, key, None, int(done))
    folder = storage.join(cfg.artifact_root, stage, key)
    return Resolved(folder, key, storage.read_manifest(folder), None)


MAX_OTHER_WORLD_SIZE = 64  # the rank counts whose unfinished runs a stage looks for checkpoints in


def world_sizes(cfg: RunConfig, rule: KeyRule) -> set[int]:
    """The rank counts in the stage's keyed config (empty: the stage runs no ranks)."""
    return {s["deepspeed"]["world_size"] for s in keyed_config(cfg, rule).values()
            if isinstance(s, dict) and isinstance(s.get("deepspeed"), dict)}
