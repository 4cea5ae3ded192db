"""``elaswave-run``: environment, death reports, exit status, signals, multi-node, bad input.

The multi-process tests start real launchers and tiny worker scripts (``tests/workers``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import psutil
import pytest
from harness import free_port, is_gone, launch, wait_until, worker_script

from megatron_elaswave.launch.keys import NODE_CHANGES_KEY, death_key, worker_key
from megatron_elaswave.launch.config import LaunchConfig
from megatron_elaswave.launch.launcher import job_exit_status
from megatron_elaswave.launch.rendezvous import accepts_connections
from megatron_elaswave.launch.proctitle import worker_title
from megatron_elaswave.launch.run import parse_config
from megatron_elaswave.launch.store import (
    WorkerDeath,
    change_node_state,
    read_deaths,
    read_exit,
    read_node_states,
    record_death,
    store_listener,
)

multiprocess = pytest.mark.multiprocess


def read_reports(directory: Path) -> dict[int, dict]:
    """``{rank: report}`` from the ``rank<r>.json`` files the workers wrote."""
    return {
        int(path.stem.removeprefix("rank")): json.loads(path.read_text())
        for path in directory.glob("rank*.json")
    }


def wait_for_reports(job, directory: Path, ranks: set[int], timeout: float = 30.0) -> None:
    job.wait_for(lambda: ranks <= read_reports(directory).keys(), timeout, f"reports of {ranks}")


# --- pure functions -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "returncodes, status",
    [
        ([0, 0], 0),
        ([3, 0, 0], 0),  # a death survived
        ([-9, 3, 0], 0),
        ([0, 3], 3),  # a failure after the job finished
        ([0, 0, -9], 128 + 9),
        ([4, 5], 4),  # nobody finished: the first failure decides
        ([-15, 2], 128 + 15),
        ([3, 0, 5], 3),
    ],
)
def test_exit_status_rule(returncodes, status):
    assert job_exit_status(returncodes) == status


def test_worker_env_follows_torchrun():
    config = LaunchConfig(script=__file__, nproc_per_node=2, nnodes=3, node_rank=2, run_id="j7")
    env = config.worker_env(1, {"PATH": "/bin"})
    assert env["PATH"] == "/bin"
    assert (env["RANK"], env["LOCAL_RANK"]) == ("5", "1")
    assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("6", "2")
    assert env["GROUP_RANK"] == env["NODE_RANK"] == "2"
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert env["TORCHELASTIC_RUN_ID"] == "j7"
    assert env["OMP_NUM_THREADS"] == "1"
    assert config.worker_env(0, {"OMP_NUM_THREADS": "4"})["OMP_NUM_THREADS"] == "4"


def test_command_line_accepts_both_spellings_and_passes_script_args_through():
    config = parse_config(
        ["--nproc_per_node", "2", "--nnodes=2", "--node-rank", "1", "-m", "pkg.train", "--lr", "1"]
    )
    assert (config.nproc_per_node, config.nnodes, config.node_rank) == (2, 2, 1)
    assert config.run_as_module and config.script == "pkg.train"
    assert config.script_args == ("--lr", "1")
    assert config.worker_command()[-4:] == ["-m", "pkg.train", "--lr", "1"]


def test_a_script_of_a_megatron_lm_checkout_runs_through_the_adaptor(tmp_path):
    """``elaswave-run /path/to/Megatron-LM/pretrain_gpt.py ...`` needs no ``-m``: a script beside
    a ``megatron/training`` package runs through the adaptor's runner; other scripts as given."""
    (tmp_path / "megatron" / "training").mkdir(parents=True)
    (tmp_path / "megatron" / "training" / "__init__.py").touch()
    for name in ("pretrain_gpt.py", "elsewhere/train.py"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).touch()
    megatron_lm = parse_config([str(tmp_path / "pretrain_gpt.py"), "--elastic"]).worker_command()
    assert megatron_lm[2:] == ["-m", "megatron_elaswave.run_megatron_lm",
                               str(tmp_path / "pretrain_gpt.py"), "--elastic"]
    plain = parse_config([str(tmp_path / "elsewhere/train.py"), "--lr", "1"])
    assert plain.worker_command()[2:] == [str(tmp_path / "elsewhere/train.py"), "--lr", "1"]
    assert parse_config([str(tmp_path / "pretrain_gpt.py")]).runs_megatron_lm
    assert parse_config(["-m", "megatron_elaswave.run_megatron_lm", "pretrain_gpt.py"]
                        ).runs_megatron_lm
    assert not plain.runs_megatron_lm


