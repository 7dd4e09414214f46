"""CURVE authentication and encryption of the connector (kvconnector.security).

Covers key files (generate, save with 0600 secrets, load, ZeroMQ certificate compatibility,
bad files refused), keys from a config map, the default loopback bind, a byte-exact
transfer over CURVE with an authorized client, and refusals: a client key not on the
allow-list, a client that does not speak CURVE, and a client holding the wrong server key.
A refused client never reaches the handshake (the prefill endpoint receives no message at
all), the refusal is logged, and the client fails with TransferTimeoutError within its
connect deadline. A TCP tap checks that CURVE traffic does not carry the plaintext
descriptor that an unencrypted connection does.

Run: python -m pytest tests/test_security.py
"""

import logging
import os
import socket
import stat
import threading
import time

import pytest
import torch
import zmq
import zmq.auth

from connector_fakes import filled_caches, make_desc
from kvconnector import DecodeEndpoint, PrefillEndpoint
from kvconnector.security import (ALLOW_ANY, CurveServerKeys, client_keys, configure_curve,
                                  generate_keypair, keys_from_config, load_authorized_keys,
                                  load_keypair, save_keypair, server_keys)
from kvconnector.transport import CurveKeys
from layouts import TransferError, TransferTimeoutError

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not zmq.has("curve"), reason="libzmq built without CURVE")]
REFUSE_TIMEOUT_S = 1.0   # connect deadline of a refused client; the test allows 2 s of slack


@pytest.fixture
def keys(tmp_path):
    """server/client/stranger key files; the server admits only the client."""
    paths = {n: save_keypair(tmp_path / "keys", n) for n in ("server", "client", "stranger")}
    (tmp_path / "authorized").mkdir()
    pub = paths["client"][0]
    (tmp_path / "authorized" / pub.name).write_bytes(pub.read_bytes())
    return tmp_path, paths


def test_key_files_round_trip_and_are_zmq_certificates(keys):
    tmp, paths = keys
    pub_path, sec_path = paths["server"]
    assert stat.S_IMODE(os.stat(sec_path).st_mode) == 0o600
    pub, sec = load_keypair(sec_path)
    assert load_keypair(pub_path) == (pub, None)
    assert zmq.auth.load_certificate(str(sec_path)) == (pub, sec)  # interoperable format
    assert zmq.curve_public(sec) == pub                              # a real pair
    assert load_authorized_keys(tmp / "authorized") == {load_keypair(paths["client"][0])[0]}
    fresh = generate_keypair()
    assert fresh[0] != pub and len(fresh[0]) == 40


@pytest.mark.parametrize("content,match", [
    (b"not a certificate", "[Nn]o public"),
    (b'curve\n    public-key = "tooshort"\n', "z85"),
], ids=["garbage", "short-key"])
def test_bad_key_file_is_a_typed_error(tmp_path, content, match):
    p = tmp_path / "bad.key"
    p.write_bytes(content)
    with pytest.raises(TransferError, match=match):
        load_keypair(p)


def test_keys_from_config(keys):
    tmp, paths = keys
    srv = keys_from_config({"secret_file": paths["server"][1], "authorized": tmp / "authorized"}, "server")
    assert isinstance(srv, CurveServerKeys) and srv.authorized_keys == {load_keypair(paths["client"][0])[0]}
    pub, sec = generate_keypair()
    cli = keys_from_config({"public_key": pub.decode(), "secret_key": sec.decode(),
                            "server_key": paths["server"][0]}, "client")
    assert cli == CurveKeys(pub, sec, srv.public_key)
    for given in (srv.public_key, srv.public_key.decode(), paths["server"][0]):  # bytes, str, file
        assert client_keys(paths["client"][1], given).server_key == srv.public_key
    assert keys_from_config({}, "client") is None
    with pytest.raises(TransferError, match="server_key"):
        keys_from_config({"secret_file": paths["client"][1]}, "client")


def _transfer(pre_curve, dec_curve, timeout_s=5.0, lanes=1):
    desc = make_desc(num_layers=2, num_blocks=6)
    src, dst = filled_caches(desc, 0), filled_caches(desc, 1)
    before = [c.clone() for c in dst]
    with PrefillEndpoint(src, desc, curve=pre_curve, chunk_bytes=1) as pre, \
            DecodeEndpoint(dst, desc, curve=dec_curve, lanes=lanes) as dec:
        assert pre.endpoint.startswith("tcp://127.0.0.1:")  # loopback unless told otherwise
        t0 = time.monotonic()
        try:
            dec.connect(pre.endpoint, timeout_s=timeout_s)
        except TransferTimeoutError as e:
            return e, time.monotonic() - t0, pre, [torch.equal(a, b) for a, b in zip(dst, before)]
        pre.publish("t", [5, 1, 2])
        dec.pull("t", [0, 3, 4], deadline_s=10).result(timeout=10)
        for s, d in zip(src, dst):
            for si, di in zip([5, 1, 2], [0, 3, 4]):
                assert torch.equal(s.view(torch.uint8)[si], d.view(torch.uint8)[di])
        return None, time.monotonic() - t0, pre, None


