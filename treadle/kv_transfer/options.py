"""``kv_transfer_config``: its keys and defaults, the parse into a KVTransferConfig (a one-line
TreadleError for a bad key or value), and the ports a producer's ranks serve KV on. The engine's
resolver composes these; nothing here opens a connection."""
from __future__ import annotations

import contextlib
import socket
from typing import Any

from treadle.config import KV_CONNECTORS, KV_ROLES, KVTransferConfig, TreadleError, json_option

# the keys of ``kv_transfer_config`` and their defaults (kv_port 0: a free port is picked)
KV_TRANSFER_DEFAULTS: dict[str, Any] = {
    "kv_connector": "tcp", "kv_role": None, "kv_ip": "127.0.0.1", "kv_port": 0, "engine_id": None,
    "transfer_timeout_s": 10.0, "producer_block_timeout_s": 60.0, "layerwise_start": True,
}


def resolve_kv_transfer(raw: dict[str, Any] | str | None) -> KVTransferConfig | None:
    """``kv_transfer_config`` (a dict or its JSON) -> KVTransferConfig (port 0 and engine id ""
    are settled by ``create_engine_config``); None or empty -> None. Bad keys or values are
    one-line TreadleErrors."""
    parsed = json_option(raw, "kv_transfer_config", KV_TRANSFER_DEFAULTS, '{"kv_connector": "tcp", ...}')
    if parsed is None:
        return None
    kv = {**KV_TRANSFER_DEFAULTS, **parsed}
    if kv["kv_connector"] not in KV_CONNECTORS:
        raise TreadleError(f"kv_transfer_config kv_connector {kv['kv_connector']!r} is not one of "
                           f"{', '.join(KV_CONNECTORS)}")
    if kv["kv_role"] not in KV_ROLES:
        raise TreadleError(f"kv_transfer_config kv_role {kv['kv_role']!r} is not one of {', '.join(KV_ROLES)}")
    port = kv["kv_port"]
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port < 65536:
        raise TreadleError("kv_transfer_config kv_port must be an integer in [0, 65535]")
    for key in ("transfer_timeout_s", "producer_block_timeout_s"):
        if not isinstance(kv[key], (int, float)) or isinstance(kv[key], bool) or not kv[key] > 0:
            raise TreadleError(f"kv_transfer_config {key} must be a positive number of seconds")
    if not isinstance(kv["layerwise_start"], bool):
        raise TreadleError("kv_transfer_config layerwise_start must be true or false")
    return KVTransferConfig(connector=kv["kv_connector"], role=kv["kv_role"], ip=str(kv["kv_ip"]), port=port,
                            engine_id=str(kv["engine_id"] or ""),
                            transfer_timeout_s=float(kv["transfer_timeout_s"]),
                            producer_block_timeout_s=float(kv["producer_block_timeout_s"]),
                            layerwise_start=kv["layerwise_start"])


def free_ports(ip: str, count: int) -> int:
    """The first of ``count`` consecutive free ports (tensor-parallel rank r serves KV on
    ``kv_port + r``)."""
    for _ in range(50):
        with contextlib.ExitStack() as stack:
            first = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            first.bind((ip, 0))
            port = int(first.getsockname()[1])
            try:
                for r in range(1, count):
                    stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)).bind((ip, port + r))
            except OSError:
                continue
            return port
    raise TreadleError(f"kv_transfer_config: found no {count} consecutive free ports on {ip}; set kv_port")
