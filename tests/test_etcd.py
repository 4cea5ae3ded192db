"""The job store on an etcd cluster (``elaswave-run --store etcd://...``).

Every test starts a three-member etcd cluster on loopback ports (the ``etcd_cluster`` fixture,
skipped where etcd or its client is not installed). The store itself is checked against the
``TCPStore`` it stands in for, and torch's gloo groups are formed on it; the jobs are two nodes
of two workers (TP1 x PP2 x DP2) that lose node 0, one etcd member, or the etcd quorum, and end
on the failure-free trajectory, or with one line per worker and a non-zero status.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
from harness import free_port, is_gone, launch_nodes
from test_elastic import TRAIN_ITERS, assert_on_trajectory, small_flags, small_reference  # noqa: F401
from test_pretrain_gpt import PRETRAIN, text_data  # noqa: F401  (fixture)
from torch.distributed import DistStoreError

from etcd_cluster import EtcdCluster, etcd_missing, make_tls_files
from megatron_elaswave.launch.etcd_address import EtcdAddress
from megatron_elaswave.launch.etcd_store import HistoryCompaction, StoreRefused
from megatron_elaswave.launch.silence import Heartbeat
from megatron_elaswave.launch.store import read_if_set
from megatron_elaswave.metrics import read_metrics

pytestmark = pytest.mark.multiprocess


def store_on(cluster, namespace: str, timeout_s: float = 2.0):
    from megatron_elaswave.launch.etcd_store import EtcdStore

    return EtcdStore(EtcdAddress.parse(cluster.url, namespace), timedelta(seconds=timeout_s))


def exercise(store) -> list:
    """What a store answers to every call the runtime and torch's rendezvous make."""
    answers = [store.set("a", "1"), store.get("a"), store.add("n", 2), store.add("n", 3),
               store.add("n", 0), store.get("n"), store.add("fresh", 0),
               store.compare_set("c", "", "x"), store.compare_set("c", "", "y"),
               store.compare_set("c", "x", "z"), store.compare_set("missing", "e", "d"),
               store.set("empty", ""), store.compare_set("empty", "", "filled"),
               store.check(["a", "n"]), store.check(["a", "nope"]),
               store.multi_set(["m1", "m2"], ["v1", b"v2"]), store.multi_get(["m1", "m2"]),
               store.delete_key("m1"), store.delete_key("m1"), store.check(["m1"]),
               read_if_set(store, "a"), read_if_set(store, "m1"),
               sorted(store.list_keys()), store.num_keys()]
    started = time.monotonic()
    with pytest.raises(DistStoreError):
        store.wait(["never"], timedelta(seconds=0.3))
    answers.append(0.3 <= time.monotonic() - started < 5)
    return answers


@pytest.mark.timeout(120)
def test_the_etcd_store_answers_as_the_tcpstore_does(etcd_cluster, store):
    assert exercise(store_on(etcd_cluster, "semantics")) == exercise(store)


def test_a_compare_set_on_an_empty_key_that_is_deleted_meanwhile_creates_it(monkeypatch):
    # The second try compares the empty key's revision; when the key is gone by then, the
    # third must create it, as TCPStore's compare_set does on a missing key.
    from megatron_elaswave.launch.etcd_store import EtcdStore

    store = EtcdStore(EtcdAddress.parse("etcd://127.0.0.1:2379"), timedelta(seconds=1))
    answers = iter([(False, {"value": "", "mod_revision": "5"}), (False, None), (True, None)])
    compared = []

    def commit_or_read(key, condition, value):
        compared.append(condition["target"])
        return next(answers)

    monkeypatch.setattr(store, "_commit_or_read", commit_or_read)
    assert store.compare_set("lock", "", "mine") == b"mine"
    assert compared == ["CREATE", "MOD", "CREATE"]


@pytest.mark.timeout(120)
def test_a_get_of_keys_not_yet_set_waits_for_them(etcd_cluster):
    reader, writer = store_on(etcd_cluster, "late"), store_on(etcd_cluster, "late")
    reader.set("early", "1")
    threading.Timer(0.3, writer.set, ("late", "2")).start()
    started = time.monotonic()
    assert reader.multi_get(["early", "late"]) == [b"1", b"2"]
    assert time.monotonic() - started >= 0.3


