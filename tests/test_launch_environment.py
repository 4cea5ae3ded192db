"""``elaswave-run`` in place of ``torchrun``: torchrun's flags, and the placement SLURM and
Kubernetes give through the environment.

The first tests start no processes: they feed the pure functions of
:mod:`megatron_elaswave.launch.environment` an environment mapping. The multi-process tests at
the end start two real launchers on loopback, placed only by SLURM's variables, only by a
PyTorchJob's, or only by torchrun's c10d rendezvous flags, and SIGKILL a worker.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from harness import LaunchedJob, free_port, worker_script

from megatron_elaswave.launch.environment import (
    DEFAULT_RDZV_PORT,
    expand_hostlist,
    indexed_job_settings,
    parse_endpoint,
    parse_nnodes,
    pytorchjob_settings,
    scheduler_settings,
    slurm_settings,
)
from megatron_elaswave.launch.keys import node_key
from megatron_elaswave.launch.config import UsageError
from megatron_elaswave.launch.rendezvous import is_this_machine
from megatron_elaswave.launch.run import (
    build_parser,
    config_from_args,
    ignored_flag_notices,
    main,
)
from megatron_elaswave.launch.store import NodeRecord, from_json, read_worker

multiprocess = pytest.mark.multiprocess
SCRIPT = worker_script("exit_plan.py")  # any script that exists; these tests never run it


def devices(gpu: int = 0, accelerator: int = 0, cpu: int = 16):
    """A stand-in for the machine's device counts."""
    return {"gpu": gpu, "accelerator": accelerator, "cpu": cpu}.__getitem__


def config(argv: list[str], env: dict[str, str] | None = None, **machine):
    """The launch configuration of ``argv + [SCRIPT]`` in ``env`` alone (never ``os.environ``),
    on a machine of ``devices(**machine)``, with 40000 as the free port."""
    args = build_parser().parse_args([*argv, SCRIPT])
    return config_from_args(args, env or {}, count_devices=devices(**machine),
                            pick_free_port=lambda: 40000)


def placement(argv: list[str], env: dict[str, str] | None = None, **machine) -> tuple:
    """``(nnodes, node_rank, master_addr, master_port, nproc_per_node)`` of :func:`config`."""
    c = config(argv, env, **machine)
    return c.nnodes, c.node_rank, c.master_addr, c.master_port, c.nproc_per_node


def refusal(argv: list[str], env: dict[str, str] | None = None, **machine) -> str:
    """The one-line error of a launch that :func:`config` refuses."""
    with pytest.raises(UsageError) as refused:
        config(argv, env, **machine)
    message = str(refused.value)
    assert "\n" not in message and refused.value.exit_status == 2
    return message


# --- SLURM's host lists ---------------------------------------------------------------------


