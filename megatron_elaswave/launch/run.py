"""``elaswave-run``: launch a job whose surviving workers keep going when a worker dies.

Usage (torchrun's flags, each also in its ``snake_case`` spelling, plus elaswave-run's own)::

    elaswave-run [--nproc-per-node N|gpu|cpu|auto] [--nnodes K] [--node-rank R]
                 [--master-addr A] [--master-port P] [--rdzv-backend static|c10d]
                 [--rdzv-endpoint HOST[:PORT]] [--rdzv-id ID] [--standalone] [--run-id ID]
                 [--log-dir DIR] [--rejoin [--rejoin-delay S] [--max-rejoins N]]
                 [-m] script_or_module [args...]

Also ``python -m megatron_elaswave.launch.run``. Settings the command line does not give come
from torchrun's ``PET_`` variables, then from SLURM or Kubernetes
(:mod:`megatron_elaswave.launch.environment`). What the launcher guarantees, and its exit status,
are described in :mod:`megatron_elaswave.launch.launcher`. Errors in the command line are reported
as one line on stderr, with exit status 2; torchrun's flags that have no effect here are named in
one line each on stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import asdict

from megatron_elaswave.launch.environment import (
    Setting,
    command_line_settings,
    count_local_devices,
    free_port,
    resolve,
)
from megatron_elaswave.launch.config import LaunchConfig, LaunchError, UsageError
from megatron_elaswave.launch.console import log
from megatron_elaswave.launch.spawn import (
    ForkServer,
    ForkServerError,
    can_fork_workers,
    host_has_gpus,
)

PROG = "elaswave-run"

_LOGS_GO = ("each worker's stdout and stderr go to DIR/rank<r>.log with --log-dir DIR, else "
            "to this terminal")
IGNORED_TORCHRUN_FLAGS: dict[tuple[str, ...], str] = {
    ("--monitor-interval",): "the launcher checks its workers every 50 ms",
    ("--start-method",): "workers are forked from a preloaded interpreter (--preload), or "
                         "started afresh with --preload none",
    ("--event-log-handler",): "the launcher reports each event in one line on stderr",
    ("--local-addr",): "workers reach each other and the job store through the master address",
    ("-r", "--redirects"): _LOGS_GO,
    ("-t", "--tee"): _LOGS_GO,
    ("--local-ranks-filter",): _LOGS_GO,
    ("--logs-specs",): _LOGS_GO,
    ("--duplicate-stdout-filters",): _LOGS_GO,
    ("--duplicate-stderr-filters",): _LOGS_GO,
    ("--numa-binding",): "elaswave-run does not bind workers to CPUs",
}
"""torchrun's flags accepted without effect, and why they have none here."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not the usage block
        raise UsageError(message)


def _flag(name: str) -> tuple[str, ...]:
    """``--nproc-per-node`` and torchrun's other spelling, ``--nproc_per_node``."""
    snake = name.replace("-", "_")
    return (f"--{name}", f"--{snake}") if snake != name else (f"--{name}",)


def _spellings(names: tuple[str, ...]) -> tuple[str, ...]:
    """Every spelling of a flag given by its names (``-t``, ``--tee``)."""
    return tuple(spelling for name in names
                 for spelling in (_flag(name[2:]) if name.startswith("--") else (name,)))


def _dest(names: tuple[str, ...]) -> str:
    return names[-1].lstrip("-").replace("-", "_")


def _default(field_name: str) -> object:
    return LaunchConfig.__dataclass_fields__[field_name].default


def _seconds(parser: argparse.ArgumentParser, name: str, field_name: str, help: str) -> None:
    parser.add_argument(*_flag(name), type=float, default=_default(field_name), metavar="SECONDS",
                        help=help)


def _modules(value: str) -> tuple[str, ...]:
    if value.strip().lower() == "none":
        return ()
    return tuple(name.strip() for name in value.split(",") if name.strip())


