"""SGLangEngine's HTTP handling, tested against a loopback stand-in server.

SGLang needs a GPU and cannot run here, so these replies were NOT recorded from a live server:
they are written in the shape SGLang documents and its own tests assert for /generate with
return_logprob (meta_info.output_token_logprobs = [[logprob, token_id, text], ...],
meta_info.finish_reason.type), /health and /update_weights_from_disk. The client code under test
is the real one, over real HTTP. On a GPU machine, docs/gpu.md's check runs it against SGLang.
"""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from trainer.config import SGLangConfig
from trainer.rollout import SamplingParams
from trainer.sglang import SGLangEngine, SGLangError, _Server, launch_command, parse_generation

pytestmark = pytest.mark.sglang_standin


def _reply(prompt_ids):
    # Echo-style reply: tokens 7, 8 then EOS (2); "length" when the prompt is longer than 3 tokens.
    finish = {"type": "length", "length": 3} if len(prompt_ids) > 3 else {"type": "stop", "matched": 2}
    return {"text": "ab", "meta_info": {"id": "x", "prompt_tokens": len(prompt_ids), "completion_tokens": 3,
                                        "output_token_logprobs": [[-0.25, 7, "a"], [-0.5, 8, "b"], [-0.125, 2, None]],
                                        "finish_reason": finish}}


class Handler(BaseHTTPRequestHandler):
    requests_seen: list = []

    def log_message(self, *args):
        pass

    def _send(self, code, obj):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send(200, {}) if self.path == "/health" else self._send(404, {"detail": "Not Found"})

    def do_POST(self):
        payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.requests_seen.append((self.server.server_port, self.path, payload))
        if self.path == "/generate":
            ids = payload["input_ids"]
            self._send(200, [_reply(p) for p in ids] if ids and isinstance(ids[0], list) else _reply(ids))
        elif self.path == "/update_weights_from_disk":
            ok = not payload["model_path"].endswith("bad")
            self._send(200, {"success": ok, "message": "Succeeded" if ok else "Failed to load weights"})
        else:
            self._send(404, {"detail": "Not Found"})


@pytest.fixture
def servers():
    Handler.requests_seen = []
    started = []
    for _ in range(2):
        srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        started.append(srv)
    yield [f"http://127.0.0.1:{s.server_port}" for s in started]
    for s in started:
        s.shutdown()


class Tok:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(96 + i % 26) for i in ids)


def test_generate_round_robin_and_parsing(servers):
    engine = SGLangEngine.from_config(SGLangConfig(urls=servers, startup_timeout_s=5), "unused", Tok())
    prompts = [[1, 2], [1, 2, 3, 4, 5], [4], [5, 6]]
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=3, temperature=0.7, top_p=0.9, seed=5))
    assert [g.prompt_ids for g in gens] == prompts
    assert gens[0].token_ids == [7, 8, 2] and gens[0].logprobs == [-0.25, -0.5, -0.125]
    assert [g.finish_reason for g in gens] == ["stop", "length", "stop", "stop"]
    posts = [r for r in Handler.requests_seen if r[1] == "/generate"]
    assert len({port for port, _, _ in posts}) == 2  # both servers got work
    payload = posts[0][2]
    assert payload["return_logprob"] is True
    assert payload["sampling_params"] == {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 3,
                                          "skip_special_tokens": True, "sampling_seed": 5}
    engine.update_weights("/tmp/new-weights")
    syncs = [r for r in Handler.requests_seen if r[1] == "/update_weights_from_disk"]
    assert len(syncs) == 2 and syncs[0][2] == {"model_path": "/tmp/new-weights"}


def test_refused_weight_update_is_an_error(servers):
    engine = SGLangEngine([_Server(u) for u in servers], Tok())
    with pytest.raises(SGLangError, match="refused new weights.*Failed to load weights"):
        engine.update_weights("/tmp/bad")


def test_unreachable_server_names_url_and_fix():
    engine = SGLangEngine([_Server("http://127.0.0.1:9")], Tok(), request_timeout_s=2)
    with pytest.raises(SGLangError, match=r"127.0.0.1:9 unreachable.*rollout.sglang.urls"):
        engine.generate([[1]], SamplingParams(max_new_tokens=2))
    with pytest.raises(SGLangError, match="not healthy after 1s"):
        SGLangEngine.from_config(SGLangConfig(urls=["http://127.0.0.1:9"], startup_timeout_s=1), "m", Tok())


def test_malformed_and_aborted_replies():
    with pytest.raises(SGLangError, match="return_logprob"):
        parse_generation({"text": "x", "meta_info": {}}, [1], Tok())
    with pytest.raises(SGLangError, match="finish_reason"):
        parse_generation({"text": "x", "meta_info": {"output_token_logprobs": [], "finish_reason": {"type": "abort"}}},
                         [1], Tok())
    g = parse_generation({"meta_info": {"output_token_logprobs": [[None, 3, None]], "finish_reason": {"type": "stop"}}},
                         [1], Tok())
    assert g.text == "c" and g.logprobs == [0.0]


def test_dead_server_process_is_reported(tmp_path):
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "print('CUDA error: no GPU'); raise SystemExit(3)"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    proc.wait()
    server = _Server("http://127.0.0.1:9", proc)
    import time

    time.sleep(0.2)
    with pytest.raises(SGLangError, match="exited with code 3"):
        server.check_alive()


def test_launch_command_shape():
    cmd = launch_command(SGLangConfig(gpus_per_server=2, extra_args=["--dtype", "bfloat16"]), "/m", 30001)
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    assert cmd[cmd.index("--model-path") + 1] == "/m" and cmd[cmd.index("--port") + 1] == "30001"
    assert cmd[cmd.index("--tp") + 1] == "2" and cmd[-2:] == ["--dtype", "bfloat16"]
