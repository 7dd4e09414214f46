"""Minimal prefill/decode request router for two vLLM OpenAI servers using the kvconnector connector.

For each ``POST /v1/completions`` or ``/v1/chat/completions``:

1. the request goes to a prefill server with ``max_tokens=1``, ``stream=false`` and
   ``kv_transfer_params={"do_remote_decode": true}``; its answer carries the
   ``kv_transfer_params`` the decode side needs (endpoint, request id, block ids, ...);
2. the original request goes to a decode server with those ``kv_transfer_params``; its answer
   (streamed when the client asked for ``stream``) is the client's answer.

Prefill and decode servers are picked round-robin. If the prefill server fails, the request
goes to the decode server without parameters (it computes the prompt itself). Standard
library only (``http.server`` + ``urllib``); every upstream call has a timeout.

Usage::

    kvconnector proxy --prefill http://p1:8100 --decode http://d1:8200 --port 8000
"""

from __future__ import annotations

import itertools
import json
import sys
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ROUTES = ("/v1/completions", "/v1/chat/completions")

EXAMPLES = """\
  kvconnector proxy --prefill http://p1:8100 --decode http://d1:8200 --port 8000
  kvconnector proxy --prefill http://p1:8100 --prefill http://p2:8100 --decode http://d1:8200 --decode http://d2:8200
"""


def add_arguments(p) -> None:
    p.add_argument("--prefill", action="append", required=True, metavar="URL",
                   help="prefill server base URL (repeat for several)")
    p.add_argument("--decode", action="append", required=True, metavar="URL",
                   help="decode server base URL (repeat for several)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (loopback by default)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per upstream request")


def _post(url: str, body: dict, timeout: float):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def prefill_request(body: dict) -> dict:
    """The request sent to the prefill server: one token, no streaming, asks for remote decode."""
    pre = dict(body, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    pre.pop("stream_options", None)
    if "max_completion_tokens" in pre:
        pre["max_completion_tokens"] = 1
    return pre


class Router:
    """Round-robin choice of prefill and decode servers (thread-safe)."""

    def __init__(self, prefill: list, decode: list, timeout: float) -> None:
        self._pre, self._dec = itertools.cycle(prefill), itertools.cycle(decode)
        self._lock, self.timeout = threading.Lock(), timeout

    def pick(self) -> tuple[str, str]:
        with self._lock:
            return next(self._pre).rstrip("/"), next(self._dec).rstrip("/")


def make_handler(router: Router):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):     # one line per request on stderr
            sys.stderr.write(f"proxy: {fmt % args}\n")

        def _reply(self, code: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):  # noqa: N802 (http.server's name)
            if self.path not in ROUTES:
                return self._reply(404, {"error": f"unknown route {self.path}; expected one of {list(ROUTES)}"})
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            except ValueError as e:
                return self._reply(400, {"error": f"request body is not JSON: {e}"})
            if not isinstance(body, dict):
                return self._reply(400, {"error": f"request body: expected a JSON object, got {type(body).__name__}"})
            # kv_transfer_params are the router's: a client's own would name a prefill endpoint for
            # the decode server to pull from, so they are never forwarded
            body.pop("kv_transfer_params", None)
            pre_url, dec_url = router.pick()
            try:
                with _post(pre_url + self.path, prefill_request(body), router.timeout) as r:
                    answer = json.loads(r.read())
                params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
                if not isinstance(params, dict):
                    raise ValueError(f"no kv_transfer_params object in its answer (got {params!r:.80})")
            except (urllib.error.URLError, OSError, ValueError) as e:
                self.log_message("prefill %s failed (%s); decode computes the prompt", pre_url, e)
                params = None
            out = dict(body)
            if params:
                out["kv_transfer_params"] = params
            try:
                resp = _post(dec_url + self.path, out, router.timeout)
            except urllib.error.HTTPError as e:
                return self._reply(e.code, {"error": e.read().decode(errors="replace")})
            except (urllib.error.URLError, OSError) as e:
                return self._reply(502, {"error": f"decode server {dec_url}: {e}"})
            with resp:
                self.send_response(resp.status)
                self.send_header("Content-Type", resp.headers.get("Content-Type", "application/json"))
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                while True:
                    chunk = resp.read1(65536) if hasattr(resp, "read1") else resp.read(65536)
                    if not chunk:
                        break
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")

    return Handler


def serve(prefill: list, decode: list, host: str = "127.0.0.1", port: int = 8000,
          timeout: float = 600.0) -> ThreadingHTTPServer:
    """Start the router on a background thread; returns the server (``shutdown()`` stops it)."""
    server = ThreadingHTTPServer((host, port), make_handler(Router(prefill, decode, timeout)))
    threading.Thread(target=server.serve_forever, name="kvc-proxy", daemon=True).start()
    return server


def run(args) -> int:
    server = ThreadingHTTPServer((args.host, args.port), make_handler(Router(args.prefill, args.decode, args.timeout)))
    print(f"kvconnector proxy on http://{args.host}:{server.server_address[1]}: prefill {args.prefill}, "
          f"decode {args.decode}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
