"""Where a node's launcher finds its place in the job: its command line, torchrun's ``PET_``
variables, and what SLURM or Kubernetes put in its environment.

Each setting (node count, node rank, master address and port, workers per node, job id, ...) is
taken from the first of these that gives it, setting by setting:

1. the command line (``--nnodes``, ``--rdzv-endpoint``, ...; ``--standalone`` gives the
   placement of a one-node job);
2. torchrun's variables ``PET_<FLAG>`` (``PET_NNODES``, ``PET_NODE_RANK``,
   ``PET_NPROC_PER_NODE``, ``PET_MASTER_ADDR``, ``PET_MASTER_PORT``, ``PET_RDZV_ENDPOINT``, ...),
   which torchrun reads for every flag not given, and which Kubeflow's PyTorchJob (training
   operator 1.7 and later) and TrainJob set;
3. the scheduler, one of: an ``srun`` step (:func:`slurm_settings`); else Kubeflow's PyTorchJob
   as operators before 1.7 set it up (:func:`pytorchjob_settings`); else an Indexed Job, such as
   a JobSet's (:func:`indexed_job_settings`);
4. the defaults of :class:`~megatron_elaswave.launch.config.LaunchConfig`.

The functions that read a source are pure (a mapping of the environment in, settings out), and
every error is a :class:`~megatron_elaswave.launch.config.UsageError` of one line naming the
flag or variable it comes from.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from itertools import product

from megatron_elaswave.launch.config import LaunchConfig, UsageError

DEFAULT_RDZV_PORT = 29400
"""Port of ``--rdzv-endpoint HOST`` given without one, as in torchrun."""

FLAGS = {
    "nnodes": "--nnodes",
    "node_rank": "--node-rank",
    "master_addr": "--master-addr",
    "master_port": "--master-port",
    "nproc_per_node": "--nproc-per-node",
    "run_id": "--run-id",
    "rdzv_backend": "--rdzv-backend",
    "join_timeout_s": "--join-timeout",
    "shutdown_grace_s": "--shutdown-grace",
    "role": "--role",
    "standalone": "--standalone",
    "max_restarts": "--max-restarts",
    "signals_to_handle": "--signals-to-handle",
}
"""Each setting and the ``elaswave-run`` flag that gives it."""

OPTION_SETTINGS = {
    "nnodes": ("nnodes",),
    "nproc_per_node": ("nproc_per_node",),
    "node_rank": ("node_rank",),
    "master_addr": ("master_addr",),
    "master_port": ("master_port",),
    "rdzv_backend": ("rdzv_backend",),
    "rdzv_endpoint": ("master_addr", "master_port"),
    "rdzv_id": ("run_id",),
    "rdzv_conf": ("join_timeout_s",),
    "standalone": ("standalone", "nnodes", "node_rank", "master_addr", "master_port"),
    "max_restarts": ("max_restarts",),
    "role": ("role",),
    "shutdown_timeout": ("shutdown_grace_s",),
    "signals_to_handle": ("signals_to_handle",),
    "no_python": (),
    "virtual_local_rank": (),
}
"""The torchrun options (by their ``dest``) that mean something here, or are refused, and the
settings each gives; each is read from ``PET_<DEST>`` too."""

REFUSED_SWITCHES = {
    "no_python": "elaswave-run's workers are Python processes forked from a preloaded "
                 "interpreter; start the program from a Python script instead",
    "virtual_local_rank": "elaswave-run gives each worker its index on the node as LOCAL_RANK "
                          "and leaves CUDA_VISIBLE_DEVICES as it is; drop it and pick the device "
                          "by LOCAL_RANK",
}
"""torchrun's switches that cannot mean anything here, and what to do instead."""

FORWARDED_SIGNALS = frozenset({"SIGINT", "SIGTERM", "SIGHUP"})
"""The signals the launcher forwards to its workers."""

TORCHRUN_DEFAULT_SIGNALS = FORWARDED_SIGNALS | {"SIGQUIT"}
"""torchrun's default ``--signals-to-handle``; SIGQUIT ends the launcher and so its workers."""

DEVICE_KINDS = ("gpu", "cpu", "auto")
"""What ``--nproc-per-node`` takes besides a number."""