@pytest.mark.parametrize("hostlist, hosts", [
    ("node01", ["node01"]),
    ("node[01-03,7]", ["node01", "node02", "node03", "node7"]),
    ("a1,b[2-3]", ["a1", "b2", "b3"]),
    ("gpu[009-011],login", ["gpu009", "gpu010", "gpu011", "login"]),
    ("node[9-11]", ["node9", "node10", "node11"]),  # no padding: the start has one digit
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),  # the last bracket varies fastest
    ("rack[1-2]-node[08,10]", ["rack1-node08", "rack1-node10", "rack2-node08", "rack2-node10"]),
    ("127.0.0.[1-2]", ["127.0.0.1", "127.0.0.2"]),
    ("x[3],x[1]", ["x3", "x1"]),  # the order as written, duplicates and all
    (" n[1-2] ", ["n1", "n2"]),
])
def test_a_compact_slurm_host_list_expands_in_order(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


def test_a_large_host_range_expands_with_its_padding():
    hosts = expand_hostlist("node[0001-1000]")
    assert len(hosts) == 1000 and hosts[0] == "node0001" and hosts[-1] == "node1000"


@pytest.mark.parametrize("hostlist, fragment", [
    ("", "empty host list"),
    ("a,,b", "empty host name"),
    ("node[1-", "unclosed bracket"),
    ("node]1[", "unbalanced brackets"),
    ("node[[1]]", "unbalanced brackets"),
    ("node[3-1]", "runs backwards"),
    ("node[a-b]", "is not a number"),
    ("node[]", "is not a number"),
    ("node[1-2-3]", "is not a number"),
])
def test_a_malformed_host_list_is_a_one_line_error(hostlist, fragment):
    with pytest.raises(ValueError, match=fragment) as refused:
        expand_hostlist(hostlist)
    assert "\n" not in str(refused.value)


# --- torchrun's text formats ----------------------------------------------------------------


@pytest.mark.parametrize("endpoint, expected", [
    ("node0", ("node0", DEFAULT_RDZV_PORT)),
    ("node0:1234", ("node0", 1234)),
    ("10.0.0.1:29500", ("10.0.0.1", 29500)),
    ("[::1]:1234", ("::1", 1234)),
    ("[::1]", ("::1", DEFAULT_RDZV_PORT)),
    ("fe80::1", ("fe80::1", DEFAULT_RDZV_PORT)),
])
def test_an_endpoint_gives_host_and_port_with_torchruns_default_port(endpoint, expected):
    assert parse_endpoint(endpoint) == expected


@pytest.mark.parametrize("endpoint", [":1234", "node0:", "node0:0", "node0:65536", "node0:x"])
def test_a_malformed_endpoint_is_refused(endpoint):
    with pytest.raises(ValueError):
        parse_endpoint(endpoint)


def test_a_node_count_is_a_number_or_a_range_of_one():
    assert parse_nnodes("3") == 3 and parse_nnodes("2:2") == 2
    with pytest.raises(ValueError, match="--rejoin; pass --nnodes 4"):
        parse_nnodes("1:4")
    for text in ("1:2:3", "x", "-1"):
        with pytest.raises(ValueError):
            parse_nnodes(text)


# --- the sources, one by one ----------------------------------------------------------------


SRUN_TASK = {  # what srun --nodes=2 --ntasks-per-node=1 sets for the task of node 1 (abridged)
    "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_STEPID": "0",
    "SLURM_JOB_NUM_NODES": "3", "SLURM_JOB_NODELIST": "gpu[07-09]",
    "SLURM_NNODES": "2", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NODELIST": "gpu[08-09]",
    "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_NODEID": "1", "SLURM_PROCID": "1", "SLURM_LOCALID": "0",
}


def values(settings) -> dict:
    return {name: setting.value for name, setting in settings.items()}


def test_slurm_places_a_step_task_by_its_node_id_and_the_steps_first_host():
    assert values(slurm_settings(SRUN_TASK)) == {
        "nnodes": 2, "node_rank": 1, "master_addr": "gpu08"}
    assert values(slurm_settings({**SRUN_TASK, "MASTER_PORT": "6000"}))["master_port"] == 6000


def test_slurm_without_the_step_variables_falls_back_to_the_jobs():
    task = {name: value for name, value in SRUN_TASK.items()
            if name not in ("SLURM_STEP_NUM_NODES", "SLURM_STEP_NODELIST", "SLURM_NNODES",
                            "SLURM_NODEID")}
    assert values(slurm_settings(task)) == {"nnodes": 3, "node_rank": 1, "master_addr": "gpu07"}


def test_a_slurm_batch_script_outside_a_step_is_no_placement():
    """In the batch script itself SLURM sets SLURM_NNODES (the allocation) but no step: a
    launcher started there runs alone, as torchrun would, instead of waiting for the others."""
    batch = {name: value for name, value in SRUN_TASK.items() if "STEP" not in name}
    assert slurm_settings(batch) == {} and scheduler_settings(batch) == {}


def test_a_slurm_step_of_several_tasks_per_node_is_refused_unless_flags_place_the_launcher():
    crowded = {**SRUN_TASK, "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8"}
    message = refusal([], crowded)
    assert "SLURM runs 8 tasks on 2 nodes" in message and "--ntasks-per-node=1" in message
    assert placement(["--nnodes=8", "--node-rank=5"], crowded)[:2] == (8, 5)


PYTORCHJOB_WORKER_0 = {  # a Worker pod of PyTorchJob (operator 1.7+), nprocPerNode "2", 2 pods
    "KUBERNETES_SERVICE_HOST": "10.96.0.1", "PYTHONUNBUFFERED": "1",
    "MASTER_ADDR": "gpt-master-0", "MASTER_PORT": "23456",
    "PET_MASTER_ADDR": "gpt-master-0", "PET_MASTER_PORT": "23456",
    "WORLD_SIZE": "4", "RANK": "1", "PET_NODE_RANK": "1",
    "PET_NPROC_PER_NODE": "2", "PET_NNODES": "2",
}


def test_a_pytorchjob_pod_is_placed_by_its_pet_variables_not_by_world_size():
    """WORLD_SIZE is nodes x processes here; PET_NNODES, torchrun's own, comes first."""
    assert placement([], PYTORCHJOB_WORKER_0) == (2, 1, "gpt-master-0", 23456, 2)


def test_an_older_pytorchjob_pod_is_placed_by_world_size_and_rank():
    """Training operators before 1.7 set only MASTER_ADDR, MASTER_PORT, WORLD_SIZE (pods) and
    RANK (the pod's index)."""
    older = {name: PYTORCHJOB_WORKER_0[name] for name in
             ("KUBERNETES_SERVICE_HOST", "MASTER_ADDR", "MASTER_PORT")}
    older.update(WORLD_SIZE="3", RANK="2")
    assert values(pytorchjob_settings(older)) == {
        "nnodes": 3, "node_rank": 2, "master_addr": "gpt-master-0", "master_port": 23456}
    assert placement(["--nproc-per-node=4"], older) == (3, 2, "gpt-master-0", 23456, 4)


def test_world_size_and_rank_outside_kubernetes_are_not_a_placement():
    """A batch script may export MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK for
    torch.distributed itself (WORLD_SIZE counting processes): that is no node count."""
    exported = {"MASTER_ADDR": "n1", "MASTER_PORT": "29500", "WORLD_SIZE": "8", "RANK": "0"}
    assert pytorchjob_settings(exported) == {}
    assert placement([], exported) == (1, 0, "127.0.0.1", 29500, 1)


def test_a_trainjob_pod_of_kubeflow_trainer_is_placed_by_its_pet_variables():
    trainer_pod = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "JOB_COMPLETION_INDEX": "3",
                   "PET_NNODES": "4", "PET_NPROC_PER_NODE": "auto", "PET_NODE_RANK": "3",
                   "PET_MASTER_ADDR": "gpt-node-0-0.gpt", "PET_MASTER_PORT": "29400"}
    assert placement([], trainer_pod, accelerator=8) == (4, 3, "gpt-node-0-0.gpt", 29400, 8)


