"""Typed, frozen run configuration loaded from YAML presets in `configs/`.

Every model rejects unknown keys. `load_config(preset, overrides)` is the one entry point: it
reads the preset (a name under `configs/` or a path), applies dotted `key=value` overrides, and
validates the result, raising `ConfigError` that lists every problem with its field, value and fix.
A custom environment class is imported and checked where the run starts
(`trainer.rl.envs.check_environment`), not here: this module imports nothing of the rest of posttrain.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from trainer.errors import InputError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"


class ConfigError(InputError):
    """A preset or override is invalid; the message names each field, value and fix."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SyntheticData(Strict):
    """Problems generated locally: GSM8K-style word problems (the embedded default's task), or, with
    family=code, functions to write that compute the same kind of arithmetic chain."""

    family: Literal["math", "code"] = Field(
        "math", description="math: word problems answered '#### n'; code: 'Write a Python function f(x) that "
        "adds 3 to x, then ...' answered by a fenced function, graded by its hidden tests (task.grader=code)")
    n_train: int = Field(20000, ge=1, description="training problems to generate")
    n_test: int = Field(500, ge=1, description="held-out problems to generate")
    min_ops: int = Field(1, ge=1, le=8, description="fewest arithmetic steps per problem")
    max_ops: int = Field(3, ge=1, le=8, description="most arithmetic steps per problem")
    digits: int = Field(1, ge=1, le=4, description="digits of each operand")
    ops: list[Literal["+", "-", "*"]] = Field(default_factory=lambda: ["+", "-", "*"], min_length=1)
    worked_fraction: float = Field(
        1.0, ge=0.0, le=1.0,
        description="share of training answers that show their worked steps; the rest give only "
        "'#### n', as terse answers do in real SFT data (code: one statement a step; the rest return one "
        "expression)",
    )
    tool_fraction: float = Field(
        0.0, ge=0.0, le=1.0,
        description="share of training answers that call the calculator tool (one call with the whole "
        "expression, the tool's answer, then '#### n'); the prompts do not describe the tool "
        "(rollout.environment.describe_tools=false): SFT shows it",
    )
    held_out_fraction: float = Field(
        0.2, gt=0.0, lt=1.0,
        description="share of distinct equations (start value, operations, operands) kept out of "
        "training for the held-out set; no held-out equation is ever trained on",
    )

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
    train: str | None = Field(None, description="train file: local path or s3:// URI (jsonl/json/parquet/csv/tsv)")
    test: str | None = Field(None, description="test file; if unset, test_size rows are split off train")
    hub_name: str | None = Field(None, description="datasets hub name, e.g. openai/gsm8k")
    hub_config: str | None = None
    hub_train_split: str = "train"
    hub_test_split: str | None = "test"
    fields: Fields = Field(default_factory=Fields)
    test_size: int = Field(500, ge=1, description="rows split off train when no test file is given")
    max_train: int | None = Field(None, ge=1)
    max_test: int | None = Field(None, ge=1)
    test_sample: int | None = Field(
        None, ge=1, description="evaluate on this many test rows drawn once by seed (kept in file order; the "
        "prepared test split lists them), not the first max_test")
    dev_size: int = Field(
        0, ge=0, description="training rows drawn by seed and set aside as a dev split: never trained on, "
        "whichever split the evals read (choose settings on them, not on the test split)")
    held_out: Literal["test", "dev"] = Field(
        "test", description="what every eval scores: the test split, or the dev split (data.dev_size rows "
        "carved from train; the test file is then not read)")
    system_prompt: str | None = None
    calculator_annotations: Literal["keep", "strip", "tool"] = Field(
        "keep", description="GSM8K-style '<<48/2=24>>' in answers: keep them in the SFT targets, strip them, or "
        "make each a calculator call (the answer up to it ends in a tool call, the tool answers, the answer "
        "goes on): what rollout.environment.name=calculator plays"
    )
    on_bad_row: Literal["error", "skip"] = Field(
        "error", description="error: stop at the first malformed row; skip: drop and count it"
    )

    @model_validator(mode="after")
    def _source_fields(self) -> "DataConfig":
        if self.source == "files" and not self.train:
            raise ValueError("source=files needs data.train (a local path or s3:// URI)")
        if self.source == "hub" and not self.hub_name:
            raise ValueError("source=hub needs data.hub_name (for example openai/gsm8k)")
        if self.held_out == "dev" and not self.dev_size:
            raise ValueError("data.held_out=dev needs data.dev_size (how many training rows to set aside as the "
                             "dev split)")
        if self.source == "synthetic" and (self.dev_size or self.test_sample):
            raise ValueError("data.dev_size and data.test_sample are for data from files or the hub; synthetic "
                             "problems are held out by equation (data.synthetic.n_test)")
        return self


class TokenizerConfig(Strict):
    train: bool = Field(True, description="train a BPE tokenizer (from-scratch models only)")
    vocab_size: int = Field(384, ge=64, le=200_000)
    added_tokens: list[str] = Field(default_factory=list, description="strings kept whole, one token each, and "
                                    "kept in decoded text (e.g. <tool_call>, </tool_call>, <|tool|>)")