@dataclass(frozen=True)
class Setting:
    """One launch setting, with where it came from: ``source`` is a flag (``--nnodes``), an
    environment variable (``SLURM_NNODES``) or ``default``; ``raw`` is the text it was read from."""

    value: object
    source: str
    raw: str = ""

    def located(self) -> str:
        """Where the raw text was given: ``--nnodes 1:4`` or ``PET_NNODES=1:4``."""
        if self.source.startswith("-"):
            return f"{self.source} {self.raw}".rstrip()
        return f"{self.source}={self.raw}"

    def note(self, name: str) -> str:
        """What to add after ``--flag value`` of setting ``name`` to say where it came from: nothing
        for its own flag, else `` (from SLURM_NODEID=1)``, `` (from --rdzv-endpoint h:1)`` or
        `` (the default)``."""
        if self.source == FLAGS[name]:
            return ""
        if self.source == "default":
            return " (the default)"
        return f" (from {self.located()})"

    def describe(self, name: str) -> str:
        """Setting ``name`` as a user finds it: ``--nnodes 2 (from SLURM_NNODES=2)``."""
        return f"{FLAGS[name]} {self.value}{self.note(name)}"


Settings = dict[str, Setting]
"""Settings by name (the keys of :data:`FLAGS`)."""


@dataclass(frozen=True)
class Placement:
    """What the launcher of this node was told, every setting decided. ``node_rank`` is ``None``
    when the launchers take their node ranks as they reach the job store (``--rdzv-backend
    c10d`` with no node rank from any source)."""

    nnodes: int
    node_rank: int | None
    master_addr: str
    master_port: int
    nproc_per_node: int
    run_id: str
    role: str
    join_timeout_s: float
    shutdown_grace_s: float | None


# --- text formats ---------------------------------------------------------------------------


def expand_hostlist(hostlist: str) -> list[str]:
    """The hosts of a SLURM host list, in its order: ``node[01-03,7],login1`` gives ``node01,
    node02, node03, node7, login1``.

    A bracket holds numbers and ranges separated by commas; a range keeps the zero padding of its
    first number. Several brackets in one name multiply out, the last varying fastest
    (``r[1-2]n[1-2]``: ``r1n1, r1n2, r2n1, r2n2``), as in SLURM. Raises :class:`ValueError` with
    one line for anything else (an empty list or name, an unclosed bracket, a range that runs
    backwards, a bracket that is not numbers).
    """
    hosts = [host for name in _top_level_names(hostlist) for host in _expand_name(name)]
    if not hosts:
        raise ValueError(f"empty host list {hostlist!r}")
    return hosts


def _top_level_names(hostlist: str) -> list[str]:
    """``hostlist`` split at the commas outside brackets."""
    names, current, depth = [], "", 0
    for char in hostlist.strip():
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if depth not in (0, 1):
            raise ValueError(f"unbalanced brackets in host list {hostlist!r}")
        if char == "," and depth == 0:
            names.append(current)
            current = ""
        else:
            current += char
    if depth:
        raise ValueError(f"unclosed bracket in host list {hostlist!r}")
    return [*names, current] if hostlist.strip() else []


def _expand_name(name: str) -> list[str]:
    """The hosts one name of a host list stands for (``node[1-2]``: ``node1, node2``)."""
    if not name:
        raise ValueError("empty host name in host list")
    parts = re.split(r"(\[[^\]]*\])", name)
    choices = [_bracket_values(part, name) if part.startswith("[") else [part] for part in parts]
    return ["".join(combination) for combination in product(*choices)]


