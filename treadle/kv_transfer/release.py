"""The release message (torch-free): "free the KV you hold for these requests, nobody will pull it".

    consumer / router DEALER                  producer ROUTER (tcp.py's serving thread)
      [RELEASE_TAG, ReleaseRequest(ids)] ->   stops serving the ids, reports them released;
                                              the scheduler side frees their blocks at once

Sent by a consumer whose request was aborted before its pull finished (or whose load failed),
and by the router when the client left (or no decode instance took the request) after the
producer answered. Both know the producer's connector address from ``kv_transfer_params``
(``remote_host``, ``remote_port``, ``remote_request_id``), so one message on the connector's
existing channel covers both; no reply (fire and forget: a lost release only means the
producer frees at ``producer_block_timeout_s``, as before). Releasing a request already
pulled, expired or unknown does nothing. Only the ids travel, so the message is the same
whatever the KV layout or the parallel sizes are.
"""
from __future__ import annotations

from typing import Any

import msgspec
import zmq

RELEASE_TAG = b"treadle-kv-release"  # the first frame after the DEALER's identity; a pull has one frame
RELEASE_LINGER_MS = 1000  # how long a closed sender keeps trying to deliver


class ReleaseRequest(msgspec.Struct, array_like=True):
    request_ids: list[str]  # the producer's request ids (remote_request_id)


def send_release(ctx: zmq.Context, host: str, port: int, request_ids: list[str], num_ranks: int = 1) -> None:
    """Queue the release for each of the producer's ``num_ranks`` ranks (rank r serves on
    ``port + r``) and return at once (ZeroMQ's I/O thread delivers it within
    RELEASE_LINGER_MS, or drops it). Never raises for an unreachable producer."""
    body = msgspec.msgpack.encode(ReleaseRequest(request_ids))
    for rank in range(num_ranks):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, RELEASE_LINGER_MS)
        try:
            sock.connect(f"tcp://{host}:{port + rank}")
            sock.send_multipart([RELEASE_TAG, body], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        finally:
            sock.close()


def decode_release(parts: list[Any]) -> list[str] | None:
    """The request ids of a release message as the ROUTER receives it ([identity, tag, body]);
    None when ``parts`` is not one (a pull)."""
    if len(parts) != 3 or bytes(parts[1]) != RELEASE_TAG:
        return None
    try:
        return msgspec.msgpack.decode(parts[2], type=ReleaseRequest).request_ids
    except msgspec.DecodeError:
        return []

