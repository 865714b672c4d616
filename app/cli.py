"""The `mlxchat` command: the TUI by default, `generate` for scripts, `pull` / `models` / `rm` for models by name
(in the Hugging Face cache), and the subcommands that tools register.

Tools above the app (``mlxchat bench``, ``serve``, ``lab``) add their subcommands through the entry-point group
``mlxchat.commands``, so the app never imports them (the dependency runs tool -> app -> core).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from typing import Any

from mlxchat.core.distributed.command import (add_split_arguments, add_worker_command, check_split, lost_a_peer,
                                              run_worker, start_split)

from .format_flags import add_format_flags, response_format
from .formatting import fmt_bytes
from .sampler_flags import add_sampler_flags, sampler_flags
from .tool_flags import add_tool_flags, calls_json, close_servers, show_event, start_with_tools, tool_servers

COMMANDS_GROUP = "mlxchat.commands"


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line like every other error (and exit code 2, as argparse's)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"mlxchat: error: {message} (see `{self.prog} --help`)\n")


CONTEXT_POLICIES = ("error", "truncate", "rotate")
# Tokens left for the reply when a prompt is truncated to fit the context and no --max-tokens says how many.
TRUNCATE_REPLY_ROOM = 512


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="mlxchat", description="Chat with a local LLM on MLX.")
    sub = p.add_subparsers(dest="command")

    chat = sub.add_parser("chat", help="open the full-screen chat (the default)")
    _reply_flags(chat, policy_default="config.toml's context_policy, truncate")
    chat.add_argument("--new", action="store_true", help="start with a new chat even if config.toml says "
                                                         "reopen_last = true")
    add_split_arguments(chat)

    gen = sub.add_parser("generate", help="answer one prompt, streaming to stdout")
    gen.add_argument("prompt", help="the prompt, or - to read it from stdin")
    _reply_flags(gen, policy_default="error")
    gen.add_argument("--stats", action="store_true", help="print speed and memory to stderr")
    gen.add_argument("--json", action="store_true", help="print one JSON object (text, reasoning, finish_reason, "
                                                         "metrics)")
    # Thinking models (core/decode/reasoning.py): the reasoning apart from the answer, bounded, or switched off.
    gen.add_argument("--hide-thinking", action="store_true",
                     help="print only the answer of a thinking model, not its reasoning (and no reasoning in --json)")
    add_format_flags(gen)
    add_tool_flags(gen)
    gen.add_argument("--draft-model", metavar="SPEC",
                     help="the draft model of --speculative draft: a model with the same vocabulary, or self:N (the "
                          "first N layers of --model)")
    add_split_arguments(gen)
    add_worker_command(sub)

    pull = sub.add_parser("pull", help="download a model from the Hugging Face hub into its cache, by repo id")
    pull.add_argument("repo_id", help="ORG/NAME, e.g. mlx-community/SmolLM2-135M-Instruct")
    sub.add_parser("models", help="list the models mlxchat can load here (the embedded one, local files you added, the "
                                   "Hugging Face cache): architecture, size, last used, loadable, quantization mix")
    rm = sub.add_parser("rm", help="delete a model from the Hugging Face cache")
    rm.add_argument("repo_id", help="ORG/NAME, as `mlxchat models` lists it")
    rm.add_argument("--yes", "-y", action="store_true", help="delete without asking (for scripts)")

    _tool_commands(sub)
    return p


def _reply_flags(p: argparse.ArgumentParser, *, policy_default: str) -> None:
    """The flags `chat` and `generate` share (mlx_lm.chat's and mlx_lm.generate's): the model, the sampler, the
    system prompt and what a conversation longer than the context does. One definition, so they cannot drift."""
    p.add_argument("--model", help="GGUF file, MLX/HF folder or HF repo id (default: the embedded SmolLM2-135M)")
    p.add_argument("--max-tokens", type=int, help="stop a reply after N tokens (default: end of turn or context)")
    add_sampler_flags(p)
    p.add_argument("--seed", type=int, help="same seed, same text")
    p.add_argument("--profile",
                   help="a preset (precise, factual, chat, creative, longform, completion) or a saved profile")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--system", help="system prompt")
    p.add_argument("--context-policy", choices=CONTEXT_POLICIES,
                   help=f"a conversation longer than the context: error (refuse it), truncate (keep the system prompt "
                        f"and the end), rotate (a rotating KV window, see --kv-window); default: {policy_default}")
    p.add_argument("--kv-window", "--max-kv-size", dest="kv_window", type=int,
                   help="tokens kept in a rotating KV cache (implies --context-policy rotate; default with rotate: "
                        "the context)")
    p.add_argument("--kv-cache-dir", help="save conversations' KV caches here and load a saved prefix instead of "
                                          "prefilling it (chat default: config.toml's kv_cache_dir, else the cache "
                                          "folder's kv/)")
    p.add_argument("--kv-cache-mb", type=float, help="the most the KV cache folder may hold, least recently used "
                                                     "files removed first; 0 turns the disk cache off (default 4096)")
    # Thinking models (core/decode/reasoning.py): a budget on the reasoning, or the template's switch.
    p.add_argument("--reasoning-budget", type=int, metavar="N",
                   help="a thinking model reasons for at most N tokens, then answers")
    p.add_argument("--enable-thinking", action=argparse.BooleanOptionalAction, default=None,
                   help="switch a thinking model's reasoning on or off (templates with enable_thinking)")
    p.add_argument("--speculative", choices=("ngram", "draft", "auto", "off"),
                   help="guess tokens and verify them in one pass; the text is the same (ngram: from the prompt and "
                        "the reply so far; draft: a --draft-model; auto: ngram, only while it pays; default: off)")


def _check_reply_flags(args: argparse.Namespace) -> None:
    """What argparse cannot check in `_reply_flags`, before any model loads; --kv-window alone means rotate."""
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {args.max_tokens}")
    if "" in args.stop:
        raise ValueError("--stop needs a non-empty string (an empty one would match everywhere)")
    if args.kv_window is not None:
        if args.context_policy not in (None, "rotate"):
            raise ValueError(f"--kv-window goes with --context-policy rotate, not {args.context_policy}")
        if args.kv_window < 16:
            raise ValueError(f"--kv-window must be at least 16 tokens, got {args.kv_window}")
        args.context_policy = "rotate"
    if args.kv_cache_mb is not None and args.kv_cache_mb < 0:
        raise ValueError(f"--kv-cache-mb must be at least 0 (0 turns the disk cache off), got {args.kv_cache_mb:g}")
    if args.reasoning_budget is not None and args.reasoning_budget < 0:
        raise ValueError(f"--reasoning-budget must be 0 or more tokens, got {args.reasoning_budget}")


def _sampler_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The sampler flags and --seed given, by their profile names: they override the profile's settings."""
    return sampler_flags(args) | ({"seed": args.seed} if args.seed is not None else {})


