"""sft stage: DeepSpeed supervised fine-tuning, then a save_pretrained export of the policy.

Run alone: `posttrain sft --preset tiny` (prepare_data and tokenizer come from cache).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tasks.runner import run_launched
from tasks.prepare_data import load_split
from tasks.tokenizer import tokenizer_dir
from trainer import storage

# what on_rank imports when it runs: a launcher that forks the ranks imports them once first
# (tasks/rank_main.py's preload)
RANK_IMPORTS = ("trainer.model", "trainer.sft", "trainer.tokenizer", "trainer.lora")


def train_and_export(cfg, data: dict, tokenizer: dict | None, work: Path, logger,
                     fault_at_step: int | None = None, label: str = "sft") -> dict:
    """The SFT stage's work on one rank: in this process, or on each rank under the launcher.
    `label` names the training in its progress (the control stage trains by SFT too)."""
    # torch and transformers load here, not at import: a fully cached run never needs them
    from trainer import engine as ds, lora
    from trainer.model import build_model, count_params, load_problem, resolve_pretrained
    from trainer.sft import train_sft
    from trainer.tokenizer import load_tokenizer

    if tokenizer:
        tok = load_tokenizer(tokenizer_dir(tokenizer))
    else:  # tokenizer.train: false, the model's own
        try:
            tok = load_tokenizer(resolve_pretrained(cfg.model.pretrained))
        except OSError as exc:
            raise load_problem(cfg.model.pretrained, exc, "the tokenizer of ") from None
    model = build_model(cfg.model, tok, cfg.seed)
    logger.log_params({"model.n_params": count_params(model)})
    if not cfg.sft.enabled:
        return export_pretrained(model, tok, work, logger)
    engine, result = train_sft(cfg, model, tok, load_split(data, "train"), work, logger, fault_at_step, label)
    if result.resumed_from_step is not None:
        logger.set_tags({"resumed_from_step": result.resumed_from_step})
    ds.export_model(engine, tok, work / "model", work / "adapter")
    metrics = {"sft/final_loss": result.final_loss, "sft/tokens_per_second": result.tokens_per_second,
               "sft/train_seconds": result.train_seconds, "sft/steps": result.steps,
               "sft/n_truncated": result.n_truncated, "sft/n_params": count_params(lora.inner(engine.module)),
               "sft/trainable_params": lora.trainable_params(engine.module), "sft/world_size": ds.world_size()}
    logger.log_metrics(metrics)
    # the model folder becomes the run's logged model (tasks.runner.log_policy, in the stage's process)
    out = {"metrics": metrics, "model_subdir": "model", "result": dataclasses.asdict(result)}
    if cfg.model.lora is not None:  # the merged model above, and the adapter that made it
        logger.log_artifact(work / "adapter", "adapter")  # a NullLogger off rank 0
        logger.set_tags({"posttrain.lora": f"merged ({cfg.model.lora.describe()}); adapter in adapter/"})
        out["adapter_subdir"] = "adapter"
    return out



def export_pretrained(model, tok, work: Path, logger) -> dict:
    """sft.enabled=false: the stage trains nothing and commits model.pretrained itself as the
    starting policy, so that eval, GRPO, the control and SGLang read it where they read SFT's."""
    from trainer import engine as ds
    from trainer.model import count_params

    model.save_pretrained(str(work / "model"), safe_serialization=True)
    tok.save_pretrained(str(work / "model"))
    metrics = {"sft/steps": 0, "sft/n_params": count_params(model)}
    logger.log_metrics(metrics)
    logger.set_tags({"posttrain.sft": "disabled: model.pretrained is the starting policy"})
    return {"metrics": metrics, "model_subdir": "model", "skipped": True,
            "result": {"steps": 0, "state_hash": ds.state_dict_hash(model), "resumed_from_step": None}}


def body(cfg, inputs: dict, ref, fault: dict):
    def compute(work: Path, logger) -> dict:
        if cfg.sft.deepspeed.launched and cfg.sft.enabled:
            return run_launched("sft", cfg, cfg.sft.deepspeed, work, ref, logger, {**inputs, "fault": fault.get("sft")})
        return train_and_export(cfg, inputs["data"], inputs["tokenizer"], work, logger, fault.get("sft"))

    return compute


def on_rank(cfg, inputs: dict, work: Path, logger) -> dict:
    """The body of a rank launched by the DeepSpeed launcher (the SFT-only control's too)."""
    return train_and_export(cfg, inputs["data"], inputs["tokenizer"], work, logger, inputs.get("fault"),
                            inputs.get("label", "sft"))


def model_dir(manifest: dict) -> Path:
    # the source run: which computation of that folder (a recompute at the same URL is a new download)
    return storage.local_dir(storage.join(manifest["uri"], manifest["model_subdir"]),
                             version=manifest.get("source_run_id"))
