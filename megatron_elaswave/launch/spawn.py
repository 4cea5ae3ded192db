"""How an agent starts its workers: forked from a server that has already imported torch and
megatron-core, or executed afresh.

Importing torch and megatron-core's GPT stack costs about 10 s of CPU in every worker; a node's
workers all pay it at once when the job starts, and a replacement pays it again before it can
join. An agent's :class:`ForkServer` imports the ``--preload`` modules once, while the job forms,
and forks each worker from there. It guarantees:

* **A forked worker is the agent's own child**, as an executed one is: the server forks twice
  and the agent is a child subreaper (``PR_SET_CHILD_SUBREAPER``), so the agent reaps it, reads
  its exit status and signals it directly (:class:`ForkedWorker`), and it dies with the agent
  (``PR_SET_PDEATHSIG``).
* **It runs as** ``python -u script args`` **(or** ``-m module`` **) would**: its own
  environment, ``sys.argv``, ``sys.path[0]`` and ``__main__``; stdin from ``/dev/null``, stdout
  and stderr to its log; a process title naming its rank and script (``elaswave rank 5/8
  pretrain_gpt.py``, :mod:`megatron_elaswave.launch.proctitle`), where ``ps`` would show the
  server's; default signal handlers; and the interpreter's ordinary exit (atexit handlers, the
  status of ``SystemExit``, a traceback and status 1 for an exception), but not the C exit
  handlers of the preloaded libraries (:func:`_end_with_the_interpreter`). Modules that were
  preloaded are not imported again, so they read the environment the agent started with, not
  the worker's rank variables.
* **Waiting for the preload never blocks supervision**: :meth:`ForkServer.ready` answers at
  once, and the agent starts workers once it is true (a fork itself takes milliseconds, up to
  a second on a loaded machine; the agent heartbeats between forks).
* **It falls back**: a server that cannot preload (a module raises, preloading initialized CUDA,
  which forked children could not use) or dies, or is not ready within
  :data:`PRELOAD_TIMEOUT_S`, says why, and the agent executes its workers afresh. Linux only;
  elsewhere workers are always executed.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import json
import os
import re
import runpy
import select
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from megatron_elaswave.launch.proctitle import name_worker, prepare_titles

DEFAULT_PRELOAD = (
    "torch",
    "torch.distributed",
    "megatron.core.models.gpt",
    "megatron.core.optimizer",
    "megatron.core.pipeline_parallel",
)
"""What a Megatron training script imports first and at most cost; those not installed are
skipped."""

IMPORT_NOTICES = (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
)
"""What megatron-core warns when imported without Transformer Engine or Apex: nothing a CPU job
can act on. The preload imports it without them (a training script that imports megatron-core
itself filters them as well)."""

PRELOAD_TIMEOUT_S = 120.0
"""How long the agent waits for the server's preload before executing workers afresh."""

WARM_COMPILE_CACHES = "--warm-compile-caches"
"""The server's flag (before the modules) for ``ForkServer(warm_compile_caches=True)``."""

SPAWN_TIMEOUT_S = 10.0
"""How long one fork may take before the server is given up."""

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
_REPARENT_TIMEOUT_S = 5.0


def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGKILL this process when its parent dies; runs in a new worker
    (between fork and exec, or after the fork server handed it over). A parent that died before
    the request took effect is caught by comparing with ``parent_pid``."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)


def host_has_gpus() -> bool:
    """Whether an NVIDIA or AMD GPU driver exposes devices here (``/dev/nvidiactl``,
    ``/dev/kfd``), told without loading a GPU runtime, which forked workers could not use."""
    return any(os.path.exists(node) for node in ("/dev/nvidiactl", "/dev/kfd"))


def can_fork_workers() -> bool:
    """Whether this platform lets an agent adopt the workers its fork server starts."""
    return _LIBC is not None


class ForkServerError(Exception):
    """The fork server failed; the message is one line, and the agent executes workers instead."""


class ForkedWorker:
    """A worker the fork server started and the agent adopted: the subset of
    :class:`subprocess.Popen` the agent uses, on the agent's own child."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self._wait(os.WNOHANG)

    def wait(self) -> int:
        returncode = self._wait(0)
        assert returncode is not None
        return returncode

    def _wait(self, options: int) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, options)
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:  # never signal a pid that may have been reused
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def reap_orphans(known_pids: set[int]) -> None:
    """Reap exited children the agent did not start: as a subreaper it inherits the orphaned
    descendants of its workers. Children in ``known_pids`` are left to their handles."""
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if info is None or info.si_pid in known_pids:
            return
        os.waitpid(info.si_pid, 0)


@dataclass(frozen=True)
class _Request:
    argv: list[str]
    """What follows ``python -u``: ``[script, *args]`` or ``["-m", module, *args]``."""
    env: dict[str, str]
    cwd: str
    log: str | None
    """File for stdout and stderr; ``None`` keeps the agent's."""
    append: bool