def _tool_commands(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Let each tool add its subcommand. An entry point in ``mlxchat.commands`` names a function
    ``register(subparsers)`` that adds one parser (``subparsers.add_parser(name, help=...)``, which gets this
    parser's one-line errors) and sets ``command_runner`` as a default: ``command_runner(args) -> int`` runs the
    command (a name no subcommand uses for its own arguments; `lab show RUN` has a `run`). ``register``
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
            broken.set_defaults(command_runner=lambda _args, ep=ep, e=e: _unavailable(ep, e))


def _unavailable(ep: object, error: Exception) -> int:
    print(f"mlxchat: error: the {getattr(ep, 'name', '?')} command could not be loaded from "
          f"{getattr(ep, 'value', '?')} ({type(error).__name__}: {error}); reinstall mlxchat", file=sys.stderr)
    return 2


def _read_prompt(arg: str) -> str:
    if arg != "-":
        # Python decodes argv with surrogateescape: bytes that are not UTF-8 arrive as lone surrogates.
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"the prompt is not valid UTF-8 (byte {ord(arg[e.start]) - 0xDC00:#04x} at offset "
                             f"{e.start}); convert it first, e.g. with iconv -t UTF-8") from None
        return arg
    raw = sys.stdin.buffer.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"stdin is not valid UTF-8 (byte {raw[e.start]:#04x} at offset {e.start}); "
                         "convert it first, e.g. with iconv -t UTF-8") from None


