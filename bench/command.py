"""``mlxchat bench``: registered with the ``mlxchat`` command through the entry-point group ``mlxchat.commands``
(pyproject.toml), so the app never imports the benchmark. Importing this module is cheap; the benchmark itself
(MLX, mlx-lm, matplotlib) is imported only when the command runs."""

from __future__ import annotations

import argparse


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Add the ``bench`` subcommand and its flags to ``mlxchat``'s parser."""
    bench = sub.add_parser("bench", help="benchmark against mlx-lm (and llama.cpp when installed)")
    bench.add_argument("--quick", action="store_true",
                       help="fewer prompt lengths, tokens and repeats: about 5 minutes on an idle 2-core machine")
    bench.add_argument("--model", help="GGUF file (default: the embedded model)")
    bench.add_argument("--out", default="bench/results", help="folder for the JSON and PNG (default: bench/results)")
    bench.add_argument("--repeats", type=int, help="repeats per case; each figure is their median (default: 3)")
    bench.add_argument("--max-tokens", type=int, help="generated tokens per run (default: 128; --quick 32)")
    bench.add_argument("--lengths", help="prompt lengths, comma-separated (default: 32,512,2048; --quick 32,1024)")
    bench.add_argument("--rotating-context", type=int, help="tokens of context in the rotating-cache run "
                                                            "(default: 20000; --quick 2600)")
    bench.add_argument("--rotating-decode", type=int, help="how many of them are generated; the rest is a prompt "
                                                           "prefilled through the window (default: 2000)")
    bench.add_argument("--llama-threads", type=int, help="llama.cpp threads, when it is installed (default: 2)")
    bench.add_argument("--skip", action="append", help="leave out a section: matrix, chat, tui, rotating, "
                                                       "roofline, formats, native, kv, server, split, kv_disk, "
                                                       "constrained, speculative, realsize (repeatable)")
    bench.set_defaults(command_runner=run)


def run(args: argparse.Namespace) -> int:
    from .run import run_from_cli

    return run_from_cli(args)
