"""Rollouts from SGLang servers over their native HTTP API (needs a GPU; `pip install .[gpu]`).

- launch: `python -m sglang.launch_server --model-path ... --port ...`, one process per server,
  waited on with GET /health; or connect to running servers (`rollout.sglang.urls`).
- generate: POST /generate with `input_ids`, `sampling_params` and `return_logprob`; each reply's
  `meta_info.output_token_logprobs` holds `[logprob, token_id, ...]` per generated token and
  `meta_info.finish_reason.type` is "stop" or "length". Prompts go round-robin over servers.
- weights: POST /update_weights_from_disk {"model_path": ...} on every server after a round.

An unreachable server, a dead server process or an error reply raises `SGLangError` naming the
server and what to check.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from threading import Thread

import requests

from trainer.config import SGLangConfig
from trainer.errors import InputError
from trainer.generate import Generation

log = logging.getLogger(__name__)


class SGLangError(InputError):
    pass


class _Server:
    def __init__(self, url: str, proc: subprocess.Popen | None = None) -> None:
        self.url, self.proc = url.rstrip("/"), proc
        self.log_tail: deque[str] = deque(maxlen=40)
        if proc is not None and proc.stdout is not None:
            Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log_tail.append(line.rstrip())

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            tail = "\n".join(self.log_tail)
            raise SGLangError(f"SGLang server {self.url} exited with code {self.proc.returncode}; its last "
                              f"output:\n{tail}")


def server_gpus(cfg: SGLangConfig, i: int) -> str:
    """CUDA_VISIBLE_DEVICES of launched server i."""
    first = cfg.first_gpu + i * cfg.gpus_per_server
    return ",".join(str(first + g) for g in range(cfg.gpus_per_server))


def launch_command(cfg: SGLangConfig, model_path: str, port: int) -> list[str]:
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path, "--host", "127.0.0.1",
            "--port", str(port), "--tp", str(cfg.gpus_per_server),
            "--mem-fraction-static", str(cfg.mem_fraction_static), *cfg.extra_args]


class SGLangEngine:
    def __init__(self, servers: list[_Server], tok, request_timeout_s: float = 600.0) -> None:
        if not servers:
            raise SGLangError("rollout.sglang: no servers; set rollout.sglang.urls or launch: true")
        self.servers, self.tok, self.timeout = servers, tok, request_timeout_s
        self._session = requests.Session()

    @classmethod
    def from_config(cls, cfg: SGLangConfig, model_path: str, tok) -> "SGLangEngine":
        if cfg.urls:
            engine = cls([_Server(u) for u in cfg.urls], tok, cfg.request_timeout_s)
        elif cfg.launch:
            servers = []
            for i in range(cfg.num_servers):
                port = cfg.base_port + i
                env = dict(os.environ)
                env["CUDA_VISIBLE_DEVICES"] = server_gpus(cfg, i)
                cmd = launch_command(cfg, model_path, port)
                log.info("launching SGLang: %s", " ".join(cmd))
                proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        start_new_session=True)
                servers.append(_Server(f"http://127.0.0.1:{port}", proc))
            engine = cls(servers, tok, cfg.request_timeout_s)
        else:
            raise SGLangError("rollout.sglang: urls is empty and launch is false; give server URLs or launch: true")
        engine.wait_healthy(cfg.startup_timeout_s)
        return engine

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for s in self.servers:
            while True:
                s.check_alive()
                try:
                    if self._session.get(f"{s.url}/health", timeout=5).status_code == 200:
                        break
                except requests.RequestException:
                    pass
                if time.monotonic() > deadline:
                    self.close()
                    raise SGLangError(f"SGLang server {s.url} not healthy after {timeout_s:.0f}s; check that it "
                                      "is running and reachable (rollout.sglang.urls) or raise startup_timeout_s")
                time.sleep(1.0)

    def _post(self, server: _Server, path: str, payload: dict) -> object:
        server.check_alive()
        try:
            resp = self._session.post(f"{server.url}{path}", json=payload, timeout=self.timeout)
        except requests.RequestException as exc:
            server.check_alive()
            raise SGLangError(f"SGLang server {server.url} unreachable on {path}: {exc}; check that it is "
                              "running and that rollout.sglang.urls is right") from None
        if resp.status_code != 200:
            raise SGLangError(f"SGLang server {server.url}{path} answered {resp.status_code}: {resp.text[:500]}")
        return resp.json()

    def generate(self, prompts: list[list[int]], params) -> list[Generation]:
        if not prompts:
            return []
        shards: list[list[int]] = [list(range(i, len(prompts), len(self.servers))) for i in range(len(self.servers))]
        sampling = {"temperature": params.temperature, "top_p": params.top_p,
                    "max_new_tokens": params.max_new_tokens, "skip_special_tokens": True}
        if params.seed is not None:
            sampling["sampling_seed"] = params.seed

        def run(k: int) -> list[dict]:
            idx = shards[k]
            if not idx:
                return []
            body = {"input_ids": [prompts[i] for i in idx], "sampling_params": sampling, "return_logprob": True}
            reply = self._post(self.servers[k], "/generate", body)
            return reply if isinstance(reply, list) else [reply]

        with ThreadPoolExecutor(len(self.servers)) as pool:
            replies = list(pool.map(run, range(len(self.servers))))
        out: list[Generation | None] = [None] * len(prompts)
        for k, idx in enumerate(shards):
            if len(replies[k]) != len(idx):
                raise SGLangError(f"SGLang server {self.servers[k].url} returned {len(replies[k])} results "
                                  f"for {len(idx)} prompts")
            for i, r in zip(idx, replies[k]):
                out[i] = parse_generation(r, prompts[i], self.tok)
        return out  # type: ignore[return-value]

    def update_weights(self, model_dir: str | None) -> None:
        if model_dir is None:
            return
        for s in self.servers:
            reply = self._post(s, "/update_weights_from_disk", {"model_path": model_dir})
            if isinstance(reply, dict) and reply.get("success") is False:
                raise SGLangError(f"SGLang server {s.url} refused new weights from {model_dir}: {reply.get('message')}")

    def close(self) -> None:
        for s in self.servers:
            if s.proc is not None and s.proc.poll() is None:
                try:
                    os.killpg(s.proc.pid, signal.SIGTERM)
                    s.proc.wait(timeout=30)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    os.killpg(s.proc.pid, signal.SIGKILL)


def parse_generation(reply: dict, prompt_ids: list[int], tok) -> Generation:
    """One /generate result -> Generation. Raises SGLangError on a malformed or aborted result."""
    meta = reply.get("meta_info") if isinstance(reply, dict) else None
    if not isinstance(meta, dict) or "output_token_logprobs" not in meta:
        raise SGLangError("SGLang /generate reply lacks meta_info.output_token_logprobs; the request must "
                          f"set return_logprob (got keys {sorted(reply) if isinstance(reply, dict) else reply!r})")
    entries = meta["output_token_logprobs"] or []
    ids = [int(e[1]) for e in entries]
    logprobs = [float(e[0]) if e[0] is not None else 0.0 for e in entries]
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type") if isinstance(finish, dict) else str(finish)
    if kind not in ("stop", "length"):
        raise SGLangError(f"SGLang generation ended with finish_reason {finish!r}")
    text = reply.get("text")
    if text is None:
        text = tok.decode(ids, skip_special_tokens=True)
    return Generation(prompt_ids=prompt_ids, token_ids=ids, logprobs=logprobs, text=text, finish_reason=kind)