class LoRAConfig(Strict):
    """Low-rank adapters (peft) on the policy: the optimizer and checkpoints hold the adapters, the base
    stays frozen; the stage's result is the merged model plus the adapter (trainer.lora)."""

    rank: int = Field(8, ge=1, description="the adapters' rank r (LoRA Without Regret: rank 1 already learns RL)")
    alpha: float = Field(32.0, gt=0, description="the adapters' scale is alpha / rank (32, LoRA Without Regret's: "
                         "with it the best learning rate is about 10x full fine-tuning's at every rank)")
    dropout: float = Field(0.0, ge=0, lt=1.0, description="dropout on the adapters' input while training")
    target_modules: str | list[str] = Field(
        "all-linear", description="all-linear (every linear layer but the output head), or the layers' names "
        "(q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj on Llama and Qwen)")
    merge: bool = Field(
        True, description="the rollout engine generates with the adapters merged into the weights (in place "
        "for the in-process engine, a merged export for SGLang); false: the in-process engine computes the "
        "adapters at every token (slower, the base never touched), and SGLang cannot be used")

    def describe(self) -> str:
        """One line for the dry run, MLflow tags and registry versions."""
        targets = self.target_modules if isinstance(self.target_modules, str) else ",".join(self.target_modules)
        return f"rank {self.rank}, alpha {self.alpha:g}, dropout {self.dropout:g}, {targets}"

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list) and (not v or not all(isinstance(x, str) and x for x in v)):
            raise ValueError("give all-linear or a non-empty list of layer names, e.g. [q_proj, v_proj]")
        if isinstance(v, str) and v != "all-linear":  # a regular expression over the layers' full names (peft's)
            import re

            try:
                re.compile(v)
            except re.error as exc:
                raise ValueError(f"not a regular expression ({exc}); give all-linear, a list of layer names "
                                 "(e.g. [q_proj, v_proj]) or a pattern such as '.*(q|v)_proj'") from None
        return v


MLFLOW_MODEL_PREFIX = "models:/"  # model.pretrained: an MLflow model, which the pipeline downloads (tasks/sources.py)


def is_mlflow_model(ref: str | None) -> bool:
    return bool(ref) and ref.startswith(MLFLOW_MODEL_PREFIX)


class ModelConfig(Strict):
    pretrained: str | None = Field(
        None, description="local folder, s3:// URI, .gguf file (local or s3://, converted once to a cached "
        "safetensors folder), MLflow model (models:/<name>/<version>, models:/<name>@<alias>, models:/<id>) "
        "or hub name; unset builds a model from the fields below"
    )
    hidden_size: int = Field(128, ge=8)
    num_layers: int = Field(4, ge=1)
    num_heads: int = Field(4, ge=1)
    intermediate_size: int = Field(384, ge=8)
    max_position: int = Field(256, ge=16)
    dtype: Literal["float32", "bfloat16"] = "float32"
    tf32: bool = Field(
        False, description="on a CUDA GPU (Ampere or later) every stage's float32 matrix products (training, "
        "rollouts, evals) take TF32 tensor cores: several times faster, each product's inputs rounded to 10 "
        "mantissa bits, sums still in float32, so the numbers change; no effect on a CPU, on bfloat16 products "
        "or on SGLang's servers. Off: exact float32 products, torch's default")
    lora: LoRAConfig | None = Field(
        None, description="LoRA adapters for every training stage (SFT, GRPO, the control); unset: full "
        "fine-tuning")

    @model_validator(mode="after")
    def _heads(self) -> "ModelConfig":
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}; "
                "pick num_heads that divides hidden_size"
            )
        return self


class DeepSpeedConfig(Strict):
    """How a training stage runs: in this process (one rank), or under the DeepSpeed launcher."""

    zero_stage: Literal[0, 1, 2, 3] = 1
    precision: Literal["fp32", "bf16"] = "fp32"
    ranks_per_node: int = Field(
        1, ge=1, description="ranks per machine (the launcher's --num_gpus); above 1 the stage runs under "
        "the DeepSpeed launcher, one process per rank")
    nodes: int = Field(1, ge=1, description="machines; above 1 needs hostfile (the launcher's --num_nodes)")
    hostfile: str | None = Field(None, description="DeepSpeed hostfile ('host slots=N' per line) for several nodes")
    master_port: int | None = Field(None, ge=1024, le=65535, description="rendezvous port; unset picks a free one")
    master_addr: str | None = Field(
        None, description="several machines: rank 0's address, which the others connect to; unset: this machine's "
        "address on `interface`, else the first address `hostname -I` gives (DeepSpeed's runner)")
    interface: str | None = Field(
        None, description="several machines: the network interface the ranks' collectives use (GLOO_SOCKET_IFNAME "
        "and NCCL_SOCKET_IFNAME on every rank); unset: what the host's name resolves to")
    collective_timeout_s: float = Field(
        600.0, gt=0, description="a collective (or the rendezvous) that waits this long on another rank fails: how "
        "long a lost host or a dead rank can hold up the stage (more than its longest step on one rank alone: "
        "rank 0's evals and checkpoint uploads)")
    timeout_s: float | None = Field(
        None, gt=0, description="kill the launched ranks and fail the task after this many seconds")

    @property
    def world_size(self) -> int:
        return self.ranks_per_node * self.nodes

    @property
    def launched(self) -> bool:
        """True when the stage runs under the DeepSpeed launcher rather than in this process."""
        return self.world_size > 1 or self.hostfile is not None

    @model_validator(mode="after")
    def _nodes(self) -> "DeepSpeedConfig":
        if self.nodes > 1 and not self.hostfile:
            raise ValueError(f"nodes={self.nodes} needs hostfile (a DeepSpeed hostfile listing the machines)")
        return self


