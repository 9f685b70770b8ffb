"""Typed, frozen run configuration loaded from YAML presets in `configs/`.

Every model rejects unknown keys. `load_config(preset, overrides)` is the one entry point: it
reads the preset (a name under `configs/` or a path), applies dotted `key=value` overrides, and
validates the result, raising `ConfigError` that lists every problem with its field, value and fix.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from trainer.errors import InputError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"


class ConfigError(InputError):
    """A preset or override is invalid; the message names each field, value and fix."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SyntheticData(Strict):
    """GSM8K-style word problems generated locally (the embedded default's task)."""

    n_train: int = Field(20000, ge=1, description="training problems to generate")
    n_test: int = Field(500, ge=1, description="held-out problems to generate")
    min_ops: int = Field(1, ge=1, le=8, description="fewest arithmetic steps per problem")
    max_ops: int = Field(3, ge=1, le=8, description="most arithmetic steps per problem")
    digits: int = Field(1, ge=1, le=4, description="digits of each operand")
    ops: list[Literal["+", "-", "*"]] = Field(default_factory=lambda: ["+", "-", "*"], min_length=1)

    @model_validator(mode="after")
    def _ops_range(self) -> "SyntheticData":
        if self.min_ops > self.max_ops:
            raise ValueError(
                f"min_ops={self.min_ops} is above max_ops={self.max_ops}; set min_ops <= max_ops"
            )
        return self


class Fields(Strict):
    """Which columns of a real dataset hold what."""

    question: str = "question"
    answer: str = "answer"
    messages: str | None = Field(
        None, description="a chat-messages column; when set, question/answer are not used"
    )


class DataConfig(Strict):
    source: Literal["synthetic", "files", "hub"] = "synthetic"
    synthetic: SyntheticData = Field(default_factory=SyntheticData)
    train: str | None = Field(None, description="train file: local path or s3:// URI (jsonl/json/parquet)")
    test: str | None = Field(None, description="test file; if unset, test_size rows are split off train")
    hub_name: str | None = Field(None, description="datasets hub name, e.g. openai/gsm8k")
    hub_config: str | None = None
    hub_train_split: str = "train"
    hub_test_split: str | None = "test"
    fields: Fields = Field(default_factory=Fields)
    test_size: int = Field(500, ge=1, description="rows split off train when no test file is given")
    max_train: int | None = Field(None, ge=1)
    max_test: int | None = Field(None, ge=1)
    system_prompt: str | None = None
    on_bad_row: Literal["error", "skip"] = Field(
        "error", description="error: stop at the first malformed row; skip: drop and count it"
    )

    @model_validator(mode="after")
    def _source_fields(self) -> "DataConfig":
        if self.source == "files" and not self.train:
            raise ValueError("source=files needs data.train (a local path or s3:// URI)")
        if self.source == "hub" and not self.hub_name:
            raise ValueError("source=hub needs data.hub_name (for example openai/gsm8k)")
        return self


class TokenizerConfig(Strict):
    train: bool = Field(True, description="train a BPE tokenizer (from-scratch models only)")
    vocab_size: int = Field(384, ge=64, le=200_000)


class ModelConfig(Strict):
    pretrained: str | None = Field(
        None, description="local path, s3:// URI or hub name; unset builds a model from the fields below"
    )
    hidden_size: int = Field(128, ge=8)
    num_layers: int = Field(4, ge=1)
    num_heads: int = Field(4, ge=1)
    intermediate_size: int = Field(384, ge=8)
    max_position: int = Field(256, ge=16)
    dtype: Literal["float32", "bfloat16"] = "float32"

    @model_validator(mode="after")
    def _heads(self) -> "ModelConfig":
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}; "
                "pick num_heads that divides hidden_size"
            )
        return self


class DeepSpeedConfig(Strict):
    zero_stage: Literal[0, 1, 2, 3] = 1
    precision: Literal["fp32", "bf16"] = "fp32"
    world_size: int = Field(1, ge=1, description="ranks for the DeepSpeed launcher")


