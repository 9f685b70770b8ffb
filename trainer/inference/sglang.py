"""Rollouts from SGLang servers over their native HTTP API.

- environment: SGLang pins its own torch and transformers, so launched servers run from their own
  interpreter (`rollout.sglang.python`; by default the one `make sglang-env` builds under
  `$POSTTRAIN_SGLANG_HOME`, keyed by the pins in `deployments/sglang/`).
- launch: `<python> trainer/inference/sglang_server.py --parent-pid <this process> -- --model-path ...`, one
  process group per server, waited on with GET /health. The wrapper runs SGLang's own
  `sglang.launch_server` unchanged and takes the whole server down when the process that started
  it is gone, even after a SIGKILL. Or connect to running servers (`rollout.sglang.urls`).
- generate: POST /generate with `input_ids`, one `sampling_params` per prompt (sample i of a call
  gets seed base + i) and `return_logprob`; each result's `meta_info.output_token_logprobs` holds
  `[logprob, token_id, text]` per generated token, `meta_info.finish_reason.type` is "stop" or
  "length". Every copy of a prompt goes to one server (its prefix cache), distinct prompts round-robin.
- weights, by tensor (`rollout.sglang.weight_sync: tensor`, servers on this machine): in
  one weight-update session a server (/begin_weight_update, /end_weight_update), chunks of the
  weights go by POST /update_weights_from_tensor. The request carries names only: torch's pickling
  puts CPU tensors in shared-memory files (its `file_system` strategy) and CUDA tensors behind IPC
  handles, which a server on this machine maps and copies from. No folder is written.
- weights, from disk (the default): POST /update_weights_from_disk
  {"model_path": ...} on every server. SGLang answers 200 `{"success": true}`, or 400
  `{"success": false, "message": ...}` and keeps the old weights.
- weights, through the artifact store (`weight_sync: store`, servers on other machines): the folder
  is uploaded under `<artifact_root>/rollout-weights/`, its READY marker written last, and each
  server's posttrain front (`python -m trainer.inference.rollout_host` on the server's machine)
  downloads it and loads it from its own disk (POST /posttrain/update_weights_from_store).
- weight versions: every update names the version it loads (`weight_version`; SGLang then answers
  each /generate with it in `meta_info.weight_version`). Once a version is loaded, a reply from
  another one, from weights something else loaded into a server, fails the round, naming the server.

An unreachable server, a dead server process, a time-out or an error reply raises `SGLangError`
naming the server and what to check. Faults are not retried here: the round fails, the stage's
task fails, and a re-run resumes from the last checkpoint with fresh servers.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import socket
import subprocess
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from threading import Thread
from typing import TYPE_CHECKING, Callable

import requests

from trainer.config import SGLangConfig
from trainer.errors import InputError
from trainer.inference.generate import Generation, too_long

if TYPE_CHECKING:  # torch is imported where weights are sent: a server can be started without it
    import torch

log = logging.getLogger(__name__)

PINS_DIR = Path(__file__).resolve().parents[2] / "deployments" / "sglang"
SERVER_WRAPPER = Path(__file__).resolve().parent / "sglang_server.py"
CPU_DEFAULT_MAX_TOTAL_TOKENS = 8192
TENSOR_CHUNK_BYTES = 512 << 20  # weights in shared memory at once during a tensor sync
STORE_PATH = "/posttrain/update_weights_from_store"  # trainer/inference/rollout_host.py's own request


class SGLangError(InputError):
    pass


# ---------------------------------------------------------------- the server's environment

def pin_files(device: str) -> list[Path]:
    """The requirement files an SGLang environment for `device` is built from (cpu or cuda)."""
    files = [PINS_DIR / "requirements.txt"]
    if device == "cuda":
        files.append(PINS_DIR / "requirements-cuda.txt")
    return files


def env_dir(device: str) -> Path:
    """Where `make sglang-env` puts the environment: keyed by its pins, shared by every clone."""
    h = hashlib.sha256()
    for f in pin_files(device):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    home = Path(os.environ.get("POSTTRAIN_SGLANG_HOME", Path.home() / ".cache" / "posttrain"))
    return home / f"sglang-{device}-{h.hexdigest()[:12]}"


def server_python(cfg: SGLangConfig) -> str:
    """The interpreter launched servers run under (not checked; see `check_server_python`)."""
    return cfg.python or str(env_dir(cfg.device) / "bin" / "python")


def has_cuda_device() -> bool:
    """A CUDA device this machine's processes can use: torch sees one, or the NVIDIA driver's tool is
    here (posttrain's own torch may be a CPU build where the servers' is not)."""
    import shutil

    import torch

    return torch.cuda.is_available() or shutil.which("nvidia-smi") is not None


def check_server_python(cfg: SGLangConfig) -> str | None:
    """None if launched servers can start from `server_python(cfg)`, else what is wrong and the fix:
    GPU servers need a CUDA device; the interpreter exists and finds sglang and, in CPU mode, `sgl_kernel` (SGLang's CPU mode imports
    compiled CPU kernels from it at start), with rollout.sglang.env's PYTHONPATH."""
    flag = "" if cfg.device == "cuda" else " SGLANG_DEVICE=cpu"  # `make sglang-env`'s
    if cfg.device == "cuda" and not has_cuda_device():
        return ("rollout.sglang.device=cuda: this machine has no CUDA device (torch sees none, and there is no "
                "nvidia-smi); run the servers in CPU mode with rollout.sglang.device=cpu, rollouts in process with "
                "rollout.engine=hf, or give rollout.sglang.urls of servers running elsewhere")
    if cfg.python:
        if not Path(cfg.python).is_file():
            return f"rollout.sglang.python: {cfg.python!r} does not exist; point it at an interpreter that has sglang"
    elif not (env_dir(cfg.device) / ".complete").is_file():
        return (f"rollout.sglang.python is unset and no SGLang environment is built at {env_dir(cfg.device)}; "
                f"build it with `make sglang-env{flag}`, or set rollout.sglang.python")
    python = server_python(cfg)
    wanted = ["sglang"] + (["sgl_kernel"] if cfg.device == "cpu" else [])
    # found, not imported: a few tens of milliseconds, nothing of torch
    probe = ("import importlib.util, sys; "
             "print(' '.join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))")
    try:
        out = subprocess.run([python, "-c", probe, *wanted], env={**os.environ, **cfg.env}, capture_output=True,
                             text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"rollout.sglang.python: {python} cannot be run ({exc}); point it at an interpreter that has sglang"
    missing = out.stdout.split() if out.returncode == 0 else wanted
    if "sglang" in missing and cfg.python:
        return f"rollout.sglang.python: {python} cannot import sglang; point it at an interpreter that has sglang"
    if "sglang" in missing:
        return (f"the SGLang environment at {env_dir(cfg.device)} cannot import sglang; build it again with "
                f"`rm -rf {env_dir(cfg.device)} && make sglang-env{flag}`, or set rollout.sglang.python")
    if "sgl_kernel" in missing:
        return ("rollout.sglang.device=cpu: SGLang's CPU mode imports compiled CPU kernels from sgl_kernel, which "
                f"{python} cannot import (the package registry has no CPU build of sglang-kernel); run rollouts "
                "in process with rollout.engine=hf, or put a CPU build of sgl_kernel on the servers' PYTHONPATH "
                "(rollout.sglang.env: posttrain's tests use tests/sglang_cpu, a plain-torch stand-in for the two "
                "kernels a dense model calls)")
    return None


# ---------------------------------------------------------------- launching

def server_gpu_positions(cfg: SGLangConfig, i: int) -> list[int]:
    """Launched server i's GPUs as positions among the GPUs this process may use."""
    first = cfg.first_gpu + i * cfg.gpus_per_server
    return list(range(first, first + cfg.gpus_per_server))


def server_gpus(cfg: SGLangConfig, i: int, visible: str | None = None) -> str:
    """CUDA_VISIBLE_DEVICES of launched server i: its positions picked from the list this process
    inherited (`visible`, default $CUDA_VISIBLE_DEVICES: a SLURM allocation, a worker pinned to some
    GPUs), entries passed on as written (indices or UUIDs); physical GPU numbers when none is set."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    positions = server_gpu_positions(cfg, i)
    if visible is None:
        return ",".join(str(p) for p in positions)
    gpus = [g.strip() for g in visible.split(",") if g.strip()]
    if positions[-1] >= len(gpus):
        raise SGLangError(
            f"SGLang server {i} needs GPU positions {positions[0]}..{positions[-1]} (rollout.sglang.first_gpu="
            f"{cfg.first_gpu}, gpus_per_server={cfg.gpus_per_server}), but CUDA_VISIBLE_DEVICES={visible!r} lists "
            f"{len(gpus)} GPU(s); lower rollout.sglang.first_gpu, gpus_per_server or num_servers, or give this "
            "process more GPUs")
    return ",".join(gpus[p] for p in positions)


def launch_command(cfg: SGLangConfig, model_path: str, port: int, dtype: str = "bfloat16",
                   parent_pid: int | None = None) -> list[str]:
    """The command line of one launched server (SGLang's own launch_server under the wrapper).

    `dtype` is the policy's (model.dtype): SGLang's default, "auto", would serve a float32
    checkpoint in float16, and the rollouts' logprobs would drift from the trainer's."""
    cmd = [server_python(cfg), str(SERVER_WRAPPER), "--parent-pid", str(parent_pid or os.getpid()), "--",
           "--model-path", model_path, "--dtype", dtype, "--host", cfg.host, "--port", str(port),
           "--tp", str(cfg.gpus_per_server), "--mem-fraction-static", str(cfg.mem_fraction_static)]
    max_tokens = cfg.max_total_tokens
    if cfg.device == "cpu":
        # an idle CPU-mode scheduler otherwise busy-polls the cores the trainer needs. SGLang's own
        # warmup gives its HTTP server a fixed 120 s to come up and then kills the server; on 2 busy
        # cores that start took longer (seen with two servers starting at once beside a trainer), so
        # readiness is left to wait_healthy's GET /health (a real one-token request through the
        # scheduler) within rollout.sglang.startup_timeout_s
        cmd += ["--device", "cpu", "--sleep-on-idle", "--skip-server-warmup"]
        max_tokens = max_tokens or CPU_DEFAULT_MAX_TOTAL_TOKENS
    if max_tokens:
        cmd += ["--max-total-tokens", str(max_tokens)]
    return cmd + list(cfg.extra_args)


def server_cpus(cfg: SGLangConfig, i: int) -> list[int]:
    """The cores launched server i is pinned to ([]: not pinned). In CPU mode several servers split
    the cores (rollout.sglang.cpus, or those this process may use) in contiguous shares: each
    server's thread pool spans the cores it may use, and two pools spinning on the same cores ran
    a round's generation 15x slower than one server alone (2 servers on 2 cores: 27 s against
    1.6 s for 64 samples of 48 tokens)."""
    cores = list(cfg.cpus)
    if cfg.device == "cpu" and cfg.num_servers > 1:
        cores = cores or sorted(os.sched_getaffinity(0))
        n = cfg.num_servers
        if len(cores) >= n:
            return cores[i * len(cores) // n:(i + 1) * len(cores) // n]
    return cores


def server_env(cfg: SGLangConfig, i: int) -> dict[str, str]:
    """The environment variables launched server i gets on top of this process's."""
    env = {"SGLANG_USE_CPU_ENGINE": "1"} if cfg.device == "cpu" else {"CUDA_VISIBLE_DEVICES": server_gpus(cfg, i)}
    cpus = server_cpus(cfg, i)
    if cpus:  # the wrapper pins itself before SGLang starts, so every thread and child inherits it
        env["POSTTRAIN_SERVER_CPUS"] = ",".join(str(c) for c in cpus)
    return {**env, **cfg.env}


PORT_SCAN = 100


def syncs_by_tensor(cfg: SGLangConfig) -> bool:
    """Whether each round's weights go by tensor (`weight_sync: tensor`) rather than as a folder.
    Not the default: in CPU mode the folder is faster (SmolLM2-135M 0.9-1.3 s saved and loaded, against
    2.0-5.1 s by tensor: two copies into shared memory, then the server's; tests/test_smollm2_sglang.py),
    and on GPUs the CUDA IPC path has not run (a handle names the trainer's device index, which a
    server with other visible GPUs numbers differently)."""
    return cfg.weight_sync == "tensor"


def free_ports(host: str, base: int, n: int) -> list[int]:
    """The first `n` ports from `base` up that a server could listen on: another run's servers on
    this machine hold theirs, so concurrent runs do not collide."""
    ports = [p for p in range(base, min(base + PORT_SCAN, 65536)) if not port_taken(host, p)][:n]
    if len(ports) < n:
        raise SGLangError(f"rollout.sglang: fewer than {n} free ports on {host} in {base}-{base + PORT_SCAN - 1} "
                          "(other servers or earlier runs still up?); stop them or set rollout.sglang.base_port")
    if ports != list(range(base, base + n)):
        log.info("ports from rollout.sglang.base_port=%d are taken; SGLang servers use %s", base, ports)
    return ports


def port_taken(host: str, port: int) -> bool:
    """Whether a server could not listen on host:port. Binds as uvicorn does (SO_REUSEADDR), so the
    closed connections of an earlier server on the port (TIME_WAIT) do not count."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


BIND_FAILED = ("address already in use", "[Errno 98]")  # uvicorn's error when its port is taken


SCRATCH_PREFIX = "posttrain-sglang-"


def server_scratch() -> Path:
    """A new temp folder for one launched CPU-mode server (its TMPDIR): SGLang names its ZMQ sockets with
    temp files and never removes them, so `_Server.stop` removes the folder. Named after this machine
    and process; each call first removes this machine's folders whose process is gone (a run killed
    before it could stop its servers)."""
    import tempfile

    from trainer.procwatch import host_tag, sweep_dead

    temp, mine = Path(tempfile.gettempdir()), f"{SCRATCH_PREFIX}{host_tag()}-"
    if len(str(temp)) > 40 and Path("/tmp").is_dir():  # a unix socket's path has at most 107 characters
        temp = Path("/tmp")
    sweep_dead(temp, mine)
    return Path(tempfile.mkdtemp(prefix=f"{mine}{os.getpid()}-", dir=temp))


SHM_PREFIX = "sglang_"  # SGLang's shared memory in /dev/shm (its load reports), left behind when it stops


class _Server:
    def __init__(self, url: str, proc: subprocess.Popen | None = None,
                 relaunch: Callable[[], _Server] | None = None, scratch: Path | None = None) -> None:
        self.url, self.proc, self.relaunch, self.scratch = url.rstrip("/"), proc, relaunch, scratch
        self._shm: set[str] = set()  # the shared memory its processes held when it was killed
        self._killed = False  # close() kills every server before stopping each: one /proc scan each
        self.log_tail: deque[str] = deque(maxlen=60)
        self.bind_failed = False  # its HTTP server found the port taken (and exited, uvicorn's code 3)
        self._drainer: Thread | None = None
        if proc is not None and proc.stdout is not None:
            self._drainer = Thread(target=self._drain, daemon=True)
            self._drainer.start()

    def _drain(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log_tail.append(line.rstrip())
            if any(b in line for b in BIND_FAILED):
                self.bind_failed = True

    def lost_its_port(self) -> bool:
        """Whether this launched server exited because its port was taken after it was chosen (by
        another process: the check and the bind are a minute apart while the model loads)."""
        if self.proc is None or self.proc.poll() is None:
            return False
        if self._drainer is not None:
            self._drainer.join(timeout=5)  # the output's last lines
        return self.bind_failed

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            if self._drainer is not None:
                self._drainer.join(timeout=5)  # its last lines, which say why it exited
            tail = "\n".join(self.log_tail)
            raise SGLangError(f"SGLang server {self.url} exited with code {self.proc.returncode}; its last "
                              f"output:\n{tail}")

    def kill(self) -> None:
        """SIGKILL the server's process group, noting first the shared memory its processes hold."""
        from trainer.procwatch import group_shared_memory

        if self.proc is None or self._killed:
            return
        self._shm |= group_shared_memory(self.proc.pid, SHM_PREFIX)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._killed = True

    def stop(self, wait_s: float = 20.0) -> None:
        """SIGKILL the server's process group, then remove the files SGLang leaves: its temp folder
        (ZMQ sockets) and its shared memory. Nothing is in flight when posttrain stops a server, and
        SIGTERM bought no cleanup: SGLang answered it by draining, or (a child terminated first) by
        a 5 s pause for crash diagnostics, 5 to 8 s a stop on 2 cores, and left the same files."""
        from trainer.procwatch import group_gone, remove_folder

        if self.proc is None:
            return
        self.kill()
        self.proc.wait()
        deadline = time.monotonic() + wait_s  # the children
        while not group_gone(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        # with the shared memory the server noted in its folder (one that died before this stop held none)
        remove_folder(self.scratch, self._shm)


# ---------------------------------------------------------------- the engine

MAX_RELAUNCHES = 2  # per engine, for ports taken between their choice and the server's bind
PROGRESS_PIECES = 8  # requests a server at once when a call's progress is counted (all in flight together)


class SGLangEngine:
    # generate() may be called from several threads at once: a round's chunks are all sent together,
    # and the servers batch them (trainer/rl/orchestrator.py)
    concurrent = True

    def __init__(self, servers: list[_Server], tok, request_timeout_s: float = 600.0, tensor_sync: bool = False,
                 tp_size: int = 1) -> None:
        if not servers:
            raise SGLangError("rollout.sglang: no servers; set rollout.sglang.urls or launch: true")
        self.servers, self.tok, self.timeout = servers, tok, request_timeout_s
        # weights by update_weights_from_tensor (servers on this machine), else a folder each round
        self.tensor_sync, self.tp_size = tensor_sync, tp_size
        self._session = requests.Session()
        self.relaunched = 0  # launched servers started again because their port was taken (wait_healthy)
        # the servers' longest prompt + 1 (SGLang's max_req_input_len: the model's context, or its KV
        # pool, less 6), read once they are healthy; None: not known, every prompt is sent as it is
        self.prompt_limit: int | None = None
        # the weights' version every /generate reply must carry (None: not checked, nothing loaded yet)
        self.version: str | None = None

    @classmethod
    def from_config(cls, cfg: SGLangConfig, model_path: str, tok, dtype: str = "bfloat16") -> "SGLangEngine":
        """Connect to `cfg.urls`, or launch `cfg.num_servers` servers on `model_path`; healthy on return.
        Launched servers are stopped again if any of them fails to come up."""
        tensor_sync = syncs_by_tensor(cfg)
        tp = cfg.gpus_per_server if cfg.device == "cuda" else 1
        if cfg.urls:
            engine = cls([_Server(u) for u in cfg.urls], tok, cfg.request_timeout_s, tensor_sync, tp)
        elif cfg.launch:
            problem = check_server_python(cfg)
            if problem:
                raise SGLangError(problem)
            servers: list[_Server] = []
            used: set[int] = set()

            def launch(i: int, port: int) -> _Server:
                cmd = launch_command(cfg, model_path, port, dtype)
                log.info("launching SGLang: %s", " ".join(cmd))
                # CPU mode: a temp folder of its own (on a GPU, not yet run: caches such as
                # TorchInductor's default to the temp folder and must outlive the server)
                scratch = server_scratch() if cfg.device == "cpu" else None
                env = {**os.environ, **({"TMPDIR": str(scratch)} if scratch else {}), **server_env(cfg, i)}
                proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        start_new_session=True)
                used.add(port)
                # on the next free port above every one this engine has used (one of them may be
                # loading its model, not yet listening)
                return _Server(f"http://{cfg.host}:{port}", proc,
                               relaunch=lambda: launch(i, free_ports(cfg.host, max(used) + 1, 1)[0]), scratch=scratch)

            try:
                ports = free_ports(cfg.host, cfg.base_port, cfg.num_servers)
                for i, port in enumerate(ports):
                    servers.append(launch(i, port))
            except BaseException:
                for s in servers:  # the ones already started
                    s.stop()
                raise
            engine = cls(servers, tok, cfg.request_timeout_s, tensor_sync, tp)
        else:
            raise SGLangError("rollout.sglang: urls is empty and launch is false; give server URLs or launch: true")
        engine.wait_healthy(cfg.startup_timeout_s)
        return engine

    def wait_healthy(self, timeout_s: float) -> None:
        """Every server answers GET /health with 200 (503 while it warms up). Stops launched servers
        and raises SGLangError if one dies or is not healthy in time."""
        deadline = time.monotonic() + timeout_s
        try:
            for i in range(len(self.servers)):
                while True:
                    s = self.servers[i]
                    if s.relaunch is not None and self.relaunched < MAX_RELAUNCHES and s.lost_its_port():
                        s.stop()
                        self.servers[i] = s.relaunch()
                        self.relaunched += 1
                        log.warning("SGLang server %s exited: its port was taken after it was chosen; launched "
                                    "again as %s", s.url, self.servers[i].url)
                        continue
                    s.check_alive()
                    try:
                        if self._session.get(f"{s.url}/health", timeout=5).status_code == 200:
                            break
                    except requests.RequestException:
                        pass
                    if time.monotonic() > deadline:
                        raise SGLangError(f"SGLang server {s.url} not healthy after {timeout_s:.0f}s; check that it "
                                          "is running and reachable (rollout.sglang.urls) or raise "
                                          "rollout.sglang.startup_timeout_s")
                    time.sleep(0.5)
        except BaseException:
            self.close()
            raise
        self.prompt_limit = self._read_prompt_limit()

    def _read_prompt_limit(self) -> int | None:
        """The smallest `max_req_input_len` the servers report (GET /get_server_info): SGLang refuses
        a prompt that long or longer, and a request whose prompt and max_new_tokens pass the model's
        context. None where a server does not say (another SGLang version)."""
        limits = []
        for s in self.servers:
            try:
                info = self._session.get(f"{s.url}/get_server_info", timeout=10).json()
            except (requests.RequestException, ValueError):
                return None
            limit = info.get("max_req_input_len") if isinstance(info, dict) else None
            if not isinstance(limit, int) or limit <= 0:
                log.info("SGLang server %s does not report max_req_input_len: prompts go as they are", s.url)
                return None
            limits.append(limit)
        return min(limits)

    def _post(self, server: _Server, path: str, payload: dict) -> tuple[int, object]:
        """(status, parsed body). Raises SGLangError if the server is dead, unreachable or times out."""
        server.check_alive()
        try:
            resp = self._session.post(f"{server.url}{path}", json=payload, timeout=self.timeout)
        except requests.Timeout:
            raise SGLangError(f"SGLang server {server.url} did not answer {path} within {self.timeout:.0f}s "
                              "(rollout.sglang.request_timeout_s); check that it is not stuck or overloaded") from None
        except requests.RequestException as exc:
            server.check_alive()
            raise SGLangError(f"SGLang server {server.url} unreachable on {path}: {exc}; check that it is "
                              "running and that rollout.sglang.urls is right") from None
        try:
            body = resp.json()
        except ValueError:
            body = resp.text
        return resp.status_code, body

    def generate(self, prompts: list[list[int]], params, progress=None) -> list[Generation]:
        """With `progress` (a bar: `update(n)`) each server's prompts go as PROGRESS_PIECES requests at
        once, counted as each is answered; without, one request a server."""
        if not prompts:
            return []
        out: list[Generation | None] = [None] * len(prompts)
        # A prompt the servers would refuse gets no token ("length", as the in-process engines answer
        # one that fills the model's context); the others are sent.
        refused = too_long(prompts, self.prompt_limit)
        for i in refused:
            out[i] = Generation.no_room(prompts[i])
        if progress is not None and refused:
            progress.update(len(refused))
        shards = route(prompts, len(self.servers), skip=out)
        pieces = [(k, piece) for k, idx in enumerate(shards)
                  for piece in _split(idx, PROGRESS_PIECES if progress is not None else 1) if piece]

        def sampling(i: int) -> dict:
            # one seed per sample: with a shared seed the n samples of a group would be identical
            # wherever SGLang honours seeds (see README, "Reproducibility")
            room = self._room(len(prompts[i]), params.max_new_tokens)
            sp = {"temperature": params.temperature, "top_p": params.top_p, "max_new_tokens": room,
                  "min_new_tokens": min(params.min_new_tokens, room), "skip_special_tokens": True}
            if params.seed is not None:
                sp["sampling_seed"] = params.seed + i
            if params.stop:  # SGLang keeps the tokens that complete a stop string in output_ids, as we do
                sp["stop"] = list(params.stop)
            return sp

        def run(k: int, idx: list[int]) -> list[Generation]:
            body = {"input_ids": [prompts[i] for i in idx], "sampling_params": [sampling(i) for i in idx],
                    "return_logprob": True}
            server = self.servers[k]
            status, reply = self._post(server, "/generate", body)
            if status != 200:
                raise SGLangError(f"SGLang server {server.url}/generate answered {status}: {str(reply)[:500]}")
            reply = reply if isinstance(reply, list) else [reply]
            if len(reply) != len(idx):
                raise SGLangError(f"SGLang server {server.url} returned {len(reply)} results for {len(idx)} prompts")
            if self.version is not None:
                for r in reply:
                    self._check_version(server, r)
            return [parse_generation(r, prompts[i], self.tok, server.url) for i, r in zip(idx, reply)]

        if not pieces:
            return out  # type: ignore[return-value]
        # the first failing request fails the call at once, without waiting for the others' replies
        pool = ThreadPoolExecutor(len(pieces))
        futures = {pool.submit(run, k, idx): idx for k, idx in pieces}
        try:
            for fut in as_completed(futures):
                for i, g in zip(futures[fut], fut.result()):
                    out[i] = g
                if progress is not None:
                    progress.update(len(futures[fut]))
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        return out  # type: ignore[return-value]

    def _room(self, prompt_len: int, max_new_tokens: int) -> int:
        """max_new_tokens for a prompt: what SGLang's scheduler grants it anyway (max_req_len -
        prompt - 1, max_req_len = max_req_input_len + 5), asked for outright, so that its
        tokenizer's check (prompt + max_new_tokens within the context) does not refuse the request:
        a response near the context's end is cut there ("length"), as in this process."""
        if self.prompt_limit is None:
            return max_new_tokens
        return max(0, min(max_new_tokens, self.prompt_limit + 4 - prompt_len))

    def _check_version(self, server: _Server, reply: object) -> None:
        meta = reply.get("meta_info") if isinstance(reply, dict) else None
        got = meta.get("weight_version") if isinstance(meta, dict) else None
        if got != self.version:
            raise SGLangError(f"SGLang server {server.url} answered with weights {got!r}, not {self.version!r}, the "
                              "version this process loaded into it: something else loaded weights into the server "
                              "since (another run or client sharing it?). Give each run servers of its own")

    def update_weights(self, model_dir: str | None, version: str | None = None) -> None:
        """Every server loads the model folder `model_dir` (as weight version `version`, which every
        reply must then carry). Raises SGLangError naming the server and the folder if one refuses
        (it then keeps serving its previous weights)."""
        if model_dir is None:
            return
        self.version = None  # until every server has the new weights, no reply is checked against either
        for s in self.servers:
            status, reply = self._post(s, "/update_weights_from_disk", {
                "model_path": model_dir, **({"weight_version": version} if version else {})})
            msg = _refusal(status, reply)
            if msg is not None:
                raise SGLangError(f"SGLang server {s.url} refused new weights from {model_dir} (HTTP {status}): "
                                  f"{msg}; it keeps serving its previous weights. Check that the folder is a "
                                  "complete save_pretrained model readable from the server's machine, or use "
                                  "rollout.sglang.weight_sync=store for servers on other machines")
        self.version = version

    def update_weights_from_store(self, url: str, version: str) -> dict[str, float]:
        """Every server's posttrain front (trainer/inference/rollout_host.py) downloads the committed
        folder at `url` (an artifact-store URL, READY marker written last) and loads it as weight
        version `version`. Returns the slowest server's seconds: {"download": .., "load": ..}."""
        self.version = None
        worst = {"download": 0.0, "load": 0.0}
        for s in self.servers:
            status, reply = self._post(s, STORE_PATH, {"url": url, "version": version})
            if status == 404:
                raise SGLangError(f"SGLang server {s.url} does not take weights from a store (HTTP 404 on {STORE_PATH}):"
                                  " run it behind posttrain's front on its machine (python -m "
                                  "trainer.inference.rollout_host, docs/cluster.md), or use weight_sync=disk")
            msg = _refusal(status, reply)
            if msg is not None:
                raise SGLangError(f"SGLang server {s.url} did not load the weights at {url} (HTTP {status}): {msg}; "
                                  "it keeps serving its previous weights")
            seconds = reply.get("seconds", {}) if isinstance(reply, dict) else {}
            worst = {k: max(v, float(seconds.get(k, 0.0))) for k, v in worst.items()}
        self.version = version
        return worst

    def update_weights_from_tensors(self, weights: dict[str, torch.Tensor], version: str | None = None) -> None:
        """Every server copies `weights` (names as in a save_pretrained folder) from this process's
        memory: chunks of at most TENSOR_CHUNK_BYTES are copied into shared memory (CPU) or exported
        by IPC handle (CUDA), and each server, in one weight-update session, maps and loads them.
        The servers must run on this machine. Raises SGLangError naming the server if one refuses."""
        import base64
        import io
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing as tmp

        chunks: list[list[str]] = [[]]
        size = 0
        for name, t in weights.items():
            if chunks[-1] and size + t.nbytes > TENSOR_CHUNK_BYTES:
                chunks.append([])
                size = 0
            chunks[-1].append(name)
            size += t.nbytes
        opened: list[_Server] = []
        self.version = None
        try:
            for s in self.servers:
                self._expect(s, "/begin_weight_update", {"selector": "all"})
                opened.append(s)
            for k, names in enumerate(chunks):
                # copies: the policy's own storage stays where it is; freed once every server has loaded
                named = [(n, weights[n].detach().clone()) for n in names]
                strategy = tmp.get_sharing_strategy()
                tmp.set_sharing_strategy("file_system")  # files a server maps by name (fd passing needs a child)
                try:
                    buf = io.BytesIO()
                    ForkingPickler(buf).dump(named)
                finally:
                    tmp.set_sharing_strategy(strategy)
                payload = base64.b64encode(buf.getvalue()).decode()
                for s in self.servers:
                    last = k == len(chunks) - 1
                    self._expect(s, "/update_weights_from_tensor", {
                        "serialized_named_tensors": [payload] * self.tp_size, "flush_cache": last,
                        **({"weight_version": version} if version and last else {})})
                del named, buf
            self.version = version
        finally:
            for s in opened:
                try:
                    self._post(s, "/end_weight_update", {})
                except SGLangError:
                    pass  # the error that stopped the update is the one to report

    def _expect(self, server: _Server, path: str, payload: dict) -> None:
        status, reply = self._post(server, path, payload)
        msg = _refusal(status, reply)
        if msg is not None:
            raise SGLangError(f"SGLang server {server.url} refused the policy's weights ({path}, HTTP {status}): "
                              f"{msg}; its weights may be partly updated, so the round stops. The server must run "
                              "on this machine; rollout.sglang.weight_sync=disk sends a saved folder instead")

    def close(self) -> None:
        """Stop the servers this engine launched (never ones it only connected to): all killed
        first, then each waited for and cleaned up."""
        for s in self.servers:
            s.kill()
        for s in self.servers:
            s.stop()