def _profile(args: argparse.Namespace):  # noqa: ANN202 - SamplingProfile, imported late with MLX
    """--profile, else config.toml's default profile (the chat preset unless it names another), with the sampler
    flags over it. Never the raw distribution (temperature 1, no filter): unflagged, that rambled."""
    from mlxchat.core import SamplingProfile
    from mlxchat.core.locations import Locations
    from mlxchat.core.sampling.profile import ProfileStore

    from .config import ConfigError, Settings

    name = args.profile
    if name is None:
        config = Locations.resolve().config_file
        try:
            name = Settings.load(config).profile
        except ConfigError as e:
            name = Settings().profile
            print(f"mlxchat: note: {e}", file=sys.stderr)
    # A saved profile that is corrupt is an error here (the file is named and left as it is): a script that asked
    # for a profile by name must not silently get other settings.
    base = ProfileStore().resolve(name)
    fmt = response_format(args)  # the constrained-decoding flags (app/format_flags.py)
    return SamplingProfile.model_validate({**base.model_dump(), "name": name, **_sampler_flags(args),
                                           **({"response_format": fmt} if fmt else {})})


def format_stats(m) -> str:  # noqa: ANN001 - core.Metrics
    spec = (f" · speculative {m.speculative}: {m.accepted_tokens}/{m.draft_tokens} guesses accepted "
            f"({m.acceptance:.0%}), {m.tokens_per_step:.2f} tok/step" if m.speculative != "off" else "")
    disk = f", {m.disk_tokens} from disk" if m.disk_tokens else ""
    # Over fewer than two tokens there is no time between tokens to report: say so rather than "0.0 tok/s".
    decode = (f"decode {m.decode_tokens_per_s:.1f} tok/s (TPOT {m.tpot_s * 1000:.0f} ms)" if m.completion_tokens > 1
              else "no decode rate (under 2 tokens)")
    return (f"prompt {m.prompt_tokens} tok ({m.cached_tokens} cached{disk}) · TTFT {m.ttft_s:.2f} s · "
            f"prefill {m.prefill_tokens_per_s:.0f} tok/s · {decode} · {m.completion_tokens} tok out · "
            f"peak {m.peak_memory_bytes / 2**20:.0f} MiB{spec}")


class _Interrupts:
    """Ctrl-C during `generate`: the first stops the reply at the next token (its text so far stays printed, exit
    130); before a reply streams (imports, loading) there is nothing to keep, so it leaves at once. A second Ctrl-C
    leaves at once too.

    Leaving at once is `os._exit`, after flushing: a KeyboardInterrupt raised in the main thread while the
    inference thread runs MLX (it cannot be stopped mid-load) lets the interpreter finalize under that thread, which
    aborts the process ("terminate called without an active exception", exit 134) or crashes it (exit 139)."""

    def __init__(self) -> None:
        self.stream: Any = None  # core.Stream, once the reply streams
        self.count = 0

    def __call__(self, signum: int, frame: object) -> None:
        self.count += 1
        if self.stream is None or self.count > 1:
            _leave_now(130)
        self.stream.cancel()


def _leave_now(code: int) -> None:
    for out, end in ((sys.stdout, ""), (sys.stderr, "\n")):
        try:
            out.write(end)
            out.flush()
        except (OSError, RuntimeError, ValueError):  # a closed pipe, or a write this signal interrupted
            pass
    os._exit(code)


def _without_sigint(fn: Callable[[], Any]) -> Any:
    """Run `fn` on a thread that blocks SIGINT, as will every thread it starts (MLX's, OpenBLAS's, the engine's
    inference thread): Ctrl-C then always reaches the main thread, and never interrupts MLX code mid-call (which
    hung or crashed the process). The main thread waits in short joins, so its handler runs promptly."""
    box: dict[str, Any] = {}

    def run() -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised on the main thread
            box["error"] = e

    thread = threading.Thread(target=run, name="mlxchat-load", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.1)
    if "error" in box:
        raise box["error"]
    return box["value"]


