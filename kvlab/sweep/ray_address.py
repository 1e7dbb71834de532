"""Can a Ray cluster be joined at the address a sweep names? Checked with the params, before the
sweep folder is made: ``ray.init`` on a dead address retries for minutes without a word. Needs no
ray (a socket and a gRPC greeting), so :mod:`kvlab.sweep.checks` stays light."""

from __future__ import annotations

import os
import socket

HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])  # + an empty SETTINGS frame
HTTP2_SETTINGS = 4  # the frame type every HTTP/2 server sends first
CONNECT_TIMEOUT_S = 5.0  # a head that does not answer a TCP connect in 5 s is not there (ray.init retries for minutes)


def address_problem(address: str | None, timeout_s: float = CONNECT_TIMEOUT_S) -> str | None:
    """Why the Ray cluster at ``address`` (else ``RAY_ADDRESS``) cannot be joined: not an address,
    nothing answering a TCP connect there within ``timeout_s``, or something that is no gRPC server
    (Ray's GCS and client server are); None when it answers, or for
    ``auto``/``local``/no address (Ray finds or starts a cluster on this machine and says so
    itself). Checked before the sweep folder is made: ``ray.init`` on a dead address retries for
    minutes without a word."""
    key = "ray_address" if address is not None else "RAY_ADDRESS"
    address = address if address is not None else os.environ.get("RAY_ADDRESS")
    if address is None or address.strip() in ("", "auto", "local"):
        return None
    fix = "start the cluster (ray start --head) or fix the address: auto, HOST:6379 or ray://HOST:10001"
    hostport = address.strip().removeprefix("ray://")
    host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return f"{key}: {address!r} is not an address; give auto, HOST:PORT (the head's GCS, e.g. :6379) or ray://HOST:10001"
    try:
        conn = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
    except OSError as err:
        why = f"no answer within {timeout_s:g} s" if isinstance(err, TimeoutError) else (err.strerror or str(err))
        return f"{key}: nothing answers at {address} ({why.lower()}); {fix}"
    with conn:
        if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
            return None  # a TLS head answers only a TLS hello: the TCP answer is all we check
        try:  # Ray's GCS and client server speak gRPC: an HTTP/2 server answers a client preface with SETTINGS
            conn.settimeout(timeout_s)
            conn.sendall(HTTP2_PREFACE)
            frame = b""
            while len(frame) < 9 and (part := conn.recv(9 - len(frame))):
                frame += part
        except OSError:
            frame = b""
        if len(frame) < 9 or frame[3] != HTTP2_SETTINGS:
            return (f"{key}: {address} takes a connection but does not answer as a Ray head (no gRPC reply within "
                    f"{timeout_s:g} s); {fix}")
    return None