def test_read_deaths_stops_at_a_numbered_but_unwritten_record():
    from torch.distributed import HashStore

    store = HashStore()
    death = WorkerDeath(
        rank=1, local_rank=1, node_rank=0, pid=9, exit_code=3, signal=None, cause="exit", time=1.0
    )
    store.add("elaswave/deaths/count", 1)  # a writer numbered death 0 but has not written it
    assert record_death(store, death) == 1
    assert read_deaths(store) == []
    store.set(death_key(0), json.dumps({**asdict(death), "rank": 0, "future_field": 1}))
    assert [d.rank for d in read_deaths(store)] == [0, 1]
    assert read_deaths(store, start=1) == [death]


def test_the_node_states_change_one_node_at_a_time_from_many_launchers(store):
    import threading

    changes = [(node, "lost" if node % 3 == 0 else "done") for node in range(12)]
    threads = [threading.Thread(target=change_node_state, args=(store.clone(), node, state))
               for node, state in changes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    states = read_node_states(store)
    assert states.lost == {0, 3, 6, 9} and states.done == set(range(12)) - {0, 3, 6, 9}
    assert store.add(NODE_CHANGES_KEY, 0) == 12
    change_node_state(store, 3, None)  # a launcher replaced lost node 3
    assert read_node_states(store).running(13) == {3, 12}


# --- one node -------------------------------------------------------------------------------


@multiprocess
@pytest.mark.timeout(200)
def test_the_preload_imports_megatron_core_without_its_notices_about_missing_extensions(tmp_path):
    """Forked from the default preload, a worker finds megatron-core imported and nothing of
    its Transformer Engine and Apex notices printed; executed afresh, the same worker prints
    them (this environment has neither, so the first check can fail)."""
    outputs = {}
    for preload in ("default", "none"):
        flags = [] if preload == "default" else ["--preload=none"]
        with launch([worker_script("imports_megatron_core.py")], nproc_per_node=1,
                    master_port=free_port(), launcher_args=flags) as job:
            returncode, outputs[preload] = job.wait(timeout=90)
        assert returncode == 0, outputs[preload]
        assert "imported megatron.core.optimizer" in outputs[preload]
    assert "Transformer Engine and Apex are not installed" in outputs["none"]
    assert "not installed" not in outputs["default"], outputs["default"]


@multiprocess
@pytest.mark.timeout(60)
@pytest.mark.parametrize("preload", ["torch", "none"], ids=["forked", "executed"])
def test_workers_get_the_launch_environment(tmp_path, preload):
    port, logs = free_port(), tmp_path / "logs"
    script = worker_script("dump_env.py")
    with launch(
        [script, str(tmp_path), "--extra", "x"],
        nproc_per_node=2,
        master_port=port,
        launcher_args=["--run-id=job42", f"--log-dir={logs}", f"--preload={preload}"],
        env={"OMP_NUM_THREADS": "3"},
    ) as job:
        returncode, output = job.wait(timeout=60)
    assert returncode == 0, output
    reports = read_reports(tmp_path)
    assert reports.keys() == {0, 1}
    for rank, seen in reports.items():
        assert seen["preloaded"] == (preload != "none")
        assert (seen["name"], seen["argv0"], seen["stdin"]) == ("__main__", script, "")
        assert seen["path0"] == os.path.dirname(script)
        assert seen["cwd"] == os.getcwd()
        assert (tmp_path / f"rank{rank}.atexit").exists()
        assert seen["RANK"] == seen["LOCAL_RANK"] == str(rank)
        assert seen["WORLD_SIZE"] == seen["LOCAL_WORLD_SIZE"] == "2"
        assert seen["GROUP_RANK"] == seen["NODE_RANK"] == "0"
        assert seen["MASTER_ADDR"] == seen["ELASWAVE_STORE_ADDR"] == "127.0.0.1"
        assert seen["MASTER_PORT"] == seen["ELASWAVE_STORE_PORT"] == str(port)
        assert seen["TORCHELASTIC_RUN_ID"] == "job42"
        assert seen["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert seen["OMP_NUM_THREADS"] == "3"  # the user's value wins
        assert seen["TORCH_CPP_LOG_LEVEL"] == os.environ.get("TORCH_CPP_LOG_LEVEL")
        assert seen["ppid"] == job.pid
        assert seen["argv"] == ["--extra", "x"]
        # ps tells the workers apart: a forked one by its title, an executed one by its command.
        assert seen["title"] == (f"elaswave rank {rank}/2 dump_env.py" if preload != "none"
                                 else f"{sys.executable} -u {script} {tmp_path} --extra x")
        assert f"hello from rank {rank}" in (logs / f"rank{rank}.log").read_text()
    assert "hello" not in output


def _run_dump_env(tmp_path: Path, preload: str) -> tuple[int, str]:
    """Two workers of ``dump_env.py`` launched with ``--preload=preload``, which may name the
    modules of ``tests/workers``: the launcher's exit status and output."""
    with launch(
        [worker_script("dump_env.py"), str(tmp_path)],
        nproc_per_node=2,
        master_port=free_port(),
        launcher_args=[f"--preload={preload}"],
        env={"PYTHONPATH": os.path.dirname(worker_script("dump_env.py"))},
    ) as job:
        return job.wait(timeout=60)


@multiprocess
@pytest.mark.timeout(60)
def test_forked_workers_end_with_the_interpreter_not_with_the_preloads_c_exit_handlers(tmp_path):
    """A preloaded library's C exit handlers (libtorch's static destructors, here ``abort()``)
    do not run in the workers or the server; the interpreter's own exit still does."""
    returncode, output = _run_dump_env(tmp_path, preload="torch,aborts_at_exit")
    assert returncode == 0, output
    reports = read_reports(tmp_path)
    assert [seen["preloaded"] for seen in reports.values()] == [True, True], output
    assert all((tmp_path / f"rank{rank}.atexit").exists() for rank in reports)
    assert "SIGABRT" not in output and "without preloading" not in output, output


@multiprocess
@pytest.mark.timeout(120)
def test_workers_of_a_server_that_warmed_torch_compile_find_its_cpu_probes_done(tmp_path):
    """Asked to warm the compile caches (Megatron-LM's loop), the server probes the CPU's
    vector instruction sets and registers Inductor's passes once, under the key a CPU
    compilation asks for, and its workers inherit them; otherwise each worker would do both."""
    found = {}
    for warm in (True, False):
        report = tmp_path / f"warm-{warm}.json"
        driver = (
            "import os, sys\n"
            "from megatron_elaswave.launch.spawn import ForkServer\n"
            f"server = ForkServer(['torch'], dict(os.environ), warm_compile_caches={warm})\n"
            "while not server.ready():\n"
            "    import time; time.sleep(0.05)\n"
            f"worker = server.spawn([{worker_script('compile_caches.py')!r}, {str(report)!r}],"
            " dict(os.environ), None, False)\n"
            "sys.exit(worker.wait())\n")
        result = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True,
                                timeout=100)
        assert result.returncode == 0, result.stderr
        found[warm] = json.loads(report.read_text())
    assert found == {
        True: {"preloaded": True, "vector_isa_probed": True, "joint_graph_passes_registered": True},
        False: {"preloaded": True, "vector_isa_probed": False,
                "joint_graph_passes_registered": False}}


def test_the_launcher_reads_its_command_line_without_importing_torch():
    """The fork server's preload starts before the launcher imports torch, so the two imports
    run side by side."""
    check = ("import sys, megatron_elaswave.launch.run; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                            timeout=60, check=True)
    assert result.stdout.strip() == "[]", result.stdout


@multiprocess
@pytest.mark.timeout(60)
def test_a_preload_that_fails_starts_the_workers_afresh(tmp_path):
    returncode, output = _run_dump_env(tmp_path, preload="raises_on_import")
    assert returncode == 0, output
    assert ("starting workers without preloading: preloading raises_on_import failed: "
            "RuntimeError: this module refuses to be imported") in output
    assert [seen["preloaded"] for seen in read_reports(tmp_path).values()] == [False, False]


@multiprocess
@pytest.mark.timeout(60)
def test_survivors_outlive_a_sigkilled_rank_0_and_keep_the_store(tmp_path):
    port = free_port()
    with launch(
        [worker_script("survivor.py"), str(tmp_path), "0", "--hold"],
        nproc_per_node=3,
        master_port=port,
    ) as job:
        pids = job.worker_pids()
        assert _listens_on(job.pid, port)
        assert not any(_listens_on(pid, port) for pid in pids.values())

        killed_at = time.time()
        job.kill_worker(0)
        [death] = job.wait_for_deaths(1)
        assert (death.rank, death.pid, death.cause) == (0, pids[0], "signal")
        assert (death.signal, death.exit_code) == ("SIGKILL", None)
        assert 0 <= death.time - killed_at < 1.0, "the death must be recorded promptly"

        wait_for_reports(job, tmp_path, {1, 2})
        assert not is_gone(pids[1]) and not is_gone(pids[2])
        # Release the survivors one at a time: rank 1's normal exit is recorded, not a death.
        store = job.store()
        store.set("test/release/1", "")
        job.wait_for(lambda: read_exit(store, 1) is not None, 30, "rank 1's exit record")
        assert read_exit(store, 1).pid == pids[1] and len(job.deaths()) == 1
        store.set("test/release/2", "")
        returncode, output = job.wait(timeout=30)

    assert returncode == 0, output
    assert f"worker rank 0 (pid {pids[0]}) killed by SIGKILL; 2 workers still running" in output
    for rank, report in read_reports(tmp_path).items():
        [seen] = report["deaths"]
        assert (seen["rank"], seen["signal"], seen["time"]) == (0, "SIGKILL", death.time)
        assert report["store_readback"] == str(rank)


@multiprocess
@pytest.mark.timeout(60)
def test_a_nonzero_exit_is_recorded_with_its_code_and_survived(tmp_path):
    with launch(
        [worker_script("survivor.py"), str(tmp_path), "1", "--victim-exit", "3"],
        nproc_per_node=2,
        master_port=free_port(),
    ) as job:
        returncode, output = job.wait(timeout=30)
    assert returncode == 0, output
    [death] = read_reports(tmp_path)[0]["deaths"]
    assert (death["rank"], death["cause"]) == (1, "exit")
    assert (death["exit_code"], death["signal"]) == (3, None)
    assert "exited with code 3; 1 worker still running" in output


@multiprocess
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "plan, status",
    [
        (["0:0:4", "1:3:5"], 4),  # every worker failed: the first failure decides
        (["0:0:0", "1:3:SIGKILL"], 128 + 9),  # a failure after the job finished
    ],
)
def test_unsurvived_failures_fail_the_launcher(plan, status):
    with launch([worker_script("exit_plan.py"), *plan], 2, master_port=free_port()) as job:
        returncode, output = job.wait(timeout=30)
    assert returncode == status, output


@multiprocess
@pytest.mark.timeout(60)
def test_sigterm_is_forwarded_and_stragglers_are_killed_after_the_grace_period(tmp_path):
    grace_s = 1.0
    with launch(
        [worker_script("sigterm.py"), str(tmp_path)],
        nproc_per_node=2,
        master_port=free_port(),
        launcher_args=[f"--shutdown-grace={grace_s}"],
    ) as job:
        job.wait_for(
            lambda: all((tmp_path / f"rank{r}.ready").exists() for r in (0, 1)),
            timeout=30,
            what="workers to install their SIGTERM handlers",
        )
        pids = job.worker_pids()
        sent = time.monotonic()
        job.send_signal(signal.SIGTERM)
        returncode, output = job.wait(timeout=20)
        elapsed = time.monotonic() - sent

    assert returncode == 128 + signal.SIGTERM, output
    assert (tmp_path / "rank0.term").exists() and (tmp_path / "rank1.term").exists()
    assert grace_s <= elapsed < grace_s + 5, "rank 1 ignores SIGTERM and must wait for SIGKILL"
    assert "killing the workers still running: rank 1" in output
    assert all(is_gone(pid) for pid in pids.values())


# --- several nodes on loopback --------------------------------------------------------------


@multiprocess
@pytest.mark.timeout(90)
def test_two_node_launchers_form_one_job(tmp_path):
    # One worker per node keeps this test light; worker_env's rank arithmetic for several
    # workers per node is checked by test_worker_env_follows_torchrun.
    port = free_port()
    with contextlib.ExitStack() as stack:
        nodes = {}

        def start(node: int):
            nodes[node] = stack.enter_context(
                launch(
                    [worker_script("allreduce.py"), str(tmp_path)],
                    nproc_per_node=1,
                    nnodes=2,
                    node_rank=node,
                    master_port=port,
                )
            )

        start(0)
        store = nodes[0].store()
        nodes[0].wait_for(lambda: store.check(["elaswave/nodes/0"]), 30, "node 0 to join")
        time.sleep(0.5)
        assert not store.check([worker_key(0)]), "no worker before node 1 joins"
        start(1)
        results = {node: job.wait(timeout=60) for node, job in nodes.items()}

    for returncode, output in results.values():
        assert returncode == 0, output
    reports = read_reports(tmp_path)
    assert reports.keys() == {0, 1}
    for rank, report in reports.items():
        assert report["world_size"] == 2 and report["sum"] == 0 + 1
        assert report["launcher_pid"] == nodes[rank].pid


@multiprocess
@pytest.mark.timeout(90)
def test_a_killed_node_launcher_takes_its_workers_down_and_node_0_reports_them(tmp_path):
    """Node 1's launcher alone is SIGKILLed: its worker dies with it, and node 0, whose
    connection to it closed, declares the node lost at once, not after its 60 s of silence."""
    port = free_port()
    survivor = [worker_script("survivor.py"), str(tmp_path), "1"]
    with contextlib.ExitStack() as stack:
        node0, node1 = (
            stack.enter_context(
                launch(
                    survivor,
                    nproc_per_node=1,
                    nnodes=2,
                    node_rank=node,
                    master_port=port,
                    launcher_args=["--node-timeout=60"],
                )
            )
            for node in (0, 1)
        )
        victim = node1.worker_pids()[1]
        node0.worker_pids()

        node1.send_signal(signal.SIGKILL)  # the launcher alone, as when its node fails
        assert node1.wait(timeout=10)[0] == -signal.SIGKILL
        wait_until(lambda: is_gone(victim), timeout=5, what="node 1's worker to die with it")
        returncode, output = node0.wait(timeout=30)

    assert returncode == 0, output
    assert ("node 1 lost: its launcher's process ended (its connection closed and its port "
            "refuses connections); recorded deaths for rank 1") in output, output
    [death] = read_reports(tmp_path)[0]["deaths"]
    assert (death["rank"], death["node_rank"], death["pid"]) == (1, 1, victim)
    assert (death["cause"], death["signal"], death["exit_code"]) == ("node_lost", None, None)


# --- --rejoin -------------------------------------------------------------------------------


def starts(directory: Path) -> list[dict]:
    with open(directory / "starts.jsonl") as handle:
        return [json.loads(line) for line in handle]


@multiprocess
@pytest.mark.timeout(60)
def test_rejoin_starts_a_killed_worker_again_in_its_slot(tmp_path):
    plan = [worker_script("rejoin_plan.py"), str(tmp_path), "1:SIGKILL,0"]
    with launch(plan, 2, master_port=free_port(),
                launcher_args=["--rejoin", "--rejoin-delay=0.5"]) as job:
        returncode, output = job.wait(timeout=30)
    assert returncode == 0, output
    first, again = [s for s in starts(tmp_path) if s["rank"] == 1]
    assert (first["rejoin"], first["restart_count"]) == (None, 0)
    assert (again["rejoin"], again["restart_count"]) == ("1", 1)
    assert first["pid"] != again["pid"]
    assert "restarting worker rank 1 in 0.5 s" in output


@multiprocess
@pytest.mark.timeout(60)
def test_decisions_about_a_dead_worker_never_fence_its_replacement(tmp_path):
    """A decision takes rank 1's replacement in and the next excludes it, and it dies before
    its launcher has read either: the worker started in its slot afterwards is not the one
    they speak of, and is neither counted a member nor killed."""
    plan = [worker_script("decided_then_replaced.py"), str(tmp_path), "4"]
    with launch(plan, 2, master_port=free_port(),
                launcher_args=["--rejoin", "--rejoin-delay=0", "--exclusion-grace=0.5"]) as job:
        returncode, output = job.wait(timeout=40)
    assert [s["restart_count"] for s in starts(tmp_path) if s["rank"] == 1] == [0, 1, 2]
    assert "was excluded by the job" not in output
    assert returncode == 0, output


@multiprocess
@pytest.mark.timeout(60)
def test_rejoin_gives_up_after_max_rejoins(tmp_path):
    plan = [worker_script("rejoin_plan.py"), str(tmp_path), "1:4"]
    with launch(plan, 2, master_port=free_port(),
                launcher_args=["--rejoin", "--rejoin-delay=0", "--max-rejoins=2"]) as job:
        returncode, output = job.wait(timeout=30)
    assert [s["restart_count"] for s in starts(tmp_path) if s["rank"] == 1] == [0, 1, 2]
    assert "not restarting it" in output
    assert returncode == 0, output  # rank 0 finished after the failures: they were survived


@multiprocess
@pytest.mark.timeout(60)
def test_no_worker_is_restarted_once_one_has_finished(tmp_path):
    plan = [worker_script("rejoin_plan.py"), str(tmp_path), "0:0", "1:5@1.5"]
    with launch(plan, 2, master_port=free_port(),
                launcher_args=["--rejoin", "--rejoin-delay=0"]) as job:
        returncode, output = job.wait(timeout=30)
    assert [s["rank"] for s in starts(tmp_path)].count(1) == 1
    assert returncode == 5, output


@multiprocess
@pytest.mark.timeout(60)
@pytest.mark.parametrize("status", [2, 3], ids=["bad-input", "cannot-continue"])
def test_no_worker_is_restarted_once_one_has_stopped_the_job(tmp_path, status):
    """Rank 0 stops the job (exit 2 or 3) and rank 1 dies after it: nothing is left to join."""
    plan = [worker_script("rejoin_plan.py"), str(tmp_path), f"0:{status}", "1:5@1.5"]
    with launch(plan, 2, master_port=free_port(),
                launcher_args=["--rejoin", "--rejoin-delay=0"]) as job:
        returncode, output = job.wait(timeout=30)
    assert sorted(s["rank"] for s in starts(tmp_path)) == [0, 1], output
    assert "restarting worker" not in output
    assert returncode != 0, output


@multiprocess
@pytest.mark.timeout(90)
def test_a_taken_node_rank_needs_rejoin_and_a_lost_node(tmp_path):
    """A second launcher for a node rank that is alive: refused in one line without
    ``--rejoin``; with it, it waits for the node to be declared lost, and times out here."""
    port = free_port()
    survivor = [worker_script("survivor.py"), str(tmp_path), "1"]
    with contextlib.ExitStack() as stack:
        for node in (0, 1):
            stack.enter_context(launch(survivor, nproc_per_node=1, nnodes=2, node_rank=node,
                                       master_port=port))
        common = ["--nnodes=2", "--node-rank=1", f"--master-port={port}", "--nproc-per-node=1"]
        wait_until(lambda: accepts_connections(("127.0.0.1", port)), 30, "the job store")
        refused = run_launcher(*common, *survivor)
        waited = run_launcher(*common, "--rejoin", "--join-timeout=2", *survivor)
    assert_one_line_error(refused, 2, "node rank 1 has already joined this job")
    assert "--rejoin" in refused.stderr
    assert waited.returncode == 1
    assert "waiting until the nodes that watch it declare it lost" in waited.stderr
    assert "to be declared lost" in waited.stderr.strip().splitlines()[-1]


# --- bad input ------------------------------------------------------------------------------


def run_launcher(*args: str, timeout: float = 30.0) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megatron_elaswave.launch.run", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_one_line_error(result: subprocess.CompletedProcess, status: int, fragment: str):
    assert result.returncode == status, result.stderr
    assert result.stdout == ""
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("elaswave-run: error: ") and fragment in line


@multiprocess
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "args, fragment",
    [
        ([], "missing the script"),
        (["/no/such/train.py"], "no such script"),
        (["--nproc-per-node=0", "SCRIPT"], "--nproc-per-node must be at least 1"),
        (["--nproc-per-node=two", "SCRIPT"], "--nproc-per-node two: expected a number of"),
        (["--nnodes=2", "--node-rank=2", "SCRIPT"], "--node-rank 2 is out of range"),
        (["--master-port=70000", "SCRIPT"], "--master-port 70000: the port must be a number"),
        (["--no-such-flag", "SCRIPT"], "unrecognized arguments"),
        (["--rejoin-delay=-1", "SCRIPT"], "--rejoin-delay, --max-rejoins and --exclusion-grace must"),
        (["--exclusion-grace=-2", "SCRIPT"], "--exclusion-grace must not be negative"),
        (["--store=etcd://127.0.0.1:2379", "--store-compaction-interval=-1", "SCRIPT"],
         "--store-compaction-interval must not be negative"),
    ],
)
def test_bad_input_is_one_line_and_status_2(args, fragment):
    script = worker_script("exit_plan.py")
    result = run_launcher(*(script if arg == "SCRIPT" else arg for arg in args))
    assert_one_line_error(result, 2, fragment)