def _refusal(status: int, reply: object) -> str | None:
    """A weight update's reply: None if the server took it, else what it said."""
    if status == 200 and not (isinstance(reply, dict) and reply.get("success") is False):
        return None
    return reply.get("message") if isinstance(reply, dict) else str(reply)[:500]


def _split(idx: list[int], n: int) -> list[list[int]]:
    """`idx` in at most n runs of near-equal length, in order (none when it is empty)."""
    if not idx:
        return []
    n = max(1, min(n, len(idx)))
    size, extra = divmod(len(idx), n)
    bounds = [0]
    for j in range(n):
        bounds.append(bounds[-1] + size + (j < extra))
    return [idx[a:b] for a, b in zip(bounds, bounds[1:])]


def route(prompts: list[list[int]], n_servers: int, skip: list | None = None) -> list[list[int]]:
    """Each server's share of the prompts, as indices in prompt order: every copy of a prompt (a
    group's samples) goes to one server, which prefills it once and serves the rest from its prefix
    cache; distinct prompts go round-robin, in order of first appearance. Prompts whose `skip`
    entry is set (already answered) go nowhere."""
    server_of: dict[tuple[int, ...], int] = {}
    shards: list[list[int]] = [[] for _ in range(n_servers)]
    for i, p in enumerate(prompts):
        if skip is not None and skip[i] is not None:
            continue
        k = server_of.setdefault(tuple(p), len(server_of) % n_servers)
        shards[k].append(i)
    return shards