def _bracket_values(bracket: str, name: str) -> list[str]:
    """The numbers ``[01-03,7]`` stands for, zero-padded as written: ``01, 02, 03, 7``."""
    values = []
    for item in bracket[1:-1].split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if match is None:
            raise ValueError(f"{item!r} in {name!r} is not a number or a range of numbers")
        first, last = match.group(1), match.group(2) or match.group(1)
        if int(last) < int(first):
            raise ValueError(f"range {item!r} in {name!r} runs backwards")
        values += [str(n).zfill(len(first)) for n in range(int(first), int(last) + 1)]
    return values


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``HOST[:PORT]`` (``[IPv6]:PORT`` too) as ``(host, port)``, the port
    :data:`DEFAULT_RDZV_PORT` when not given, as torchrun reads ``--rdzv-endpoint``. Raises
    :class:`ValueError` with one line for an empty host or a port that is not a port."""
    text = endpoint.strip()
    bracketed = re.fullmatch(r"\[([^\]]+)\](?::(.*))?", text)
    if bracketed:
        host, port = bracketed.group(1), bracketed.group(2)
    elif text.count(":") == 1:
        host, port = text.split(":")
    else:  # a host name, or an IPv6 address without brackets (and so without a port)
        host, port = text, None
    if not host:
        raise ValueError("no host")
    return host, DEFAULT_RDZV_PORT if port is None else _port(port)


def _port(text: str) -> int:
    """A TCP port, 1..65535; :class:`ValueError` otherwise."""
    if not text.strip().isdigit() or not 0 < int(text) < 2**16:
        raise ValueError("the port must be a number in 1..65535")
    return int(text)


def _count(text: str) -> int:
    """A non-negative whole number; :class:`ValueError` otherwise."""
    if not text.strip().isdigit():
        raise ValueError(f"expected a whole number, got {text!r}")
    return int(text)


def parse_nnodes(text: str) -> int:
    """``N``, or ``MIN:MAX`` with ``MIN == MAX``: the number of nodes. A range of node counts is
    refused (:class:`ValueError`, one line): here the nodes of a job are fixed, survivors go on
    when one is lost, and a lost node comes back with ``--rejoin``."""
    bounds = text.split(":")
    if len(bounds) > 2:
        raise ValueError("expected N or MIN:MAX")
    low, high = (_count(bound) for bound in (bounds[0], bounds[-1]))
    if low != high:
        raise ValueError(
            "elaswave-run does not form a job from a range of node counts: the job starts on a "
            "fixed number of nodes, goes on without a node it loses, and takes a node back when "
            f"its launcher is started again with --rejoin; pass --nnodes {high}"
        )
    return low


def _parse_switch(text: str) -> bool:
    """A torchrun switch set from the environment: ``1``, ``true``, ``yes`` or empty (as Kubeflow
    sets ``PET_STANDALONE``) mean on; ``0``, ``false``, ``no`` off."""
    value = text.strip().lower()
    if value in ("", "1", "true", "yes"):
        return True
    if value in ("0", "false", "no"):
        return False
    raise ValueError("expected 1 or 0")


def _parse_rdzv_conf(text: str) -> dict[str, str]:
    """``key1=value1,key2=value2`` as a dict."""
    pairs = [item.split("=", 1) for item in text.split(",") if item.strip()]
    if any(len(pair) != 2 or not pair[0].strip() for pair in pairs):
        raise ValueError("expected KEY=VALUE[,KEY=VALUE...]")
    return {key.strip(): value.strip() for key, value in pairs}


def _converted(raw: Setting, convert: Callable[[str], object]) -> Setting:
    """``raw`` with its text converted; a conversion error becomes one line naming the source."""
    try:
        value = convert(raw.raw)
    except ValueError as error:
        raise UsageError(f"{raw.located()}: {error}") from None
    return Setting(value, raw.source, raw.raw)


# --- torchrun's options, from the command line or PET_ variables -----------------------------


def torchrun_environment(env: Mapping[str, str]) -> dict[str, Setting]:
    """torchrun's ``PET_<DEST>`` variables set in ``env`` for the options of
    :data:`OPTION_SETTINGS`, as raw settings keyed by ``dest``."""
    return {
        dest: Setting(env[variable], variable, env[variable])
        for dest in OPTION_SETTINGS
        if (variable := f"PET_{dest.upper()}") in env
    }


def torchrun_settings(options: Mapping[str, Setting],
                      pick_free_port: Callable[[], int]) -> Settings:
    """The settings that torchrun's ``options`` (raw text keyed by torchrun's ``dest``, all from
    one source) give.

    ``--rdzv-endpoint`` gives the master address and port (it wins over ``--master-addr`` and
    ``--master-port`` of the same source, as in torchrun), ``--rdzv-id`` the job id,
    ``--rdzv-conf join_timeout=S`` the join timeout (its other keys tune torch's rendezvous and
    are accepted without effect), ``--shutdown-timeout`` the shutdown grace, and
    ``--standalone`` a one-node job with its store on a free local port. Raises
    :class:`UsageError`, one line, for what cannot mean anything here.
    """
    switches = {dest: _converted(options[dest], _parse_switch).value
                for dest in ("standalone", "no_python", "virtual_local_rank") if dest in options}
    for dest, instead in REFUSED_SWITCHES.items():
        if switches.get(dest):
            raise UsageError(f"{options[dest].located()}: {instead}")
    settings: Settings = {}
    converters = {"nnodes": parse_nnodes, "node_rank": _count, "master_port": _port,
                  "master_addr": _non_empty, "role": _non_empty, "nproc_per_node": _nproc_spec}
    for dest, convert in converters.items():
        if dest in options:
            settings[dest] = _converted(options[dest], convert)
    if "rdzv_endpoint" in options:
        endpoint = _converted(options["rdzv_endpoint"], parse_endpoint)
        host, port = endpoint.value
        settings["master_addr"] = Setting(host, endpoint.source, endpoint.raw)
        settings["master_port"] = Setting(port, endpoint.source, endpoint.raw)
    if "rdzv_backend" in options:
        settings["rdzv_backend"] = _converted(options["rdzv_backend"], _rdzv_backend)
    if "rdzv_id" in options:
        settings["run_id"] = _converted(options["rdzv_id"], _non_empty)
    if "rdzv_conf" in options:
        conf = _converted(options["rdzv_conf"], _parse_rdzv_conf)
        if "join_timeout" in conf.value:
            settings["join_timeout_s"] = _converted(
                conf, lambda text: _positive_seconds(_parse_rdzv_conf(text)["join_timeout"]))
    if "shutdown_timeout" in options:
        settings["shutdown_grace_s"] = _converted(options["shutdown_timeout"], _seconds)
    if "max_restarts" in options:
        settings["max_restarts"] = _converted(options["max_restarts"], _no_restarts)
    if "signals_to_handle" in options:
        settings["signals_to_handle"] = _converted(options["signals_to_handle"], _handled_signals)
    if switches.get("standalone"):
        settings.update(_standalone(options["standalone"], settings, pick_free_port))
    return settings


def _non_empty(text: str) -> str:
    """``text`` without surrounding blanks; :class:`ValueError` if nothing is left."""
    if not text.strip():
        raise ValueError("must not be empty")
    return text.strip()


def _seconds(text: str) -> float:
    """A number of seconds, not negative; :class:`ValueError` otherwise."""
    try:
        seconds = float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a number of seconds") from None
    if not seconds >= 0:
        raise ValueError("must not be negative")
    return seconds


def _positive_seconds(text: str) -> float:
    """A positive number of seconds; :class:`ValueError` otherwise."""
    if _seconds(text) == 0:
        raise ValueError("must be positive")
    return float(text)


def _nproc_spec(text: str) -> str:
    """``--nproc-per-node``'s text, checked: a whole number or one of :data:`DEVICE_KINDS`."""
    spec = text.strip().lower()
    if spec not in DEVICE_KINDS and not spec.isdigit():
        raise ValueError("expected a number of workers, gpu, cpu or auto")
    return spec