class SFTConfig(Strict):
    lr: float = Field(3e-3, gt=0, le=1.0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(30, ge=0)
    micro_batch_size: int = Field(64, ge=1)
    grad_accum: int = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1, description="stop after this many optimizer steps")
    max_seconds: float | None = Field(120.0, gt=0, description="time budget; the LR schedule spans the planned steps")
    epochs: float = Field(1.0, gt=0)
    max_length: int = Field(128, ge=8)
    grad_clip: float = Field(1.0, gt=0)
    checkpoint_every: int = Field(200, ge=1, description="optimizer steps between DeepSpeed checkpoints")
    log_every: int = Field(10, ge=1)
    deepspeed: DeepSpeedConfig = Field(default_factory=DeepSpeedConfig)

    @model_validator(mode="after")
    def _budget(self) -> "SFTConfig":
        if self.max_steps is None and self.max_seconds is None and self.epochs is None:
            raise ValueError("set at least one of sft.max_steps, sft.max_seconds, sft.epochs")
        return self


class EvalConfig(Strict):
    max_examples: int | None = Field(None, ge=1, description="evaluate on the first N held-out rows")
    max_new_tokens: int = Field(64, ge=1)
    batch_size: int = Field(256, ge=1)


class TrackingConfig(Strict):
    experiment: str = "posttrain"


class RunConfig(Strict):
    name: str = "tiny"
    seed: int = 0
    artifact_root: str = Field("artifacts", description="local path or s3://bucket/prefix")
    data: DataConfig = Field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)

    @model_validator(mode="after")
    def _tokenizer_needs_scratch_model(self) -> "RunConfig":
        if self.model.pretrained and self.tokenizer.train:
            raise ValueError(
                "tokenizer.train=true with model.pretrained set: a pretrained model uses its own "
                "tokenizer; set tokenizer.train=false"
            )
        return self

    def section_hash(self, *names: str) -> str:
        """Stable hash of the named config sections (part of a stage's cache key)."""
        payload = {n: _dump(getattr(self, n)) for n in names}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def _dump(value: Any) -> Any:
    return value.model_dump(mode="json") if isinstance(value, BaseModel) else value


def preset_path(preset: str) -> Path:
    """A preset name (`tiny`) or a path to a YAML file."""
    path = Path(preset)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise ConfigError(f"preset file {preset!r} does not exist; pass an existing YAML path")
        return path
    candidate = CONFIGS_DIR / f"{preset}.yaml"
    if not candidate.is_file():
        known = sorted(p.stem for p in CONFIGS_DIR.rglob("*.yaml"))
        raise ConfigError(f"unknown preset {preset!r}; choose one of {known} or pass a YAML path")
    return candidate


def parse_override(text: str) -> tuple[list[str], Any]:
    """`sft.lr=1e-3` -> (["sft", "lr"], 0.001). Values are parsed as YAML scalars/lists."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} has no '='; write it as section.field=value")
    key, raw = text.split("=", 1)
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise ConfigError(f"override {text!r} has an empty key; write it as section.field=value")
    return parts, yaml.safe_load(raw) if raw.strip() else None


def apply_overrides(raw: dict[str, Any], overrides: list[str] | dict[str, Any]) -> dict[str, Any]:
    items = overrides.items() if isinstance(overrides, dict) else (parse_override(o) for o in overrides)
    out = json.loads(json.dumps(raw))
    for key, value in items:
        parts = key.split(".") if isinstance(key, str) else key
        node = out
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {'.'.join(parts)}: {part!r} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return out


def validate_config(raw: dict[str, Any], source: str = "config") -> RunConfig:
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source)) from None


def format_validation_error(exc: ValidationError, source: str) -> str:
    lines = [f"{source}: {exc.error_count()} invalid setting(s):"]
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "(top level)"
        value = err.get("input")
        if err["type"] == "extra_forbidden":
            lines.append(f"  - {field}: unknown key; remove it or check its spelling")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"  - {field} = {value!r}: {msg}")
    return "\n".join(lines)


def load_config(preset: str = "tiny", overrides: list[str] | dict[str, Any] | None = None) -> RunConfig:
    """Read a preset, apply overrides, validate. Raises ConfigError."""
    path = preset_path(preset)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc}); fix the syntax") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections, got {type(raw).__name__}")
    raw = apply_overrides(raw, overrides or [])
    return validate_config(raw, source=str(path))
