"""``kvconnector proxy`` (tools/proxy.py) against two fake OpenAI servers: the prefill call gets
one token and ``do_remote_decode``, the decode call gets the prefill's ``kv_transfer_params``; a
dead prefill server degrades to a plain decode request. No vLLM needed.

Run::

    python -m pytest tests/test_vllm_proxy.py -q -p no:cacheprovider
"""

from __future__ import annotations

import json
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tools.proxy import serve

pytestmark = pytest.mark.timeout(60)


def fake_server(role: str, seen: list):
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
