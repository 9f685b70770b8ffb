"""LoRA adapters on the policy (`model.lora`), through peft.

`wrap` freezes the model and adds peft's low-rank adapters to the layers `target_modules` names: the
optimizer, the gradients and DeepSpeed's checkpoints then train and hold the adapters (the frozen
base is written with them, so a resume restores the weights exactly as they were). Everything else
reads the policy through three helpers:

- `inner(module)`: the transformers model inside a peft wrapper (the layout the engines expect);
- `merged(module)`: the adapters merged into the base weights in place for the duration of a block
  (generation: the fast decoder reads the weights, not the adapters), and taken out again after. No
  copy of the base is made; the subtraction restores each weight up to float rounding (at most half
  an ulp a round, the same in every run, and held by the checkpoints);
- `plain_state(module)`: the merged weights under the plain model's names, copied to the CPU (what
  a save_pretrained export, an SGLang weight push and the async rollout process take).
"""

from __future__ import annotations

import contextlib
import re
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from trainer.config import ConfigError, LoRAConfig
from trainer.errors import InputError

if TYPE_CHECKING:
    import torch


def _layers(module: "torch.nn.Module"):
    from peft.tuners.lora import LoraLayer

    return [(n, m) for n, m in module.named_modules() if isinstance(m, LoraLayer)]


def adapted(module: "torch.nn.Module") -> bool:
    """Whether the module carries LoRA adapters (a peft wrapper, or the model inside one)."""
    return _has_peft(module)


def _has_peft(module: "torch.nn.Module") -> bool:
    # peft is imported only where a module holds adapters: a module of peft's in the tree
    return any(type(m).__module__.startswith("peft.") for m in module.modules())


def unmerged(module: "torch.nn.Module") -> bool:
    """Whether some adapter is not merged into its layer's weight (the weights alone are not the policy)."""
    if not _has_peft(module):
        return False
    from peft import PeftModel

    return isinstance(module, PeftModel) or any(not m.merged for _, m in _layers(module))


def inner(module: "torch.nn.Module") -> "torch.nn.Module":
    """The transformers model inside a peft wrapper (the module itself otherwise)."""
    from_peft = type(module).__module__.startswith("peft.")
    return module.get_base_model() if from_peft else module


def linear_layers(model: "torch.nn.Module") -> dict[str, tuple[int, int]]:
    """The model's linear layers by leaf name, with (in, out) features: what target_modules may name
    (the output head left out, as peft's all-linear does)."""
    import torch

    head = model.get_output_embeddings()
    out: dict[str, tuple[int, int]] = {}
    for name, m in model.named_modules():
        peft_own = "lora_" in name or name.endswith("base_layer")  # inside a layer peft already wrapped
        if isinstance(m, torch.nn.Linear) and m is not head and not peft_own:
            leaf = name.rsplit(".", 1)[-1]
            small = out.get(leaf, (m.in_features, m.out_features))
            out[leaf] = (min(small[0], m.in_features), min(small[1], m.out_features))
    return out


