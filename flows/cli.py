"""`posttrain` command line: run the speedrun or any single stage as a Prefect flow.

    posttrain speedrun --preset tiny
    posttrain sft --preset tiny --set sft.lr=1e-3 --set sft.max_steps=200
    posttrain speedrun --recompute sft                # ignore SFT's cached result (and what follows it)
    posttrain config --preset qwen2.5-0.5b-gsm8k      # print the resolved config
    posttrain speedrun --preset qwen2.5-0.5b-gsm8k --dry-run   # check paths, print the launch plan
    posttrain compare                                 # latest nightly vs the best earlier nightly
    posttrain compare --run RUN --baseline OTHER      # any two runs: metrics, and held-out answers paired
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import sys
import time
from pathlib import Path

# Prefect reads its settings at import: route the ML core's std logging into the flow-run logs.
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "trainer")
# Prefect's temporary server phones home at start; offline that costs a DNS time-out.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")

from tasks import stages  # noqa: E402
from tasks.sources import is_model_uri, lookup  # noqa: E402
from trainer.config import ConfigError, load_config  # noqa: E402
from trainer.errors import InputError  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="posttrain", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    kinds = stages.kinds()
    for name in ["speedrun", *stages.commands(), "config"]:
        sp = sub.add_parser(name, help=f"run the {name} flow" if name != "config" else "print the resolved config")
        sp.add_argument("--preset", default="tiny", help="preset name under configs/ or a YAML path")
        sp.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="dotted override, e.g. sft.lr=1e-3 (repeatable)")
        if name != "config":
            sp.add_argument("--recompute", action="append", default=[], choices=kinds, metavar="STAGE",
                            help=f"recompute STAGE and every stage that reads from it despite the cache; one of {kinds}")
            sp.add_argument("--json", dest="json_out", metavar="PATH",
                            help="also write the run's result as JSON (-: to standard output, the summary then "
                                 "to standard error)")
            sp.add_argument("--dry-run", action="store_true",
                            help="resolve the config, check its paths and print the launch plan; run nothing")
        if name == "speedrun":
            sp.add_argument("--nightly", action="store_true",
                            help="tag the run as a nightly and compare it with the best earlier nightly")
    cp = sub.add_parser("compare", help="a run (default: the latest nightly) vs another (default: the best earlier "
                                        "nightly), held-out answers paired")
    cp.add_argument("--run", dest="run_id", help="MLflow run id of a speedrun (default: the latest nightly)")
    cp.add_argument("--baseline", dest="baseline_id",
                    help="MLflow run id of the run to compare with (default: the best earlier nightly)")
    cp.add_argument("--experiment", default="posttrain", help="MLflow experiment (default: posttrain)")
    return p


def print_summary(result: dict, seconds: float, temporary_prefect: bool = True) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title="posttrain summary")
    for col in ("stage", "status", "wall s", "key metric"):
        table.add_column(col)
    for s in result["stages"]:
        m = s["metrics"]
        metric = next((f"{k}={v:.4g}" for k, v in m.items()
                       if k in ("eval/accuracy", "sft/tokens_per_second", "data/n_train", "tokenizer/vocab_size",
                                "grpo/rounds")), "")
        table.add_row(s["label"], "cache hit" if s["cache_hit"] else "ran", f"{s['wall_seconds']:.1f}", metric)
    console.print(table)
    hits = sum(s["cache_hit"] for s in result["stages"])
    console.print(f"stages: {len(result['stages'])} ({hits} cache hits, {len(result['stages']) - hits} ran)")
    from tasks.report import accuracy_lines

    if result.get("task", "math") != "math" or result.get("grader", "math") != "math":
        console.print(f"task: {result['task']} (grader {result['grader']}): every accuracy below is its verdict",
                      markup=False, highlight=False, soft_wrap=True)
    for line in accuracy_lines(result["headline"]):
        console.print(line, markup=False, highlight=False)
    for k, v in result["headline"].items():
        if k != "wall_seconds" and not (k == "start_accuracy" and "sft_accuracy" in result["headline"]):
            console.print(f"{k}: {v:.1%}" if "accuracy" in k else f"{k}: {v:.4g}")
    grpo = next((s for s in result["stages"] if s["stage"] == "grpo"), None)
    if grpo and not grpo["cache_hit"]:
        console.print(f"grpo wall time: {grpo['wall_seconds']:.1f}s over {grpo['metrics'].get('grpo/rounds', 0):.0f} rounds")
    skipped = (grpo or {}).get("metrics", {}).get("grpo/skipped_updates", 0)
    if skipped:
        console.print(f"grpo: {skipped:.0f} of {grpo['metrics'].get('grpo/rounds', 0):.0f} rounds did not update the "
                      "policy: no sample was left to train on (a group whose rewards all agree, all right or all "
                      "wrong, is filtered out, as are samples with a bad reward); see update/skipped in MLflow")
    console.print(f"wall time: {seconds:.1f}s")
    if result.get("registered_model"):
        console.print(f"registered model: {result['registered_model']} (MLflow Model Registry)")
    if result.get("comparison"):
        console.print("against the best earlier nightly:")
        console.print(result["comparison"], markup=False, highlight=False)
    from tasks.pipeline import mlflow_models_url, mlflow_ui_urls

    table, page = mlflow_ui_urls(result["mlflow_experiment_id"], result["mlflow_run_id"])
    plain = {"markup": False, "highlight": False, "soft_wrap": True}  # ids and URLs whole, never wrapped
    console.print(f"MLflow run: {result['mlflow_run_id']}    Prefect flow run: {result['flow_run_id']}", **plain)
    console.print(f"MLflow runs table: {table}", **plain)
    console.print(f"this run:          {page}", **plain)
    console.print(f"policies (models): {mlflow_models_url(result['mlflow_experiment_id'])}", **plain)
    for line in where_to_look(result["flow_run_id"], temporary_prefect):
        console.print(line, **plain)


def _shown(path: Path) -> str:
    """A path as the user types it from here: relative under the working folder, else absolute."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def where_to_look(flow_run_id: str | None, temporary_prefect: bool) -> list[str]:
    """How to open this run in the MLflow and Prefect UIs, from wherever the command ran: the
    interpreter's own `mlflow` and `prefect`, a SQLite store by its absolute path, and `make serve`
    only where it shows this run (it opens the clone's store and keeps Prefect's state apart)."""
    from prefect.settings import get_current_settings

    from deployments.serve import ROOT
    from tasks.tracking import tracking_uri

    bin_dir, uri, lines = Path(sys.executable).parent, tracking_uri(), []
    serve = "make serve" if Path.cwd().resolve() == ROOT else f"make -C {ROOT} serve"
    if uri.startswith("sqlite:///"):
        path = Path(uri[len("sqlite:///"):]).expanduser()
        served = path.resolve() == (ROOT / path).resolve()  # `make serve` opens the same URI from the clone
        ui = f"{_shown(bin_dir / 'mlflow')} ui --backend-store-uri sqlite:///{_shown(path.resolve())} --port 5000"
        same = " with this MLFLOW_TRACKING_URI" if "MLFLOW_TRACKING_URI" in os.environ else ""
        lines.append(f"  (served by `{serve}`{same}, or: {ui})" if served else f"  (served by: {ui})")
    elif not uri.startswith(("http://", "https://")):
        lines.append(f"  (served by: {_shown(bin_dir / 'mlflow')} ui --backend-store-uri {uri} --port 5000)")
    settings = get_current_settings()
    page = f"runs/flow-run/{flow_run_id}" if flow_run_id else ""
    own = settings.ui_url or (settings.api.url or "").rstrip("/").removesuffix("/api")
    if own and not temporary_prefect:  # a Prefect server of the user's own
        lines.append(f"Prefect:           {own.rstrip('/')}/{page}")
        return lines
    lines.append(f"Prefect:           {_shown(bin_dir / 'prefect')} server start, then http://127.0.0.1:4200/{page}"
                 f"   (its state: {settings.home})")
    if "PREFECT_HOME" in os.environ:  # `make serve` keeps its Prefect state there too
        lines.append(f"or both, with the deployments and a worker: {serve}")
    else:
        lines.append(f"{serve}: the MLflow UI, and Prefect with the deployments and a worker; its Prefect keeps "
                     f"its own state ({_shown(ROOT / '.serve' / 'prefect')}), with the runs started from it")
    return lines


