"""ZeroMQ CURVE for the connector: key files, socket setup, and a client allow-list (ZAP).

CURVE (Curve25519 + an authenticated handshake) encrypts every frame and, with a ZAP
handler, lets the prefill side admit only clients whose public key it knows. Off by default:
pass ``curve=`` to :class:`~kvconnector.PrefillEndpoint` / :class:`~kvconnector.DecodeEndpoint`.

Roles and keys
--------------
- The **prefill** endpoint is the CURVE *server*: its own key pair, plus the set of decode
  public keys it admits (:class:`CurveServerKeys`, ``authorized_keys``).
- A **decode** endpoint is a CURVE *client*: its own key pair plus the server's public key
  (:class:`~kvconnector.transport.CurveKeys`, ``server_key``).

A client that lacks the server's public key, or whose key is not on the list, fails the
CURVE handshake inside libzmq: no ZMTP message, hence no HELLO, ever reaches the endpoint.
Each refusal is logged on the ``kvconnector.security`` logger (WARNING, with the client's
key) and counted in :attr:`ZapGuard.denied`. The client sees no error frame (CURVE gives a
stranger nothing to read); its ``connect`` ends in ``TransferTimeoutError`` at its deadline.

Key files use ZeroMQ's certificate format (what ``zmq.auth.create_certificates`` writes and
``zmq.auth.load_certificate`` reads): ``NAME.key`` holds the z85 public key, and
``NAME.key_secret`` (mode 0600) holds both keys.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
import zmq.utils.z85
from zmq.auth.thread import ThreadAuthenticator

from layouts import TransferError
from .transport import CurveKeys

log = logging.getLogger("kvconnector.security")
ALLOW_ANY = "allow_any"   # authorized_keys value: encrypt, but admit any CURVE client
Z85_KEY_CHARS = 40


@dataclass(frozen=True)
class CurveServerKeys(CurveKeys):
    """Server key pair plus the z85 public keys of the clients it admits.

    ``authorized_keys``: a frozenset of z85 keys (an empty set admits nobody), or
    :data:`ALLOW_ANY` for encryption without client authentication.
    """

    authorized_keys: frozenset | str = frozenset()


def _z85(key, what: str) -> bytes:
    k = key.encode() if isinstance(key, str) else bytes(key)
    k = k.strip()
    try:
        ok = len(k) == Z85_KEY_CHARS and len(zmq.utils.z85.decode(k)) == 32
    except Exception:  # z85.decode raises on characters outside its alphabet
        ok = False
    if not ok:
        raise TransferError(f"{what}: expected a {Z85_KEY_CHARS}-character z85 CURVE key, got {k[:48]!r}")
    return k


def generate_keypair() -> tuple[bytes, bytes]:
    """A fresh ``(public_key, secret_key)`` pair, z85 bytes (``zmq.curve_keypair``)."""
    if not zmq.has("curve"):
        raise TransferError("this libzmq was built without CURVE support")
    return zmq.curve_keypair()


def save_keypair(directory, name: str, keypair: tuple[bytes, bytes] | None = None) -> tuple[Path, Path]:
    """Write ``NAME.key`` (public) and ``NAME.key_secret`` (0600); return both paths."""
    pub, sec = keypair or generate_keypair()
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    out = []
    for suffix, secret in ((".key", None), (".key_secret", sec)):
        path = d / f"{name}{suffix}"
        lines = ["#   ZeroMQ CURVE " + ("**Secret** " if secret else "Public ") + "Certificate",
                 "#   kvconnector: " + ("keep private" if secret else "give to peers"),
                 "metadata", "curve", f'    public-key = "{_z85(pub, "public key").decode()}"']
        if secret:
            lines.append(f'    secret-key = "{_z85(secret, "secret key").decode()}"')
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if secret else 0o644)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
        out.append(path)
    return out[0], out[1]


def load_keypair(path) -> tuple[bytes, bytes | None]:
    """``(public_key, secret_key)`` from a certificate file (secret is None in a ``.key``)."""
    try:
        pub, sec = zmq.auth.load_certificate(os.fspath(path))
    except (OSError, ValueError) as e:
        raise TransferError(f"CURVE key file {path}: {e}") from e
    if pub is None:
        raise TransferError(f"CURVE key file {path}: no public-key line")
    return _z85(pub, f"{path} public-key"), None if sec is None else _z85(sec, f"{path} secret-key")


def load_authorized_keys(source) -> frozenset:
    """Public keys from a directory of ``*.key`` files, one file, or an iterable of keys/paths."""
    if isinstance(source, (str, os.PathLike)) and Path(source).is_dir():
        return frozenset(load_keypair(p)[0] for p in sorted(Path(source).glob("*.key")))
    if isinstance(source, (str, os.PathLike)) and Path(source).is_file():
        return frozenset([load_keypair(source)[0]])
    if isinstance(source, (str, bytes)):
        return frozenset([_z85(source, "authorized key")])
    keys = set()
    for item in source:
        keys |= load_authorized_keys(item)
    return frozenset(keys)


def _public_key(source, what: str) -> bytes:
    """A z85 public key given as a key file path or as the key itself (str or bytes)."""
    if isinstance(source, (str, os.PathLike)) and Path(source).is_file():
        return load_keypair(source)[0]
    return _z85(source, what)


def server_keys(secret_file, authorized) -> CurveServerKeys:
    """Keys of a prefill (server) endpoint: its secret file plus who may connect."""
    pub, sec = load_keypair(secret_file)
    if sec is None:
        raise TransferError(f"CURVE server key file {secret_file}: no secret-key (use the .key_secret file)")
    allowed = ALLOW_ANY if authorized == ALLOW_ANY else load_authorized_keys(authorized)
    return CurveServerKeys(pub, sec, None, allowed)


def client_keys(secret_file, server_public) -> CurveKeys:
    """Keys of a decode (client) endpoint: its secret file plus the server's public key (file or z85)."""
    pub, sec = load_keypair(secret_file)
    if sec is None:
        raise TransferError(f"CURVE client key file {secret_file}: no secret-key (use the .key_secret file)")
    return CurveKeys(pub, sec, _public_key(server_public, "server key"))


