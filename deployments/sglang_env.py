"""Build or locate the SGLang servers' own environment (`make sglang-env`).

    python -m deployments.sglang_env build [--device cpu|cuda|auto]   # idempotent; prints the interpreter
    python -m deployments.sglang_env path  [--device cpu|cuda|auto]

The environment lives outside the clone, under `$POSTTRAIN_SGLANG_HOME` (default
~/.cache/posttrain), in a folder named by the hash of its pin files: every clone on a machine, and
CI, reuse one build (about 6.5 GB) until the pins change. A build writes `.complete` last; a folder
without it is a broken build and is removed and rebuilt. A file lock keeps two builds of one
folder (two clones, two CI runs) from overlapping.
"""

from __future__ import annotations

import argparse
import fcntl
import shutil
import subprocess
import sys
import time
from pathlib import Path

from trainer.inference.sglang import PINS_DIR, env_dir

COMPLETE = ".complete"
# what the servers import first: fails the build here rather than at the first launch
SMOKE = "import sglang, torch, transformers; print('sglang', sglang.__version__, 'torch', torch.__version__)"


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    return "cuda" if shutil.which("nvidia-smi") else "cpu"


def build(device: str, python: str = sys.executable) -> Path:
    """The environment's interpreter, building the environment first if it is missing or broken."""
    target = env_dir(device)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent build of the same pins finishes first
        if (target / COMPLETE).is_file():
            return target / "bin" / "python"
        if target.exists():
            print(f"sglang-env: {target} has no {COMPLETE} (an interrupted build); rebuilding", flush=True)
            shutil.rmtree(target)
        t0 = time.monotonic()
        print(f"sglang-env: building the {device} SGLang environment in {target} (several minutes, ~6.5 GB)",
              flush=True)
        pip = [str(target / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        steps = [[python, "-m", "venv", str(target)],
                 [*pip, "--no-deps", "-r", str(PINS_DIR / "requirements.txt")]]
        if device == "cuda":
            steps.append([*pip, "-c", str(PINS_DIR / "requirements.txt"), "-r", str(PINS_DIR / "requirements-cuda.txt")])
        steps.append([str(target / "bin" / "python"), "-c", SMOKE])
        for cmd in steps:
            if subprocess.run(cmd).returncode != 0:
                raise SystemExit(f"sglang-env: `{' '.join(cmd)}` failed; the half-built {target} is left for "
                                 "inspection and is rebuilt on the next `make sglang-env`")
        (target / COMPLETE).write_text(f"built in {time.monotonic() - t0:.0f}s\n")
        print(f"sglang-env: ready in {time.monotonic() - t0:.0f}s", flush=True)
    return target / "bin" / "python"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deployments.sglang_env", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["build", "path"])
    parser.add_argument("--device", choices=["cpu", "cuda", "auto"], default="auto",
                        help="cuda adds SGLang's GPU kernels; auto picks cuda where nvidia-smi exists")
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    if args.command == "build":
        print(build(device))
    else:
        target = env_dir(device)
        if not (target / COMPLETE).is_file():
            print(f"no {device} SGLang environment at {target}; build it with `make sglang-env`", file=sys.stderr)
            return 1
        print(target / "bin" / "python")
    return 0


if __name__ == "__main__":
    sys.exit(main())
