"""`mlxchat serve`: its flags and its runner (the app's CLI only calls these two functions)."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import socket
import sys

from mlxchat.core.distributed.command import add_split_arguments, check_split, start_split

LOOPBACK = "127.0.0.1"


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Add ``mlxchat serve`` to the command's parser (entry point ``mlxchat.commands``, see app/cli.py)."""
    parser = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (batched, streaming)")
    add_arguments(parser)
    parser.set_defaults(command_runner=run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="GGUF file, MLX/HF folder or HF repo id (default: the embedded SmolLM2-135M)")
    parser.add_argument("--host", default=LOOPBACK, help="address to bind (default: 127.0.0.1, this machine only)")
    parser.add_argument("--port", type=int, default=8080, help="port (default: 8080; 0 picks a free one)")
    parser.add_argument("--api-key", default=os.environ.get("MLXCHAT_API_KEY") or None,
                        help="require 'Authorization: Bearer KEY' (default: $MLXCHAT_API_KEY; none when unset)")
    parser.add_argument("--max-concurrent", type=int, default=4,
                        help="requests decoded together in one batch (default: 4)")
    parser.add_argument("--max-queue", type=int, default=16,
                        help="requests that may wait for a slot; more get 429 (default: 16)")
    parser.add_argument("--profile", help="default sampling profile: a preset or a saved profile (default: the "
                                          "chat preset, and Ollama's own defaults on /api/*); "
                                          "requests may name another with \"profile\"")
    parser.add_argument("--speculative", choices=("off", "ngram", "auto"), default="off",
                        help="guess tokens by prompt lookup and verify them, same text, while a request has the model "
                             "to itself (default: off; a request's \"speculative\" field wins)")
    parser.add_argument("--cors", action="append", default=[], metavar="ORIGIN",
                        help="allow browser requests from ORIGIN (repeatable; default: CORS off)")
    parser.add_argument("--max-body-mb", type=float, default=4.0, help="largest request body (default: 4 MiB)")
    parser.add_argument("--prefix-cache-mb", type=float, default=512.0,
                        help="memory for reused prompt prefixes, least recently used dropped first "
                             "(default: 512 MiB; 0 disables)")
    parser.add_argument("--kv-cache-dir", help="save prompt prefixes evicted from memory (and all of them at "
                                               "shutdown) here, and load a saved prefix instead of prefilling it "
                                               "(default: the cache folder's kv/, e.g. ~/.cache/mlxchat/kv)")
    parser.add_argument("--kv-cache-mb", type=float, default=None,
                        help="the most that folder may hold, least recently used files removed first "
                             "(default: 4096; 0 turns the disk cache off)")
    add_split_arguments(parser)  # --hosts: a split model, served one request at a time


def _profiles() -> dict:
    from mlxchat.core import SamplingProfile
    from mlxchat.core.sampling.profile import ProfileStore

    store = ProfileStore()
    found = {name: SamplingProfile.preset(name) for name in SamplingProfile.presets()}
    for name in store.list():
        try:
            found[name] = store.load(name, warn=False)  # `run` warns about the one it serves by default
        except Exception as e:  # noqa: BLE001 - one broken saved profile must not keep the server down
            logging.getLogger("mlxchat.server").warning("skipping saved profile %s: %s", name, e)
    return found