def _add_torchrun_flags(parser: argparse.ArgumentParser) -> None:
    """torchrun's flags, every one of torch 2.13's; each defaults to ``None`` (not given), so
    that the environment can give it (:mod:`megatron_elaswave.launch.environment`)."""
    placement = [
        ("nproc-per-node", "N|gpu|cpu|auto",
         "workers per node: a number, one per CUDA device (gpu), per CPU (cpu), or per "
         "accelerator device, else per CPU (auto); default 1"),
        ("nnodes", "N", "number of nodes in the job (torchrun's MIN:MAX only with MIN = MAX); "
         "default 1"),
        ("node-rank", "R", "rank of this node; default 0, or, with --rdzv-backend c10d, "
         "taken as the launcher joins"),
        ("master-addr", "ADDR", "address of node rank 0, whose launcher hosts the job store "
         "(without --store); default 127.0.0.1"),
        ("master-port", "PORT", "port of the job store (without --store); default 29500"),
        ("rdzv-backend", "static|c10d", "static: node ranks as given (the default); c10d: a "
         "launcher given no node rank takes one as it joins"),
        ("rdzv-endpoint", "HOST[:PORT]", "where the job store is: the master address and "
         "port (default port 29400)"),
        ("rdzv-id", "ID", "the job id, as --run-id"),
        ("rdzv-conf", "KEY=VALUE,...", "join_timeout=S sets --join-timeout; other keys tune "
         "torch's rendezvous and have no effect here"),
        ("max-restarts", "N", "torchrun's whole-job restarts: only 0 (see --rejoin)"),
        ("role", "NAME", "the workers' ROLE_NAME; default 'default'"),
        ("shutdown-timeout", "SECONDS", "as --shutdown-grace"),
        ("signals-to-handle", "SIGNALS", "accepted where it names only torchrun's default "
         "signals: SIGINT, SIGTERM and SIGHUP are forwarded to the workers"),
    ]
    for name, metavar, help in placement:
        parser.add_argument(*_flag(name), metavar=metavar, help=help)
    parser.add_argument("--standalone", action="store_true",
                        help="a one-node job with its store on a free local port")
    for name, help in (("no-python", "refused: workers are Python processes"),
                       ("virtual-local-rank", "refused: LOCAL_RANK is the worker's index"),
                       ("run-path", "the same as running the script as given")):
        parser.add_argument(*_flag(name), action="store_true", help=help)
    for names, reason in IGNORED_TORCHRUN_FLAGS.items():
        parser.add_argument(*_spellings(names), dest=_dest(names), metavar="VALUE",
                            help=f"torchrun's; no effect: {reason}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Start a node's workers; when one dies, record it and keep the others.",
    )
    _add_torchrun_flags(parser)
    parser.add_argument(
        "--store",
        default=_default("store"),
        metavar="etcd://HOST:PORT[,HOST:PORT...]",
        help="keep the job store on this etcd cluster instead of in node rank 0's launcher, so "
        "that any node, node 0 included, can be lost",
    )
    for name, variable, what in (("cacert", "ETCDCTL_CACERT", "the CA certificate of the etcd "
                                  "cluster's members (TLS)"),
                                 ("cert", "ETCDCTL_CERT", "this client's TLS certificate"),
                                 ("key", "ETCDCTL_KEY", "its private key")):
        parser.add_argument(f"--store-{name}", metavar="FILE",
                            help=f"with --store: {what}; default ${variable}, as etcdctl (the "
                            "user and password come from $ETCDCTL_USER and $ETCDCTL_PASSWORD "
                            "only)")
    _seconds(parser, "store-compaction-interval", "store_compaction_interval_s",
             "with --store: how often the job compacts the etcd cluster's history (cluster-wide; "
             "default 60, 0 for a cluster that compacts itself)")
    parser.add_argument(*_flag("run-id"), help="job id, the same on every node; default 'none'")
    parser.add_argument(
        *_flag("log-dir"), default=None, help="write each worker's output to DIR/rank<r>.log"
    )
    parser.add_argument(*_flag("shutdown-grace"), type=float, metavar="SECONDS",
                        help="after forwarding SIGINT/SIGTERM, how long to wait before SIGKILL; "
                        "default 10, and for SIGTERM to workers run with --exit-signal-handler "
                        "(which save a checkpoint on it) their --distributed-timeout-minutes")
    parser.add_argument(*_flag("join-timeout"), type=float, metavar="SECONDS",
                        help="how long to wait for the job store and for all node launchers to "
                        "join; default 300")
    _seconds(parser, "node-timeout", "node_timeout_s",
             "heartbeat silence after which the nodes that watch a node declare it lost")
    parser.add_argument(
        "--rejoin",
        action="store_true",
        help="start a dead worker again in its slot, to rejoin the running job; with a node "
        "rank that was declared lost, take that node's place",
    )
    _seconds(parser, "rejoin-delay", "rejoin_delay_s",
             "with --rejoin: wait this long after a worker's death before starting it again")
    parser.add_argument(
        *_flag("max-rejoins"),
        type=int,
        default=_default("max_rejoins"),
        metavar="N",
        help="with --rejoin: start one slot again at most N times",
    )
    _seconds(parser, "exclusion-grace", "exclusion_grace_s",
             "a worker the job excluded (stopped or hung, not dead) is killed this long after "
             "the decision")
    parser.add_argument(
        "--preload",
        type=_modules,
        default=_default("preload"),
        metavar="MODULES",
        help="comma-separated modules to import once and fork every worker from (default: "
        "torch and megatron-core's GPT stack); 'none' to start each worker afresh",
    )
    parser.add_argument(
        "-m", "--module", action="store_true", help="run the entry point as a Python module"
    )
    parser.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        metavar="script_or_module [args ...]",
        help="training script (a module name with -m) and its arguments",
    )
    return parser


