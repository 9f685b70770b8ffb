"""PPO's critic (grpo.advantage=gae): the policy's trunk with a scalar head at every token.

The critic is transformers' own token classifier with one label (`LlamaForTokenClassification`,
`Qwen2ForTokenClassification`, ...): `save_pretrained` / `from_pretrained` round-trip it, and its
trunk has the policy's layout, so it starts as a copy of the policy's first `critic.layers` layers
(the value head at zero: every value 0 until it learns) or from a critic a gae stage saved before
(`critic.path`). Its value at position t is the value of the state after token t: aligned, like
the trainer's log-probs, with the next-token targets, so `values(...)[:, t]` is V(s) for the
state in which the policy chose target t.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.config import ConfigError, CriticConfig, GRPOConfig
from trainer.errors import InputError

if TYPE_CHECKING:  # torch is imported where a critic is built: the CLI checks a config without it
    import torch


def value_head_problem(path: str | Path) -> str | None:
    """Why the folder cannot be a critic (no config, not a one-label token classifier), or None."""
    conf = Path(path) / "config.json"
    if not conf.is_file():
        return f"{path} has no config.json (not a save_pretrained folder)"
    try:
        c = json.loads(conf.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return f"{conf} is unreadable ({exc})"
    arch = c.get("architectures") or []
    labels = len(c.get("id2label") or {}) or c.get("num_labels", 2)
    if not any(a.endswith("ForTokenClassification") for a in arch) or labels != 1:
        return (f"{path} has no value head: its architecture is {', '.join(arch) or 'not named'} with {labels} "
                "label(s), a critic is a ...ForTokenClassification with one label (the critic/ folder a gae "
                "GRPO stage saves)")
    return None


def check_critic(g: GRPOConfig) -> None:
    """Stop a gae run before it starts when grpo.critic.path cannot be a critic (the CLI and the flows
    call this once the config has loaded; remote folders are checked when the stage loads them)."""
    path = g.critic.path
    if g.advantage != "gae" or path is None or "://" in path:
        return
    if problem := value_head_problem(path):
        raise ConfigError(f"grpo.critic.path: {problem}; give such a folder, or leave grpo.critic.path unset to "
                          "start the critic from the policy's trunk")


def build_critic(policy: "torch.nn.Module", c: CriticConfig) -> "torch.nn.Module":
    """A critic from `c.path`, or from the policy's first `c.layers` layers with a zero value head."""
    import torch
    from transformers import AutoModelForTokenClassification

    dtype = next(policy.parameters()).dtype
    if c.path is not None:
        if problem := value_head_problem(c.path):
            raise InputError(f"grpo.critic.path: {problem}; give such a folder, or leave grpo.critic.path unset "
                             "to start the critic from the policy's trunk")
        return AutoModelForTokenClassification.from_pretrained(c.path, dtype=dtype)
    conf = copy.deepcopy(policy.config)
    total = conf.num_hidden_layers
    if c.layers is not None and c.layers > total:
        raise InputError(f"grpo.critic.layers={c.layers}, but the policy has {total} layers; give at most {total} "
                         "(or leave it unset for all of them)")
    conf.num_hidden_layers = c.layers or total
    if getattr(conf, "layer_types", None):
        conf.layer_types = conf.layer_types[: conf.num_hidden_layers]
    conf.num_labels, conf.id2label, conf.label2id = 1, {0: "value"}, {"value": 0}
    conf.classifier_dropout = 0.0  # a value model regresses; dropout would only add noise
    conf.architectures = None
    critic = AutoModelForTokenClassification.from_config(conf, dtype=dtype)
    trunk = policy.base_model.state_dict()
    missing, _unused = critic.base_model.load_state_dict(trunk, strict=False)  # unused: the layers left out
    if missing:
        raise InputError(f"the critic's trunk does not match the policy's ({len(missing)} weights missing, e.g. "
                         f"{missing[0]}); set grpo.critic.path to a saved critic")
    with torch.no_grad():
        critic.score.weight.zero_()
        if critic.score.bias is not None:
            critic.score.bias.zero_()
    return critic.train()


def values(critic: "torch.nn.Module", ids: "torch.Tensor", attn: "torch.Tensor") -> "torch.Tensor":
    """[B, T] ids -> [B, T-1] values, aligned with the next-token targets (float32)."""
    out = critic(input_ids=ids[:, :-1], attention_mask=attn[:, :-1]).logits
    return out[..., 0].float()