def parse_generation(reply: dict, prompt_ids: list[int], tok, url: str = "SGLang") -> Generation:
    """One /generate result -> Generation. Raises SGLangError on a malformed or aborted result."""
    meta = reply.get("meta_info") if isinstance(reply, dict) else None
    if not isinstance(meta, dict) or "output_token_logprobs" not in meta:
        raise SGLangError(f"{url}: /generate reply lacks meta_info.output_token_logprobs; the request must "
                          f"set return_logprob (got keys {sorted(reply) if isinstance(reply, dict) else reply!r})")
    entries = meta["output_token_logprobs"] or []
    ids = [int(e[1]) for e in entries]
    missing = [k for k, e in enumerate(entries) if e[0] is None]
    if missing:
        # a zero would weigh in as probability 1 in the trainer/engine importance ratio (TIS)
        raise SGLangError(f"{url}: /generate returned no logprob for generated token(s) at {missing[:8]}; "
                          "the trainer needs every sampled token's logprob")
    logprobs = [float(e[0]) for e in entries]
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type") if isinstance(finish, dict) else str(finish)
    if kind not in ("stop", "length"):
        raise SGLangError(f"{url}: generation ended with finish_reason {finish!r}")
    text = reply.get("text")
    if text is None:
        text = tok.decode(ids, skip_special_tokens=True)
    return Generation(prompt_ids=prompt_ids, token_ids=ids, logprobs=logprobs, text=text, finish_reason=kind,
                      served_by=url)