@pytest.mark.timeout(120)
def test_an_add_whose_answer_is_lost_counts_once_though_another_add_came_between(etcd_cluster):
    """The transaction of an ``add`` commits and its answer is lost; before it is sent again,
    another launcher adds to the same counter. The resent transaction finds the counter moved,
    and the retry finds its own total: three adds of one count three, each returns its own."""
    mine, other = store_on(etcd_cluster, "lost-answer"), store_on(etcd_cluster, "lost-answer")
    assert mine.add("deaths", 1) == 1
    call, lost = mine._call, []

    def answer_lost_once(path, payload):
        answer = call(path, payload)
        if path == "kv/txn" and payload.get("compare") and not lost:
            lost.append(answer)
            assert other.add("deaths", 1) == 3  # between the commit and the resend
            answer = call(path, payload)  # what the resend answers: the compare fails
        return answer

    mine._call = answer_lost_once
    assert mine.add("deaths", 1) == 2
    assert lost and lost[0]["succeeded"]
    assert other.get("deaths") == b"3"
    assert mine.delete_key("deaths") and other.add("deaths", 0) == 0


def cluster_revision_and_keys(cluster) -> tuple[int, int]:
    """The cluster's revision and how many keys it holds, every namespace's, read beside the
    store under test."""
    answer = cluster.call("kv/range", {"key": "AA==", "range_end": "AA==", "count_only": True})
    return int(answer["header"]["revision"]), int(answer.get("count", 0))


@pytest.mark.timeout(120)
def test_a_heartbeat_is_one_write_of_one_key_and_a_replacement_never_repeats_a_value(
        etcd_cluster, store):
    """On etcd a beat overwrites the member's key: one revision and no other key (an ``add``
    reads first and keeps a token key of its own); on a ``TCPStore`` it is an ``add``. Its
    watchers read it as a counter, on either store; the values move at every beat, a
    replacement's included."""
    etcd = store_on(etcd_cluster, "beats")
    for each in (etcd, store):
        key = "rt/heartbeat/0"
        member, values = Heartbeat(key), []
        for _ in range(2):
            before = cluster_revision_and_keys(etcd_cluster)
            member.beat(each)
            if each is etcd:
                revision, keys = cluster_revision_and_keys(etcd_cluster)
                assert (revision, keys) == (before[0] + 1, before[1] + (not values))
            values.append(each.add(key, 0))
        Heartbeat(key).beat(each)  # the member's replacement
        values.append(each.add(key, 0))
        assert values == sorted(set(values)), values


@pytest.mark.timeout(120)
def test_the_history_is_compacted_an_interval_behind(etcd_cluster):
    """Ticked with a clock of its own, the compaction drops the history older than the
    revision it read one interval before, and nothing newer: the values stay."""
    store, said = store_on(etcd_cluster, "history"), []
    compaction = HistoryCompaction(10.0, said.append)
    for value in range(3):  # (a read at revision 0 would read the latest)
        store.set("x", str(value))
    compaction.tick(store, 0.0)
    kept = cluster_revision_and_keys(etcd_cluster)[0]
    for value in range(5):
        store.set("x", str(value))
    compaction.tick(store, 9.0)  # not an interval yet
    assert at_revision(etcd_cluster, kept - 1) == "not compacted"
    compaction.tick(store, 10.0)
    last = cluster_revision_and_keys(etcd_cluster)[0]  # the revision that tick read
    assert at_revision(etcd_cluster, kept - 1) == "compacted"
    assert at_revision(etcd_cluster, kept) == "not compacted"
    assert store.get("x") == b"4" and said == []
    store.set("x", "5")
    compaction.finish(store)  # the agent ends: no later tick would compact to its last reading
    assert at_revision(etcd_cluster, last - 1) == "compacted"
    assert at_revision(etcd_cluster, last) == "not compacted"


def at_revision(cluster, revision: int) -> str:
    """Whether the cluster still holds its state at ``revision``."""
    import urllib.error

    try:
        cluster.call("kv/range", {"key": "AA==", "range_end": "AA==", "count_only": True,
                                  "revision": str(revision)})
    except urllib.error.HTTPError as error:
        assert b"required revision has been compacted" in error.read()
        return "compacted"
    return "not compacted"


@pytest.mark.timeout(180)
def test_a_cluster_out_of_space_is_one_line_that_says_so():
    """A cluster whose history filled its quota refuses every write; the store gives up after
    its bound with a line that names the cause and the way out."""
    from megatron_elaswave.launch.etcd_store import EtcdStore, StoreLost

    missing = etcd_missing()
    if missing:
        pytest.skip(missing)
    with EtcdCluster(1, quota_bytes=2**19) as cluster:
        store = EtcdStore(EtcdAddress.parse(cluster.url, "full"), timedelta(seconds=2),
                          unavailable_s=1)
        heartbeat = Heartbeat("rt/heartbeat/0")
        with pytest.raises(StoreLost) as lost:
            for _ in range(200_000):
                heartbeat.beat(store)
    message = str(lost.value)
    assert "\n" not in message
    assert message.startswith("the etcd cluster is out of space (etcdserver: mvcc: database "
                              "space exceeded): compact and defragment it"), message


