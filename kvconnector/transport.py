"""ZeroMQ plumbing: socket setup in one place, and the I/O thread each endpoint runs.

ZeroMQ sockets are not thread-safe, so each endpoint's socket lives on one background
thread (:class:`IOLoop`). Callers hand it work with :meth:`IOLoop.call_soon`, which wakes
the thread through an inproc pipe, so a request costs no polling delay. Every wait is
bounded: the loop polls with the handler's next deadline (heartbeat, lease, pull), never
forever.

Socket options (:func:`make_socket`): ``LINGER=0`` (close never blocks), ``MAXMSGSIZE``
(a peer cannot make us allocate more than ``max_frame_bytes`` for one frame, whatever a
header says), reconnect interval with capped exponential back-off, TCP keepalive, and on
ROUTER ``ROUTER_MANDATORY`` so a message to a vanished peer is an error instead of a
silent drop. CURVE keys, when given, are applied here and only here.
"""

from __future__ import annotations

import itertools
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np
import zmq

from layouts import TransferError

from .trace import Trace

DEFAULT_HOST = "127.0.0.1"
RECONNECT_IVL_MS = 50
RECONNECT_IVL_MAX_MS = 2000     # cap of the exponential back-off between reconnects
HWM = 64                        # messages queued per peer before send would block
_loop_ids = itertools.count()


@dataclass(frozen=True)
class CurveKeys:
    """ZeroMQ CURVE key material (z85 bytes). Servers need ``secret_key``/``public_key``;
    clients also need ``server_key``. Authentication of client keys (ZAP) is applied by the
    caller that owns the policy; this only configures the socket."""

    public_key: bytes
    secret_key: bytes
    server_key: bytes | None = None


def make_socket(ctx: zmq.Context, kind: int, *, max_frame_bytes: int,
                curve: CurveKeys | None = None, server: bool = False) -> zmq.Socket:
    """Create a socket with the connector's options (the only place they are set)."""
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.MAXMSGSIZE, int(max_frame_bytes))
    s.setsockopt(zmq.SNDHWM, HWM)
    s.setsockopt(zmq.RCVHWM, HWM)
    s.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
    s.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
    s.setsockopt(zmq.TCP_KEEPALIVE, 1)
    if kind == zmq.ROUTER:
        s.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if curve is not None:
        s.curve_publickey = curve.public_key
        s.curve_secretkey = curve.secret_key
        if server:
            s.curve_server = True
        else:
            if curve.server_key is None:
                raise TransferError("CURVE client needs the server's public key (server_key)")
            s.curve_serverkey = curve.server_key
    return s


def bind(sock: zmq.Socket, host: str = DEFAULT_HOST, port: int = 0) -> tuple[str, int]:
    """Bind ``tcp://host:port`` (port 0: a random free port); return (endpoint, port)."""
    try:
        if port == 0:
            port = sock.bind_to_random_port(f"tcp://{host}", min_port=20000, max_port=65000, max_tries=200)
        else:
            sock.bind(f"tcp://{host}:{port}")
    except zmq.ZMQError as e:
        raise TransferError(f"cannot bind tcp://{host}:{port}: {e}") from e
    return f"tcp://{host}:{port}", port