def compare(args) -> int:
    from mlflow import MlflowClient

    from tasks.tracking import tracking_uri
    from tasks.report import compare as compare_runs

    client = MlflowClient(tracking_uri=tracking_uri())
    try:
        print(compare_runs(client, args.experiment, args.run_id, args.baseline_id).text())
    except InputError as exc:
        print(f"posttrain: {exc}", file=sys.stderr)
        return 2
    return 0


def _check_json_out(path: str) -> None:
    """--json PATH can be written once the run ends: its folder is made now (a run is not spent to
    find it cannot be), and PATH is not a folder."""
    from trainer.storage import folder_problem

    target = Path(path).absolute()
    if target.is_dir():
        raise ConfigError(f"--json {path}: is a folder; name a file (e.g. {target / 'result.json'})")
    problem = folder_problem(target.parent)
    if problem is None:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            problem = f"cannot make {target.parent} ({exc.strerror or exc})"
    if problem:
        raise ConfigError(f"--json {path}: {problem}; name a file in a folder you can write in")


INTERRUPTED = ("The stages that finished are cached, and a stage cut short keeps its last checkpoint "
               "(sft.checkpoint_every, grpo.checkpoint_every): run the same command again to go on from there.")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "compare":
        return compare(args)
    try:
        cfg = load_config(args.preset, args.overrides)  # fail fast, before any server starts
        from trainer import preflight

        preflight.check(cfg)
    except ConfigError as exc:
        print(f"posttrain: {exc}", file=sys.stderr)
        return 2
    if args.command == "config":
        import yaml

        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
        return 0
    if args.dry_run:
        from tasks.plan import dry_run

        text, problems = dry_run(cfg, stages.until_for(args.command))
        print(text)
        return 2 if problems else 0
    try:
        if is_model_uri(cfg.model.pretrained):  # a models:/ URI the store does not have: said before the flow runs
            from tasks.tracking import mlflow_client, tracking_uri

            lookup(mlflow_client(tracking_uri()), cfg.model.pretrained)
        stages.check_servers(cfg, stages.until_for(args.command))
        if args.json_out and args.json_out != "-":
            _check_json_out(args.json_out)
        preflight.check_root(cfg)
    except InputError as exc:
        print(f"posttrain: {exc}", file=sys.stderr)
        return 2
    to_stdout = args.json_out == "-"
    try:
        with _stdout_to_stderr(to_stdout):
            result = _run(args)
    except KeyboardInterrupt:  # Ctrl-C: the flow run is marked crashed and the MLflow runs killed on the way out
        print(f"\nposttrain: interrupted. {INTERRUPTED}", file=sys.stderr)
        return 130
    if result is None:
        return 2
    if to_stdout:  # the result alone on standard output, for a pipe (`| jq .headline`)
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
        sys.stdout.flush()
    gc.freeze()  # nothing left needs collecting: saves ~1 s of garbage collection at interpreter exit
    return 0


