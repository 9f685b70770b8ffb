"""GGUF files as a model source: `model.pretrained: path/or/s3/model.gguf`.

A GGUF file is converted once into an ordinary safetensors folder (weights dequantised to
float32, the tokenizer, its chat template), cached under `$POSTTRAIN_CACHE/gguf/<content hash>`
(default `~/.cache/posttrain`), and that folder is what every stage, SGLang server and reference
model then loads. Conversion runs transformers' own GGUF reader (it needs the `gguf` package).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from trainer import storage
from trainer.errors import InputError


class GGUFError(InputError):
    pass


def is_gguf(ref: str | None) -> bool:
    return bool(ref) and ref.lower().endswith(".gguf")


def cache_root() -> Path:
    return Path(os.environ.get("POSTTRAIN_CACHE", Path.home() / ".cache" / "posttrain")) / "gguf"


def _local_file(ref: str, root: Path) -> Path:
    """The GGUF file on this machine: the path itself, or a download of an s3:// object (kept per
    URI, ETag and size)."""
    if not storage.is_remote(ref):
        path = Path(ref).expanduser()
        if not path.is_file():
            raise GGUFError(f"model.pretrained: {ref!r} does not exist (relative paths are from {Path.cwd()}); "
                            "point it at a .gguf file")
        return path
    fs, remote = storage.fs_for(ref)
    try:
        info = fs.info(remote)
    except FileNotFoundError:
        raise GGUFError(f"model.pretrained: {ref!r} does not exist; check the URI and credentials") from None
    tag = hashlib.sha256(f"{ref}@{info.get('ETag') or info.get('etag')}@{info.get('size')}".encode()).hexdigest()[:16]
    dest = root / "downloads" / tag / Path(remote).name
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process downloads; released if it dies
        if not dest.is_file():
            tmp = dest.with_name(f".{dest.name}.{os.getpid()}")
            fs.get(remote, str(tmp))
            os.replace(tmp, dest)
    return dest


def convert(path: Path, out: Path) -> None:
    """Write the GGUF file's model (float32), tokenizer and chat template as a save_pretrained folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        import gguf  # noqa: F401  transformers' reader needs it
    except ImportError:
        raise GGUFError("model.pretrained: reading a .gguf file needs the gguf package (pip install gguf; "
                        "`make setup` installs it)") from None
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    except Exception as exc:  # a truncated file, an architecture transformers cannot read from GGUF
        raise GGUFError(f"model.pretrained: {path} could not be read as a GGUF model ({type(exc).__name__}: "
                        f"{str(exc)[:300]}); check the file (its download may be incomplete)") from None
    # transformers marks a GGUF-loaded model as quantized and refuses to save it; its weights are
    # already dequantised to float32, so the marks go and it saves as an ordinary model
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))


def converted(ref: str) -> Path:
    """The safetensors folder converted from the GGUF file `ref` (local path or s3://), converting
    it on first use. One process converts; others wait for it; a folder is used only once whole.

    Raises GGUFError naming the field and the file when it is missing or not a readable GGUF model."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    path = _local_file(ref, root)
    dest = root / storage.file_sha256(path)[:16]
    if (dest / ".complete").exists():
        return dest
    with open(root / f".{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (dest / ".complete").exists():
            tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{dest.name}."))
            try:
                convert(path, tmp)
                (tmp / "source.txt").write_text(f"converted from {ref}\n")
                (tmp / ".complete").touch()
                shutil.rmtree(dest, ignore_errors=True)  # an incomplete earlier conversion
                os.replace(tmp, dest)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return dest