JOBSET_POD = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "JOB_COMPLETION_INDEX": "2",
              "MASTER_ADDR": "gpt-workers-0-0.gpt", "MASTER_PORT": "3389"}


def test_a_jobset_pod_takes_its_completion_index_and_the_master_its_manifest_names():
    assert values(indexed_job_settings(JOBSET_POD)) == {
        "node_rank": 2, "master_addr": "gpt-workers-0-0.gpt", "master_port": 3389}
    assert placement(["--nnodes=4"], JOBSET_POD) == (4, 2, "gpt-workers-0-0.gpt", 3389, 1)


def test_a_node_rank_out_of_range_names_where_both_numbers_came_from():
    assert refusal([], JOBSET_POD) == (
        "--node-rank 2 (from JOB_COMPLETION_INDEX=2) is out of range for --nnodes 1 "
        "(the default)")
    assert refusal(["--nnodes=2", "--node-rank=2"]) == (
        "--node-rank 2 is out of range for --nnodes 2")


# --- precedence -----------------------------------------------------------------------------


def test_each_setting_comes_from_the_first_source_that_gives_it():
    """Command line, then torchrun's PET_ variables, then the scheduler, then the defaults,
    setting by setting."""
    env = {**SRUN_TASK, "MASTER_PORT": "6000", "PET_MASTER_PORT": "7000"}
    assert placement([], env) == (2, 1, "gpu08", 7000, 1)
    assert placement(["--node-rank=0"], env) == (2, 0, "gpu08", 7000, 1)
    assert placement(["--master-addr=ib-gpu08", "--master-port=8000"], env) == (
        2, 1, "ib-gpu08", 8000, 1)
    assert placement(["--rdzv-endpoint=head"], env) == (2, 1, "head", DEFAULT_RDZV_PORT, 1)
    assert placement(["--standalone"], env) == (1, 0, "127.0.0.1", 40000, 1)
    assert placement([], {}) == (1, 0, "127.0.0.1", 29500, 1)