def _import_core() -> None:
    """Import the engine (MLX, and the BLAS whose worker threads start on import) with SIGINT blocked on this, the
    main thread, so that those threads block it too; a Ctrl-C meanwhile is handled once the import is done. (Not
    on another thread, like the load: MLX's per-thread state would then end with that thread, which aborts the
    process at exit.)"""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        import mlxchat.core  # noqa: F401
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _load(spec: str | None, args: argparse.Namespace | None = None) -> Any:  # noqa: ANN401 - core.Engine
    """The model on this machine, or split across the hosts file's machines with this process as rank 0."""
    if args is not None and getattr(args, "hosts", None) is not None:
        return start_split(spec, args)
    from mlxchat.core import Engine

    disk = {}  # `generate` uses a KV cache folder only when asked (a one-off prompt saves nothing, it may load)
    if args is not None and getattr(args, "kv_cache_dir", None) and args.kv_cache_mb != 0:
        disk = {"kv_cache_dir": args.kv_cache_dir} | ({"kv_cache_mb": args.kv_cache_mb} if args.kv_cache_mb else {})
    return Engine.load(spec, draft_model=getattr(args, "draft_model", None), **disk)


def _worker(args: argparse.Namespace) -> int:
    _import_core()
    return run_worker(args)


def _chat(args: argparse.Namespace) -> int:
    from mlxchat.app.app import run_tui

    options = chat_options(args)
    if getattr(args, "hosts", None) is None:
        return run_tui(args.model, **options)
    _import_core()
    check_split(args)
    engine = _without_sigint(lambda: _load(args.model, args))
    try:
        code = run_tui(args.model, engine=engine, **options)
    finally:
        engine.close()
    if not engine.usable:
        _leave_now(code)  # its inference thread may be blocked on the lost peer for good: exiting normally would abort
    return code


def chat_options(args: argparse.Namespace) -> dict[str, Any]:
    """`mlxchat chat`'s flags as `make_app`'s arguments: they set up the new chat over config.toml's settings (a
    new chat: with any of them, or --new, the last chat is not reopened). Bad values fail here, in one line."""
    from mlxchat.core import SamplingProfile
    from mlxchat.core.sampling.profile import ProfileStore

    _check_reply_flags(args)
    sampling = _sampler_flags(args) | ({"stop": args.stop} if args.stop else {})
    SamplingProfile.model_validate(sampling)  # each flag's range, before the app opens
    if args.profile is not None:
        ProfileStore().resolve(args.profile)  # an unknown name is an error, as in generate
    if args.speculative == "draft":
        raise ValueError("--speculative draft needs a draft model, which only `mlxchat generate --draft-model` "
                         "loads: use --speculative ngram or auto in the chat")
    settings = {k: v for k, v in (("context_policy", args.context_policy), ("kv_window", args.kv_window),
                                  ("speculative", args.speculative), ("kv_cache_dir", args.kv_cache_dir),
                                  ("kv_cache_mb", args.kv_cache_mb), ("reasoning_budget", args.reasoning_budget),
                                  ("enable_thinking", args.enable_thinking)) if v is not None}
    if args.new or sampling or args.profile or args.system is not None:
        settings["reopen_last"] = False
    return {"max_tokens": args.max_tokens, "profile": args.profile, "system_prompt": args.system,
            "sampling": sampling, "settings": settings}


def _generate(args: argparse.Namespace, interrupts: _Interrupts) -> int:
    prompt = _read_prompt(args.prompt)
    if not prompt.strip():  # checked again by the engine; here it saves loading the model for nothing
        raise ValueError("the prompt is empty: type a message first")
    _check_reply_flags(args)
    args.context_policy = args.context_policy or "error"
    if args.draft_model is not None:
        if getattr(args, "hosts", None) is not None:
            raise ValueError("--draft-model does not work with a model split across machines (--hosts)")
        args.speculative = args.speculative or "draft"
    elif args.speculative == "draft":
        raise ValueError("--speculative draft needs --draft-model SPEC (a model with the same vocabulary, or self:N)")
    servers = tool_servers(args)  # --mcp: checked (a terminal to ask on, or --yes; known names) before loading
    _import_core()
    check_split(args)
    profile = _profile(args)
    engine = _without_sigint(lambda: _load(args.model, args))
    from mlxchat.core.decode.events import TokenEvent

    # A thinking model's reasoning streams first (dim on a terminal), a blank line, then the answer.
    dim = sys.stdout.isatty()
    thinking = answered = False
    try:
        stream = start_with_tools(engine, prompt, profile, args, servers) if servers else \
            _start(engine, prompt, profile, args)
        interrupts.stream = stream
        for event in stream:
            if isinstance(event, TokenEvent) and not args.json:
                if event.reasoning and not args.hide_thinking and not answered:
                    sys.stdout.write(("\x1b[2m" if dim and not thinking else "") + event.reasoning)
                    thinking = True
                if event.text:
                    if thinking and not answered:
                        sys.stdout.write(("\x1b[0m" if dim else "") + "\n\n")
                    answered = True
                    sys.stdout.write(event.text)
                sys.stdout.flush()
            elif servers:
                show_event(event)
    finally:
        close_servers(servers)
    if thinking and not answered and dim:
        sys.stdout.write("\x1b[0m")
    # The reply has ended; wait for the inference thread to finish the job (it frees MLX arrays after its last
    # event), so the interpreter never finalizes while that thread runs MLX code.
    engine.run(lambda: None)
    result = stream.result
    if args.json:
        json.dump({"text": result.text, **({} if args.hide_thinking else {"reasoning": result.reasoning}),
                   "finish_reason": result.finish_reason, "model": engine.name,
                   "profile": profile.name, "sampler": result.sampler, "seed": result.seed,
                   "metrics": result.metrics.as_dict(), **({"tool_calls": calls_json(stream)} if servers else {})},
                  sys.stdout, ensure_ascii=False)
    sys.stdout.write("\n")
    if args.stats:
        print(f"{format_stats(result.metrics)} · profile {profile.name}: {result.sampler} · {engine.describe()}",
              file=sys.stderr)
    return 130 if interrupts.count else 0


