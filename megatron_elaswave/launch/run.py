"""``elaswave-run``: launch a job whose surviving workers keep going when a worker dies.

Usage (flags as in torchrun; each also accepts its ``snake_case`` spelling)::

    elaswave-run [--nproc-per-node N] [--nnodes K] [--node-rank R] [--master-addr A]
                 [--master-port P] [--run-id ID] [--log-dir DIR]
                 [--rejoin [--rejoin-delay S] [--max-rejoins N]] [-m] script_or_module [args...]

Also ``python -m megatron_elaswave.launch.run``. What the launcher guarantees, and its exit status,
are described in :mod:`megatron_elaswave.launch.launcher`. Errors in the command line are reported as
one line on stderr, with exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from megatron_elaswave.launch.launcher import LaunchConfig, LaunchError, UsageError, run

PROG = "elaswave-run"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not the usage block
        raise UsageError(message)


def _flag(name: str) -> tuple[str, ...]:
    """``--nproc-per-node`` and torchrun's other spelling, ``--nproc_per_node``."""
    snake = name.replace("-", "_")
    return (f"--{name}", f"--{snake}") if snake != name else (f"--{name}",)


def _default(field_name: str) -> object:
    return LaunchConfig.__dataclass_fields__[field_name].default


def _seconds(parser: argparse.ArgumentParser, name: str, field_name: str, help: str) -> None:
    parser.add_argument(*_flag(name), type=float, default=_default(field_name), metavar="SECONDS",
                        help=help)


def _modules(value: str) -> tuple[str, ...]:
    if value.strip().lower() == "none":
        return ()
    return tuple(name.strip() for name in value.split(",") if name.strip())


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Start a node's workers; when one dies, record it and keep the others.",
    )
    parser.add_argument(
        *_flag("nproc-per-node"),
        type=int,
        default=_default("nproc_per_node"),
        help="workers per node",
    )
    parser.add_argument(
        "--nnodes", type=int, default=_default("nnodes"), help="number of nodes in the job"
    )
    parser.add_argument(
        *_flag("node-rank"), type=int, default=_default("node_rank"), help="rank of this node"
    )
    parser.add_argument(
        *_flag("master-addr"),
        default=_default("master_addr"),
        help="address of node rank 0, whose launcher hosts the job store (without --store)",
    )
    parser.add_argument(
        *_flag("master-port"),
        type=int,
        default=_default("master_port"),
        help="port of the job store (without --store)",
    )
    parser.add_argument(
        "--store",
        default=_default("store"),
        metavar="etcd://HOST:PORT[,HOST:PORT...]",
        help="keep the job store on this etcd cluster instead of in node rank 0's launcher, so "
        "that any node, node 0 included, can be lost",
    )
    parser.add_argument(
        *_flag("run-id"), default=_default("run_id"), help="job id, the same on every node"
    )
    parser.add_argument(
        *_flag("log-dir"), default=None, help="write each worker's output to DIR/rank<r>.log"
    )
    _seconds(parser, "shutdown-grace", "shutdown_grace_s",
             "after forwarding SIGINT/SIGTERM, how long to wait before SIGKILL")
    _seconds(parser, "join-timeout", "join_timeout_s",
             "how long to wait for the job store and for all node launchers to join")
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


def parse_config(argv: Sequence[str] | None = None) -> LaunchConfig:
    args = build_parser().parse_args(argv)
    if not args.command:
        raise UsageError("missing the script to run (or the module, with -m)")
    script, *script_args = args.command
    return LaunchConfig(
        script=script,
        script_args=tuple(script_args),
        run_as_module=args.module,
        nproc_per_node=args.nproc_per_node,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        store=args.store,
        run_id=args.run_id,
        log_dir=args.log_dir,
        shutdown_grace_s=args.shutdown_grace,
        join_timeout_s=args.join_timeout,
        node_timeout_s=args.node_timeout,
        rejoin=args.rejoin,
        rejoin_delay_s=args.rejoin_delay,
        max_rejoins=args.max_rejoins,
        exclusion_grace_s=args.exclusion_grace,
        preload=args.preload,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``elaswave-run``; returns the exit status."""
    try:
        return run(parse_config(argv))
    except LaunchError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return error.exit_status


if __name__ == "__main__":
    sys.exit(main())