class ForkServer:
    """The agent's side of one fork server: starts it, and asks it for workers."""

    def __init__(self, preload: Sequence[str], env: Mapping[str, str], *,
                 warm_compile_caches: bool = False) -> None:
        """Start the server, importing ``preload``; ``warm_compile_caches`` where every worker
        will call ``torch.compile`` on the CPU first thing (Megatron-LM's loop compiles
        megatron-core's fused kernels before its first step) on a host without a GPU: their
        first compilation then costs about 2 s less each, and the preload as much more, once
        (:mod:`megatron_elaswave.patches.inductor_caches`)."""
        if not can_fork_workers():
            raise ForkServerError("workers can be forked on Linux only")
        _LIBC.prctl(_PR_SET_CHILD_SUBREAPER, 1)
        request_read, self._requests = os.pipe()
        self._responses, response_write = os.pipe()
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-u", "-m", __name__, str(os.getpid()), str(request_read),
                 str(response_write), *([WARM_COMPILE_CACHES] if warm_compile_caches else []),
                 *preload],
                env=dict(env),
                stdin=subprocess.DEVNULL,
                pass_fds=(request_read, response_write),
                preexec_fn=lambda parent=os.getpid(): die_with_parent(parent),
            )
        finally:
            os.close(request_read)
            os.close(response_write)
        self._started = time.monotonic()
        self._buffer = b""
        self._ready = False

    def ready(self) -> bool:
        """Whether the preload finished; raises :class:`ForkServerError` when it failed, the
        server died, or :data:`PRELOAD_TIMEOUT_S` passed. Never blocks."""
        if not self._ready:
            line = self._read_line(timeout=0.0)
            if line is None:
                if self.process.poll() is not None:
                    raise ForkServerError(f"the fork server exited with {self.process.returncode}")
                if time.monotonic() - self._started > PRELOAD_TIMEOUT_S:
                    raise ForkServerError(f"preloading took more than {PRELOAD_TIMEOUT_S:g} s")
                return False
            answer = json.loads(line)
            if "error" in answer:
                raise ForkServerError(answer["error"])
            self._ready = True
        return True

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], log: str | None,
              append: bool) -> ForkedWorker:
        """Fork a worker running ``python -u *argv``; raises :class:`ForkServerError` when the
        server cannot (it died, or took more than :data:`SPAWN_TIMEOUT_S`)."""
        request = _Request(list(argv), dict(env), os.getcwd(), log, append)
        try:
            os.write(self._requests, (json.dumps(asdict(request)) + "\n").encode())
        except BrokenPipeError:
            raise ForkServerError("the fork server is gone") from None
        line = self._read_line(timeout=SPAWN_TIMEOUT_S)
        if line is None:
            raise ForkServerError(f"no worker forked within {SPAWN_TIMEOUT_S:g} s")
        answer = json.loads(line)
        if "error" in answer:
            raise ForkServerError(answer["error"])
        return ForkedWorker(answer["pid"])

    def close(self) -> None:
        """Stop the server (its workers are the agent's and go on)."""
        for descriptor in (self._requests, self._responses):
            try:
                os.close(descriptor)
            except OSError:
                pass
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def _read_line(self, timeout: float) -> str | None:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            remaining = max(0.0, deadline - time.monotonic())
            if not select.select([self._responses], [], [], remaining)[0]:
                return None
            chunk = os.read(self._responses, 4096)
            if not chunk:  # the server is gone
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()


# ---- the server process -----------------------------------------------------------------------


