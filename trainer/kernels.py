"""posttrain's compiled CPU kernels, built on first use into one library: the fast decoder's step
(`trainer/csrc/decode_layer.cpp`), the training forward's fused elementwise ops
(`trainer/csrc/train_ops.cpp`, used by `trainer/fasttrain.py`) and the float32 matrix products
both use (`trainer/csrc/gemm.cpp`).

It is built with torch's own extension builder against the installed torch, for the CPU's vector
width as torch itself uses it (AVX-512, AVX2), into a cache outside the clone keyed by the source,
torch's version and that width: `$POSTTRAIN_KERNEL_CACHE`, else `$XDG_CACHE_HOME/posttrain/kernels`,
else `~/.cache/posttrain/kernels`. Fresh clones on one machine reuse it; the first build takes
about 15 s on 2 cores (`make setup` does it ahead). `POSTTRAIN_KERNELS_ISA=avx2` (or `default`) builds
and runs a narrower variant than the CPU allows: an AVX-512 machine then runs what an AVX2-only
one runs (the instruction set, not that machine's clock or memory; `ATEN_CPU_CAPABILITY=avx2` does
the same for torch's own ops). With no compiler, or `POSTTRAIN_KERNELS=0`, the
fast decoder runs its torch-op path instead (same results up to float rounding, about half the
speed on small models) and GRPO's log-prob passes run the model's own forward; which path runs is
logged once.

`python -m trainer.kernels` builds it and says where it is.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).parent / "csrc" / name for name in ("decode_layer.cpp", "train_ops.cpp", "gemm.cpp")]
HEADERS = [Path(__file__).parent / "csrc" / "gemm.h"]
ARCH_FLAGS = {  # torch's CPU capability -> the macro and flags its vector headers expect
    "AVX512": ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512dq", "-mavx512vl",
               "-mavx512bw", "-mfma"],
    "AVX2": ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"],
}

_state: dict[str, object] = {}


def cache_root() -> Path:
    if os.environ.get("POSTTRAIN_KERNEL_CACHE"):
        return Path(os.environ["POSTTRAIN_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "posttrain" / "kernels"


def _capability() -> str:
    """The variant to build: `$POSTTRAIN_KERNELS_ISA` (avx512, avx2 or default) when set, else the
    vector width torch itself uses on this CPU (which `ATEN_CPU_CAPABILITY` lowers for torch's own ops)."""
    import torch

    forced = os.environ.get("POSTTRAIN_KERNELS_ISA", "").strip().upper()
    if forced:
        if forced not in (*ARCH_FLAGS, "DEFAULT"):
            raise ValueError(f"POSTTRAIN_KERNELS_ISA={forced.lower()!r}: use avx512, avx2 or default")
        runs = {"AVX512": torch.cpu._is_avx512_supported(), "AVX2": torch.cpu._is_avx2_supported()}
        if not runs.get(forced, True):
            raise ValueError(f"POSTTRAIN_KERNELS_ISA={forced.lower()}: this CPU has no {forced}; use "
                             f"{'avx2 or ' if runs['AVX2'] else ''}default")
        return forced
    cap = torch.backends.cpu.get_cpu_capability()
    return cap if cap in ARCH_FLAGS else "DEFAULT"


def variant() -> str:
    """Which build runs ("avx512", "avx2", "default"; "off" when the kernels are off or did not build)."""
    return _capability().lower() if ops() else "off"


def build_dir() -> Path:
    import torch

    cap = _capability()
    key = hashlib.sha256(b"".join(f.read_bytes() for f in SOURCES + HEADERS)
                         + f"|{torch.__version__}|{cap}|{sys.version_info[:2]}".encode())
    return cache_root() / f"kernels-{cap.lower()}-{key.hexdigest()[:12]}"


def decode_layer():
    """torch.ops.posttrain.decode_layer, built if need be; None when it cannot be (the reason is logged once)."""
    return ops() and ops().decode_layer


def ops():
    """The namespace torch.ops.posttrain with every kernel, built if need be; None when it cannot be."""
    if "op" in _state:
        return _state["op"]
    op = None
    if os.environ.get("POSTTRAIN_KERNELS", "1") == "0":
        log.info("fast decoder: compiled kernel off (POSTTRAIN_KERNELS=0); torch-op path")
    else:
        try:
            op = _load()
            log.info("compiled kernels (%s) from %s", _capability().lower(), build_dir())
        except Exception as e:  # no compiler, no headers, a failed build: the torch-op path still works
            log.warning("could not build the compiled kernels (%s): the fast decoder uses its torch-op path, "
                        "about half the speed on small models, and GRPO the model's own forward. "
                        "`python -m trainer.kernels` shows the build log.",
                        str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__)
    _state["op"] = op
    return op


def _load(verbose: bool = False):
    """Load the built library, building it first if need be. Ranks and runs that start together
    build it once: they take an flock on the build folder, which the OS releases if its holder dies.
    torch's builder keeps its own lock file there, which a builder killed mid-build (SIGKILL) leaves
    behind and every later builder would wait on forever; under the flock no builder is alive, so
    such a file is stale and removed, and so are the compilers' temporary files, which they write under
    the build folder's `tmp/` (under TMPDIR, a killed build would leave them in /tmp for good).
    `.complete` names the library once a build has loaded."""
    import fcntl
    import shutil

    import torch
    from torch.utils.cpp_extension import load

    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    done = out / ".complete"
    with open(out / "build.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        if done.exists() and (out / done.read_text().strip()).is_file():
            torch.ops.load_library(str(out / done.read_text().strip()))
            return torch.ops.posttrain
        (out / "lock").unlink(missing_ok=True)
        scratch = out / "tmp"
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir()
        flags = ["-O3", "-fopenmp", *ARCH_FLAGS.get(_capability(), [])]
        saved = os.environ.get("TMPDIR")
        os.environ["TMPDIR"] = str(scratch)  # ninja and the compilers inherit the environment
        try:
            # a plain shared library registering the op (no Python module)
            load(name="posttrain_kernels", sources=[str(f) for f in SOURCES], extra_cflags=flags,
                 build_directory=str(out), is_python_module=False, verbose=verbose)
        finally:
            if saved is None:
                os.environ.pop("TMPDIR", None)
            else:
                os.environ["TMPDIR"] = saved
            shutil.rmtree(scratch, ignore_errors=True)
        built = max(out.glob("posttrain_kernels*.so"), key=lambda f: f.stat().st_mtime)
        done.write_text(built.name + "\n")
    return torch.ops.posttrain


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if os.environ.get("POSTTRAIN_KERNELS", "1") == "0":
        print("POSTTRAIN_KERNELS=0: the compiled kernel is off")
        return
    _load(verbose="-v" in sys.argv)
    print(f"kernels: {build_dir()}")


if __name__ == "__main__":
    main()