def test_a_pet_variable_the_command_line_overrides_cannot_refuse_the_launch():
    """torchrun reads PET_<FLAG> only for a flag not given; so does elaswave-run."""
    for variable, value, flag in [("PET_NNODES", "1:4", "--nnodes=2"),
                                  ("PET_MAX_RESTARTS", "3", "--max-restarts=0"),
                                  ("PET_RDZV_BACKEND", "etcd", "--rdzv-backend=static")]:
        assert refusal([], {variable: value}).startswith(f"{variable}={value}: ")
        assert config([flag], {variable: value}).script == SCRIPT


def test_the_rendezvous_endpoint_wins_over_the_master_flags_as_in_torchrun():
    flags = ["--master-addr=a", "--master-port=1", "--rdzv-endpoint=b:2"]
    assert placement(flags)[2:4] == ("b", 2)


def test_a_c10d_launcher_given_no_node_rank_takes_one_at_the_store():
    assert placement(["--rdzv-backend=c10d", "--nnodes=2"])[1] is None
    assert placement(["--rdzv-backend=c10d", "--nnodes=2", "--node-rank=1"])[1] == 1
    assert placement(["--rdzv-backend=c10d"])[1] == 0  # one node: nothing to take
    assert placement(["--nnodes=2"])[1] == 0  # static: torchrun's default node rank
    kubeflow_elastic = {"PET_RDZV_BACKEND": "c10d", "PET_RDZV_ENDPOINT": "gpt-worker-0:23456",
                        "PET_NNODES": "2:2", "PET_RDZV_ID": "gpt"}
    c = config([], kubeflow_elastic)
    assert (c.nnodes, c.node_rank, c.master_addr, c.master_port, c.run_id) == (
        2, None, "gpt-worker-0", 23456, "gpt")


def test_standalone_is_one_node_with_its_store_on_a_free_local_port():
    assert placement(["--standalone", "--nproc-per-node=3"]) == (1, 0, "127.0.0.1", 40000, 3)
    assert placement([], {"PET_STANDALONE": ""}) == (1, 0, "127.0.0.1", 40000, 1)  # Kubeflow's
    assert placement([], {"PET_STANDALONE": "0"}) == (1, 0, "127.0.0.1", 29500, 1)
    assert refusal(["--standalone", "--nnodes=2"]) == (
        "--standalone runs a one-node job, not --nnodes 2; drop one of them")
    assert refusal(["--nnodes=3"], {"PET_STANDALONE": "1"}) == (
        "PET_STANDALONE=1 runs a one-node job, not --nnodes 3; drop one of them")


# --- torchrun's other flags -----------------------------------------------------------------