def keys_from_config(cfg: dict | None, role: str):
    """Keys from a config map; None when ``cfg`` is empty (CURVE off).

    Keys (file paths or z85 strings): ``secret_file`` **or** ``public_key`` + ``secret_key``;
    server role: ``authorized`` (directory, files, keys, or ``"allow_any"``); client role:
    ``server_key`` (a file or a z85 key).
    """
    if not cfg:
        return None
    if role not in ("server", "client"):
        raise ValueError(f"role: expected 'server' or 'client', got {role!r}")
    if "secret_file" in cfg:
        pub, sec = load_keypair(cfg["secret_file"])
    else:
        pub, sec = _z85(cfg.get("public_key", ""), "public_key"), _z85(cfg.get("secret_key", ""), "secret_key")
    if sec is None:
        raise TransferError("CURVE config: secret_file has no secret-key")
    if role == "server":
        auth = cfg.get("authorized", frozenset())
        return CurveServerKeys(pub, sec, None, ALLOW_ANY if auth == ALLOW_ANY else load_authorized_keys(auth))
    srv = cfg.get("server_key")
    if srv is None:
        raise TransferError("CURVE client config: server_key is required")
    return CurveKeys(pub, sec, _public_key(srv, "server_key"))


def configure_curve(sock: zmq.Socket, keys: CurveKeys, server: bool) -> None:
    """Make ``sock`` a CURVE server or client (before bind/connect). Used for raw sockets;
    endpoints get the same through :func:`kvconnector.transport.make_socket`."""
    sock.curve_publickey, sock.curve_secretkey = keys.public_key, keys.secret_key
    if server:
        sock.curve_server = True
    elif keys.server_key is None:
        raise TransferError("CURVE client needs the server's public key (server_key)")
    else:
        sock.curve_serverkey = keys.server_key


class _AllowList:
    """ZAP credentials provider: admit listed keys, log and count the rest."""

    def __init__(self, guard: "ZapGuard", keys) -> None:
        self.guard, self.keys = guard, keys

    def callback(self, domain: str, client_key: bytes) -> bool:
        ok = self.keys == ALLOW_ANY or client_key in self.keys
        with self.guard.lock:
            if ok:
                self.guard.allowed += 1
            else:
                self.guard.denied += 1
                self.guard.denied_keys.append(client_key)
        if not ok:
            log.warning("CURVE client refused (key not authorized): %s", client_key.decode(errors="replace"))
        return ok


class ZapGuard:
    """A running ZAP handler on one ZeroMQ context (call :meth:`stop` before ``ctx.term()``)."""

    def __init__(self, ctx: zmq.Context, keys) -> None:
        self.lock = threading.Lock()
        self.allowed = self.denied = 0
        self.denied_keys: list[bytes] = []
        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("kvconnector.security.zap"))
        self._auth.start()
        self._auth.configure_curve_callback("*", credentials_provider=_AllowList(self, keys))

    def stop(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


def start_authenticator(ctx: zmq.Context, curve: CurveKeys | None) -> ZapGuard | None:
    """Start ZAP on ``ctx`` when ``curve`` is server keys with an allow-list (else None).

    Must run before the server socket accepts connections; without it a CURVE server
    admits any client that knows its public key.
    """
    if not isinstance(curve, CurveServerKeys):
        return None
    return ZapGuard(ctx, curve.authorized_keys)