@pytest.mark.parametrize("lanes", [1, 3])
def test_authorized_client_transfers_byte_exact(keys, lanes):
    """Byte exact under CURVE; with lanes, every extra connection is authenticated like the first
    and carries BLOCKS."""
    tmp, paths = keys
    srv = server_keys(paths["server"][1], tmp / "authorized")
    err, _, pre, _ = _transfer(srv, client_keys(paths["client"][1], paths["server"][0]), lanes=lanes)
    assert err is None and pre._zap.allowed >= lanes and pre._zap.denied == 0
    st = pre.stats()
    assert st["lanes_opened"] == lanes - 1 and (st["messages_sent_on_lanes"] > 0) == (lanes > 1)


@pytest.mark.parametrize("who", ["unlisted-key", "no-curve", "wrong-server-key"])
def test_refused_client_never_reaches_the_handshake(keys, who, caplog):
    tmp, paths = keys
    srv = server_keys(paths["server"][1], tmp / "authorized")
    cli = {"unlisted-key": client_keys(paths["stranger"][1], paths["server"][0]),
           "no-curve": None,
           "wrong-server-key": client_keys(paths["client"][1], paths["stranger"][0])}[who]
    caplog.set_level(logging.WARNING, logger="kvconnector.security")
    err, elapsed, pre, untouched = _transfer(srv, cli, timeout_s=REFUSE_TIMEOUT_S)
    assert isinstance(err, TransferTimeoutError), "a refused client must fail its connect deadline"
    assert elapsed < REFUSE_TIMEOUT_S + 2.0
    st = pre.stats()
    assert st["messages_received"] == 0 and not pre.errors  # no HELLO (no frame at all) arrived
    assert all(untouched)
    if who == "unlisted-key":  # the only case where the server learns a client key to log
        stranger = load_keypair(paths["stranger"][0])[0].decode()
        assert pre._zap.denied >= 1
        assert any(stranger in r.getMessage() for r in caplog.records)


def test_allow_any_encrypts_without_an_allow_list(keys):
    _, paths = keys
    pub, sec = load_keypair(paths["server"][1])
    err, _, pre, _ = _transfer(CurveServerKeys(pub, sec, None, ALLOW_ANY),
                               client_keys(paths["stranger"][1], paths["server"][0]))
    assert err is None


class _Tap:
    """A loopback TCP forwarder that records every byte from client to server."""

    def __init__(self, target_port):
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.port, self.target, self.seen = self.lsock.getsockname()[1], target_port, bytearray()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        c, _ = self.lsock.accept()
        s = socket.create_connection(("127.0.0.1", self.target))
        for a, b, rec in ((c, s, True), (s, c, False)):
            threading.Thread(target=self._pipe, args=(a, b, rec), daemon=True).start()

    def _pipe(self, a, b, record):
        try:
            while data := a.recv(65536):
                if record:
                    self.seen += data
                b.sendall(data)
        except OSError:
            pass


@pytest.mark.parametrize("use_curve", [False, True], ids=["plain", "curve"])
def test_curve_traffic_is_encrypted(keys, use_curve):
    tmp, paths = keys
    desc = make_desc(num_layers=1, num_blocks=2)
    srv = server_keys(paths["server"][1], tmp / "authorized") if use_curve else None
    cli = client_keys(paths["client"][1], paths["server"][0]) if use_curve else None
    with PrefillEndpoint(filled_caches(desc, 0), desc, curve=srv) as pre:
        tap = _Tap(pre.port)
        with DecodeEndpoint(filled_caches(desc, 1), desc, curve=cli) as dec:
            dec.connect(f"tcp://127.0.0.1:{tap.port}", timeout_s=5)
    # the HELLO carries the descriptor as msgpack strings: visible unless encrypted
    assert (b"hadamard_signed" in tap.seen) is (not use_curve)


def test_configure_curve_on_a_raw_socket(keys):
    _, paths = keys
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    try:
        with pytest.raises(TransferError, match="server_key"):
            configure_curve(s, CurveKeys(*load_keypair(paths["client"][1])), server=False)
        configure_curve(s, client_keys(paths["client"][1], paths["server"][0]), server=False)
        assert s.getsockopt(zmq.MECHANISM) == zmq.CURVE and s.getsockopt(zmq.CURVE_SERVER) == 0
    finally:
        s.close(0)
        ctx.term()
