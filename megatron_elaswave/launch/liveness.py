"""Whether another node's agent process still runs, told by a TCP connection to it.

The kernel closes the sockets of a process that ends, however it ends (SIGKILL, the OOM killer,
a crash), and a machine that is up answers a connection to a port nothing listens on with a
refusal. So an agent that holds a connection to the agent of each node it watches learns within
milliseconds that one was killed with its node's workers, where that node's heartbeat takes
``--node-timeout`` to fall silent.

A connection that closes is evidence only when the agent's port then refuses a new one: a reset
by something in between leaves the port accepting, and the watch goes on over the new
connection. A machine that is off or cut off answers nothing, and an agent that is stopped
(SIGSTOP, swapping) keeps its sockets open: both are left to the heartbeat's silence
(:mod:`~megatron_elaswave.launch.node_watch`), as before.
"""

from __future__ import annotations

import selectors
import socket
import threading
from collections.abc import Callable

CONNECT_TIMEOUT_S = 2.0
"""How long a watcher waits for a connection to be accepted or refused; an agent that answers
neither is left to its heartbeat."""


def address_toward(host: str) -> str:
    """This machine's address on the route to ``host`` (the job store's): the one the other
    nodes, which reach the store too, can most likely reach this one by. Nothing is sent."""
    family, _, _, _, address = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        return probe.getsockname()[0]


class LivenessListener:
    """This agent's end: a port on every interface that accepts the watchers' connections and
    holds them open until a watcher closes its end or this process ends. Its thread only waits
    on the sockets; the port is opened when the listener is made."""

    def __init__(self, toward: str) -> None:
        """Listen on a free port; :attr:`address` is this machine's address toward ``toward``
        (the job store's host) and that port."""
        host = address_toward(toward)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._server = socket.create_server(("", 0), family=family)
        self.address = f"{host}:{self._server.getsockname()[1]}"
        """``HOST:PORT``, published in this agent's node record."""
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._server, selectors.EVENT_READ)
        threading.Thread(target=self._serve, daemon=True, name="elaswave-liveness").start()

    def _serve(self) -> None:
        while True:
            for key, _ in self._selector.select():
                if key.fileobj is self._server:
                    try:
                        connection, _ = self._server.accept()
                    except OSError:  # the watcher gave up before it was accepted
                        continue
                    self._selector.register(connection, selectors.EVENT_READ)
                    continue
                try:
                    still_open = key.fileobj.recv(64)  # watchers send nothing: this is the end
                except OSError:
                    still_open = b""
                if not still_open:
                    self._selector.unregister(key.fileobj)
                    key.fileobj.close()


class AgentConnection:
    """A watcher's connection to another node's :class:`LivenessListener`, held by a thread of
    its own. Calls ``on_gone(node_rank)`` once, from that thread, when the connection closed and
    the agent's port refuses a new one; calls nothing when the agent cannot be reached at all
    or :meth:`close` was called first."""

    def __init__(self, node_rank: int, address: str, on_gone: Callable[[int], None]) -> None:
        host, _, port = address.rpartition(":")
        self._address = (host.strip("[]"), int(port))
        self._node_rank = node_rank
        self._on_gone = on_gone
        self._closed = threading.Event()
        self._socket: socket.socket | None = None
        self._lock = threading.Lock()
        threading.Thread(target=self._watch, daemon=True,
                         name=f"elaswave-watch-node{node_rank}").start()

    def close(self) -> None:
        """Stop watching; wakes the thread, which then reports nothing."""
        self._closed.set()
        with self._lock:
            if self._socket is not None:
                try:
                    self._socket.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                self._socket.close()

    def _watch(self) -> None:
        while not self._closed.is_set():
            try:
                connection = socket.create_connection(self._address, timeout=CONNECT_TIMEOUT_S)
            except ConnectionRefusedError:
                if self._socket is not None:  # it was there, and its port is closed now
                    if not self._closed.is_set():
                        self._on_gone(self._node_rank)
                    return
                return  # never reached: no evidence either way
            except OSError:
                return  # unreachable or not answering: the heartbeat decides
            connection.settimeout(None)
            with self._lock:
                if self._closed.is_set():
                    connection.close()
                    return
                self._socket = connection
            try:
                while connection.recv(64):  # the listener sends nothing
                    pass
            except OSError:
                pass
            connection.close()