def test_a_cluster_that_refuses_compaction_is_said_once_and_left_alone():
    class Refusing:
        revisions = iter(range(100, 200))
        compactions = 0

        def revision(self):
            return next(self.revisions)

        def compact(self, revision):
            self.compactions += 1
            raise StoreRefused("the job store at etcd://h:1 refused a request: permission "
                               "denied", 7)

    refusing, said = Refusing(), []
    compaction = HistoryCompaction(1.0, said.append)
    for now in range(6):
        compaction.tick(refusing, float(now))
    assert refusing.compactions == 1
    [line] = said
    assert "permission denied" in line and "--auto-compaction-retention" in line
    with pytest.raises(ValueError, match="must be positive"):
        HistoryCompaction(0, said.append)


@pytest.mark.timeout(180)
def test_the_store_answers_alike_on_a_cluster_with_tls_client_certificates_and_users(
        tmp_path, store):
    """Three members serving TLS that ask for a client certificate, with authentication on
    (the certificates made here): the store answers as the ``TCPStore`` does, with etcdctl's
    variables; a wrong password, and a client without a certificate, are refused in one line."""
    from dataclasses import replace

    from megatron_elaswave.launch.etcd_address import EtcdSecurity
    from megatron_elaswave.launch.etcd_store import EtcdStore

    missing = etcd_missing()
    if missing:
        pytest.skip(missing)
    files = make_tls_files(tmp_path / "tls")
    with EtcdCluster(3, tls=files) as cluster:
        cluster.enable_auth("root", "a secret")
        security = EtcdSecurity.from_environment({
            "ETCDCTL_CACERT": str(files.ca), "ETCDCTL_CERT": str(files.client_cert),
            "ETCDCTL_KEY": str(files.client_key), "ETCDCTL_USER": "root",
            "ETCDCTL_PASSWORD": "a secret"})

        def on_cluster(security: EtcdSecurity) -> EtcdStore:
            return EtcdStore(EtcdAddress.parse(cluster.url, "secured"), timedelta(seconds=2),
                             unavailable_s=3, security=security)

        assert exercise(on_cluster(security)) == exercise(store)
        with pytest.raises(DistStoreError, match="refused a request: .*authentication failed"):
            on_cluster(replace(security, password="wrong")).set("a", "1")
        with pytest.raises(DistStoreError) as refused:
            on_cluster(replace(security, cert=None, key=None)).set("a", "1")
        assert "\n" not in str(refused.value)