def _rdzv_backend(text: str) -> str:
    """``static`` or ``c10d``; etcd's backends are refused with what to pass instead."""
    backend = text.strip().lower()
    if backend in ("static", "c10d"):
        return backend
    if backend.startswith("etcd"):
        raise ValueError(
            "elaswave-run keeps the job store in node 0's launcher, or on an etcd cluster "
            "(v3.4 or newer) with --store etcd://HOST:PORT[,HOST:PORT...]: pass that instead"
        )
    raise ValueError("expected static or c10d")


def _no_restarts(text: str) -> int:
    """``--max-restarts``, which only 0 passes: whole-job restarts are not how this job
    survives a failure."""
    restarts = _count(text)
    if restarts:
        raise ValueError(
            "elaswave-run does not restart the whole job: the survivors of a failure go on "
            "(with --elastic in the training script), and --rejoin --max-rejoins N starts a "
            "dead worker again in its slot; drop --max-restarts or pass 0"
        )
    return restarts


def _handled_signals(text: str) -> frozenset[str]:
    """``--signals-to-handle``'s names, refused where one is not among torchrun's defaults."""
    names = frozenset(name.strip().upper() for name in text.split(",") if name.strip())
    if not names <= TORCHRUN_DEFAULT_SIGNALS:
        extra = ", ".join(sorted(names - TORCHRUN_DEFAULT_SIGNALS))
        raise ValueError(f"elaswave-run forwards SIGINT, SIGTERM and SIGHUP to its workers, not "
                         f"{extra}; send one of those")
    return names


