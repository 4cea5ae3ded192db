"""A generation's store: hosted by its lowest member and found through the job store, gone with
its host, never waited on past a detected failure."""

import signal
import subprocess
import sys
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from megatron_elaswave.launch.keys import generation_store_key
from megatron_elaswave.launch.store import WaitInterrupted
from megatron_elaswave.runtime.generation_store import KEPT_GENERATIONS, GenerationStores

TIMEOUT = timedelta(seconds=20)

HOST = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
from megatron_elaswave.runtime.generation_store import GenerationStores
job = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=20))
stores = GenerationStores(job, 0, host_address="127.0.0.1", timeout=timedelta(seconds=20))
stores.open(5, [0, 1]).set("from-host", "hello")
print("hosting", flush=True)
time.sleep(120)
"""


def job_store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)


def stores_of(job: dist.Store, *ranks: int) -> list[GenerationStores]:
    return [GenerationStores(job, rank, host_address="127.0.0.1", timeout=TIMEOUT)
            for rank in ranks]


def test_without_a_host_address_every_generation_uses_the_job_store():
    job = dist.HashStore()
    stores = GenerationStores(job, 3, host_address=None, timeout=TIMEOUT)
    assert stores.open(1, [3, 4]) is job
    assert stores.open(2, [0, 3]) is job
    assert not stores.hosted


@pytest.mark.timeout(60)
def test_the_lowest_member_hosts_and_the_others_find_it_through_the_job_store():
    job = job_store()
    host, member = stores_of(job, 2, 7)
    opened = {}
    # The member asks first: it waits for the host's address to appear.
    waiter = threading.Thread(target=lambda: opened.update(member=member.open(4, [7, 2, 9])))
    waiter.start()
    opened["host"] = host.open(4, [2, 7, 9])
    waiter.join(30)
    opened["member"].set("pieces/7", "held")
    assert opened["host"].get("pieces/7") == b"held"
    assert opened["host"].add("barrier", 1) == 1 and opened["member"].add("barrier", 1) == 2
    assert opened["member"].multi_get(["pieces/7"]) == [b"held"]
    assert member.open(4, [2, 7, 9]) is opened["member"]  # one store per generation
    assert job.get(generation_store_key(4)).decode().startswith("127.0.0.1:")
    assert not job.check(["pieces/7"])  # nothing of the exchange went to the job store


@pytest.mark.timeout(60)
@pytest.mark.parametrize("keep", [(), (1,)], ids=["closed", "kept"])
def test_a_host_serves_a_generation_past_the_kept_ones_only_when_asked_to(keep):
    job = job_store()
    (host,) = stores_of(job, 0)
    host.open(1, [0])
    port = int(job.get(generation_store_key(1)).decode().rpartition(":")[2])
    dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT).set("served", "1")
    for generation in range(2, 3 + KEPT_GENERATIONS):
        host.open(generation, [0], keep=keep)
    if keep:
        dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT).set("served", "2")
    else:
        with pytest.raises(dist.DistError):
            dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=1))


@pytest.mark.timeout(60)
def test_a_request_to_a_store_whose_host_was_killed_ends_once_the_failure_is_detected():
    job = job_store()
    process = subprocess.Popen([sys.executable, "-c", HOST, str(job.port)],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "hosting"
        failure = threading.Event()
        (member,) = stores_of(job, 1)
        store = member.open(5, [0, 1], failure)
        assert store.get("from-host") == b"hello"
        process.send_signal(signal.SIGKILL)
        process.wait()
        threading.Timer(0.3, failure.set).start()  # the monitor records the death
        with pytest.raises(WaitInterrupted, match="went down with its host, rank 0"):
            store.get("from-host")
        assert failure.is_set()
    finally:
        process.kill()
        process.wait()


@pytest.mark.timeout(60)
def test_a_member_waiting_for_a_host_that_never_publishes_gives_up_on_a_detected_failure():
    job = job_store()
    (member,) = stores_of(job, 3)
    failure = threading.Event()
    threading.Timer(0.3, failure.set).start()
    with pytest.raises(WaitInterrupted, match="failure was detected"):
        member.open(6, [1, 3], failure)