@multiprocess
@pytest.mark.timeout(60)
def test_a_port_in_use_is_bad_input():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_launcher(f"--master-port={port}", worker_script("exit_plan.py"))
    assert_one_line_error(result, 2, f"--master-port {port}: Address already in use")


@multiprocess
@pytest.mark.timeout(60)
def test_a_missing_store_host_times_out_with_one_line():
    result = run_launcher(
        "--nnodes=2",
        "--node-rank=1",
        f"--master-port={free_port()}",
        "--join-timeout=0.5",
        worker_script("exit_plan.py"),
    )
    assert_one_line_error(result, 1, "timed out after 0.5 s waiting for the job store")


def test_a_store_reached_at_an_ipv4_address_sees_its_clients_as_ipv4_peers():
    """torch names each peer that a store accepts by a reverse lookup, in the store's event
    loop: ``/etc/hosts`` answers it for the IPv4 loopback, but the IPv4-mapped IPv6 form that a
    dual-stack socket reports goes to the resolver. A store reached at a host name stays
    dual-stack, as its clients may connect over IPv6."""
    from torch.distributed import TCPStore

    listener = store_listener("127.0.0.1", 0)
    port = listener.getsockname()[1]
    server = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                      master_listen_fd=listener.detach())
    client = TCPStore("127.0.0.1", port, is_master=False)
    client.set("key", "value")
    assert server.get("key") == b"value"
    accepted = [c for c in psutil.Process().net_connections(kind="tcp")
                if c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED]
    assert accepted and all(c.family == socket.AF_INET for c in accepted), accepted
    if socket.has_dualstack_ipv6():
        with store_listener("localhost", 0) as by_name:
            assert by_name.family == socket.AF_INET6