def test_nproc_per_node_counts_devices_as_torchrun_does():
    assert placement(["--nproc-per-node=gpu"], gpu=4)[4] == 4
    assert placement(["--nproc_per_node=cpu"], cpu=12)[4] == 12
    assert placement(["--nproc-per-node=auto"], accelerator=8)[4] == 8
    assert placement(["--nproc-per-node=auto"], cpu=6)[4] == 6
    assert refusal(["--nproc-per-node=gpu"]) == (
        "--nproc-per-node gpu: this machine has no CUDA device that torch can use; pass the "
        "number of workers, or cpu")
    assert "PET_NPROC_PER_NODE=gpu: " in refusal([], {"PET_NPROC_PER_NODE": "gpu"})
    assert refusal(["--nproc-per-node=0"]) == "--nproc-per-node must be at least 1, got 0"
    assert "expected a number of workers, gpu, cpu or auto" in refusal(["--nproc-per-node=xpu"])


def test_the_rendezvous_id_conf_role_and_shutdown_timeout_map_to_the_launchers_settings():
    c = config(["--rdzv_id=job-7", "--rdzv-conf=join_timeout=42,read_timeout=60",
                "--role=trainer", "--shutdown-timeout=3", "--max_restarts=0"])
    assert (c.run_id, c.join_timeout_s, c.role, c.shutdown_grace_s) == ("job-7", 42, "trainer", 3)
    assert c.worker_env(0, {})["ROLE_NAME"] == "trainer"
    assert config(["--rdzv-id=a", "--run-id=a"]).run_id == "a"
    assert refusal(["--rdzv-id=a", "--run-id=b"]) == (
        "--run-id b and --run-id a (from --rdzv-id a) disagree; pass one of them")


@pytest.mark.parametrize("argv, fragment", [
    (["--nnodes=1:4"], "does not form a job from a range of node counts"),
    (["--max-restarts=3"], "--rejoin --max-rejoins N starts a dead worker again"),
    (["--no-python"], "--no-python: elaswave-run's workers are Python processes"),
    (["--virtual-local-rank"], "leaves CUDA_VISIBLE_DEVICES as it is"),
    (["--rdzv-backend=etcd-v2"], "pass that instead"),
    (["--rdzv-backend=zeus"], "expected static or c10d"),
    (["--signals-to-handle=SIGTERM,SIGUSR1"], "not SIGUSR1"),
    (["--rdzv-conf=join_timeout"], "expected KEY=VALUE"),
    (["--rdzv-conf=join_timeout=0"], "must be positive"),
])
def test_a_torchrun_flag_that_cannot_mean_anything_here_is_one_line(argv, fragment):
    assert fragment in refusal(argv)


def test_main_reports_a_refusal_in_one_line_with_status_2(capsys, monkeypatch):
    for name in [*os.environ]:
        if name.startswith(("SLURM_", "PET_")):
            monkeypatch.delenv(name)
    assert main(["--nnodes", "2:8", SCRIPT]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("elaswave-run: error: --nnodes 2:8: elaswave-run does not form")


def test_every_torchrun_flag_is_accepted_in_both_spellings():
    from torch.distributed.run import get_args_parser

    ours = build_parser()._option_string_actions
    theirs = [option for action in get_args_parser()._actions for option in action.option_strings
              if option not in ("-h", "--help")]
    assert len(theirs) > 40
    assert [option for option in theirs if option not in ours] == []


def test_torchrun_flags_without_effect_here_are_named_in_one_line_each():
    args = build_parser().parse_args(["--tee", "3", "--monitor_interval=1", "-r", "3", SCRIPT])
    notices = ignored_flag_notices(args)
    assert notices == [
        "ignoring --monitor-interval 1: the launcher checks its workers every 50 ms",
        "ignoring --redirects 3: each worker's stdout and stderr go to DIR/rank<r>.log with "
        "--log-dir DIR, else to this terminal",
        "ignoring --tee 3: each worker's stdout and stderr go to DIR/rank<r>.log with "
        "--log-dir DIR, else to this terminal",
    ]
    assert config_from_args(args, {}).script == SCRIPT


def test_this_machine_is_told_from_others_by_the_addresses_it_can_bind():
    assert is_this_machine("127.0.0.1") and is_this_machine("localhost")
    assert is_this_machine(socket.gethostname())
    assert not is_this_machine("192.0.2.1")  # TEST-NET-1: never a local address


# --- two launchers on loopback, placed by the environment -----------------------------------


_SCHEDULER_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK",
                        "JOB_COMPLETION_INDEX", "KUBERNETES_SERVICE_HOST")