def _pull(args: argparse.Namespace) -> int:
    from mlxchat.core.model import hub

    snapshot = hub.pull(args.repo_id)  # huggingface_hub's own progress bars, on stderr
    model = hub.find(args.repo_id)
    size = f" ({fmt_bytes(model.size_bytes)})" if model else ""
    print(f"{args.repo_id}{size} is in {snapshot}")
    if model is not None and not model.loadable:
        print(f"mlxchat: note: {args.repo_id} has no config.json with safetensors weights; mlxchat cannot load it",
              file=sys.stderr)
    return 0


def _models(args: argparse.Namespace) -> int:
    from mlxchat.core.model import hub
    from mlxchat.core.model.loader import inspect
    from mlxchat.core.locations import Locations

    from .models import local_models, saved_models

    saved, problems = saved_models(Locations.resolve())
    for problem in problems:
        print(f"mlxchat: note: {problem}", file=sys.stderr)
    local = local_models(saved)
    rows = [(m.name, m.architecture, fmt_bytes(m.size_bytes), _when(m.last_used), "yes" if m.loadable else "no",
             m.quantization) for m in local]
    cached = hub.cached_models()
    for m in cached:
        facts = inspect(m.snapshot) if m.loadable else None
        rows.append((m.repo_id, facts.architecture if facts else "", fmt_bytes(m.size_bytes), _when(m.last_used),
                     "yes" if m.loadable else "no", facts.quantization if facts else ""))
    rows.insert(0, ("MODEL", "ARCH", "SIZE", "LAST USED", "LOADABLE", "QUANTIZATION"))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        print("  ".join([*(cell.ljust(w) for cell, w in zip(r, widths)), r[5]]).rstrip())
    for m in local:
        if m.problem:
            print(f"mlxchat: note: {m.name} cannot load: {m.problem}", file=sys.stderr)
    if not cached:
        print("no models in the Hugging Face cache; fetch one with `mlxchat pull ORG/NAME`", file=sys.stderr)
    return 0


def _when(seconds: float | None) -> str:
    return "-" if seconds is None else time.strftime("%Y-%m-%d %H:%M", time.localtime(seconds))