_TORCHRUN_VALUE_OPTIONS = (
    "nproc_per_node", "nnodes", "node_rank", "master_addr", "master_port", "rdzv_backend",
    "rdzv_endpoint", "rdzv_id", "rdzv_conf", "max_restarts", "role", "shutdown_timeout",
    "signals_to_handle",
)
_TORCHRUN_SWITCHES = ("standalone", "no_python", "virtual_local_rank")


def _given_torchrun_options(args: argparse.Namespace) -> dict[str, Setting]:
    """The torchrun options given on the command line, as raw settings keyed by ``dest``."""
    options = {dest: Setting(getattr(args, dest), f"--{dest.replace('_', '-')}",
                             getattr(args, dest))
               for dest in _TORCHRUN_VALUE_OPTIONS if getattr(args, dest) is not None}
    options.update({dest: Setting(True, f"--{dest.replace('_', '-')}", "")
                    for dest in _TORCHRUN_SWITCHES if getattr(args, dest)})
    return options


def _own_settings(args: argparse.Namespace) -> dict[str, Setting]:
    """elaswave-run's own flags that give a setting torchrun's flags give too, where given."""
    flags = {"run_id": ("--run-id", args.run_id),
             "join_timeout_s": ("--join-timeout", args.join_timeout),
             "shutdown_grace_s": ("--shutdown-grace", args.shutdown_grace)}
    return {name: Setting(value, flag, str(value))
            for name, (flag, value) in flags.items() if value is not None}


