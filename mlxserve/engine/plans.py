"""The step plans of a distributed engine, from rank 0 to the other ranks over TCP.

A plan could travel as an MLX collective, but then reading it on the host waits for
everything queued before it on the engine's stream: the decode step that mlx-lm's
BatchGenerator queued ahead of time, which then no longer overlaps the host's work on the
next one. Over a socket of its own a plan costs a send and a receive and waits for no
device. (The model's own collectives keep the ranks in step: a rank ahead waits there.)

Rank 0 listens on an ephemeral port; its addresses, the port and a random token reach the
other ranks once, at start, through an MLX collective (`connect`). Each rank connects,
sends the token and its rank, and expects the token back: only the ranks of this launch
join, and they only read what rank 0 writes. Messages are a 4-byte length and a pickle.
"""

from __future__ import annotations

import json
import os
import logging
import pickle
import secrets
import select
import socket
import struct
import threading

log = logging.getLogger("mlxserve.distributed")

CONNECT_TIMEOUT_S = 60.0
_LEN = struct.Struct("<I")


def rank0_addresses() -> list[str]:
    """Where the other ranks may reach rank 0: the address the launcher gave it (ring hostfile,
    NCCL's host, JACCL's coordinator), then what its host name resolves to, then loopback."""
    out = []
    if os.environ.get("MLXSERVE_PLAN_HOST"):
        out.append(os.environ["MLXSERVE_PLAN_HOST"])
    try:
        hostfile = os.environ.get("MLX_HOSTFILE")
        if hostfile and os.path.isfile(hostfile):
            out += [addr.rsplit(":", 1)[0] for addr in json.load(open(hostfile))[0]]
    except (OSError, ValueError, IndexError, TypeError):
        pass
    for name in ("NCCL_HOST_IP", "MLX_JACCL_COORDINATOR"):
        if os.environ.get(name):
            out.append(os.environ[name].rsplit(":", 1)[0] if name == "MLX_JACCL_COORDINATOR" else os.environ[name])
    try:
        out += [info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)]
    except OSError:
        pass
    out.append("127.0.0.1")
    return list(dict.fromkeys(out))


def _send(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("rank 0 closed the plan channel")
        buf += chunk
    return bytes(buf)


def _recv(sock: socket.socket) -> bytes:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    return _recv_exact(sock, n)


class PlanChannel:
    """Rank 0's sockets to every other rank, or another rank's socket to rank 0."""

    def __init__(self, rank: int, socks: list[socket.socket]):
        self.rank = rank
        self.socks = socks

    def send(self, obj) -> None:
        """(rank 0) The same plan to every other rank."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        for s in self.socks:
            _send(s, data)

    def recv(self):
        """(another rank) Rank 0's next plan; ConnectionError if rank 0 is gone."""
        return pickle.loads(_recv(self.socks[0]))

    def watch(self, on_lost) -> None:
        """(rank 0) Call `on_lost(rank)` from a thread of its own as soon as another rank's
        connection closes (its process died): the other ranks never write after joining, so a
        readable socket means it closed. The engine's thread may be waiting on the lost rank
        inside a step that never returns; this tells without it."""
        def run():
            socks = {s: r for r, s in enumerate(self.socks, 1)}
            while socks:
                try:
                    readable, _, _ = select.select(list(socks), [], [], 1.0)
                except (OSError, ValueError):  # closed by close()
                    return
                for s in readable:
                    try:
                        gone = s.recv(1, socket.MSG_PEEK) == b""
                    except OSError:
                        gone = True
                    if gone:
                        rank = socks.pop(s)
                        on_lost(rank)
                    else:  # a rank wrote, which ranks do not: stop watching it
                        log.warning("rank %d wrote to the plan channel; not watching it", socks.pop(s))
        threading.Thread(target=run, name="mlx-plan-watch", daemon=True).start()

    def close(self) -> None:
        for s in self.socks:
            try:
                s.close()
            except OSError:
                pass


def connect(rank: int, size: int, gather) -> PlanChannel:
    """Every rank, together at start: open the channel. `gather(obj)` is every rank's obj (an
    MLX collective), which carries rank 0's addresses, port and token to the others."""
    listener = None
    if rank == 0:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("0.0.0.0", 0))
        listener.listen(size)
        offer = {"addresses": rank0_addresses(), "port": listener.getsockname()[1], "token": secrets.token_hex(16)}
    else:
        offer = None
    offer = gather(offer)[0]
    token = offer["token"].encode()
    if rank == 0:
        socks = [None] * size
        listener.settimeout(CONNECT_TIMEOUT_S)
        try:
            while sum(s is not None for s in socks) < size - 1:
                conn, _ = listener.accept()
                conn.settimeout(CONNECT_TIMEOUT_S)
                try:
                    hello = _recv(conn)
                except (OSError, ConnectionError):
                    conn.close()
                    continue
                if not hello.startswith(token) or not hello[len(token):].isdigit():
                    conn.close()  # not a rank of this launch
                    continue
                r = int(hello[len(token):])
                if not 0 < r < size or socks[r] is not None:
                    conn.close()
                    continue
                _send(conn, token)
                conn.settimeout(None)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                socks[r] = conn
        except socket.timeout:
            missing = [r for r in range(1, size) if socks[r] is None]
            raise ConnectionError(f"ranks {missing} did not connect to rank 0's plan channel within "
                                  f"{CONNECT_TIMEOUT_S:g} s (it listened on port {offer['port']} of "
                                  f"{', '.join(offer['addresses'])}; set MLXSERVE_PLAN_HOST to an address "
                                  "the other ranks reach)") from None
        finally:
            listener.close()
        return PlanChannel(0, socks[1:])
    errors = []
    for address in offer["addresses"]:
        try:
            sock = socket.create_connection((address, offer["port"]), timeout=5)
        except OSError as e:
            errors.append(f"{address}: {e}")
            continue
        try:
            sock.settimeout(CONNECT_TIMEOUT_S)
            _send(sock, token + str(rank).encode())
            if _recv(sock) != token:
                raise ConnectionError("not rank 0's plan channel")
        except (OSError, ConnectionError) as e:
            sock.close()
            errors.append(f"{address}: {e}")
            continue
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return PlanChannel(rank, [sock])
    raise ConnectionError(f"rank {rank} could not reach rank 0's plan channel on port {offer['port']}: "
                          + "; ".join(errors))