def _clean_environment(**extra: str) -> dict[str, str]:
    """This process's environment without any scheduler's placement, plus ``extra``."""
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(("SLURM_", "PET_")) and name not in _SCHEDULER_VARIABLES}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def _start_launcher(argv: list[str], env: dict[str, str], log: Path, *, node_rank: int,
                    master_port: int) -> LaunchedJob:
    """``elaswave-run argv`` in a session of its own, in exactly ``env``, its output in ``log``."""
    with open(log, "wb") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "megatron_elaswave.launch.run", *argv],
            stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,
        )
    return LaunchedJob(process, node_rank=node_rank, nproc_per_node=2, master_port=master_port,
                       output_path=log, owns_output=False)


def _node_records(job: LaunchedJob, timeout: float = 90.0) -> dict[int, NodeRecord]:
    """``{node rank: record}`` of the two launchers, once both have joined."""
    store = job.store(timeout)
    keys = [node_key(0), node_key(1)]
    job.wait_for(lambda: store.check(keys), timeout, "both launchers to join")
    return {n: from_json(NodeRecord, raw) for n, raw in enumerate(store.multi_get(keys))}


def _survive_a_sigkill(nodes: list[LaunchedJob], out_dir: Path) -> None:
    """Check the job's placement, SIGKILL rank 3 (node 1's second worker), and check that the
    three survivors saw exactly that death and both launchers end with 0."""
    for node in nodes:
        pids = node.worker_pids(timeout=90)
        for rank, pid in pids.items():
            assert psutil.Process(pid).ppid() == node.pid, f"rank {rank} is not node's child"
            assert read_worker(node.store(), rank).node_rank == node.node_rank
    victim = nodes[1].kill_worker(3)
    results = [node.wait(timeout=90) for node in nodes]
    for returncode, output in results:
        assert returncode == 0, output
    killed = f"worker rank 3 (pid {victim}) killed by SIGKILL; 1 worker still running"
    assert killed in results[1][1]
    reports = {int(path.stem.removeprefix("rank")): json.loads(path.read_text())
               for path in out_dir.glob("rank*.json")}
    assert reports.keys() == {0, 1, 2}
    for report in reports.values():
        [death] = report["deaths"]
        assert (death["rank"], death["node_rank"], death["pid"]) == (3, 1, victim)
        assert (death["cause"], death["signal"]) == ("signal", "SIGKILL")


def _two_nodes_survive_a_sigkill(tmp_path, command: list[str], port: int, out,
                                 environment_of) -> None:
    """Two launchers of ``command`` that only ``environment_of(node)`` places: each is the node
    its environment names, and the job survives a SIGKILLed worker."""
    with contextlib.ExitStack() as stack:
        nodes = [stack.enter_context(_start_launcher(
            command, environment_of(n), tmp_path / f"node{n}.log", node_rank=n,
            master_port=port)) for n in (0, 1)]
        records = _node_records(nodes[0])
        assert {n: record.pid for n, record in records.items()} == {0: nodes[0].pid,
                                                                    1: nodes[1].pid}
        _survive_a_sigkill(nodes, out)