def _rm(args: argparse.Namespace) -> int:
    from mlxchat.core.model import hub

    model = hub.find(args.repo_id)
    if model is None:
        raise hub.HubError(f"{args.repo_id} is not in the Hugging Face cache (`mlxchat models` lists what is)")
    if not args.yes:
        if not sys.stdin.isatty():
            raise ValueError(f"rm asks before deleting; pass --yes to delete {args.repo_id} without asking")
        answer = input(f"Delete {args.repo_id} ({fmt_bytes(model.size_bytes)}) from the Hugging Face cache? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("kept", file=sys.stderr)
            return 1
    freed = hub.remove(args.repo_id)
    print(f"deleted {args.repo_id} ({fmt_bytes(freed)} freed)")
    return 0


def _start(engine: Any, prompt: str, profile: Any, args: argparse.Namespace) -> Any:  # noqa: ANN401 - core types
    """Start the reply under the context policy: a prompt that does not fit is refused naming the flags that
    apply here, cut to its end (the system prompt stays), or run through a rotating KV window."""
    limit = engine.context_length
    if args.context_policy == "rotate":
        chat = engine.chat(system=args.system, profile=profile, max_kv_size=args.kv_window or limit,
                           speculative=args.speculative or "off", reasoning_budget=args.reasoning_budget,
                           enable_thinking=args.enable_thinking)
        return chat.send(prompt, max_tokens=args.max_tokens, stop=args.stop)
    size = engine.count_tokens(prompt, args.system)
    if size >= limit:
        if args.context_policy == "error":
            raise ValueError(f"the prompt is {size} tokens but {engine.name} has a context of {limit}: shorten it, "
                             "or pass --context-policy truncate (keep its end) or --context-policy rotate")
        prompt = _keep_end(engine, prompt, args.system, limit - min(args.max_tokens or TRUNCATE_REPLY_ROOM,
                                                                    limit // 2))
        print(f"mlxchat: note: the prompt ({size} tokens) was cut to its last "
              f"{engine.count_tokens(prompt, args.system)} tokens to fit the context of {limit} "
              "(--context-policy truncate)", file=sys.stderr)
    return engine.stream(prompt, profile=profile, max_tokens=args.max_tokens, stop=args.stop, system=args.system,
                         speculative=args.speculative or "off", reasoning_budget=args.reasoning_budget,
                         enable_thinking=args.enable_thinking)


def _keep_end(engine: Any, prompt: str, system: str | None, budget: int) -> str:  # noqa: ANN401 - core.Engine
    """The longest end of `prompt` that, with the system prompt and the chat template, is at most `budget` tokens
    (a binary search over where to cut: token counts grow with the text kept)."""
    lo, hi = 0, len(prompt)  # cutting at hi keeps nothing, which always fits
    while lo < hi:
        mid = (lo + hi) // 2
        kept = prompt[mid:]
        if not kept.strip() or engine.count_tokens(kept, system) <= budget:
            hi = mid
        else:
            lo = mid + 1
    return prompt[lo:].lstrip() or prompt[-1:]


def _with_interrupts(args: argparse.Namespace) -> int:
    if threading.current_thread() is not threading.main_thread():  # signals reach only the main thread
        return _generate(args, _Interrupts())
    interrupts = _Interrupts()
    previous = signal.signal(signal.SIGINT, interrupts)
    try:
        return _generate(args, interrupts)
    finally:
        signal.signal(signal.SIGINT, previous)


def main(argv: Sequence[str] | None = None) -> int:
    if threading.current_thread() is not threading.main_thread():  # signals reach only the main thread
        return _main(argv)
    # Until a command handles SIGINT its own way (generate stops the reply, the TUI quits as ctrl+q does, serve
    # shuts down), a SIGINT while Python imports MLX, Textual or a tool, or while a model loads, leaves at once with
    # 130: there is nothing to keep yet, and a KeyboardInterrupt there printed a traceback or aborted the process.
    previous = signal.signal(signal.SIGINT, lambda signum, frame: _leave_now(130))
    try:
        return _main(argv)
    finally:
        signal.signal(signal.SIGINT, previous)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line; without a subcommand it is the chat's: `mlxchat --model X` opens the chat on X, as
    `mlxchat` alone opens it on the embedded model (`--help` is still the whole command's)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv.insert(0, "chat")
    return build_parser().parse_args(argv)


def _main(argv: Sequence[str] | None) -> int:
    args = parse_args(argv)
    try:
        if args.command == "generate":
            return _with_interrupts(args)
        if args.command in ("pull", "models", "rm", "worker"):
            return {"pull": _pull, "models": _models, "rm": _rm, "worker": _worker}[args.command](args)
        if (run := getattr(args, "command_runner", None)) is not None:  # a tool's subcommand (_tool_commands)
            return run(args)
        return _chat(args)
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
        if lost_a_peer(e):
            _leave_now(2)  # the inference thread may be blocked on the lost peer for good: exiting normally aborts
        return 2


if __name__ == "__main__":
    sys.exit(main())
