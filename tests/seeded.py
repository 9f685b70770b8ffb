"""Committed results copied from one artifact root into another (conftest's `small_sft` is the source)."""

import json
import shutil
from pathlib import Path


def seed(source: Path, root: Path, stages=("prepare_data", "tokenizer", "sft")) -> Path:
    """Copy the committed results of `stages` under the artifact root `source` into the artifact root
    `root`, each manifest's uri pointing at its copy: a run on `root` finds them as it would have
    committed them (cache hits), and may damage or recompute its copies."""
    for stage in stages:
        for folder in (source / stage).iterdir():
            if (folder / "manifest.json").is_file():
                dest = root / stage / folder.name
                shutil.copytree(folder, dest)
                manifest = json.loads((dest / "manifest.json").read_text())
                (dest / "manifest.json").write_text(json.dumps({**manifest, "uri": str(dest)}, indent=2))
    return root
