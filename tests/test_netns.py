"""Cross-node test: prefill and decode endpoints as two "hosts" in two network namespaces.

The fixture creates namespaces joined by one veth pair (10.203.0.1/30 <-> 10.203.0.2/30,
addresses only on that pair; kvconnector/testing/netns.py) and removes them afterwards, also on failure.
The prefill endpoint runs in namespace a bound to 10.203.0.1, the decode endpoint in
namespace b, each as its own process (``ip netns exec <ns> python tests/test_netns.py
<role>``). The decode side checks every transferred byte against the seeded source; the
test checks that the prefill lease ended "acked", that the veth interface carried at least
the payload bytes, and that neither address nor veth end shows up in the host namespace.
Skipped, with the reason, where namespaces cannot be created (no root, no iproute2).

Run: python -m pytest tests/test_netns.py   (as root)
"""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC_IDS, DST_IDS = list(range(0, 24, 2)), list(range(31, 19, -1))


def _desc():
    from connector_fakes import make_desc
    from layouts import KVQuantMode
    return make_desc(KVQuantMode.INT8_PER_TOKEN_HEAD, 64, num_kv_heads=4, block_size=16, num_layers=4,
                     num_blocks=32)


def prefill_main(host: str) -> int:
    import threading
    from connector_fakes import filled_caches
    from kvconnector import PrefillEndpoint
    desc, released = _desc(), []
    done = threading.Event()
    with PrefillEndpoint(filled_caches(desc, 0), desc, host=host,
                         on_release=lambda t, ids, why: (released.append(why), done.set())) as pre:
        pre.publish("t0", SRC_IDS, lease_s=60)
        print(f"PORT {pre.port}", flush=True)
        done.wait(60)
        print(f"RELEASED {released}", flush=True)
    return 0 if released == ["acked"] else 1


def decode_main(endpoint: str) -> int:
    import torch
    from connector_fakes import filled_caches
    from kvconnector import DecodeEndpoint
    desc = _desc()
    src, dst = filled_caches(desc, 0), filled_caches(desc, 1)  # src: what the other host holds
    with DecodeEndpoint(dst, desc) as dec:
        dec.connect(endpoint, timeout_s=10)
        res = dec.pull("t0", DST_IDS, deadline_s=30).result(timeout=35)
    for s, d in zip(src, dst):
        for si, di in zip(SRC_IDS, DST_IDS):
            if not torch.equal(s.view(torch.uint8)[si], d.view(torch.uint8)[di]):
                print(f"MISMATCH block {si}->{di}", flush=True)
                return 1
    print(f"OK {res.nbytes}", flush=True)
    return 0


@pytest.fixture
def pair():
    sys.path.insert(0, ROOT)
    from kvconnector.testing.netns import NetnsPair, unavailable_reason
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"cannot create network namespaces here: {reason}")
    p = NetnsPair(f"kvc{os.getpid() % 100000}")
    p.remove()  # a crashed earlier run with the same pid tag
    try:
        yield p.create()
    finally:
        p.remove()
        assert not p.exists()


@pytest.mark.timeout(120)
def test_transfer_crosses_a_veth_pair_between_namespaces(pair):
    script = os.path.abspath(__file__)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])}
    rx_before = pair.rx_bytes("b")
    pre = subprocess.Popen(pair.exec_argv("a", [sys.executable, script, "prefill", pair.addr_a]),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    dec = None
    try:
        line = pre.stdout.readline()
        assert line.startswith("PORT "), f"prefill did not start: {line!r} {pre.stderr.read()[-2000:]}"
        endpoint = f"tcp://{pair.addr_a}:{int(line.split()[1])}"
        # the pair's addresses and devices exist only inside the namespaces (a connect probe
        # from the host namespace proves nothing where the default gateway accepts any SYN)
        host_view = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, timeout=10).stdout
        assert "10.203.0." not in host_view and pair.dev_a not in host_view, host_view
        dec = subprocess.run(pair.exec_argv("b", [sys.executable, script, "decode", endpoint]),
                             capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
        assert dec.returncode == 0 and dec.stdout.startswith("OK "), dec.stdout + dec.stderr[-2000:]
        out, err = pre.communicate(timeout=30)
        assert pre.returncode == 0 and "RELEASED ['acked']" in out, out + err[-2000:]
    finally:
        if pre.poll() is None:
            pre.kill()
            pre.wait(5)
    nbytes = int(dec.stdout.split()[1])
    assert nbytes == 4 * len(SRC_IDS) * _desc().block_bytes
    assert pair.rx_bytes("b") - rx_before >= nbytes  # the payload really crossed the veth


if __name__ == "__main__":
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
    role, arg = sys.argv[1], sys.argv[2]
    sys.exit(prefill_main(arg) if role == "prefill" else decode_main(arg))