def _standalone(flag: Setting, given: Settings, pick_free_port: Callable[[], int]) -> Settings:
    """The placement ``--standalone`` stands for: one node, node rank 0, the store on a free port
    of this machine. Refused beside a node count or node rank of the same source that says
    otherwise."""
    for name, alone in (("nnodes", 1), ("node_rank", 0)):
        if name in given and given[name].value != alone:
            raise UsageError(f"{flag.located()} runs a one-node job, not "
                             f"{given[name].describe(name)}; drop one of them")
    placement = {"standalone": True, "nnodes": 1, "node_rank": 0, "master_addr": "127.0.0.1",
                 "master_port": pick_free_port()}
    return {name: Setting(value, flag.source, flag.raw) for name, value in placement.items()}


def command_line_settings(torchrun_options: Mapping[str, Setting], own: Settings,
                          pick_free_port: Callable[[], int]) -> Settings:
    """The settings the command line gives: torchrun's options (raw, by ``dest``) and
    elaswave-run's own flags of the same settings (``--run-id``, ``--join-timeout``,
    ``--shutdown-grace``), already converted. Where both give one, they must agree."""
    settings = torchrun_settings(torchrun_options, pick_free_port)
    for name, setting in own.items():
        other = settings.get(name)
        if other is not None and other.value != setting.value:
            raise UsageError(f"{setting.describe(name)} and {other.describe(name)} disagree; "
                             "pass one of them")
    return {**settings, **own}


# --- schedulers -----------------------------------------------------------------------------


def _first_of(env: Mapping[str, str], variables: tuple[str, ...],
              convert: Callable[[str], object]) -> Setting | None:
    """The first of ``variables`` set in ``env``, converted; ``None`` if none is set."""
    for variable in variables:
        if variable in env:
            return _converted(Setting(None, variable, env[variable]), convert)
    return None


def _present(**settings: Setting | None) -> Settings:
    """The ``settings`` that a source gives (those not ``None``)."""
    return {name: setting for name, setting in settings.items() if setting is not None}


SLURM_NODE_COUNTS = ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
SLURM_NODE_RANKS = ("SLURM_NODEID", "SLURM_PROCID")


def _in_srun_step(env: Mapping[str, str]) -> bool:
    """Whether ``env`` is a task's of an ``srun`` step (not a batch script's or a shell's)."""
    return "SLURM_STEP_ID" in env or "SLURM_STEPID" in env