GLOO_WORKER = """
import sys, torch, torch.distributed as dist
from datetime import timedelta
from megatron_elaswave.launch.etcd_address import EtcdAddress
from megatron_elaswave.launch.etcd_store import EtcdStore
rank, url = int(sys.argv[1]), sys.argv[2]
store = EtcdStore(EtcdAddress.parse(url, "gloo"), timeout=timedelta(seconds=60))
dist.init_process_group("gloo", store=dist.PrefixStore("gen0/", store), rank=rank, world_size=3,
                        timeout=timedelta(seconds=60))
total = torch.tensor([rank + 1.0])
dist.all_reduce(total)
pair = dist.new_group([0, 2])
if rank != 1:
    in_pair = torch.tensor([10.0 * rank])
    dist.all_reduce(in_pair, group=pair)
    total += in_pair
print(f"rank {rank}: {total.item():g}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_gloo_groups_form_on_the_etcd_store(etcd_cluster):
    workers = [subprocess.Popen([sys.executable, "-c", GLOO_WORKER, str(rank), etcd_cluster.url],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for rank in range(3)]
    try:
        outputs = [worker.communicate(timeout=90)[0] for worker in workers]
    finally:
        for worker in workers:
            worker.kill()
    assert [worker.returncode for worker in workers] == [0, 0, 0], outputs
    assert [output.strip().splitlines()[-1] for output in outputs] == [
        "rank 0: 26", "rank 1: 6", "rank 2: 26"]


@pytest.mark.parametrize("url, fragment", [
    ("etcd://", "is not HOST:PORT"), ("etcd://host", "is not HOST:PORT"),
    ("http://127.0.0.1:2379", "is not an etcd URL")])
def test_a_bad_store_url_is_one_line_and_status_2(url, fragment):
    result = subprocess.run([sys.executable, "-m", "megatron_elaswave.launch.run", "--store", url,
                             PRETRAIN], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert fragment in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def run_two_nodes(tmp_path, text_data, cluster, name: str, inject, node_timeout_s: float = 2.0,  # noqa: F811
                  node_args: tuple[str, ...] = ()):
    """Train on two nodes of two workers with the store on ``cluster``; ``inject(nodes,
    reached)`` sends faults; ``node_args`` go to both launchers. Returns the nodes' exit
    statuses and outputs and the metrics."""
    metrics = tmp_path / f"{name}.jsonl"
    flags = [PRETRAIN, *small_flags(text_data), "--elastic-metrics-file", str(metrics)]

    def reached(iteration: int) -> bool:
        return metrics.exists() and any(
            r["iteration"] >= iteration for r in read_metrics(str(metrics), "iteration"))

    with contextlib.ExitStack() as stack:
        nodes = launch_nodes(stack, flags, 2, master_port=free_port(), log_dir=tmp_path,
                             node_args=[[f"--node-timeout={node_timeout_s:g}", *node_args]] * 2,
                             etcd=cluster.url)
        inject(nodes, reached)
        results = [node.wait(240) for node in nodes]
    return results, metrics


@pytest.mark.timeout(420)
def test_node_0_lost_with_its_workers_is_recovered_from_on_etcd(text_data, small_reference,  # noqa: F811
                                                                 etcd_cluster, tmp_path):
    """Node 0's launcher, fork server and workers are SIGKILLed: on etcd the store lives on, node
    1 declares node 0 lost as soon as its connection to node 0's launcher closes (not after the
    node timeout) and its workers go on without ranks 0 and 1, on the trajectory. Node 0's agent
    compacted the cluster's history (every second here); node 1's does from then on."""
    killed, lost_at = {}, []

    def inject(nodes, reached):
        nodes[0].wait_for(lambda: reached(3), 120, "iteration 3")
        killed.update(nodes[0].worker_pids())
        os.killpg(nodes[0].pid, signal.SIGKILL)
        lost_at.append(cluster_revision_and_keys(etcd_cluster)[0])

    [(_, _), (node1_code, node1_output)], metrics = run_two_nodes(
        tmp_path, text_data, etcd_cluster, "node0", inject, node_timeout_s=60,
        node_args=("--store-compaction-interval=1",))
    assert at_revision(etcd_cluster, lost_at[0]) == "compacted"
    assert node1_code == 0, node1_output[-4000:]
    assert "node 0 lost: its launcher's process ended" in node1_output, node1_output[-4000:]
    assert all(is_gone(pid) for pid in killed.values())
    [recovery] = read_metrics(str(metrics), "recovery")
    assert recovery["failed_ranks"] == [0, 1]
    iterations = read_metrics(str(metrics), "iteration")
    assert [r["iteration"] for r in iterations] == list(range(1, TRAIN_ITERS + 1))
    assert all(r["world_size"] == 2 for r in iterations if r["iteration"] > recovery["iteration"])
    assert_on_trajectory(small_reference, iterations)


@pytest.mark.timeout(420)
def test_one_etcd_member_lost_is_not_noticed(text_data, small_reference, etcd_cluster,  # noqa: F811
                                             tmp_path):
    """The leader of the etcd cluster is SIGKILLed mid-run: the others elect a new one, the
    requests go to them, and the job ends on the trajectory without a recovery."""

    def inject(nodes, reached):
        nodes[0].wait_for(lambda: reached(3), 120, "iteration 3")
        etcd_cluster.kill(etcd_cluster.leader())
        nodes[0].wait_for(lambda: reached(6), 120, "iteration 6, after the member's loss")

    results, metrics = run_two_nodes(tmp_path, text_data, etcd_cluster, "member", inject)
    assert [code for code, _ in results] == [0, 0], results[0][1][-4000:] + results[1][1][-4000:]
    assert read_metrics(str(metrics), "recovery") == []
    iterations = read_metrics(str(metrics), "iteration")
    assert [r["iteration"] for r in iterations] == list(range(1, TRAIN_ITERS + 1))
    assert_on_trajectory(small_reference, iterations)


@pytest.mark.timeout(300)
def test_the_etcd_quorum_lost_stops_every_worker_in_one_line(text_data, etcd_cluster,  # noqa: F811
                                                             tmp_path):
    """Two of the three members are SIGKILLed: no request is served any more. Every worker says
    so in one line and exits non-zero, each launcher likewise, and no process is left."""
    pids = {}

    def inject(nodes, reached):
        nodes[0].wait_for(lambda: reached(3), 120, "iteration 3")
        for node in nodes:
            pids.update(node.worker_pids())
        etcd_cluster.kill(0)
        etcd_cluster.kill(1)

    results, _ = run_two_nodes(tmp_path, text_data, etcd_cluster, "quorum", inject)
    cluster = etcd_cluster.url
    for code, output in results:
        assert code != 0, output[-4000:]
        agent_lines = re.findall(r"\[elaswave-run\] lost the job store[^\n]*", output)
        assert len(agent_lines) == 1 and cluster in agent_lines[0], output[-4000:]
        assert output.count(f"pretrain_gpt.py: cannot continue: lost the job store at {cluster}"
                            ) == 2, output[-4000:]  # one per worker
        assert "Traceback" not in output, output[-4000:]
    assert all(is_gone(pid) for pid in pids.values())
