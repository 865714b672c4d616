"""The `mlxchat` command: the TUI by default, `generate` for scripts, and the subcommands that tools register.

Tools above the app (``mlxchat bench`` today; ``serve`` and ``lab`` later) add their subcommands through the
entry-point group ``mlxchat.commands``, so the app never imports them (the dependency runs tool -> app -> core).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points

COMMANDS_GROUP = "mlxchat.commands"


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line like every other error (and exit code 2, as argparse's)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"mlxchat: error: {message} (see `{self.prog} --help`)\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="mlxchat", description="Chat with a local LLM on MLX.")
    sub = p.add_subparsers(dest="command")

    chat = sub.add_parser("chat", help="open the full-screen chat (the default)")
    chat.add_argument("--model", help="GGUF file, MLX/HF folder or HF repo id (default: the embedded SmolLM2-135M)")
    chat.add_argument("--max-tokens", type=int, help="cap each reply at N tokens")

    gen = sub.add_parser("generate", help="answer one prompt, streaming to stdout")
    gen.add_argument("prompt", help="the prompt, or - to read it from stdin")
    gen.add_argument("--model", help="GGUF file, MLX/HF folder or HF repo id (default: the embedded SmolLM2-135M)")
    gen.add_argument("--max-tokens", type=int, help="stop after N tokens (default: end of turn or context)")
    gen.add_argument("--temperature", type=float, help="0 = greedy (default: the profile's)")
    gen.add_argument("--top-p", type=float)
    gen.add_argument("--top-k", type=int)
    gen.add_argument("--min-p", type=float)
    gen.add_argument("--seed", type=int, help="same seed, same text")
    gen.add_argument("--profile", help="a preset (precise, factual, chat, creative, completion) or a saved profile")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--system", help="system prompt")
    gen.add_argument("--stats", action="store_true", help="print speed and memory to stderr")
    gen.add_argument("--json", action="store_true", help="print one JSON object (text, finish_reason, metrics)")

    _tool_commands(sub)
    return p


def _tool_commands(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Let each tool add its subcommand. An entry point in ``mlxchat.commands`` names a function
    ``register(subparsers)`` that adds one parser (``subparsers.add_parser(name, help=...)``, which gets this
    parser's one-line errors) and sets ``run`` as a default: ``run(args) -> int`` runs the command. ``register``
    must stay cheap (no MLX, no plotting): it runs for every ``mlxchat`` invocation; ``run`` imports the tool."""
    seen: set[str] = set()
    for ep in sorted(entry_points(group=COMMANDS_GROUP), key=lambda e: (e.name, e.value)):
        if ep.name in seen:  # the same tool found twice on the path (e.g. an editable and a regular install)
            continue
        seen.add(ep.name)
        try:
            ep.load()(sub)
        except Exception as e:  # noqa: BLE001 - a broken tool must not take `mlxchat generate` down with it
            broken = sub.add_parser(ep.name, help=f"unavailable: {type(e).__name__}: {e}")
            broken.set_defaults(run=lambda _args, ep=ep, e=e: _unavailable(ep, e))


def _unavailable(ep: object, error: Exception) -> int:
    print(f"mlxchat: error: the {getattr(ep, 'name', '?')} command could not be loaded from "
          f"{getattr(ep, 'value', '?')} ({type(error).__name__}: {error}); reinstall mlxchat", file=sys.stderr)
    return 2


def _read_prompt(arg: str) -> str:
    if arg != "-":
        return arg
    raw = sys.stdin.buffer.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"stdin is not valid UTF-8 (byte {raw[e.start]:#04x} at offset {e.start}); "
                         "convert it first, e.g. with iconv -t UTF-8") from None


def _profile(args: argparse.Namespace):  # noqa: ANN202 - SamplingProfile, imported late with MLX
    from mlxchat.core import SamplingProfile
    from mlxchat.core.profile import ProfileStore

    # A saved profile that is corrupt is an error here (the file is named and left as it is): a script that asked
    # for a profile by name must not silently get other settings.
    base = SamplingProfile() if args.profile is None else ProfileStore().resolve(args.profile)
    overrides = {k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p), ("top_k", args.top_k),
                                   ("min_p", args.min_p), ("seed", args.seed)) if v is not None}
    return SamplingProfile.model_validate({**base.model_dump(), **overrides})


def format_stats(m) -> str:  # noqa: ANN001 - core.Metrics
    return (f"prompt {m.prompt_tokens} tok ({m.cached_tokens} cached) · TTFT {m.ttft_s:.2f} s · "
            f"prefill {m.prefill_tokens_per_s:.0f} tok/s · decode {m.decode_tokens_per_s:.1f} tok/s "
            f"(TPOT {m.tpot_s * 1000:.0f} ms) · {m.completion_tokens} tok out · "
            f"peak {m.peak_memory_bytes / 2**20:.0f} MiB")


def _generate(args: argparse.Namespace) -> int:
    from mlxchat.core import Engine
    from mlxchat.core.events import TokenEvent

    prompt = _read_prompt(args.prompt)
    if not prompt.strip():  # checked again by the engine; here it saves loading the model for nothing
        raise ValueError("the prompt is empty: type a message first")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {args.max_tokens}")
    profile = _profile(args)
    engine = Engine.load(args.model)
    stream = engine.stream(prompt, profile=profile, max_tokens=args.max_tokens, stop=args.stop, system=args.system)
    try:
        for event in stream:
            if isinstance(event, TokenEvent) and not args.json:
                sys.stdout.write(event.text)
                sys.stdout.flush()
    except KeyboardInterrupt:
        stream.cancel()
        print(file=sys.stderr)
        return 130
    result = stream.result
    if args.json:
        json.dump({"text": result.text, "finish_reason": result.finish_reason, "model": engine.name,
                   "sampler": result.sampler, "seed": result.seed, "metrics": result.metrics.as_dict()},
                  sys.stdout, ensure_ascii=False)
    sys.stdout.write("\n")
    if args.stats:
        print(format_stats(result.metrics), file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
        if (run := getattr(args, "run", None)) is not None:  # a tool's subcommand (see _tool_commands)
            return run(args)
        from mlxchat.app.app import run_tui

        run_tui(getattr(args, "model", None), max_tokens=getattr(args, "max_tokens", None))
        return 0
    except Exception as e:  # noqa: BLE001 - bad input gets one line, never a traceback
        from pydantic import ValidationError

        from mlxchat.core.errors import MlxChatError

        if isinstance(e, ValidationError):
            msg = "; ".join(err["msg"].removeprefix("Value error, ") for err in e.errors())
        elif isinstance(e, (MlxChatError, ValueError, OSError)):
            msg = str(e)
        else:
            raise
        print(f"mlxchat: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
