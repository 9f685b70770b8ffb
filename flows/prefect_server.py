"""The temporary Prefect server of one `posttrain` command, started before the command's imports.

With no Prefect API configured, Prefect starts a temporary server itself, but only when the flow is
called: after torch, prefect and mlflow are imported, and then the command waits ~6 s for it. This
starts the same server (Prefect's API app under uvicorn, UI off, in ephemeral mode, as Prefect's
`SubprocessASGIServer` does) as the command's first act, so its start-up overlaps the imports.

Only a fresh command-line process does this (prefect not yet imported); anything else, a test
calling `main(argv)` or a configured PREFECT_API_URL (environment or profile), is left to Prefect.
"""

from __future__ import annotations

import atexit
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


class TemporaryServer:
    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        self.log: Path | None = None
        self.proc: subprocess.Popen | None = None

    def start(self) -> TemporaryServer:
        """Start the server process (its port was chosen when this was made, so that its URL can be
        named in PREFECT_API_URL before Prefect is imported)."""
        self.log = Path(tempfile.mkstemp(prefix=f"posttrain-prefect-server-{self.port}-", suffix=".log")[1])
        env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1",
               "PREFECT__SERVER_FINAL": "1"}
        with self.log.open("w") as log:
            # a session of its own: a terminal's Ctrl-C (SIGINT to its foreground process group) reaches
            # the command alone, which then reports the interrupted run to this server before it stops it
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "flows.prefect_server", str(os.getpid()), str(self.port), str(self.log)],
                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    @property
    def started(self) -> bool:
        return self.proc is not None

    def wait_healthy(self, timeout: float) -> None:
        if self.proc is None:
            raise RuntimeError("the temporary Prefect server was not started")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the temporary Prefect server exited with code {self.proc.returncode}: "
                                   f"{self._log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.api_url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"the temporary Prefect server on {self.api_url} was not healthy after {timeout:.0f} s "
                           "(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS raises the limit; a server of your "
                           f"own, set in PREFECT_API_URL, skips it): {self._log_tail()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.log is not None:
            self.log.unlink(missing_ok=True)

    def _log_tail(self) -> str:
        text = self.log.read_text(errors="replace") if self.log is not None and self.log.exists() else ""
        return text[-2000:] or "(no output)"


OFF = "POSTTRAIN_EARLY_PREFECT_SERVER"  # "0": leave the server to Prefect


def start_early() -> TemporaryServer | None:
    """A server started now and named in PREFECT_API_URL (so every Prefect client of this process,
    in any thread, and every rank it launches uses it), or None where Prefect should decide."""
    if "prefect" in sys.modules or os.environ.get("PREFECT_API_URL") or os.environ.get(OFF) == "0":
        return None
    server = TemporaryServer().start()
    # stopped at exit, after Prefect's own exit handlers (registered later, run earlier) have sent
    # the last logs and events to it
    atexit.register(server.stop)
    os.environ["PREFECT_API_URL"] = server.api_url
    os.environ.setdefault("PREFECT_UI_URL", "")  # the server has no UI: no "View at" links to it
    return server


def confirm(server: TemporaryServer | None) -> None:
    """Once prefect is imported: if Prefect's own settings (a profile, prefect.toml, .env) name a
    server or forbid temporary ones, stop ours and run the command again as Prefect would."""
    if server is None:
        return
    from prefect.settings import Settings

    os.environ.pop("PREFECT_API_URL")
    try:
        own = Settings()
    finally:
        os.environ["PREFECT_API_URL"] = server.api_url
    if own.api.url is None and own.server.ephemeral.enabled:
        return
    server.stop()
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    os.execve(sys.executable, sys.orig_argv, {**env, OFF: "0"})


def wait(server: TemporaryServer | None) -> None:
    """Return once `server` answers (it is stopped when the command exits)."""
    if server is None:
        return
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS

    server.wait_healthy(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value())
    print(f"posttrain: temporary Prefect server on {server.api_url} for this command "
          "(set PREFECT_API_URL to run against your own)", file=sys.stderr, flush=True)


def serve(parent: int, port: int, log: Path) -> None:
    """The server process: Prefect's API app under uvicorn, and a thread that stops it once the
    command that started it is gone. A command stopped by SIGKILL runs no exit handler, and its
    server would otherwise listen on for good: now it shuts down within a second or two, and
    removes its log, which nobody is left to read."""
    import signal
    import threading

    import uvicorn

    from trainer.procwatch import process_gone

    def watch() -> None:
        while not process_gone(parent):
            time.sleep(0.5)
        log.unlink(missing_ok=True)
        os.kill(os.getpid(), signal.SIGTERM)  # uvicorn's own graceful shutdown

    threading.Thread(target=watch, daemon=True).start()
    uvicorn.run("prefect.server.api.server:create_app", factory=True, host="127.0.0.1", port=port,
                log_level="error", lifespan="on")


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