def _preload(modules: Sequence[str], warm_compile_caches: bool) -> str | None:
    """Import ``modules`` (and with ``warm_compile_caches`` fill the caches of a first
    ``torch.compile`` on the CPU); returns why forked workers would not work, or ``None``."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # ask NVML, not the CUDA driver
    with warnings.catch_warnings():
        for notice in IMPORT_NOTICES:
            warnings.filterwarnings("ignore", message=f".*{re.escape(notice)}")
        for name in modules:
            try:
                importlib.import_module(name)
            except ModuleNotFoundError as error:
                if error.name is None or not (name == error.name
                                              or name.startswith(error.name + ".")):
                    return f"preloading {name} failed: {error}"
            except Exception as error:  # noqa: BLE001 - any failure means: execute workers instead
                return f"preloading {name} failed: {type(error).__name__}: {error}"
    torch = sys.modules.get("torch")
    if warm_compile_caches and torch is not None:
        try:
            from megatron_elaswave.patches.inductor_caches import warm_cpu_compile_caches
        except Exception:  # noqa: BLE001 - the workers fill the caches themselves
            pass
        else:
            warm_cpu_compile_caches()
    if torch is not None and torch.cuda.is_initialized():
        return "preloading initialized CUDA, which forked workers could not use"
    return None


def _serve(agent_pid: int, requests: int, responses: int) -> _Request | None:
    """Fork a worker per request; returns the request in the worker, ``None`` in the server
    once the agent closed the pipe."""
    with os.fdopen(requests, "r", closefd=False) as lines:
        for line in lines:
            request = _Request(**json.loads(line))
            handover_read, handover_write = os.pipe()
            intermediate = os.fork()
            if intermediate == 0:  # forks the worker and leaves it to the agent, the subreaper
                os.close(handover_read)
                worker = os.fork()
                if worker == 0:
                    os.close(handover_write)
                    return request
                os.write(handover_write, str(worker).encode())
                os._exit(0)
            os.close(handover_write)
            with os.fdopen(handover_read, "rb") as handover:
                worker_pid = handover.read().decode()
            os.waitpid(intermediate, 0)  # the worker is the agent's child from here
            answer = {"pid": int(worker_pid)} if worker_pid else {"error": "fork failed"}
            os.write(responses, (json.dumps(answer) + "\n").encode())
    return None


def _end_with_the_interpreter() -> None:
    """Make this process, and the workers it forks, end once the interpreter has finalized,
    without the C exit handlers of the libraries preloaded so far: libtorch's static
    destructors deregister its operators one at a time, which a node's workers all do at once
    as the job ends (8 workers on 2 cores: about 0.5 s of the job's end). What Python does at
    exit (threads joined, ``atexit`` handlers, files flushed and closed, the exit status) still
    happens, as do the handlers of libraries loaded later: glibc runs exit handlers in the
    reverse order of registration, so ``_exit(status)`` registered here runs before the
    preloaded ones."""
    if _LIBC is not None:
        _LIBC.on_exit(ctypes.cast(_LIBC._exit, ctypes.c_void_p), None)


def _become_worker(request: _Request, agent_pid: int, server_fds: Sequence[int]) -> None:
    """Turn this freshly forked process into the worker ``request`` describes, then run it."""
    deadline = time.monotonic() + _REPARENT_TIMEOUT_S
    while os.getppid() != agent_pid:  # the intermediate's exit hands the worker to the agent
        if time.monotonic() > deadline:
            os._exit(1)
        time.sleep(0.001)
    die_with_parent(agent_pid)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)
    for descriptor in server_fds:
        os.close(descriptor)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    if request.log is not None:
        flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if request.append else os.O_TRUNC)
        log = os.open(request.log, flags, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
    os.environ.clear()
    os.environ.update(request.env)
    os.chdir(request.cwd)
    name_worker(request.env, request.argv)  # else ps shows the server's command line
    if request.argv[0] == "-m":
        module, *args = request.argv[1:]
        sys.argv = [module, *args]
        sys.path[0] = request.cwd
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(request.argv)
        sys.path[0] = os.path.dirname(os.path.abspath(request.argv[0]))
        runpy.run_path(request.argv[0], run_name="__main__")


def _main(argv: Sequence[str]) -> None:
    agent_pid, requests, responses = (int(value) for value in argv[:3])
    modules = list(argv[3:])
    warm_compile_caches = bool(modules) and modules[0] == WARM_COMPILE_CACHES
    if warm_compile_caches:
        modules.pop(0)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)  # the agent forwards them to the workers
    prepare_titles()
    failure = _preload(modules, warm_compile_caches)
    answer = {"error": failure} if failure else {"ready": True}
    os.write(responses, (json.dumps(answer) + "\n").encode())
    if failure:
        sys.exit(1)
    _end_with_the_interpreter()
    # What the preload created lives as long as any worker: the collector need not walk it,
    # which keeps the pages shared and a worker's exit short (about 2 s less with megatron-core).
    gc.freeze()
    # The threads torch starts at import hold no lock a worker needs (as for its DataLoader).
    warnings.filterwarnings("ignore", message=".*use of fork\\(\\) may lead to deadlocks",
                            category=DeprecationWarning)
    request = _serve(agent_pid, requests, responses)
    if request is not None:
        _become_worker(request, agent_pid, (requests, responses))


if __name__ == "__main__":
    _main(sys.argv[1:])
