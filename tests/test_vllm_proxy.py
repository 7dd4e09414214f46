"""``kvconnector proxy`` (tools/proxy.py) against two fake OpenAI servers: the prefill call gets
one token and ``do_remote_decode``, the decode call gets the prefill's ``kv_transfer_params``; a
dead prefill server degrades to a plain decode request. No vLLM needed.

Run::

    python -m pytest tests/test_vllm_proxy.py -q -p no:cacheprovider
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tools.proxy import serve

pytestmark = pytest.mark.timeout(60)


def fake_server(role: str, seen: list, answer=None):
    """``answer``: what the prefill server answers instead of a completion with kv_transfer_params."""
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((role, self.path, body))
            out = {"choices": [{"text": f"{role}-text"}]}
            if role == "prefill":
                out["kv_transfer_params"] = {"do_remote_prefill": True, "remote_request_id": "r-1",
                                             "remote_block_ids": [3, 4]}
                if answer is not None:
                    out = answer
            data = json.dumps(out).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    s = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=s.serve_forever, daemon=True).start()
    return s


def _ask(port: int, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def test_prefill_then_decode_with_transfer_params():
    seen = []
    pre, dec = fake_server("prefill", seen), fake_server("decode", seen)
    proxy = serve([f"http://127.0.0.1:{pre.server_address[1]}"], [f"http://127.0.0.1:{dec.server_address[1]}"],
                  port=0, timeout=10)
    try:
        out = _ask(proxy.server_address[1], {"model": "m", "prompt": "hi", "max_tokens": 7})
        assert out["choices"][0]["text"] == "decode-text"
        (r1, p1, b1), (r2, p2, b2) = seen
        assert (r1, p1, b1["max_tokens"], b1["kv_transfer_params"]) == ("prefill", "/v1/completions", 1,
                                                                        {"do_remote_decode": True})
        assert (r2, b2["max_tokens"], b2["kv_transfer_params"]["remote_block_ids"]) == ("decode", 7, [3, 4])
        pre.shutdown()
        pre.server_close()          # prefill gone: the decode server computes the prompt itself
        seen.clear()
        out = _ask(proxy.server_address[1], {"model": "m", "prompt": "hi", "max_tokens": 7})
        assert out["choices"][0]["text"] == "decode-text"
        assert [(r, "kv_transfer_params" in b) for r, _, b in seen] == [("decode", False)]
    finally:
        proxy.shutdown()
        dec.shutdown()


def _ask_raw(port: int, data: bytes):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=data,
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_clients_transfer_params_never_reach_the_decode_server():
    """A client's own ``kv_transfer_params`` would name a prefill endpoint for the decode server to
    pull from: the router drops them. With the prefill up the decode server gets the prefill's,
    with it down none."""
    seen = []
    pre, dec = fake_server("prefill", seen), fake_server("decode", seen)
    proxy = serve([f"http://127.0.0.1:{pre.server_address[1]}"], [f"http://127.0.0.1:{dec.server_address[1]}"],
                  port=0, timeout=10)
    forged = {"do_remote_prefill": True, "remote_endpoint": "tcp://203.0.113.9:1", "remote_request_id": "x"}
    try:
        _ask(proxy.server_address[1], {"model": "m", "prompt": "hi", "kv_transfer_params": forged})
        (r1, _, b1), (r2, _, b2) = seen
        assert (r1, b1["kv_transfer_params"], r2, b2["kv_transfer_params"]["remote_request_id"]) == \
            ("prefill", {"do_remote_decode": True}, "decode", "r-1")
        pre.shutdown()
        pre.server_close()
        seen.clear()
        _ask(proxy.server_address[1], {"model": "m", "prompt": "hi", "kv_transfer_params": forged})
        assert [(r, "kv_transfer_params" in b) for r, _, b in seen] == [("decode", False)]
    finally:
        proxy.shutdown()
        dec.shutdown()


@pytest.mark.parametrize("answer", [[1, 2], {"choices": []}, {"kv_transfer_params": "r-1"}])
def test_a_prefill_answer_without_params_degrades_to_a_plain_decode(answer):
    seen = []
    pre, dec = fake_server("prefill", seen, answer), fake_server("decode", seen)
    proxy = serve([f"http://127.0.0.1:{pre.server_address[1]}"], [f"http://127.0.0.1:{dec.server_address[1]}"],
                  port=0, timeout=10)
    try:
        out = _ask(proxy.server_address[1], {"model": "m", "prompt": "hi"})
        assert out["choices"][0]["text"] == "decode-text"
        assert [(r, "kv_transfer_params" in b) for r, _, b in seen] == [("prefill", True), ("decode", False)]
        status, err = _ask_raw(proxy.server_address[1], b"[1, 2]")
        assert status == 400 and err["error"] == "request body: expected a JSON object, got list"
    finally:
        proxy.shutdown()
        pre.shutdown()
        dec.shutdown()