class SFTConfig(Strict):
    enabled: bool = Field(True, description="false: no SFT; GRPO, the evals and the control start from "
                          "model.pretrained as it is (the common recipe from an instruct model)")
    lr: float = Field(3e-3, gt=0, le=1.0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(30, ge=0)
    micro_batch_size: int = Field(64, ge=1)
    grad_accum: int = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1, description="stop after this many optimizer steps")
    max_seconds: float | None = Field(120.0, gt=0, description="time budget; the LR schedule spans the planned steps")
    epochs: float = Field(1.0, gt=0)
    max_length: int = Field(128, ge=8)
    packing: bool = Field(True, description="pack each micro-batch's examples into rows of up to max_length "
                          "tokens, each attending only to itself (same loss and gradients, no padding "
                          "computed); Llama, Mistral, Qwen2 and Qwen3 only, others are padded")
    grad_clip: float = Field(1.0, gt=0)
    checkpoint_every: int = Field(200, ge=1, description="optimizer steps between DeepSpeed checkpoints")
    log_every: int = Field(10, ge=1)
    deepspeed: DeepSpeedConfig = Field(default_factory=DeepSpeedConfig)

    @model_validator(mode="after")
    def _budget(self) -> "SFTConfig":
        if self.max_steps is None and self.max_seconds is None and self.epochs is None:
            raise ValueError("set at least one of sft.max_steps, sft.max_seconds, sft.epochs")
        return self


class SGLangConfig(Strict):
    """SGLang servers for rollouts: connect to `urls`, or launch `num_servers` of them.

    Launched servers run from their own interpreter (`python`; by default the environment that
    `make sglang-env` builds), since SGLang pins torch and transformers versions of its own."""

    urls: list[str] = Field(default_factory=list, description="running servers, e.g. http://10.0.0.5:30000")
    launch: bool = Field(True, description="start servers with python -m sglang.launch_server when urls is empty")
    python: str | None = Field(
        None, description="interpreter that runs launched servers; unset: the SGLang environment built by "
        "`make sglang-env` (its path is printed by `python -m deployments.sglang_env path`)")
    device: Literal["cuda", "cpu"] = Field(
        "cuda", description="cpu runs SGLang's CPU mode (SGLANG_USE_CPU_ENGINE=1, --device cpu): slow, for tests "
        "and machines without a GPU")
    host: str = Field("127.0.0.1", description="address launched servers bind to")
    num_servers: int = Field(1, ge=1)
    base_port: int = Field(30000, ge=1024, le=65535, description="launched servers take the first free ports "
                           "from here up (another run's servers hold theirs)")
    gpus_per_server: int = Field(1, ge=1)
    first_gpu: int = Field(0, ge=0, description="server i uses GPUs first_gpu + i*gpus_per_server onwards, "
                           "counted in the CUDA_VISIBLE_DEVICES list the run inherits (physical numbers when "
                           "unset); put them after the training ranks' GPUs (0..ranks_per_node-1) on a shared machine")
    mem_fraction_static: float = Field(0.5, gt=0, le=1)
    max_total_tokens: int | None = Field(
        None, ge=256, description="KV-cache size in tokens (--max-total-tokens); unset lets SGLang size it from "
        "memory, except on device=cpu, where it is 8192 (SGLang would reserve about 14 GB)")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment variables for launched servers")
    cpus: list[int] = Field(default_factory=list, description="cores launched servers are pinned to (their "
                            "threads included); empty: the cores this process may use. In CPU mode several "
                            "servers split them, each its own contiguous share")
    extra_args: list[str] = Field(default_factory=list)
    startup_timeout_s: float = Field(600.0, gt=0)
    request_timeout_s: float = Field(600.0, gt=0, description="a /generate or weight update taking longer fails "
                                     "the round, naming the server")
    weight_sync: Literal["disk", "tensor", "store"] = Field(
        "disk", description="how each round's weights reach the servers: disk (a save_pretrained folder, "
        "update_weights_from_disk) or tensor (update_weights_from_tensor: the tensors in shared memory, no folder; "
        "servers on this machine only; measured slower in CPU mode, not yet run on GPUs: docs/gpu.md) or store "
        "(servers on other machines, each behind posttrain's front, python -m trainer.inference.rollout_host: "
        "the folder goes through the artifact store, an s3:// artifact_root; docs/cluster.md)")


BUILTIN_ENVIRONMENTS = ("calculator", "single_turn")  # built by trainer/rl/envs.py (a test checks the two agree)


