"""The `mlxchat` command: the TUI by default, `generate` for scripts, `bench` for the side-by-side benchmark."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence


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

    bench = sub.add_parser("bench", help="benchmark against mlx-lm (and llama.cpp when installed)")
    bench.add_argument("--quick", action="store_true", help="a subset that runs in under two minutes")
    bench.add_argument("--model", help="GGUF file (default: the embedded model)")
    bench.add_argument("--out", default="bench/results", help="folder for the JSON and PNG (default: bench/results)")
    bench.add_argument("--repeats", type=int, help="repeats per case; each figure is their median (default: 3)")
    bench.add_argument("--max-tokens", type=int, help="generated tokens per run (default: 128; --quick 32)")
    bench.add_argument("--lengths", help="prompt lengths, comma-separated (default: 32,512,2048; --quick 32,512)")
    bench.add_argument("--rotating-context", type=int, help="tokens of context in the rotating-cache run "
                                                            "(default: 20000; --quick 2600)")
    bench.add_argument("--rotating-decode", type=int, help="how many of them are generated; the rest is a prompt "
                                                           "prefilled through the window (default: 2000)")
    bench.add_argument("--llama-threads", type=int, help="llama.cpp threads, when it is installed (default: 2)")
    bench.add_argument("--skip", action="append", help="leave out a section: matrix, chat, tui, rotating, "
                                                       "roofline, formats (repeatable)")
    from mlxchat.lab.cli import add_arguments as add_lab_arguments

    add_lab_arguments(sub.add_parser("lab", help="tune sampling on fixed prompt sets: runs, metrics, comparisons"))
    return p


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

    store = ProfileStore()
    if args.profile is None:
        base = SamplingProfile()
    elif args.profile in SamplingProfile.presets():
        base = SamplingProfile.preset(args.profile)
    elif args.profile in store.list():
        # A saved profile that is corrupt is an error here (the file is named and left as it is): a script that
        # asked for a profile by name must not silently get other settings.
        base = store.load(args.profile)
    else:
        raise ValueError(f"unknown profile {args.profile!r}; presets: {', '.join(SamplingProfile.presets())}; "
                         f"saved profiles (in {store.folder}): {', '.join(store.list()) or 'none'}")
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
        if args.command == "lab":
            from mlxchat.lab.cli import run as run_lab

            return run_lab(args)
        if args.command == "bench":
            from mlxchat.bench.run import run_from_cli

            return run_from_cli(args)
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