def check_one_slurm_task_per_node(env: Mapping[str, str]) -> None:
    """Refuse, in one line, an ``srun`` step of more tasks than nodes (``SLURM_STEP_NUM_TASKS``
    or ``SLURM_NTASKS`` against the node count): each task would be a launcher, several per
    node, and SLURM's node rank would not tell them apart."""
    nnodes = _first_of(env, SLURM_NODE_COUNTS, _count)
    tasks = _first_of(env, ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"), _count)
    if nnodes is not None and tasks is not None and tasks.value != nnodes.value:
        raise UsageError(
            f"SLURM runs {tasks.value} tasks on {nnodes.value} nodes ({tasks.located()}, "
            f"{nnodes.located()}): start one elaswave-run per node, with srun "
            "--ntasks-per-node=1; it starts the node's workers itself"
        )


def slurm_settings(env: Mapping[str, str]) -> Settings:
    """The placement SLURM gives a launcher started as one task per node of an ``srun`` step
    (``srun --ntasks-per-node=1 elaswave-run ...``); nothing outside a step (no
    ``SLURM_STEP_ID``: a batch script itself, or an ``salloc`` shell, runs one launcher on one
    node).

    Node count: ``SLURM_STEP_NUM_NODES``, else ``SLURM_NNODES``, else ``SLURM_JOB_NUM_NODES``.
    Node rank: ``SLURM_NODEID``, else ``SLURM_PROCID``. Master address: the first host of
    ``SLURM_STEP_NODELIST``, else of ``SLURM_JOB_NODELIST`` (or ``SLURM_NODELIST``), which is
    node 0's. Master port: ``MASTER_PORT`` if set. A node rank from here needs one task per node
    (:func:`check_one_slurm_task_per_node`).
    """
    if not _in_srun_step(env):
        return {}
    nnodes = _first_of(env, SLURM_NODE_COUNTS, _count)
    nodelist = _first_of(env, ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"),
                         lambda text: expand_hostlist(text)[0])
    return _present(
        nnodes=nnodes,
        node_rank=_first_of(env, SLURM_NODE_RANKS, _count),
        master_addr=nodelist,
        master_port=_first_of(env, ("MASTER_PORT",), _port),
    )


PYTORCHJOB_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
"""What Kubeflow's training operator sets in every pod of a PyTorchJob with a Master replica."""

KUBERNETES_VARIABLE = "KUBERNETES_SERVICE_HOST"
"""Set in every Kubernetes pod: tells a PyTorchJob's ``WORLD_SIZE`` and ``RANK`` from those a
batch script may export for ``torch.distributed`` itself."""


def pytorchjob_settings(env: Mapping[str, str]) -> Settings:
    """The placement of a Kubeflow PyTorchJob's pod as operators before 1.7 give it, in a
    Kubernetes pod with all of :data:`PYTORCHJOB_VARIABLES` set: ``WORLD_SIZE`` pods (nodes),
    this pod's node rank ``RANK`` (the Master is 0), the Master's service ``MASTER_ADDR`` and
    port ``MASTER_PORT``. Later operators set ``WORLD_SIZE`` to nodes x processes, but also
    ``PET_NNODES``, which comes first (module docstring)."""
    if KUBERNETES_VARIABLE not in env or not all(name in env for name in PYTORCHJOB_VARIABLES):
        return {}
    return _present(
        nnodes=_first_of(env, ("WORLD_SIZE",), _count),
        node_rank=_first_of(env, ("RANK",), _count),
        master_addr=_first_of(env, ("MASTER_ADDR",), _non_empty),
        master_port=_first_of(env, ("MASTER_PORT",), _port),
    )


def indexed_job_settings(env: Mapping[str, str]) -> Settings:
    """The placement of a pod of a Kubernetes Indexed Job, such as a JobSet's: its node rank
    ``JOB_COMPLETION_INDEX``, and ``MASTER_ADDR`` and ``MASTER_PORT`` where the manifest sets
    them (JobSet sets neither: the first pod's stable name, ``<jobset>-<job>-0-0.<jobset>``, is
    passed explicitly). The node count is not in the environment: pass ``--nnodes``."""
    if "JOB_COMPLETION_INDEX" not in env:
        return {}
    return _present(
        node_rank=_first_of(env, ("JOB_COMPLETION_INDEX",), _count),
        master_addr=_first_of(env, ("MASTER_ADDR",), _non_empty),
        master_port=_first_of(env, ("MASTER_PORT",), _port),
    )


def scheduler_settings(env: Mapping[str, str]) -> Settings:
    """The placement the scheduler gives: SLURM's, else a PyTorchJob's, else an Indexed Job's
    (the first of them that recognizes ``env``); nothing without one."""
    for source in (slurm_settings, pytorchjob_settings, indexed_job_settings):
        if settings := source(env):
            return settings
    return {}


# --- the decision ---------------------------------------------------------------------------


def default_settings() -> Settings:
    """The settings no source gave: :class:`LaunchConfig`'s defaults (the node rank is decided
    by :func:`resolve`)."""
    fields = LaunchConfig.__dataclass_fields__
    defaults = {name: fields[name].default for name in
                ("nnodes", "master_addr", "master_port", "run_id", "role", "join_timeout_s",
                 "shutdown_grace_s")}
    defaults.update(nproc_per_node=str(fields["nproc_per_node"].default), rdzv_backend="static")
    return {name: Setting(value, "default", str(value)) for name, value in defaults.items()}


def count_local_devices(kind: str) -> int:
    """How many of ``kind`` this machine has: ``gpu``, CUDA devices; ``accelerator``, devices of
    torch's current accelerator (CUDA, or another backend loaded, as torchrun's ``auto``); ``cpu``,
    the CPUs this process may run on."""
    if kind == "cpu":
        if hasattr(os, "sched_getaffinity"):
            return len(os.sched_getaffinity(0))
        return os.cpu_count() or 1
    import torch

    if kind == "gpu":
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    return torch.accelerator.device_count() if torch.accelerator.is_available() else 0


def resolve_nproc_per_node(setting: Setting, count_devices: Callable[[str], int]) -> int:
    """Workers per node from ``--nproc-per-node``'s text: a number as is; ``gpu`` one per CUDA
    device (refused in one line where there is none); ``cpu`` one per CPU; ``auto`` one per
    accelerator device, else one per CPU (as torchrun)."""
    spec = setting.value
    if spec == "cpu":
        return count_devices("cpu")
    if spec == "auto":
        return count_devices("accelerator") or count_devices("cpu")
    if spec == "gpu":
        gpus = count_devices("gpu")
        if not gpus:
            raise UsageError(f"{setting.located()}: this machine has no CUDA device that torch "
                             "can use; pass the number of workers, or cpu")
        return gpus
    workers = int(spec)
    if workers < 1:
        raise UsageError(f"--nproc-per-node must be at least 1, got {workers}"
                         f"{setting.note('nproc_per_node')}")
    return workers


def resolve(command_line: Settings, env: Mapping[str, str], *,
            count_devices: Callable[[str], int] = count_local_devices,
            pick_free_port: Callable[[], int]) -> Placement:
    """Every setting of this node's launcher, each from the first source that gives it: the
    ``command_line`` (:func:`command_line_settings`), torchrun's ``PET_`` variables in ``env``,
    the scheduler's (:func:`scheduler_settings`), the defaults.

    The node rank, given by no source, is 0, except under ``--rdzv-backend c10d`` with more
    than one node: then it is ``None``, and each launcher takes one as it reaches the job store.
    Raises :class:`UsageError`, one line, for a node rank out of range, a node rank from an
    ``srun`` step of several tasks per node, or ``--standalone`` with more than one node.
    """
    settings = {
        **default_settings(),
        **scheduler_settings(env),
        **torchrun_settings(_not_given(torchrun_environment(env), command_line), pick_free_port),
        **command_line,
    }
    nnodes = settings["nnodes"]
    if nnodes.value < 1:
        raise UsageError(f"--nnodes must be at least 1, got {nnodes.value}{nnodes.note('nnodes')}")
    if "standalone" in settings and nnodes.value != 1:
        raise UsageError(f"{settings['standalone'].located()} runs a one-node job, not "
                         f"{nnodes.describe('nnodes')}; drop one of them")
    return Placement(
        nnodes=nnodes.value,
        node_rank=_node_rank(settings, env),
        master_addr=settings["master_addr"].value,
        master_port=settings["master_port"].value,
        nproc_per_node=resolve_nproc_per_node(settings["nproc_per_node"], count_devices),
        run_id=settings["run_id"].value,
        role=settings["role"].value,
        join_timeout_s=settings["join_timeout_s"].value,
        shutdown_grace_s=settings["shutdown_grace_s"].value,
    )


def _not_given(options: Mapping[str, Setting], command_line: Settings) -> dict[str, Setting]:
    """The ``options`` that give a setting the ``command_line`` does not: torchrun reads
    ``PET_<DEST>`` only for a flag not given, so a variable it would not read cannot refuse
    the launch."""
    return {dest: option for dest, option in options.items()
            if not OPTION_SETTINGS[dest] or not set(OPTION_SETTINGS[dest]) <= command_line.keys()}


def _node_rank(settings: Settings, env: Mapping[str, str]) -> int | None:
    """The node rank of :func:`resolve`, checked against the node count (and, taken from SLURM,
    against SLURM's tasks per node)."""
    nnodes = settings["nnodes"]
    node_rank = settings.get("node_rank")
    if node_rank is None:
        dynamic = settings["rdzv_backend"].value == "c10d" and nnodes.value > 1
        return None if dynamic else 0
    if node_rank.source in SLURM_NODE_RANKS:
        check_one_slurm_task_per_node(env)
    if node_rank.value >= nnodes.value:
        raise UsageError(f"{node_rank.describe('node_rank')} is out of range for "
                         f"{nnodes.describe('nnodes')}")
    return node_rank.value


def free_port() -> int:
    """A TCP port nothing listens on right now, for ``--standalone``'s job store."""
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]
