"""The pipeline's stages, in one table.

Each row says what a stage reads (its inputs: earlier rows), what its result is keyed on, what
computes it, whether the config turns it on, and whether it has a command of its own. Everything
else is derived from this table, so adding a stage is adding a row:

- the speedrun flow and a flow and CLI command per `command` (flows/speedrun.py, flows/cli.py):
  they run the rows in order, each from its inputs' results, up to the command's row;
- `--recompute` choices, and what a recompute takes with it (every row downstream of it);
- the cache keys (each row holds its `KeyRule`; tasks/keys.py computes a key from it);
- the dry run (tasks/plan.py), which resolves each row's folder from the same inputs;
- which body a rank launched by the DeepSpeed launcher runs (tasks/rank_main.py).

Bodies are named as "module:function" and imported when used: the CLI reads this table for its
commands without loading Prefect, torch or the stages' code.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from tasks.keys import (SFT_UNKEYED, KeyRule, data_content, environment_content, grpo_content, model_content,
                        task_content)
from trainer.config import RunConfig


def _always(cfg: RunConfig) -> bool:
    return True


@dataclass(frozen=True)
class Stage:
    name: str                    # the row's name: the summary's label, the results' key ("eval (grpo)")
    kind: str                    # its folder under artifact_root, its --recompute name; rows may share one
    key: KeyRule                 # the config sections keyed, the fields not keyed, content read from outside
    body: str                    # "module:function": (cfg, inputs, ref, fault) -> the body run_stage runs,
                                 # body(work_dir, logger) -> {"metrics": ..., ...}
    inputs: dict[str, str] = field(default_factory=dict)  # the body's input -> the row whose result it is
    enabled: Callable[[RunConfig], bool] = _always         # off: skipped, and its dependants get None
    command: str | None = None   # a CLI command and Prefect flow of its own: the pipeline up to this row
    task: bool = True            # a Prefect task of its own (GRPO's rounds are tasks instead)
    rank_body: str | None = None  # "module:function" a launched rank runs: (cfg, inputs, work, logger) -> dict
    plan: str | None = None      # "module:function": its dry-run lines, (cfg, row, folder, inputs, notes, problems)
    report: str | None = None    # "module:function": headline metrics once it ran, (run, results) -> None
    # the prepared splits its body reads -> what for (MLflow's dataset context, on its child run's
    # Dataset inputs), or a function of the config that says so
    reads: dict[str, str] | Callable[[RunConfig], dict[str, str]] = field(default_factory=dict)
    # the input whose policy (weights) its body reads: its run names that policy's MLflow logged
    # model as an input (the control reads GRPO's result for its time budget, not its weights)
    policy: str | None = None
    # its body starts from model.pretrained's weights: where that is an MLflow model (tasks/sources.py),
    # its run lists that logged model as an input
    pretrained: bool = False

    def inputs_from(self, results: dict[str, dict | None]) -> dict[str, dict | None]:
        return {name: results.get(row) for name, row in self.inputs.items()}

    def splits_read(self, cfg: RunConfig) -> dict[str, str]:
        return self.reads(cfg) if callable(self.reads) else self.reads


EVAL_KEY = KeyRule(("eval", "task"), unkeyed={"eval.engine": "keyed as the engine it resolves to (answered_by)"},
                   content=lambda cfg: {"answered_by": cfg.eval_engine(), **environment_content(cfg),
                                        **task_content(cfg)})


TRAINS = {"train": "training"}


def _evals(cfg: RunConfig) -> dict[str, str]:
    """An eval reads the held-out split, and the training split where it samples seen problems."""
    return {"test": "evaluation", **({"train": "evaluation (seen)"} if cfg.eval.seen_examples else {})}


# trains on train, measured on test: GRPO (its periodic evals), and the pipeline's parent run
TRAIN_TEST = {"train": "training", "test": "evaluation"}


def _grpo_on(cfg: RunConfig) -> bool:
    return cfg.grpo.enabled


def _control_on(cfg: RunConfig) -> bool:
    return cfg.grpo.enabled and cfg.control.enabled


STAGES: list[Stage] = [
    Stage("prepare_data", "prepare_data", KeyRule(("data", "task"), content=data_content), "tasks.prepare_data:body",
          command="prepare-data"),
    Stage("tokenizer", "tokenizer", KeyRule(("tokenizer",)), "tasks.tokenizer:body", {"data": "prepare_data"},
          enabled=lambda cfg: cfg.tokenizer.train, command="tokenizer", reads=TRAINS),
    Stage("sft", "sft", KeyRule(("model", "tokenizer", "sft"), unkeyed=SFT_UNKEYED, content=model_content),
          "tasks.sft:body", {"data": "prepare_data", "tokenizer": "tokenizer"}, command="sft",
          rank_body="tasks.sft:on_rank", plan="tasks.plan:plan_sft", report="tasks.pipeline:report_start", reads=TRAINS,
          pretrained=True),
    Stage("eval (sft)", "eval", EVAL_KEY, "tasks.eval:body", {"data": "prepare_data", "model": "sft"},
          plan="tasks.plan:plan_eval", report="tasks.pipeline:report_start_eval", reads=_evals, policy="model"),
    Stage("grpo", "grpo", KeyRule(("rollout", "grpo", "task"), unkeyed={
        "grpo.rounds": "more rounds continue from the last checkpoint (the result key counts them)",
        "grpo.checkpoint_every": "resume from any checkpoint is exact",
        "grpo.checkpoint_min_seconds": "resume from any checkpoint is exact",
        "grpo.sample_table_every": "how often sample tables are logged",
        "grpo.eval_every": "periodic evals observe the policy; they do not change its weights",
        "grpo.eval_examples": "periodic evals observe the policy",
        "grpo.pass_k": "periodic evals observe the policy",
        "grpo.deepspeed.timeout_s": "how long the launch may take",
        "rollout.sglang": "where and how servers run (ports, addresses, timeouts, memory), not what they sample",
    }, content=grpo_content, extends="grpo.rounds"),
          "tasks.grpo:body", {"data": "prepare_data", "sft": "sft"}, enabled=_grpo_on, command="grpo", task=False,
          rank_body="tasks.grpo:on_rank", plan="tasks.plan:plan_grpo", report="tasks.pipeline:report_grpo",
          reads=TRAIN_TEST, policy="sft"),
    Stage("eval (grpo)", "eval", EVAL_KEY, "tasks.eval:body", {"data": "prepare_data", "model": "grpo"},
          enabled=_grpo_on, plan="tasks.plan:plan_eval", report="tasks.pipeline:report_grpo_eval", reads=_evals,
          policy="model"),
    # the SFT-only control runs SFT's body (and so its key rule's fields)
    Stage("control", "control", KeyRule(("model", "sft", "control"), unkeyed=SFT_UNKEYED, content=model_content),
          "tasks.control:body", {"data": "prepare_data", "sft": "sft", "grpo": "grpo"}, enabled=_control_on,
          plan="tasks.plan:plan_control", reads=TRAINS, policy="sft"),
    Stage("eval (control)", "eval", EVAL_KEY, "tasks.eval:body", {"data": "prepare_data", "model": "control"},
          enabled=_control_on, command="eval", plan="tasks.plan:plan_eval", report="tasks.pipeline:report_control_eval",
          reads=_evals, policy="model"),
]


def load(ref: str) -> Callable[..., Any]:
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def row(name: str) -> Stage:
    for s in STAGES:
        if s.name == name:
            return s
    raise KeyError(f"no stage {name!r} in tasks/stages.py; the stages are {[s.name for s in STAGES]}")


def rules() -> dict[str, KeyRule]:
    """Each stage kind's key rule."""
    return {s.kind: s.key for s in STAGES}


