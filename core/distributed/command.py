"""The command line of a model split across machines: the flags `chat`, `generate` (app/cli.py) and `serve`
(server/cli.py) share, their checks, starting rank 0, and `mlxchat worker`. Cheap to import: MLX loads only when a
model does (core's package loads its engine only when asked), so the CLI's parser can build these flags."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_split_arguments(parser: argparse.ArgumentParser) -> None:
    """`--hosts` and its companions: with `--hosts`, this process is rank 0 of a split model."""
    parser.add_argument("--hosts", metavar="FILE", help="split the model across the machines of FILE (MLX's ring "
                                                        "hosts file); this process is rank 0, the others run "
                                                        "`mlxchat worker --hosts FILE --rank R`")
    parser.add_argument("--control-port", type=int, help="with --hosts: the port rank 0 listens on for workers "
                                                         "(default: one above FILE's highest port on rank 0's host)")
    parser.add_argument("--connect-timeout", type=float, default=30.0,
                        help="with --hosts: seconds to wait for the workers (default: 30)")
    parser.add_argument("--parallel", choices=("pipeline", "tensor"), default="pipeline",
                        help="with --hosts: pipeline (layer ranges, the default) or tensor (every layer's heads over "
                             "the ranks; needs heads divisible by the number of ranks)")


def add_worker_command(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    worker = sub.add_parser("worker", help="run one rank of a model split across machines (see --hosts)")
    worker.add_argument("--hosts", required=True, metavar="FILE", help="the hosts file rank 0 uses (MLX's ring "
                                                                       "format: a JSON list of [\"host:port\"])")
    worker.add_argument("--rank", required=True, type=int, help="this machine's rank in FILE (1 to N-1)")
    worker.add_argument("--control-port", type=int, help="rank 0's control port, if it was given one")


def check_split(args: argparse.Namespace) -> None:
    """Bad --hosts, --control-port or --connect-timeout: one line, before the model loads."""
    if getattr(args, "hosts", None) is None:
        return
    from mlxchat.core.distributed import read_hosts

    read_hosts(args.hosts)
    if args.control_port is not None and not 0 < args.control_port < 65536:
        raise ValueError(f"--control-port must be between 1 and 65535, got {args.control_port}")
    if getattr(args, "connect_timeout", 1) <= 0:
        raise ValueError(f"--connect-timeout must be greater than 0, got {args.connect_timeout}")


def start_split(spec: str | None, args: argparse.Namespace) -> Any:  # noqa: ANN401 - core's SplitEngine
    """Rank 0: wait for the workers, split the model and load this rank's part, saying each step on stderr."""
    from mlxchat.core.distributed.leader import SplitEngine
    from mlxchat.core.distributed.ring_noise import quiet_ring_errors

    quiet_ring_errors()  # a lost peer is mlxchat's one line, not the ring's eleven
    return SplitEngine.start(args.hosts, spec, connect_timeout_s=args.connect_timeout,
                             control_port=args.control_port, parallel=args.parallel,
                             progress=lambda line: print(f"mlxchat: {line}", file=sys.stderr, flush=True))


def run_worker(args: argparse.Namespace) -> int:
    """`mlxchat worker`: serve this rank until rank 0 closes or goes away."""
    from mlxchat.core.distributed import read_hosts
    from mlxchat.core.distributed.ring_noise import quiet_ring_errors
    from mlxchat.core.distributed.worker import run

    hosts = read_hosts(args.hosts)
    hosts.check_rank(args.rank)
    check_split(args)
    quiet_ring_errors()  # rank 0 going away is the worker's one line, not the ring's eleven
    return run(hosts, args.rank, args.control_port)


def lost_a_peer(error: BaseException) -> bool:
    """A split model's failure (core/distributed/leader.py's SplitError): its process should leave with os._exit."""
    leader = sys.modules.get("mlxchat.core.distributed.leader")
    return leader is not None and isinstance(error, leader.SplitError)