class _NoTracebackForInputErrors(logging.Filter):
    """Prefect logs a failed task's and flow's exception with its traceback, twice. An InputError
    (a bad row, file or setting) already names where and the fix, and the CLI prints it last: its
    tracebacks would push that line ~100 lines down. Other exceptions keep theirs."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], InputError):
            record.exc_info, record.exc_text = None, None
        return True


def _quiet_input_errors() -> None:
    for name in ("prefect.task_runs", "prefect.flow_runs"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoTracebackForInputErrors) for f in logger.filters):
            logger.addFilter(_NoTracebackForInputErrors())


def _run(args) -> dict | None:
    """The command's flow on its Prefect server, its --json file and summary: the result, or None
    after printing the user's error."""
    from flows import prefect_server

    _quiet_input_errors()

    t0 = time.perf_counter()
    server = prefect_server.start_early()  # its start-up overlaps the imports below
    from flows.speedrun import flow_for

    prefect_server.confirm(server)
    kwargs = {"nightly": True} if getattr(args, "nightly", False) else {}
    try:
        if server is not None:
            from tasks.pipeline import warm_up

            warm_up()  # meanwhile the server starts
        prefect_server.wait(server)
        result = flow_for(args.command)(preset=args.preset, overrides=args.overrides, recompute=args.recompute, **kwargs)
    except InputError as exc:
        print(f"posttrain: {exc}", file=sys.stderr)
        return None
    if args.json_out and args.json_out != "-":  # whole or not at all
        part = Path(args.json_out).with_name(f".{Path(args.json_out).name}.{os.getpid()}.part")
        part.write_text(json.dumps(result, indent=2))
        part.replace(args.json_out)
    print_summary(result, time.perf_counter() - t0, temporary_prefect=server is not None)
    return result


@contextlib.contextmanager
def _stdout_to_stderr(active: bool):
    """With `--json -` standard output holds the result alone: while the run runs, all it prints
    (posttrain's progress, DeepSpeed's notices, the ranks' output) goes to standard error, by file
    descriptor and in Python."""
    if not active:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 1)
        os.close(saved)


if __name__ == "__main__":
    sys.exit(main())