class IOLoop:
    """One background thread that owns one socket (and any added with :meth:`add_socket`).

    Parameters
    ----------
    sock : zmq.Socket
        The endpoint's socket (ROUTER or DEALER), created by :func:`make_socket`.
    on_message : callable(frames: list[zmq.Frame]) -> None
        Called on the loop thread for every message received.
    on_tick : callable(now: float) -> float
        Called after every wake-up; returns seconds until it needs to run again.
    on_error : callable(exc) -> None
        Called with any exception a handler raised; the loop keeps running.
    on_header : callable(frame: zmq.Frame) -> list of writable buffers or None, optional
        Called with the first frame of every multipart message. Buffers returned receive the
        following frames in order, with ``Socket.recv_into`` (no allocation per frame: the
        frame is copied once, from ZeroMQ's message into the buffer); ``on_message`` then
        gets, after the first frame, each buffer cut to the frame's size. A frame longer
        than its buffer is passed as a zero-filled stand-in of the frame's length (its
        bytes were cut off), so the receiver's size check names it oversized; frames beyond
        the buffers are received as usual. None: the message is received as usual.
    trace : Trace, optional
        The endpoint's :class:`~kvconnector.trace.Trace`: a ``receive`` span (the message off
        the socket) and a ``handle`` span (``on_message``) per message while it is enabled.
    """

    def __init__(self, ctx: zmq.Context, sock: zmq.Socket, *, name: str,
                 on_message: Callable, on_tick: Callable, on_error: Callable,
                 on_header: Callable | None = None, trace: Trace | None = None) -> None:
        self.ctx, self.sock = ctx, sock
        self._trace = trace
        self._on_message, self._on_tick, self._on_error = on_message, on_tick, on_error
        self._on_header = on_header
        addr = f"inproc://kvc-wake-{next(_loop_ids)}"
        self._wake_rx = ctx.socket(zmq.PULL)
        self._wake_rx.setsockopt(zmq.LINGER, 0)
        self._wake_rx.bind(addr)
        self._wake_tx = ctx.socket(zmq.PUSH)
        self._wake_tx.setsockopt(zmq.LINGER, 0)
        self._wake_tx.connect(addr)
        self._wake_lock = threading.Lock()
        self._calls: deque = deque()
        self._stop = False
        self.handled_s = 0.0     # seconds spent receiving and handling messages (bench.transfer --threads)
        self.socks = [sock]      # the endpoint's socket, then any added with add_socket
        self._handlers: dict = {}    # added socket -> its own on_message
        self._poller = zmq.Poller()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def on_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def call_soon(self, fn: Callable, *args) -> None:
        """Run ``fn(*args)`` on the loop thread (from any thread)."""
        self._calls.append((fn, args))
        if not self.on_thread:
            with self._wake_lock:
                try:
                    self._wake_tx.send(b"", zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass  # pipe full or closing: the loop is awake anyway

    def add_socket(self, sock: zmq.Socket, on_message: Callable | None = None) -> None:
        """Also receive from ``sock`` (call on the loop thread): its messages go to ``on_message``
        (received whole, no ``on_header``), or by default to the loop's own ``on_message`` /
        ``on_header``; the loop closes it with its own."""
        self.socks.append(sock)
        if on_message is not None:
            self._handlers[sock] = on_message
        self._poller.register(sock, zmq.POLLIN)

    def _run(self) -> None:
        poller = self._poller
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        timeout_s = 0.0
        while not self._stop:
            try:
                events = dict(poller.poll(max(0, int(timeout_s * 1000))))
                if self._wake_rx in events:
                    while self._wake_rx.poll(0):
                        self._wake_rx.recv()
                while self._calls:
                    fn, args = self._calls.popleft()
                    self._guard(fn, *args)
                for sock in self.socks:
                    self._drain(sock)
                timeout_s = self._guard(self._on_tick, time.monotonic())
                timeout_s = 0.05 if timeout_s is None else min(timeout_s, 0.25)
            except zmq.ZMQError as e:
                if self._stop or e.errno == zmq.ETERM:
                    break
                self._guard(self._on_error, TransferError(f"socket error: {e}"))
                timeout_s = 0.01

    def _drain(self, sock: zmq.Socket) -> None:
        """Handle a bounded batch of ``sock``'s messages, so ticks (deadlines, sends) and the other
        sockets keep being served under load; EVENTS is asked first: a recv that raises
        zmq.Again costs more than the check."""
        own = self._handlers.get(sock)
        for _ in range(256):
            if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                break
            if own is not None:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._guard(own, frames)
                continue
            t0 = time.perf_counter()
            try:
                frames = self._recv(sock)
            except zmq.Again:
                break
            t1 = time.perf_counter()
            self._guard(self._on_message, frames)
            t2 = time.perf_counter()
            self.handled_s += t2 - t0
            if self._trace is not None and self._trace.enabled:
                n = sum(len(f) if isinstance(f, zmq.Frame) else f.nbytes for f in frames[1:])
                self._trace.span("receive", t0, t1, frames=len(frames), bytes=n)
                self._trace.span("handle", t1, t2)

    def _recv(self, sock: zmq.Socket) -> list:
        """One whole message (ZeroMQ delivers the frames of a message together, so once its
        first frame is here the others are too)."""
        if self._on_header is None:
            return sock.recv_multipart(zmq.NOBLOCK, copy=False)
        first = sock.recv(zmq.NOBLOCK, copy=False)
        if not first.more:
            return [first]
        bufs = self._guard(self._on_header, first)
        if not bufs:
            return [first, *sock.recv_multipart(copy=False)]
        frames = [first]
        while sock.getsockopt(zmq.RCVMORE):
            if len(frames) > len(bufs):
                frames.append(sock.recv(copy=False))
                continue
            buf = bufs[len(frames) - 1]
            n = sock.recv_into(buf)
            frames.append(buf[:n] if n <= len(buf) else np.broadcast_to(np.uint8(0), (n,)))
        return frames

    def _guard(self, fn, *args):
        try:
            return fn(*args)
        except Exception as e:  # a handler bug or hostile input must not kill the thread
            try:
                self._on_error(e)
            except Exception:
                traceback.print_exc()
            return None

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the thread (bounded wait), then close sockets and the context."""
        self._stop = True
        if self._thread.is_alive():
            with self._wake_lock:
                try:
                    self._wake_tx.send(b"", zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
            self._thread.join(timeout_s)
        for s in (*self.socks, self._wake_rx, self._wake_tx):
            s.close(linger=0)
        self.ctx.term()
