"""The connection a launcher holds to each node it watches: gone when the other launcher's
process ends, not when a connection is only reset."""

import signal
import socket
import subprocess
import sys
import threading

import pytest

from megatron_elaswave.launch.liveness import AgentConnection, address_toward

LISTENER = ("from megatron_elaswave.launch.liveness import LivenessListener; import sys, time; "
            "print(LivenessListener('127.0.0.1').address, flush=True); time.sleep(120)")


def watch(address: str) -> tuple[AgentConnection, threading.Event]:
    gone = threading.Event()
    return AgentConnection(1, address, lambda node_rank: gone.set()), gone


def test_the_address_is_the_one_on_the_route_to_the_store():
    assert address_toward("127.0.0.1") == "127.0.0.1"


@pytest.mark.timeout(60)
def test_a_listener_whose_process_is_killed_is_reported_gone():
    process = subprocess.Popen([sys.executable, "-c", LISTENER], stdout=subprocess.PIPE, text=True)
    try:
        address = process.stdout.readline().strip()
        connection, gone = watch(address)
        assert not gone.wait(0.5)  # alive: held, nothing reported
        process.send_signal(signal.SIGKILL)
        assert gone.wait(10)
        connection.close()
    finally:
        process.kill()
        process.wait()


@pytest.mark.timeout(60)
def test_a_reset_connection_to_a_port_that_still_accepts_is_opened_again():
    """The first connection is closed by the other side while its port accepts: the watch
    reconnects and reports nothing; once the port is closed too, the next close is reported."""
    server = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{server.getsockname()[1]}"
    connection, gone = watch(address)
    first, _ = server.accept()
    first.close()
    second, _ = server.accept()  # it came back
    assert not gone.wait(0.5)
    server.close()
    second.close()
    assert gone.wait(10)
    connection.close()


@pytest.mark.timeout(60)
def test_a_closed_watch_reports_nothing():
    server = socket.create_server(("127.0.0.1", 0))
    connection, gone = watch(f"127.0.0.1:{server.getsockname()[1]}")
    accepted, _ = server.accept()
    connection.close()
    assert accepted.recv(1) == b""  # the watcher's end is closed
    server.close()
    accepted.close()
    assert not gone.wait(0.5)
