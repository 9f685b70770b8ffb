"""Policy models: a tiny Llama built from the config, or a pretrained model from a local path,
an `s3://` URI (downloaded once into the local cache), a `.gguf` file (converted once,
`trainer.gguf_source`) or a hub name. An MLflow `models:/` URI is the pipeline's to resolve
(tasks/sources.py downloads it and hands the stages its folder): here it is only recognised."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from trainer import storage
from trainer.config import ModelConfig, is_mlflow_model
from trainer.errors import InputError

log = logging.getLogger(__name__)


class ModelLoadError(InputError):
    pass


def pretrained_kind(ref: str) -> str:
    """What a model.pretrained value names: "remote" (an s3:// URI), "local" (a path), "mlflow" (a
    models:/ URI) or "hub"."""
    if is_mlflow_model(ref):
        return "mlflow"
    if storage.is_remote(ref):
        return "remote"
    if ref.lower().endswith(".gguf"):  # a file path, never a hub name
        return "local"
    if ref.startswith((".", "/", "~")) or Path(ref).exists():
        return "local"
    return "hub"


def load_problem(ref: str, exc: OSError, what: str = "", field: str = "model.pretrained") -> ModelLoadError:
    """`field`'s model `ref` could not be loaded (`what`: "the tokenizer of ", say): the error, and for
    a hub name the way to run where the hub cannot be reached."""
    msg = f"{field}: could not load {what}{ref!r}: {exc}"
    if pretrained_kind(ref) == "hub":
        msg += (f"\nWhere this machine cannot reach the hub, download the model where you can (`hf download {ref} "
                f"--local-dir DIR`) and set {field}=DIR; a local folder, an s3:// URI and a .gguf file "
                "load without the hub")
    return ModelLoadError(msg)


def resolve_pretrained(ref: str, field: str = "model.pretrained") -> str:
    """A local folder for s3://, local and .gguf refs; for a hub name, what `_from_hub` says. Errors
    name `field`, the setting that holds `ref`."""
    from trainer.gguf_source import GGUFError, converted, is_gguf

    if is_gguf(ref):
        try:
            return str(converted(ref))
        except GGUFError as exc:
            raise ModelLoadError(str(exc)) from None
    kind = pretrained_kind(ref)
    if kind == "remote":
        if not storage.exists(ref):
            raise ModelLoadError(f"{field}: {ref!r} does not exist; check the URI and credentials")
        return str(storage.local_dir(ref))
    if kind == "local":
        path = Path(ref).expanduser()
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{field}: {ref!r} is not a model folder (no config.json); "
                                 "point it at a save_pretrained folder")
        return str(path)
    if kind == "mlflow":
        where = ("which the pipeline (posttrain and its Prefect flows) downloads before its stages run; outside it"
                 if field == "model.pretrained" else "which posttrain downloads for model.pretrained only; here")
        raise ModelLoadError(f"{field}: {ref!r} is an MLflow model URI, {where}, download the model "
                             f"(mlflow artifacts download --artifact-uri {ref} -d DIR) and set {field}=DIR")
    return _from_hub(ref, field)


def _from_hub(ref: str, field: str) -> str:
    """A hub name as transformers should load it: the name where the hub answers; this machine's hub
    cache's snapshot folder where it does not (a name alone, there, costs the hub client's retries of
    every optional file it looks for, about 25 s each, though the model is on disk); else the reason."""
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(ref, "config.json")
    problem = hub_problem(ref)
    if problem is None:
        return ref
    if isinstance(cached, str):
        log.info("%s: %s comes from this machine's hub cache (%s): %s", field, ref, Path(cached).parent, problem)
        return str(Path(cached).parent)
    raise load_problem(ref, OSError(f"it is not in this machine's hub cache, and {problem}"), field=field)


def hub_problem(ref: str) -> str | None:
    """Why the hub cannot serve model `ref` to this machine, asked once (a fraction of a second, no
    retries), or None (it can, or it answered busy)."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import EntryNotFoundError, GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    try:
        get_hf_file_metadata(hf_hub_url(ref, "config.json"))
    except GatedRepoError:
        return ("the hub holds it gated: accept its terms on its page, then log in (`hf auth login`) or set "
                "HF_TOKEN")
    except RepositoryNotFoundError:
        return "the hub has no model of that name (or it is private: log in with `hf auth login` or set HF_TOKEN)"
    except EntryNotFoundError:
        return "its hub repository has no config.json: it is not a transformers model"
    except HfHubHTTPError:  # the hub answered, busy (429, 5xx): the hub client's own retries may see it through
        return None
    except Exception as exc:  # the network: DNS, refused, timed out
        return f"the hub cannot be reached from here ({type(exc).__name__}: {exc})"
    return None


def build_model(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase, seed: int) -> torch.nn.Module:
    dtype = getattr(torch, cfg.dtype)
    if cfg.pretrained:
        ref = resolve_pretrained(cfg.pretrained)
        try:
            return AutoModelForCausalLM.from_pretrained(ref, dtype=dtype)
        except OSError as exc:
            raise load_problem(cfg.pretrained, exc) from None
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        max_position_embeddings=cfg.max_position,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config).to(dtype)


def load_model(path: str | Path, dtype: str = "float32") -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype))


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
