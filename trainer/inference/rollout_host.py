"""posttrain's front for an SGLang server on a machine that does not share the trainer's disk.

    python -m trainer.inference.rollout_host --model s3://bucket/root/<sft stage>/model \\
        --listen 10.0.0.7:30000 [--device cpu] [--dtype float32] [-- <more sglang.launch_server arguments>]

Run on the rollout machine, from posttrain's environment, with the artifact store's credentials
(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...). It launches one SGLang server there, as a training stage
launches its own (from the SGLang environment, listening on loopback only, stopped with this
process), and listens on --listen, the URL the trainer's `rollout.sglang.urls` names:
- POST /posttrain/update_weights_from_store {"url": .., "version": ..}: downloads the committed
  weights folder at `url` (trainer/inference/store_sync.py: READY.json first, every file's size
  checked) into this machine's scratch and has SGLang load it as weight version `version`, then
  removes the previous copy. Answers 200 {"success": true, "seconds": {"download": .., "load": ..}},
  or 400 {"success": false, "message": ..}, SGLang keeping the weights it had.
- anything else (/generate, /health, /get_server_info, ...) goes to SGLang as it is.
SIGTERM or SIGINT stops the server and removes the scratch folder.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import signal
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import requests

from trainer import storage
from trainer.config import SGLangConfig
from trainer.errors import InputError
from trainer.inference.sglang import STORE_PATH, SGLangEngine
from trainer.inference.store_sync import fetch

log = logging.getLogger("posttrain.rollout_host")
PASSED_HEADERS = ("content-type",)


class RolloutHost:
    """One SGLang server behind the front; the weights it loads live in `scratch`."""

    def __init__(self, engine: SGLangEngine, scratch: Path) -> None:
        self.engine, self.scratch = engine, scratch
        self.upstream = engine.servers[0].url
        self.lock = threading.Lock()  # one load at a time
        self.loaded: Path | None = None
        self.count = 0
        self.session = requests.Session()

    def load_from_store(self, url: str, version: str) -> dict[str, float]:
        with self.lock:
            self.count += 1
            dest = self.scratch / f"weights-{self.count}"
            t0 = time.perf_counter()
            try:
                fetch(url, dest)
                t1 = time.perf_counter()
                self.engine.update_weights(str(dest), version)
            except BaseException:
                shutil.rmtree(dest, ignore_errors=True)
                raise
            previous, self.loaded = self.loaded, dest
            if previous is not None:
                shutil.rmtree(previous, ignore_errors=True)
            log.info("loaded %s from %s (%.2f s download, %.2f s load)", version, url, t1 - t0,
                     time.perf_counter() - t1)
            return {"download": t1 - t0, "load": time.perf_counter() - t1}


def handler_for(host: RolloutHost) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args) -> None:  # requests are not logged one by one
            pass

        def _reply(self, status: int, body: bytes, content_type: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _body(self) -> bytes:
            n = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(n) if n else b""

        def _store_load(self) -> None:
            try:
                req = json.loads(self._body() or b"{}")
                url, version = req["url"], req["version"]
                if not isinstance(url, str) or not isinstance(version, str):
                    raise KeyError("url")
            except (ValueError, KeyError, TypeError):
                self._reply(400, json.dumps({"success": False, "message": "the body must be JSON "
                                             '{"url": <store URL>, "version": <name>}'}).encode())
                return
            try:
                seconds = host.load_from_store(url, version)
            except (InputError, OSError) as exc:
                self._reply(400, json.dumps({"success": False, "message": str(exc)}).encode())
                return
            self._reply(200, json.dumps({"success": True, "version": version, "seconds": seconds}).encode())

        def _pass(self, method: str) -> None:
            body = self._body() if method == "POST" else None
            headers = {k: v for k, v in self.headers.items() if k.lower() in PASSED_HEADERS}
            try:
                resp = host.session.request(method, host.upstream + self.path, data=body, headers=headers,
                                            timeout=host.engine.timeout)
            except requests.RequestException as exc:
                self._reply(502, json.dumps({"success": False, "message": f"SGLang behind this front: {exc}"}).encode())
                return
            self._reply(resp.status_code, resp.content, resp.headers.get("Content-Type", "application/json"))

        def do_POST(self) -> None:  # noqa: N802 (http.server's names)
            if self.path == STORE_PATH:
                self._store_load()
            else:
                self._pass("POST")

        def do_GET(self) -> None:  # noqa: N802
            self._pass("GET")

    return Handler


def fetch_model(model: str, scratch: Path) -> Path:
    """The starting model as a local folder: `model` itself, or a store folder downloaded."""
    if not storage.is_remote(model):
        if not (Path(model) / "config.json").is_file():
            raise InputError(f"--model {model}: no config.json there; give a save_pretrained folder or its store URL")
        return Path(model)
    files = storage.list_files(model)
    if "config.json" not in files:
        raise InputError(f"--model {model}: no config.json there; give the store URL of a save_pretrained folder "
                         "(a stage's model/ folder)")
    dest = scratch / "start"
    storage.get_files(model, list(files), dest)
    return dest


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1:]
    p = argparse.ArgumentParser(prog="python -m trainer.inference.rollout_host", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a save_pretrained folder, local or in the store (s3://...)")
    p.add_argument("--listen", default="127.0.0.1:30000", help="host:port the trainer reaches (default %(default)s)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--dtype", default="bfloat16", help="the trainer's model.dtype")
    p.add_argument("--server-port", type=int, default=31000, help="SGLang's own port, on loopback")
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--python", default=None, help="the SGLang environment's interpreter (default: make sglang-env's)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rollout_host: %(message)s")
    bind, _, port = args.listen.rpartition(":")
    if not bind or not port.isdigit():
        p.error(f"--listen {args.listen!r}: give host:port, e.g. 10.0.0.7:30000")

    def stop(signum, frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    scratch = Path(tempfile.mkdtemp(prefix="posttrain-rollout-host-"))
    engine = None
    try:
        from trainer.tokenizer import load_tokenizer

        model = fetch_model(args.model, scratch)
        cfg = SGLangConfig(launch=True, host="127.0.0.1", device=args.device, base_port=args.server_port,
                           max_total_tokens=args.max_total_tokens, python=args.python, extra_args=extra)
        engine = SGLangEngine.from_config(cfg, str(model), load_tokenizer(model), args.dtype)
        server = ThreadingHTTPServer((bind, int(port)), handler_for(RolloutHost(engine, scratch)))
        server.daemon_threads = True
        log.info("serving %s at http://%s (SGLang at %s)", args.model, args.listen, engine.servers[0].url)
        print(f"posttrain rollout host ready at http://{args.listen} (scratch {scratch})", flush=True)
        try:
            server.serve_forever()
        finally:
            server.server_close()
    except InputError as exc:
        raise SystemExit(f"rollout_host: {exc}") from None
    finally:
        if engine is not None:
            engine.close()
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
