"""Two network namespaces joined by a veth pair: two "hosts" on one machine, for tests.

:class:`NetnsPair` creates namespaces ``<tag>-a`` and ``<tag>-b`` and one veth pair with
an address on each end (``10.203.0.1/30`` and ``10.203.0.2/30`` by default) and loopback
up; nothing else (no route out, no bridge, no change to the host's namespace). Traffic
between the two addresses really crosses the veth interface. :meth:`NetnsPair.remove`
deletes both namespaces, which also deletes the veth pair; it is safe to call twice.

Needs root and iproute2 (``ip``); :func:`unavailable_reason` says why not when it cannot.

Run by hand: ``python -m kvconnector.testing.netns create TAG`` / ``python -m kvconnector.testing.netns remove TAG``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

ADDR_A, ADDR_B, PREFIX = "10.203.0.1", "10.203.0.2", 30


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if check and p.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: exit {p.returncode}: {p.stderr.strip()}")
    return p


def unavailable_reason() -> str | None:
    """None when namespaces can be created here, else a one-line reason."""
    if shutil.which("ip") is None:
        return "iproute2 'ip' not found (apt-get install -y iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"kvc-probe-{os.getpid()}"
    p = _ip("netns", "add", probe, check=False)
    if p.returncode:
        return f"'ip netns add' failed: {p.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class NetnsPair:
    """Namespaces ``ns_a``/``ns_b`` with veth ends ``dev_a``/``dev_b`` at ``addr_a``/``addr_b``."""

    def __init__(self, tag: str, addr_a: str = ADDR_A, addr_b: str = ADDR_B) -> None:
        self.ns_a, self.ns_b = f"{tag}-a", f"{tag}-b"
        short = tag[-12:]                 # interface names are at most 15 characters
        self.dev_a, self.dev_b = f"{short}a", f"{short}b"
        self.addr_a, self.addr_b = addr_a, addr_b

    def create(self) -> "NetnsPair":
        try:
            _ip("netns", "add", self.ns_a)
            _ip("netns", "add", self.ns_b)
            _ip("link", "add", self.dev_a, "netns", self.ns_a, "type", "veth",
                "peer", "name", self.dev_b, "netns", self.ns_b)
            for ns, dev, addr in ((self.ns_a, self.dev_a, self.addr_a), (self.ns_b, self.dev_b, self.addr_b)):
                _ip("-n", ns, "addr", "add", f"{addr}/{PREFIX}", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.remove()
            raise
        return self

    def remove(self) -> None:
        """Delete both namespaces (and with them the veth pair); ignores what is already gone."""
        for ns in (self.ns_a, self.ns_b):
            _ip("netns", "del", ns, check=False)

    def exists(self) -> bool:
        names = _ip("netns", "list", check=False).stdout.split()
        return self.ns_a in names or self.ns_b in names

    def exec_argv(self, side: str, argv: list[str]) -> list[str]:
        """``argv`` run inside namespace ``side`` ("a" or "b")."""
        return ["ip", "netns", "exec", self.ns_a if side == "a" else self.ns_b, *argv]

    def rx_bytes(self, side: str) -> int:
        """Bytes received so far by that side's veth end."""
        ns, dev = (self.ns_a, self.dev_a) if side == "a" else (self.ns_b, self.dev_b)
        out = subprocess.run(["ip", "netns", "exec", ns, "cat", f"/sys/class/net/{dev}/statistics/rx_bytes"],
                             capture_output=True, text=True, timeout=20, check=True)
        return int(out.stdout)

    def __enter__(self) -> "NetnsPair":
        return self.create()

    def __exit__(self, *exc) -> None:
        self.remove()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] not in ("create", "remove"):
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    pair = NetnsPair(argv[1])
    if argv[0] == "create":
        reason = unavailable_reason()
        if reason:
            print(reason, file=sys.stderr)
            return 1
        pair.create()
        print(f"{pair.ns_a} {pair.dev_a} {pair.addr_a} <-> {pair.ns_b} {pair.dev_b} {pair.addr_b}")
    else:
        pair.remove()
    return 0


if __name__ == "__main__":
    sys.exit(main())