def _check(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be between 0 and 65535, got {args.port}")
    if args.max_concurrent < 1:
        raise ValueError(f"--max-concurrent must be at least 1, got {args.max_concurrent}")
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be at least 0, got {args.max_queue}")
    if args.max_body_mb <= 0:
        raise ValueError(f"--max-body-mb must be greater than 0, got {args.max_body_mb}")
    if args.prefix_cache_mb < 0:
        raise ValueError(f"--prefix-cache-mb must be at least 0, got {args.prefix_cache_mb}")
    if args.kv_cache_mb is not None and args.kv_cache_mb < 0:
        raise ValueError(f"--kv-cache-mb must be at least 0 (0 turns the disk cache off), got {args.kv_cache_mb:g}")
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key is empty: give a key, or leave it out to serve without one")
    check_split(args)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def run(args: argparse.Namespace) -> int:
    _check(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    log = logging.getLogger("mlxchat.server")
    profiles = _profiles()
    if args.profile is not None and args.profile not in profiles:
        raise ValueError(f"unknown profile {args.profile!r}; known: {', '.join(sorted(profiles))}")
    if args.profile is not None:
        for warning in profiles[args.profile].warnings():
            log.warning("profile %s: %s", args.profile, warning)
    # Bind before loading the model, so a taken port fails in a second, not after the load.
    try:
        sock = socket.create_server((args.host, args.port))
    except OSError as e:
        raise ValueError(f"cannot listen on {args.host}:{args.port}: {e.strerror}") from None
    if not _is_loopback(args.host) and args.api_key is None:
        log.warning("listening on %s without an API key: anyone who can reach this address can use the model; "
                    "set --api-key or MLXCHAT_API_KEY", args.host)

    import uvicorn

    from mlxchat.core import Engine
    from mlxchat.core.batch import BatchScheduler

    from .app import create_app
    from .service import ServerConfig
    from .service import DEFAULT_PROFILE

    # A SIGINT meanwhile leaves at once (mlxchat.app.cli.main's handler).
    engine = Engine.load(args.model, **kv_cache_options(args)) if args.hosts is None else start_split(args.model, args)
    # From here uvicorn handles SIGINT: it shuts down gracefully, then raises the signal again, for the except below.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # So does SIGTERM (a service manager's stop); raised again, it leaves through the `finally` below, which saves
    # the prefix cache to disk, instead of killing the process there.
    signal.signal(signal.SIGTERM, _terminated)
    scheduler = None
    try:
        scheduler = BatchScheduler(engine, max_batch=args.max_concurrent, max_queue=args.max_queue,
                                   prefix_cache_bytes=int(args.prefix_cache_mb * 2**20)) \
            if args.hosts is None else _split_scheduler(engine, args)
        config = ServerConfig(api_key=args.api_key, max_body_bytes=int(args.max_body_mb * 2**20),
                              cors_origins=tuple(args.cors), profile=profiles.get(args.profile), profiles=profiles)
        server = uvicorn.Server(uvicorn.Config(create_app(engine, scheduler, config), log_level="warning",
                                               access_log=False, lifespan="off"))
        host, port = sock.getsockname()[:2]
        print(f"mlxchat: serving {engine.name} on http://{host}:{port}/v1 (profile {args.profile or DEFAULT_PROFILE}"
              f"{'' if args.profile else ', Ollama defaults on /api/*'})", flush=True)
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        # uvicorn shuts down gracefully on Ctrl-C, then raises the signal again for its caller: here.
        print("mlxchat: stopped", file=sys.stderr)
        return 130
    finally:
        _spill(engine, scheduler)
        engine.close()
    return 0


def _terminated(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def kv_cache_options(args: argparse.Namespace) -> dict:
    """`Engine.load`'s KV disk cache options from the flags."""
    from mlxchat.core.cache.kv_store import DEFAULT_BUDGET_MB
    from mlxchat.core.locations import kv_cache_dir

    mb = DEFAULT_BUDGET_MB if args.kv_cache_mb is None else args.kv_cache_mb
    if mb == 0:
        return {}
    return {"kv_cache_dir": args.kv_cache_dir or kv_cache_dir(), "kv_cache_mb": mb}


def _spill(engine, scheduler) -> None:  # noqa: ANN001 - core types, imported late
    """Save the prefix cache's entries to the KV cache folder before the process ends: a client resending a
    conversation after a restart is then served from disk."""
    index = getattr(scheduler, "prefix_cache", None)  # a split model's scheduler keeps its one cache, not spilled
    if index is not None and index.disk is not None:
        engine.run(index.spill_all)
        engine.flush_kv_cache()


def _split_scheduler(engine, args: argparse.Namespace):  # noqa: ANN001, ANN202 - core types, imported late
    """A split model serves one request at a time (core/distributed/serving.py says why)."""
    from mlxchat.core.distributed.serving import SequentialScheduler

    return SequentialScheduler(engine, max_queue=args.max_queue)


__all__ = ["add_arguments", "kv_cache_options", "run"]