def rule_for(stage: str) -> KeyRule:
    """The key rule of a kind or row name ("eval (grpo)" follows eval's rule)."""
    return of_kind(stage.split(" ")[0]).key


def kinds() -> list[str]:
    """Every folder kind, in the table's order: `--recompute`'s choices."""
    return list(dict.fromkeys(s.kind for s in STAGES))


def of_kind(kind: str) -> Stage:
    """The first row of a kind (rows of one kind share its key rule and bodies)."""
    for s in STAGES:
        if s.kind == kind:
            return s
    raise KeyError(f"no stage of kind {kind!r} in tasks/stages.py; the kinds are {kinds()}")


def commands() -> dict[str, Stage]:
    """CLI command -> the row its flow runs the pipeline up to."""
    return {s.command: s for s in STAGES if s.command}


def until_for(command: str) -> str | None:
    """The row a command runs the pipeline up to: None (all of it) for `speedrun` and the last row's."""
    row_ = commands().get(command)
    if command != "speedrun" and row_ is None:
        raise KeyError(f"no command {command!r}; the commands are {['speedrun', *commands()]}")
    return None if row_ is None or row_ is STAGES[-1] else row_.name


def until(name: str | None) -> list[Stage]:
    """The rows up to and including `name` (every row when None), in order."""
    if name is None:
        return list(STAGES)
    last = STAGES.index(row(name))
    return STAGES[:last + 1]