def _targeted(c: LoRAConfig, names: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    if c.target_modules == "all-linear":
        return names
    if isinstance(c.target_modules, str):  # peft takes a string as a regular expression over full names
        pattern = re.compile(c.target_modules)
        return {n: f for n, f in names.items() if pattern.search(n)}
    return {n: f for n, f in names.items() if n in c.target_modules}


def check(model: "torch.nn.Module", c: LoRAConfig) -> None:
    """Stop before any training when the adapters cannot go on this model: target_modules naming no
    linear layer, or a rank above a targeted layer's smaller side."""
    names = linear_layers(model)
    kind = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    targeted = _targeted(c, names)
    listed = ", ".join(sorted(names)) or "none"
    if not targeted:
        raise InputError(f"model.lora.target_modules={c.target_modules!r} matches no linear layer of this {kind} "
                         f"model; its linear layers are: {listed} (or give all-linear)")
    if isinstance(c.target_modules, list):
        unknown = [t for t in c.target_modules if t not in names]
        if unknown:
            raise InputError(f"model.lora.target_modules: {unknown} name no linear layer of this {kind} model; "
                             f"its linear layers are: {listed} (or give all-linear)")
    name, (fan_in, fan_out) = min(targeted.items(), key=lambda kv: min(kv[1]))
    if c.rank > min(fan_in, fan_out):
        raise InputError(f"model.lora.rank={c.rank} is larger than layer {name} ({fan_in} -> {fan_out}) allows; "
                         f"give a rank of at most {min(fan_in, fan_out)}, or leave {name} out of target_modules")


def check_config(cfg) -> None:
    """Stop a LoRA run before it starts where the model's layers can be known without loading it: a
    model built from the config, or a local save_pretrained folder (a .gguf file, s3:// or hub model
    is checked when its stage loads it, before anything trains)."""
    c = cfg.model.lora
    if c is None:
        return
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    ref = cfg.model.pretrained
    if ref is None:
        m = cfg.model
        conf = LlamaConfig(vocab_size=32, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
                           num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
                           num_key_value_heads=m.num_heads, tie_word_embeddings=True)
    else:
        from trainer.model import pretrained_kind

        folder = Path(ref).expanduser()
        if pretrained_kind(ref) != "local" or not (folder / "config.json").is_file():
            return
        conf = AutoConfig.from_pretrained(str(folder))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(conf)
    try:
        check(model, c)
    except InputError as exc:
        raise ConfigError(str(exc)) from None


def wrap(model: "torch.nn.Module", c: LoRAConfig) -> "torch.nn.Module":
    """The model with trainable adapters on the targeted layers and every other weight frozen. The
    adapters start at zero (B = 0), so the wrapped model computes what the model did."""
    from peft import LoraConfig, get_peft_model

    check(model, c)
    targets = c.target_modules if isinstance(c.target_modules, str) else list(c.target_modules)
    spec = LoraConfig(r=c.rank, lora_alpha=c.alpha, lora_dropout=c.dropout, target_modules=targets,
                      bias="none", task_type="CAUSAL_LM")
    with warnings.catch_warnings():  # peft reads an attribute transformers 5 renamed
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, spec)


@contextlib.contextmanager
def merged(module: "torch.nn.Module", enabled: bool = True) -> Iterator["torch.nn.Module"]:
    """The adapters merged into the base weights in place inside the block, unmerged after (the module
    itself when it has no adapters, when merging is off, or when ZeRO-3 partitions the weights: then
    the adapters are computed at every token)."""
    import torch

    partitioned = any(hasattr(p, "ds_id") for p in module.parameters())
    layers = _layers(module) if enabled and not partitioned and _has_peft(module) else []
    todo = [m for _, m in layers if not m.merged]
    with torch.no_grad():
        for m in todo:
            m.merge()
    try:
        yield module
    finally:
        with torch.no_grad():
            for m in todo:
                m.unmerge()


def plain_state(module: "torch.nn.Module") -> dict[str, "torch.Tensor"]:
    """The weights under the plain transformers model's names, adapters merged, each copied into its
    own CPU memory (tied weights untied, as safetensors needs; on a GPU the copy lands in host memory,
    not beside the weights); a model without adapters: its own state."""
    import torch

    model = inner(module)
    state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items() if "lora_" not in k}
    if not _has_peft(model):
        return state
    state = {k.replace(".base_layer.", "."): v for k, v in state.items()}
    with torch.no_grad():
        for name, m in _layers(model):
            if m.merged:
                continue
            for adapter in m.active_adapters:
                if adapter in m.lora_A:
                    state[f"{name}.weight"] += m.get_delta_weight(adapter).to("cpu", state[f"{name}.weight"].dtype)
    return state


def trainable_params(module: "torch.nn.Module") -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)