class EnvironmentConfig(Strict):
    """What a rollout is an episode of (trainer/rl/envs.py): one answer, or turns with tools."""

    name: str = Field("single_turn", description="single_turn | calculator | package.module:Class (a subclass "
                      "of trainer.rl.envs.Environment, or a TRL-style class whose public methods are tools)")
    max_turns: int = Field(4, ge=1, description="policy turns per episode (single_turn: always 1)")
    max_tokens: int | None = Field(None, ge=1, description="tokens after the prompt, the policy's and the "
                                   "environment's together; unset: max_response_tokens x max_turns")
    tool_timeout_s: float = Field(1.0, gt=0, description="a tool call running longer answers with an error")
    describe_tools: bool = Field(True, description="render the tools into the prompt (through the chat template "
                                 "when it renders tools, else as a system message); false: the policy knows its "
                                 "tools from its SFT data, and prompts stay as the data has them")
    options: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for a custom class")

    @property
    def multi_turn(self) -> bool:
        return self.name != "single_turn"

    def token_budget(self, per_turn: int) -> int:
        """Tokens after the prompt an episode may hold: max_tokens, else `per_turn` x max_turns."""
        return self.max_tokens or per_turn * self.max_turns

    @model_validator(mode="after")
    def _named(self) -> "EnvironmentConfig":
        # The name's shape only: importing a custom class and checking it is trainer/rl/envs.py's
        # `check_environment`, which the CLI and the flows call once the config has loaded.
        module, sep, attr = self.name.partition(":")
        if self.name not in BUILTIN_ENVIRONMENTS and not (sep and module and attr):
            raise ValueError(f"rollout.environment.name={self.name!r}: use {list(BUILTIN_ENVIRONMENTS)} or "
                             "'package.module:Class'")
        return self


MAX_ASYNC_STEPS = 4  # rollout.async_steps at most: batches in flight and in each checkpoint


class RolloutConfig(Strict):
    engine: Literal["hf", "sglang"] = Field("hf", description="hf: in-process, shares the policy's weights")
    prompts_per_round: int = Field(16, ge=1)
    n_samples_per_prompt: int = Field(8, ge=1)
    over_sample: float = Field(1.5, ge=1.0, description="generate this many times prompts_per_round groups")
    dynamic_filter: Literal["none", "nonzero_std"] = Field(
        "nonzero_std", description="nonzero_std drops groups whose rewards all agree (no learning signal)")
    max_prompt_tokens: int = Field(256, ge=1, description="longer prompts are skipped and counted")
    max_response_tokens: int = Field(48, ge=1)
    min_response_tokens: int = Field(0, ge=0, description="end-of-sequence is not sampled before this many new "
                                     "tokens (benchmarks: fixed-length completions)")
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    batch_size: int = Field(512, ge=1, description="sequences per generate call: the unit the ranks share out "
                            "(with N ranks keep it at most a round's sequences / N)")
    sglang: SGLangConfig = Field(default_factory=SGLangConfig)
    environment: EnvironmentConfig = Field(default_factory=EnvironmentConfig)
    async_steps: int = Field(0, ge=0, description="k > 0: round r trains on samples of policy version r-1-k, "
                             "generated while rounds r-k..r-1 update (docs/async.md); 0: generate, then update")
    worker_threads: int = Field(1, ge=1, description="torch threads of the hf engine's rollout process "
                                "(async_steps > 0); recorded like the trainer's, for exact replay")
    worker_cpus: list[int] = Field(default_factory=list, description="cores the hf engine's rollout process is "
                                   "pinned to (async_steps > 0); empty: not pinned")

    @model_validator(mode="after")
    def _lengths(self) -> "RolloutConfig":
        if self.async_steps > MAX_ASYNC_STEPS:
            raise ValueError(f"rollout.async_steps={self.async_steps}: at most {MAX_ASYNC_STEPS}; the pipeline holds "
                             "async_steps + 1 generated batches (each checkpoint stores them), and samples more "
                             f"than {MAX_ASYNC_STEPS} versions old are too far off-policy for the importance "
                             "correction; lower it")
        if self.min_response_tokens > self.max_response_tokens:
            raise ValueError(f"min_response_tokens ({self.min_response_tokens}) is above max_response_tokens "
                             f"({self.max_response_tokens}); lower it or raise max_response_tokens")
        return self


class RewardSpec(Strict):
    name: str = Field(..., description="task (the task's grader's score) | math | format | reward_model | "
                      "package.module:function")
    weight: float = 1.0
    path: str | None = Field(None, description="model folder for reward_model")


class CriticConfig(Strict):
    """PPO's value model (grpo.advantage=gae): a trunk with a scalar head per token, trained by its own
    optimizer on the clipped value loss beside the policy (trainer.rl.critic)."""

    lr: float = Field(1e-5, gt=0, le=1.0, description="the critic's learning rate (constant; verl's default for "
                      "~0.5B models, the tiny preset sets its own)")
    warmup_rounds: int = Field(
        0, ge=0, description="the first N rounds train the critic only: the policy waits for values that "
        "mean something")
    value_clip: float | None = Field(
        0.2, gt=0, description="a value may move at most this far from its sampling-time value in the clipped "
        "value loss (None: unclipped)")
    layers: int | None = Field(
        None, ge=1, description="the critic's trunk: the policy's first N layers (None: all of them)")
    path: str | None = Field(
        None, description="start from a saved critic (the critic/ folder of a gae GRPO result: a "
        "save_pretrained token classifier with one label) instead of the policy's trunk")