@multiprocess
@pytest.mark.timeout(240)
def test_two_nodes_placed_only_by_slurm_survive_a_sigkilled_worker(tmp_path):
    """``srun --nodes=2 --ntasks-per-node=1 elaswave-run --nproc-per-node 2 ...``, as each task
    sees it: node rank, node count, the master (the host list's first host) and MASTER_PORT all
    come from SLURM's variables."""
    port, out = free_port(), tmp_path / "out"
    out.mkdir()
    step = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_JOB_NUM_NODES": "2",
            "SLURM_NNODES": "2", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "127.0.0.[1-2]",
            "MASTER_PORT": str(port)}
    command = ["--nproc-per-node", "2", worker_script("survivor.py"), str(out), "3"]
    _two_nodes_survive_a_sigkill(tmp_path, command, port, out, lambda n: _clean_environment(
        **step, SLURM_NODEID=str(n), SLURM_PROCID=str(n)))


@multiprocess
@pytest.mark.timeout(240)
def test_two_pods_placed_only_by_a_pytorchjob_survive_a_sigkilled_worker(tmp_path):
    """The container command of a PyTorchJob (Master and one Worker, nprocPerNode "2") is
    ``elaswave-run survivor.py ...`` with no flag: the operator's variables place each pod."""
    port, out = free_port(), tmp_path / "out"
    out.mkdir()
    pod = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "PYTHONUNBUFFERED": "1",
           "MASTER_ADDR": "localhost", "MASTER_PORT": str(port), "PET_MASTER_ADDR": "localhost",
           "PET_MASTER_PORT": str(port), "WORLD_SIZE": "4", "PET_NNODES": "2",
           "PET_NPROC_PER_NODE": "2"}
    command = [worker_script("survivor.py"), str(out), "3"]
    _two_nodes_survive_a_sigkill(tmp_path, command, port, out, lambda n: _clean_environment(
        **pod, RANK=str(n), PET_NODE_RANK=str(n)))


@multiprocess
@pytest.mark.timeout(240)
def test_two_nodes_of_a_c10d_rendezvous_take_their_ranks_and_survive_a_sigkilled_worker(tmp_path):
    """torchrun's multi-node command line, unchanged: ``--nnodes 2 --nproc-per-node 2
    --rdzv-id ... --rdzv-backend c10d --rdzv-endpoint HOST:PORT`` on both nodes, no node rank.
    Both launchers start at once; the one that binds the endpoint's port hosts the store as
    node 0, the other takes node 1. A third launcher finds every node rank taken."""
    port, out = free_port(), tmp_path / "out"
    out.mkdir()
    rendezvous = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-id", "job-c10d",
                  "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    command = [*rendezvous, worker_script("survivor.py"), str(out), "3"]
    with contextlib.ExitStack() as stack:
        started = [stack.enter_context(_start_launcher(
            command, _clean_environment(), tmp_path / f"launcher{i}.log", node_rank=-1,
            master_port=port)) for i in (0, 1)]
        records = _node_records(started[0])
        by_pid = {job.pid: job for job in started}
        assert {record.pid for record in records.values()} == set(by_pid)
        assert {record.run_id for record in records.values()} == {"job-c10d"}
        for node_rank, record in records.items():
            by_pid[record.pid].node_rank = node_rank
        nodes = sorted(started, key=lambda job: job.node_rank)
        assert _listens_on(nodes[0].pid, port), "node 0 hosts the store"

        third = subprocess.run(
            [sys.executable, "-m", "megatron_elaswave.launch.run", *rendezvous,
             "--preload=none", worker_script("survivor.py"), str(out), "3"],
            capture_output=True, text=True, env=_clean_environment(), timeout=60)
        assert third.returncode == 2, third.stderr
        assert third.stderr.strip().splitlines() == [
            "elaswave-run: error: all 2 node ranks of this job are taken; to replace a lost "
            "node, start its launcher with --rejoin --node-rank R"]
        _survive_a_sigkill(nodes, out)


def _listens_on(pid: int, port: int) -> bool:
    connections = psutil.Process(pid).net_connections(kind="tcp")
    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in connections)