def ignored_flag_notices(args: argparse.Namespace) -> list[str]:
    """One line for each torchrun flag given that has no effect here."""
    return [f"ignoring {names[-1]} {getattr(args, _dest(names))}: {reason}"
            for names, reason in IGNORED_TORCHRUN_FLAGS.items()
            if getattr(args, _dest(names)) is not None]


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str], *,
                     count_devices: Callable[[str], int] = count_local_devices,
                     pick_free_port: Callable[[], int] = free_port) -> LaunchConfig:
    """The launch configuration of parsed ``args``, settings not given taken from ``environ``
    (:func:`megatron_elaswave.launch.environment.resolve`)."""
    if not args.command:
        raise UsageError("missing the script to run (or the module, with -m)")
    command_line = command_line_settings(_given_torchrun_options(args), _own_settings(args),
                                         pick_free_port)
    placement = resolve(command_line, environ, count_devices=count_devices,
                        pick_free_port=pick_free_port)
    script, *script_args = args.command
    return LaunchConfig(
        script=script,
        script_args=tuple(script_args),
        run_as_module=args.module,
        store=args.store,
        store_compaction_interval_s=args.store_compaction_interval,
        log_dir=args.log_dir,
        node_timeout_s=args.node_timeout,
        rejoin=args.rejoin,
        rejoin_delay_s=args.rejoin_delay,
        max_rejoins=args.max_rejoins,
        exclusion_grace_s=args.exclusion_grace,
        preload=args.preload,
        **asdict(placement),
    )


def parse_config(argv: Sequence[str] | None = None,
                 environ: Mapping[str, str] | None = None) -> LaunchConfig:
    """The launch configuration of the command line ``argv`` in the environment ``environ``
    (``os.environ`` by default)."""
    args = build_parser().parse_args(argv)
    return config_from_args(args, os.environ if environ is None else environ)


def export_store_security(args: argparse.Namespace, environ: MutableMapping[str, str]) -> None:
    """``--store-cacert/--store-cert/--store-key`` as etcdctl's variables in ``environ``, which
    the job store's clients read (this launcher's and, inherited, its workers'). Raises
    :class:`UsageError` for a file that is not there, or a flag without ``--store``."""
    given = {variable: path for variable, path in (("ETCDCTL_CACERT", args.store_cacert),
                                                   ("ETCDCTL_CERT", args.store_cert),
                                                   ("ETCDCTL_KEY", args.store_key)) if path}
    if given and not args.store:
        raise UsageError("--store-cacert, --store-cert and --store-key go with --store etcd://...")
    for variable, path in given.items():
        if not os.path.isfile(path):
            flag = "--store-" + variable.removeprefix("ETCDCTL_").lower()
            raise UsageError(f"{flag} {path}: no such file")
        environ[variable] = os.path.abspath(path)


def launch(config: LaunchConfig) -> int:
    """Run this node's part of the job (:func:`megatron_elaswave.launch.launcher.run`), its fork
    server started first; returns the agent's exit status."""
    if config.log_dir is not None:
        try:
            os.makedirs(config.log_dir, exist_ok=True)
        except OSError as error:
            raise UsageError(f"cannot create --log-dir {config.log_dir}: {error.strerror}")
    worker_base_env = dict(os.environ)
    fork_server = _start_fork_server(config, worker_base_env)  # preloads while the job forms
    try:
        # c10d logs a warning with a stack trace when a store connection drops; the agent
        # reports that itself, in one line. Takes effect where torch is imported, next.
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        # Imported once the fork server runs: the agent's own import of torch, about a second,
        # runs beside the preload rather than before it.
        from megatron_elaswave.launch.launcher import run

        return run(config, worker_base_env, fork_server)
    finally:
        if fork_server is not None:
            fork_server.close()


def _start_fork_server(config: LaunchConfig, worker_base_env: Mapping[str, str]
                       ) -> ForkServer | None:
    """The fork server that starts this node's workers, or ``None`` to execute them."""
    if not config.preload or not can_fork_workers():
        return None
    try:
        return ForkServer(config.preload, config.shared_worker_env(worker_base_env),
                          warm_compile_caches=config.runs_megatron_lm and not host_has_gpus())
    except (ForkServerError, OSError) as error:
        log(f"starting workers without preloading: {error}")
        return None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``elaswave-run``; returns the exit status."""
    try:
        args = build_parser().parse_args(argv)
        export_store_security(args, os.environ)
        config = config_from_args(args, os.environ)
        for notice in ignored_flag_notices(args):
            print(f"[{PROG}] {notice}", file=sys.stderr, flush=True)
        return launch(config)
    except LaunchError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return error.exit_status


if __name__ == "__main__":
    sys.exit(main())