def resolved(cfg: RunConfig, until_row: str | None) -> Iterator[tuple[Stage, dict, str, str, Any]]:
    """Each enabled row up to `until_row` as a run would take it: (row, its inputs, its result key,
    its folder, its `tasks.keys.Where`, or None where that cannot be read: an unreachable s3:// root,
    a missing input file; the key and folder are then those the run would compute)."""
    from tasks.keys import resolve, result_key, stage_key
    from trainer import storage

    results: dict[str, dict | None] = {}
    for row_ in until(until_row):
        if not row_.enabled(cfg):
            continue
        inputs = row_.inputs_from(results)
        try:
            where = resolve(cfg, row_.kind, row_.key, inputs)
            key, folder = where.key, where.folder
        except Exception:  # the dry run reports these problems itself
            where, folder_key = None, stage_key(cfg, row_.kind, row_.key, inputs)
            key, folder = result_key(cfg, row_.key, folder_key), storage.join(cfg.artifact_root, row_.kind, folder_key)
        results[row_.name] = {"key": key}
        yield row_, inputs, key, folder, where


def check_servers(cfg: RunConfig, until_row: str | None) -> None:
    """Raises ConfigError when a row up to `until_row` would launch SGLang servers that cannot start
    on this machine, where their stage runs: before any stage, not at the first eval after SFT has
    trained. CPU servers: their interpreter (checked whatever is cached); GPU servers: a CUDA device,
    required only when a row that launches them has no committed result yet (a run whose server
    stages are all cached needs none, as a summary reprinted on a laptop does not)."""
    sg = cfg.rollout.sglang
    if not sg.launch or sg.urls:
        return
    rows = [r for r in until(until_row) if r.enabled(cfg)
            and (r.kind == "grpo" and cfg.rollout.engine == "sglang" or r.kind == "eval" and cfg.eval_engine() == "sglang")]
    if not rows:
        return
    from trainer.config import ConfigError
    from trainer.inference.sglang import check_server_python, has_cuda_device

    if sg.device == "cuda":
        if has_cuda_device():
            return  # the rest (the GPU environment) is checked where a stage launches them
        cached = {row.name for row, *_, where in resolved(cfg, until_row) if where and where.manifest is not None}
        if all(r.name in cached for r in rows):
            return
    problem = check_server_python(sg)
    if problem:
        raise ConfigError(problem)


def check_hosts(cfg: RunConfig, until_row: str | None, recompute: frozenset[str] = frozenset()) -> None:
    """Raises HostError when a training row up to `until_row` that will run (no committed result, or
    recomputed) launches its ranks on hosts of a hostfile that cannot run them: before any stage, not
    after an hour of SFT. A run whose launched stages are all cached needs none of the hosts."""
    from trainer import launch

    checked: set[tuple[str, ...]] = set()
    for row_, *_, where in resolved(cfg, until_row):
        ds = {"sft": cfg.sft.deepspeed, "control": cfg.sft.deepspeed, "grpo": cfg.grpo.deepspeed}.get(row_.kind)
        if ds is None or not ds.hostfile or ds.nodes < 2:
            continue
        if where is not None and where.manifest is not None and row_.name not in recompute:
            continue
        hosts = launch.placement(row_.kind, ds)
        if tuple(hosts) not in checked:
            launch.check_hosts(row_.kind, hosts, ds.interface)
            checked.add(tuple(hosts))


def downstream(recompute: list[str] | tuple[str, ...] | frozenset[str]) -> frozenset[str]:
    """The rows to recompute, by name: every row of a named kind, and every row that reads (through
    any number of rows) from one of those. Rows, not kinds: `--recompute grpo` recomputes the eval
    of the GRPO policy, not the eval of the SFT policy before it, though both are evals."""
    unknown = [k for k in recompute if k not in kinds()]
    if unknown:
        raise KeyError(f"recompute: no stage {unknown}; the stages are {kinds()}")
    tainted: set[str] = set()
    for s in STAGES:
        if s.kind in recompute or any(src in tainted for src in s.inputs.values()):
            tainted.add(s.name)
    return frozenset(tainted)
