"""``kv_connector_extra_config``: the connector's settings, checked when vLLM builds the connector.

An unknown key (a typo: ``lease_seconds`` for ``lease_s``) or a value of the wrong kind would
otherwise be ignored or fail every load later with a message that does not name it; here either
stops the engine's start with one line naming the key. docs/DEPLOY.md explains each setting.
"""

from __future__ import annotations

from kvconnector.args import count, seconds
from kvconnector.dataplane import ZMQ, check_plane
from kvconnector.protocol import MAX_LANES

P = "kv_connector_extra_config: "


def _number(x, key: str) -> float:
    return seconds(P + key, x)


def _text(x, key: str) -> str:
    if not isinstance(x, str) or not x:
        raise ValueError(f"{P}{key}: expected a non-empty string, got {x!r:.80}")
    return x


def _optional_text(x, key: str) -> str | None:
    return None if x == "" else _text(x, key)     # "": not set


def _plane(x, key: str) -> str:
    try:
        return check_plane(x)
    except ValueError as e:
        raise ValueError(f"{P}{e}") from None


def _table(x, key: str) -> dict:
    if not isinstance(x, dict):
        raise ValueError(f"{P}{key}: expected a map, got {x!r:.80}")
    return x


# key -> (check, default); None: not set (each place that reads it says what that means)
SETTINGS = {
    "host": (_text, "127.0.0.1"),                       # prefill bind address
    "advertise_host": (_optional_text, None),           # address the decode side is given (default: host)
    "port": (lambda x, k: count(P + k, x, 0, 65535), 0),   # prefill rank 0's port (the connector passes vLLM's kv_port)
    "lease_s": (_number, 30.0),
    "pull_deadline_s": (_number, 10.0),
    "handshake_s": (_number, 3.0),
    "peer_timeout_s": (_number, 3.0),
    "stats_path": (_optional_text, None),
    "frame_ops": (_optional_text, None),                # "kernels.transfer.FRAME_OPS"
    "data_plane": (_plane, ZMQ),
    "nixl_region_mb": (lambda x, k: count(P + k, x, 1, 1 << 20), 256),
    "lanes": (lambda x, k: count(P + k, x, 1, MAX_LANES), None),   # None: the endpoints' defaults
    "curve": (_table, None),
    "model_id": (_optional_text, None),                 # the model both engines compare (default: vLLM's)
}


def connector_config(extra: dict | None) -> dict:
    """``extra`` checked, with every setting present (defaults filled in); ValueError naming the key
    for an unknown key or a bad value."""
    extra = dict(extra or {})
    unknown = sorted(k for k in extra if k not in SETTINGS)
    if unknown:
        raise ValueError(f"{P}unknown key {unknown[0]!r} (known: {', '.join(SETTINGS)})")
    return {k: (check(extra[k], k) if extra.get(k) is not None else default)
            for k, (check, default) in SETTINGS.items()}