def _listens_on(pid: int, port: int) -> bool:
    connections = psutil.Process(pid).net_connections(kind="tcp")
    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in connections)


@pytest.mark.parametrize("argv, title", [
    (["/path/to/pretrain_gpt.py", "--elastic"], "elaswave rank 5/8 pretrain_gpt.py"),
    (["-m", "pkg.train", "--lr", "1"], "elaswave rank 5/8 -m pkg.train"),
    (["-m", "megatron_elaswave.run_megatron_lm", "/ckpt/Megatron-LM/pretrain_gpt.py", "--lr", "1"],
     "elaswave rank 5/8 pretrain_gpt.py"),
])
def test_a_workers_title_names_its_rank_and_script(argv, title):
    assert worker_title({"RANK": "5", "WORLD_SIZE": "8"}, argv) == title
    assert worker_title({}, argv) is None  # not a launched worker: its title is left alone


def test_sigterm_gives_workers_that_save_on_it_the_time_they_give_their_save():
    """A preemption's SIGTERM to workers run with ``--exit-signal-handler`` waits as long as they
    wait for their checkpoint (``--distributed-timeout-minutes``), not the 10 s of a plain
    shutdown; an explicit ``--shutdown-grace`` is kept."""
    saving = ("--exit-signal-handler", "--distributed-timeout-minutes=3")
    assert LaunchConfig(script=__file__, script_args=saving).grace_after(signal.SIGTERM) == 180
    assert LaunchConfig(script=__file__, script_args=saving[:1]).grace_after(signal.SIGTERM) == 600
    assert LaunchConfig(script=__file__, script_args=saving).grace_after(signal.SIGINT) == 10
    assert LaunchConfig(script=__file__, script_args=saving).grace_after(None) == 10
    assert LaunchConfig(script=__file__).grace_after(signal.SIGTERM) == 10
    explicit = LaunchConfig(script=__file__, script_args=saving, shutdown_grace_s=30)
    assert explicit.grace_after(signal.SIGTERM) == 30
    assert parse_config(["--shutdown-grace", "5", __file__, *saving]).grace_after(
        signal.SIGTERM) == 5



def test_the_store_tls_flags_are_handed_on_as_etcdctls_variables(tmp_path):
    """``--store-cacert/--store-cert/--store-key`` set etcdctl's variables, which the job store's
    clients read, in the launcher and (inherited) its workers; a missing file is one line."""
    from megatron_elaswave.launch.config import UsageError
    from megatron_elaswave.launch.run import build_parser, export_store_security

    ca = tmp_path / "ca.pem"
    ca.write_text("")
    environ: dict[str, str] = {}
    args = build_parser().parse_args(["--store", "etcd://127.0.0.1:2379", "--store-cacert",
                                      str(ca), __file__])
    export_store_security(args, environ)
    assert environ == {"ETCDCTL_CACERT": str(ca)}
    with pytest.raises(UsageError, match="--store-cert /nowhere.pem: no such file"):
        export_store_security(build_parser().parse_args(
            ["--store", "etcd://127.0.0.1:2379", "--store-cert", "/nowhere.pem", __file__]), {})
    with pytest.raises(UsageError, match="go with --store"):
        export_store_security(build_parser().parse_args(["--store-key", str(ca), __file__]), {})