class GRPOConfig(Strict):
    enabled: bool = True
    advantage: Literal["group", "gae"] = Field(
        "group", description="group: GRPO's reward minus its group's mean (no critic); gae: PPO's generalised "
        "advantage estimate from a critic's token values (grpo.critic, grpo.gamma, grpo.lam)")
    gamma: float = Field(1.0, gt=0, le=1.0, description="gae: the discount per policy token")
    lam: float = Field(0.95, ge=0, le=1.0, description="gae: the bias/variance trade-off (1: Monte Carlo returns)")
    critic: CriticConfig = Field(default_factory=CriticConfig)
    rounds: int = Field(60, ge=1)
    max_seconds: float | None = Field(None, gt=0, description="stop early after this much GRPO wall time")
    lr: float = Field(3e-5, gt=0, le=1.0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_rounds: int = Field(0, ge=0)
    mini_batches: int = Field(1, ge=1, description="optimizer steps per epoch over a round's batch")
    epochs: int = Field(1, ge=1, description="passes over a round's batch")
    micro_batch_size: int = Field(64, ge=1)
    gradient_checkpointing: bool = Field(
        False, description="the policy's layers recompute their activations in the update's backward pass "
        "instead of keeping them: about one layer's activation memory instead of all layers', for one more "
        "forward pass (the same weights: the recomputation is exact)")
    grad_clip: float = Field(1.0, gt=0)
    clip_low: float = Field(0.2, ge=0, lt=1)
    clip_high: float = Field(0.2, ge=0, description="clip-higher: upper ratio bound 1 + clip_high")
    std_normalize: bool = Field(True, description="divide advantages by the group's std (off: Dr. GRPO)")
    kl_coef: float = Field(0.0, ge=0, description="KL to the frozen SFT reference; 0 loads no reference")
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    entropy_coef: float = Field(0.0, ge=0)
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    tis_cap: float | None = Field(2.0, gt=0, description="truncate the trainer/engine importance ratio at this")
    rewards: list[RewardSpec] = Field(default_factory=lambda: [RewardSpec(name="task")], min_length=1)
    on_bad_reward: Literal["error", "skip"] = "error"
    eval_every: int = Field(10, ge=1, description="rounds between held-out evals")
    eval_examples: int = Field(200, ge=1)
    pass_k: int = Field(4, ge=1, description="pass@k from k samples at periodic evals")
    checkpoint_every: int = Field(10, ge=1)
    checkpoint_min_seconds: float = Field(
        0.0, ge=0, description="skip a checkpoint that checkpoint_every makes due while fewer seconds than this "
        "have passed since the stage's last one (or its start): bounds the checkpoints' share of a run whose "
        "rounds are short (a small model on a GPU); the last round is always saved; 0: every checkpoint_every rounds")
    sample_table_every: int = Field(10, ge=1)
    deepspeed: DeepSpeedConfig = Field(default_factory=DeepSpeedConfig)

    @model_validator(mode="after")
    def _mini(self) -> "GRPOConfig":
        if self.clip_low >= 1:
            raise ValueError("clip_low must be below 1 (the lower ratio bound is 1 - clip_low)")
        return self


class EvalConfig(Strict):
    max_examples: int | None = Field(None, ge=1, description="evaluate on the first N held-out rows")
    seen_examples: int = Field(
        500, ge=0, description="also evaluate on this many training rows (a fixed sample): accuracy on "
        "problems the model was trained on, against held-out accuracy, is the memorisation gap; 0 skips it")
    max_new_tokens: int = Field(64, ge=1)
    batch_size: int = Field(256, ge=1)
    engine: Literal["rollout", "hf"] = Field(
        "rollout", description="who answers the eval stages: rollout = the rollout engine (with "
        "rollout.engine=sglang, servers launched for each eval stage on the evaluated model); hf = HF generate "
        "in the stage's process, no server launch (on CPU a server start costs more than a small model's eval)")
    lm_eval: bool = Field(
        False, description="also score every answer as lm-evaluation-harness's gsm8k task does (its strict-match "
        "and flexible-extract filters and exact_match; trainer/lm_eval_gsm8k.py): the rows' correct_lm_strict and "
        "correct_lm_flexible, eval/lm_strict_accuracy and eval/lm_flexible_accuracy. Math tasks only")
    pretrained: bool = Field(
        False, description="the SFT eval stage also scores model.pretrained, the policy before SFT "
        "(eval/pretrained_*), on the same held-out problems; HF generate in the stage's process")
    few_shot: int = Field(
        0, ge=0, le=16, description="also score the starting policy (model.pretrained) with this many training "
        "problems and their worked answers as earlier chat turns before each question (eval/few_shot_*): the same "
        "shots for every question, drawn once by seed; needs eval.pretrained, or sft.enabled=false")
    pretrained_examples: int | None = Field(
        None, ge=1, description="the pretrained policy's scores (eval.pretrained, eval.few_shot) on the first N "
        "held-out problems only (on CPU an answer costs more than a small model's training step, and a few-shot "
        "prompt carries k worked answers); None: all of them")


class ControlConfig(Strict):
    """An SFT-only control: the SFT policy trained on by SFT for as long as GRPO ran, so GRPO's gain
    is measured against the same compute spent on more SFT, not against SFT alone."""

    enabled: bool = Field(False, description="run the control stage after grpo (needs grpo.enabled)")
    lr: float = Field(1e-3, gt=0, le=1.0, description="peak learning rate of the continued SFT (cosine to 0)")
    warmup_steps: int = Field(10, ge=0)
    time_factor: float = Field(
        1.0, gt=0, description="the control's budget in GRPO's training seconds; its steps are that budget "
        "over the SFT stage's measured seconds per step")
    steps: int | None = Field(
        None, ge=1, description="a fixed number of SFT steps instead of GRPO's seconds: the control's weights "
        "then do not depend on how fast the machine ran (time_factor is not used)")


BUILTIN_GRADERS = ("math", "exact", "code")  # trainer/problems builds them (a test checks the two agree)


class TaskConfig(Strict):
    """What is learned and how it is judged (trainer/problems): data prep reads each row's gold answer
    as the grader needs it, the `task` reward scores with it, and every eval, the summary, McNemar,
    `posttrain compare` and the registry read its verdict."""

    grader: str = Field(
        "math", description="math (the final number: `#### n` or \\boxed{}, strict and flexible) | exact (the "
        "response's text after its last '####', else its last line, equals the gold answer) | code (the "
        "response's Python function, run in the sandbox against the row's `tests`) | package.module:function "
        "(fn(response, example) -> Verdict(score, correct), a bool, or a score in [0, 1], 1 meaning correct)")
    name: str | None = Field(None, description="the task's name in tags, tables and the registry; default the "
                             "grader's (a dotted path's function name)")

    @property
    def label(self) -> str:
        return self.name or self.grader.partition(":")[2] or self.grader

    @model_validator(mode="after")
    def _named(self) -> "TaskConfig":
        module, sep, attr = self.grader.partition(":")
        if self.grader not in BUILTIN_GRADERS and not (sep and module and attr.isidentifier()):
            raise ValueError(f"task.grader={self.grader!r}: use one of {list(BUILTIN_GRADERS)} or "
                             "'package.module:function'")
        if self.name is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", self.name):
            raise ValueError(f"task.name={self.name!r}: use letters, digits, '_', '.' and '-' (it names the "
                             "registered model and a tag)")
        return self


class TrackingConfig(Strict):
    experiment: str = "posttrain"
    artifact_location: str | None = Field(
        None, description="where a new experiment keeps its MLflow artifacts, e.g. s3://bucket/mlflow "
        "(set when the experiment is created; default: the tracking store's)")
    registered_model: str | None = Field(
        None, description="MLflow Model Registry name of the final policy; default posttrain-<preset name>")


class RunConfig(Strict):
    name: str = "tiny"
    seed: int = 0
    artifact_root: str = Field("artifacts", description="local path or s3://bucket/prefix")
    task: TaskConfig = Field(default_factory=TaskConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    control: ControlConfig = Field(default_factory=ControlConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)

    @model_validator(mode="after")
    def _tokenizer_needs_scratch_model(self) -> "RunConfig":
        family = self.data.synthetic.family
        if self.data.source == "synthetic" and self.task.grader != family:
            raise ValueError(f"task.grader={self.task.grader!r} with data.source=synthetic (family {family}): the "
                             f"synthetic {family} problems are graded by {family}; set task.grader={family}, another "
                             "data.synthetic.family, or give your task's rows (data.source=files, data.train)")
        if self.model.pretrained and self.tokenizer.train:
            raise ValueError(
                "tokenizer.train=true with model.pretrained set: a pretrained model uses its own "
                "tokenizer; set tokenizer.train=false"
            )
        if not self.sft.enabled and not self.model.pretrained:
            raise ValueError("sft.enabled=false starts GRPO from model.pretrained, which is not set: set "
                             "model.pretrained (a folder, s3:// URI, .gguf file or hub name) or sft.enabled=true")
        if not self.sft.enabled and self.control.enabled and self.control.steps is None:
            raise ValueError("control.enabled=true with sft.enabled=false: the control's default budget is GRPO's "
                             "seconds at SFT's measured pace, and no SFT runs to measure it; set control.steps "
                             "(a fixed number of SFT steps from the pretrained model) or control.enabled=false")
        ev = self.eval
        if ev.lm_eval and self.task.grader != "math":
            raise ValueError(f"eval.lm_eval=true with task.grader={self.task.grader!r}: lm-evaluation-harness's GSM8K "
                             "scorers read a final number; use them with task.grader=math, or set eval.lm_eval=false")
        if (ev.pretrained or ev.few_shot) and not self.model.pretrained:
            raise ValueError("eval.pretrained / eval.few_shot score model.pretrained, which is not set: set "
                             "model.pretrained, or eval.pretrained=false and eval.few_shot=0")
        if ev.few_shot and self.sft.enabled and not ev.pretrained:
            raise ValueError(f"eval.few_shot={ev.few_shot} with SFT on: the few-shot score is the pretrained "
                             "policy's, measured beside its zero-shot score; set eval.pretrained=true too")
        if ev.few_shot and self.rollout.environment.multi_turn:
            raise ValueError("eval.few_shot with a multi-turn rollout.environment: shots are single-turn chat turns; "
                             "set eval.few_shot=0")
        if (ev.pretrained or ev.few_shot) and self.eval_engine() == "sglang":
            raise ValueError("eval.pretrained / eval.few_shot run in the SFT eval stage's process (HF generate); "
                             "set eval.engine=hf, or eval.pretrained=false and eval.few_shot=0")
        if self.control.enabled and not self.grpo.enabled:
            raise ValueError("control.enabled=true needs grpo.enabled=true: the control's budget is GRPO's "
                             "training time; enable grpo or set control.enabled=false")
        if self.grpo.enabled and self.grpo.advantage == "group" and self.rollout.n_samples_per_prompt < 2:
            raise ValueError(
                "rollout.n_samples_per_prompt=1 with grpo.advantage=group: a sample's advantage is its reward "
                "against its group's mean, which with one sample a prompt is always 0, so GRPO would never "
                "update; sample at least 2 a prompt (8 is usual), or use grpo.advantage=gae (PPO's critic)")
        rb = self.rollout.prompts_per_round * self.rollout.n_samples_per_prompt
        if self.grpo.enabled and rb % self.grpo.mini_batches:
            raise ValueError(
                f"grpo.mini_batches={self.grpo.mini_batches} does not divide the round's "
                f"{rb} samples (rollout.prompts_per_round x n_samples_per_prompt); pick a divisor"
            )
        gds = self.grpo.deepspeed
        k = self.rollout.async_steps
        if self.grpo.enabled and k and self.rollout.engine == "hf" and gds.world_size > 1:
            raise ValueError(
                f"rollout.async_steps={k} with rollout.engine=hf on {gds.world_size} ranks: the hf engine's "
                "rollout process serves one rank, and with several ranks each generates its own share, so "
                "generation cannot overlap the update; use rollout.engine=sglang (servers beside the ranks), "
                "one rank (grpo.deepspeed.ranks_per_node=1), or rollout.async_steps=0")
        if self.grpo.enabled and k >= self.grpo.rounds:
            raise ValueError(f"rollout.async_steps={k} with grpo.rounds={self.grpo.rounds}: every round would train "
                             "on the first policy's samples; lower async_steps below grpo.rounds")
        if self.grpo.enabled and gds.world_size > 1 and gds.zero_stage == 3:
            # ZeRO-3 gathers each weight from every rank inside every forward, so all ranks must run the
            # same forwards in step; GRPO's do not (refused for both engines rather than left to hang)
            raise ValueError(
                f"grpo.deepspeed.zero_stage=3 with {gds.world_size} ranks (rollout.engine={self.rollout.engine}): "
                "ZeRO-3 needs every rank in each forward pass, but GRPO's greedy evals run on rank 0 alone, a "
                "rank with fewer samples than another runs fewer passes, and the hf engine generates from "
                "each rank's own (partitioned) weights, so the ranks would wait on each other forever. Use "
                "grpo.deepspeed.zero_stage=1 or 2 (optimizer state and gradients sharded, whole weights on "
                "each rank), or one rank"
            )
        remote_root = "://" in self.artifact_root and not self.artifact_root.startswith("file://")
        if self.rollout.sglang.weight_sync == "store" and self.rollout.engine == "sglang" and not remote_root:
            raise ValueError(
                f"rollout.sglang.weight_sync=store with artifact_root={self.artifact_root!r}: the servers' machines "
                "fetch each round's weights from the artifact store, so it must be one they reach: set artifact_root "
                "to an s3:// URL, or use weight_sync=disk for servers on this machine (docs/cluster.md)")
        for section in ("sft", "grpo"):
            ds = getattr(self, section).deepspeed
            if ds.nodes > 1 and not remote_root:
                raise ValueError(
                    f"{section}.deepspeed.nodes={ds.nodes} with artifact_root={self.artifact_root!r}: machines share "
                    "no disk, so the inputs each rank reads, the checkpoints a retry on any host resumes from and "
                    "the result travel through the artifact store; set artifact_root to an s3:// (or other remote) URL "
                    "(docs/cluster.md)")
        registered = self.registered_model_name()
        if not registered.strip() or any(c in registered for c in "/:"):
            field = "tracking.registered_model" if self.tracking.registered_model is not None else (
                "name (the default tracking.registered_model is posttrain-<name>)")
            raise ValueError(f"{field}: the MLflow Model Registry name {registered!r} cannot be registered (names are "
                             "not empty and have no '/' or ':'); set tracking.registered_model to another name")
        lc = self.model.lora
        if lc is not None and not lc.merge and (self.rollout.engine == "sglang" or self.eval_engine() == "sglang"):
            raise ValueError(
                "model.lora.merge=false with SGLang (rollout.engine or eval.engine): posttrain hands SGLang merged "
                "weights only, it cannot take the adapters themselves; set model.lora.merge=true (merged weights "
                "pushed each round) or use the hf engine")
        return self

    def registered_model_name(self) -> str:
        """The MLflow Model Registry name of the final policy (tracking.registered_model, or from the name)."""
        if self.tracking.registered_model is not None:
            return self.tracking.registered_model
        # a task other than math names itself: its policies are not the preset's arithmetic ones
        task = "" if self.task.grader == "math" and self.task.name is None else f"-{self.task.label}"
        return f"posttrain-{self.name.replace('.', '-')}{task.replace('.', '-')}"

    def logged_model_name(self, role: str) -> str:
        """The MLflow logged model name of one of this run's policies (`role`: sft, grpo, control,
        start): `<name>-<role>`, with what MLflow refuses in those names ('/', ':', '.', '%', quotes)
        made '-' ("qwen2.5-0.5b-gsm8k" -> "qwen2-5-0-5b-gsm8k-grpo")."""
        base = re.sub(r"[/:.%\"'\s]+", "-", self.name).strip("-") or "posttrain"
        return f"{base}-{role}"

    def eval_engine(self) -> str:
        """What answers the eval stages: "hf" or "sglang" (eval.engine resolved against rollout.engine)."""
        return self.rollout.engine if self.eval.engine == "rollout" else self.eval.engine

    def section_hash(self, *names: str) -> str:
        """Stable hash of the named config sections (part of a stage's cache key)."""
        payload = {n: _dump(getattr(self, n)) for n in names}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def _dump(value: Any) -> Any:
    return value.model_dump(mode="json") if isinstance(value, BaseModel) else value


def preset_names() -> list[str]:
    """Presets shipped under configs/ (found recursively), as `--preset` and the Prefect form take them."""
    return sorted(p.relative_to(CONFIGS_DIR).with_suffix("").as_posix() for p in CONFIGS_DIR.rglob("*.yaml"))


def preset_path(preset: str) -> Path:
    """A preset name (`tiny`) or a path to a YAML file."""
    path = Path(preset)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise ConfigError(f"preset file {preset!r} does not exist; pass an existing YAML path")
        return path
    candidate = CONFIGS_DIR / f"{preset}.yaml"
    if not candidate.is_file():
        known = preset_names()
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


# what TRL, peft and transformers call settings posttrain names otherwise, the first that applies:
# "rank" a key of the same section, ".deepspeed.precision" one inside it, "rollout.top_p" from the top
PEER_NAMES = {
    "r": ("rank",), "lora_r": ("rank",), "lora_alpha": ("alpha",), "lora_dropout": ("dropout",),
    "learning_rate": ("lr",), "beta": ("kl_coef",), "max_grad_norm": ("grad_clip",),
    "num_train_epochs": ("epochs",), "num_iterations": ("epochs",), "gradient_accumulation_steps": ("grad_accum",),
    "per_device_train_batch_size": ("micro_batch_size",), "loss_type": ("loss_agg",), "epsilon": ("clip_low",),
    "epsilon_high": ("clip_high",), "max_seq_length": ("max_length",),
    "num_generations": ("rollout.n_samples_per_prompt",),
    "max_completion_length": ("max_new_tokens", "rollout.max_response_tokens"),
    "max_new_tokens": ("rollout.max_response_tokens",), "max_prompt_length": ("rollout.max_prompt_tokens",),
    "temperature": ("rollout.temperature",), "top_p": ("rollout.top_p",),
    "bf16": (".deepspeed.precision",), "fp16": (".deepspeed.precision",),
}


def _meant(loc: tuple) -> str | None:
    """The setting an unknown key at `loc` most likely meant: a peer tool's name for it (TRL's
    `learning_rate`, peft's `r`) or a near spelling of a key of the same section, as a full dotted path."""
    import difflib

    section: Any = RunConfig
    for part in loc[:-1]:  # down to the section that holds the unknown key (list items keep their type)
        if isinstance(part, int):
            continue
        field = section.model_fields.get(part) if isinstance(section, type) and issubclass(section, BaseModel) else None
        if field is None:
            return None
        models = [a for a in _flat_args(field.annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        if not models:
            return None
        section = models[0]
    prefix = "".join(f"{p}." for p in loc[:-1])
    key, keys = str(loc[-1]), list(section.model_fields)
    for peer in PEER_NAMES.get(key, ()):
        if peer.startswith("."):
            if peer[1:].split(".")[0] in keys:
                return prefix + peer[1:]
        elif "." in peer:
            return peer
        elif peer in keys:
            return prefix + peer
    near = difflib.get_close_matches(key, keys, n=1, cutoff=0.75)
    if not near:  # a shortening of one key alone (mem_frac: mem_fraction_static)
        near = [k for k in keys if len(key) >= 3 and key in k]
    return prefix + near[0] if len(near) == 1 else None


def _flat_args(annotation: Any) -> list[Any]:
    """A field's types with Optional, unions and lists unwrapped."""
    import typing

    args = typing.get_args(annotation)
    if not args:
        return [annotation]
    return [t for a in args for t in _flat_args(a)]


def format_validation_error(exc: ValidationError, source: str) -> str:
    lines = [f"{source}: {exc.error_count()} invalid setting(s):"]
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "(top level)"
        value = err.get("input")
        if err["type"] == "extra_forbidden":
            hint = _meant(err["loc"])
            lines.append(f"  - {field}: unknown key; " + (f"did you mean {hint}?" if hint else
                                                           "remove it or check its spelling"))
        else:
            msg = err["msg"].removeprefix("Value error, ")
            # a section's (or the whole config's) own check: its message names the fields, and the
            # section's every value would bury it
            shown = "" if isinstance(value, dict) else f" = {value!r}"
            lines.append(f"  - {field}{shown}: {msg}")
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
