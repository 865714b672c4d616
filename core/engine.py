"""The engine: a loaded model on its inference thread (the chat sessions that feed it: core/chat/chat_session.py).

MLX streams are per thread, so loading, prefill and decode all run on one thread (core/decode/worker.py: `Job`,
`InferenceThread`, `Stream`); callers (a script, the CLI, the TUI) talk to it through queues. Each request gets its
own event queue and a cancel flag checked between prefill chunks and between decode steps. What a request's tokens
become (text, stops, metrics, the result) is core/decode/reply.py's `Reply`, shared with the batched server.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx

from .cache.kv_cache import ConversationCache
from .cache.kv_store import DEFAULT_BUDGET_MB, KVStore
from .cache.prefix import PrefixIndex
from .chat.chat_session import ChatSession
from .chat.messages import ContextPolicy, Forced, Prompt, prompt_messages
from .chat.tool_loop import TOOL_CHOICES, Approve, Toolbox
from .decode.beam import Beam, beam_search
from .decode.events import GenerationResult, PrefillProgress
from .decode.generate import Row, StepLoop, prefill_all_but_last
from .decode.reasoning import Reasoning
from .decode.reply import DEFAULT_MAX_TOKENS, Reply, Request
from .decode.speculative import DraftModel, Speculation, check, load_draft, plan
from .decode.tools import Tool, ToolUse, render_messages
from .decode.worker import InferenceThread, Job, Stream
from .errors import ContextLengthError
from .model import loader, native_decoder
from .model.backend import (Backend, KVOptions, clear_cache_after_prefill, kv_options, memory_warning,
                            wants_generation_stream, wants_wired_limit)
from .sampling.profile import SamplingProfile

# Re-exported: scripts, the server's schedulers and tests import these from here.
__all__ = ["DEFAULT_MAX_TOKENS", "DEFAULT_PREFILL_STEP", "ChatSession", "Engine", "Forced", "InferenceThread", "Job",
           "Request", "Stream"]

log = logging.getLogger(__name__)

DEFAULT_PREFILL_STEP = 512


def mark_used(source: str | Path) -> None:
    """Set the access time of a model's file (a folder's files) to now, keeping their modification time: `mlxchat
    models` and F3 show it as "last used", and reads alone do not keep it (relatime updates it at most once a day,
    noatime never)."""
    path = Path(source)
    now = time.time()
    for file in [path] if path.is_file() else [p for p in path.glob("*") if p.is_file()]:
        try:
            os.utime(file, (now, file.stat().st_mtime))  # follows a Hugging Face snapshot's links to its blobs
        except OSError:  # a read-only install: it is still loaded, only not marked
            pass


class Engine:
    """A loaded model and its inference thread. See docs/architecture.md §7 for the surface scripts rely on."""

    def __init__(self, model: loader.LoadedModel, worker: InferenceThread, prefill_step: int, *,
                 kv_cache_dir: str | Path | None = None, kv_cache_mb: float = DEFAULT_BUDGET_MB,
                 prefix_cache_mb: float = 0) -> None:
        self.model = model
        self._worker = worker
        self.prefill_step = prefill_step
        self.backend = Backend.current()
        self._generation_stream: mx.Stream | None = None  # made on the inference thread, on a GPU only
        if kv_cache_mb < 0:
            raise ValueError(f"kv_cache_mb must be at least 0, got {kv_cache_mb:g}")
        # KV caches saved to disk (core/cache/kv_store.py), one store per KV setting, made when first used.
        self.kv_cache_dir = Path(kv_cache_dir).expanduser() if kv_cache_dir is not None else None
        self.kv_cache_mb = kv_cache_mb
        self._kv_stores: dict[KVOptions, KVStore] = {}
        # The prefix index every request asks (core/cache/prefix.py), one per KV setting, over the disk store; the
        # solo path keeps its prompts' caches in its memory when `prefix_cache_mb` gives it room (0: disk only).
        if prefix_cache_mb < 0:
            raise ValueError(f"prefix_cache_mb must be at least 0, got {prefix_cache_mb:g}")
        self.prefix_cache_mb = prefix_cache_mb
        self._prefix_indexes: dict[KVOptions, PrefixIndex] = {}
        self.draft: DraftModel | None = None  # the draft model of speculative="draft" (core/decode/speculative.py)

    @classmethod
    def load(cls, model: str | Path | None = None, *, weights: loader.WeightPolicy | None = None,
             prefill_step: int = DEFAULT_PREFILL_STEP, kv_cache_dir: str | Path | None = None,
             kv_cache_mb: float = DEFAULT_BUDGET_MB, draft_model: str | Path | None = None,
             prefix_cache_mb: float = 0) -> "Engine":
        """Load a model. With `kv_cache_dir`, chat sessions save their KV cache there after each reply (kept under
        `kv_cache_mb` in all), and a prompt that starts with a saved conversation loads it instead of prefilling
        it (core/cache/kv_store.py). `prefix_cache_mb` keeps one-off prompts' caches (`generate`, `stream`) in
        memory, least recently used dropped first, so a prompt that starts like an earlier one prefills only the rest
        (core/cache/prefix.py; 0, the default, keeps none). `draft_model` is the draft of speculative="draft"
        (core/decode/speculative.py `load_draft`)."""
        if prefill_step < 1:
            raise ValueError(f"prefill_step must be at least 1, got {prefill_step}")
        if kv_cache_mb < 0:  # checked again by the constructor; here before a model loads for nothing
            raise ValueError(f"kv_cache_mb must be at least 0, got {kv_cache_mb:g}")
        worker = InferenceThread()
        try:
            loaded = worker.run(lambda: loader.load(model, weights))
            draft = worker.run(lambda: load_draft(draft_model, loaded, weights)) if draft_model is not None else None
        except BaseException:
            worker.stop()
            raise
        engine = cls(loaded, worker, prefill_step, kv_cache_dir=kv_cache_dir, kv_cache_mb=kv_cache_mb,
                     prefix_cache_mb=prefix_cache_mb)
        engine.draft = draft
        mark_used(loaded.source)
        if warning := memory_warning(engine.backend, loaded.weight_bytes):
            log.warning("%s", warning)
        return engine

    # --- the surface ---------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.model.name

    @property
    def context_length(self) -> int:
        return self.model.context_length

    @property
    def usable(self) -> bool:
        """Whether requests can run; a split model whose peer failed (core/distributed) cannot."""
        return True

    def model_kind(self) -> str:
        """The model's architecture and its file's quantization kind, e.g. "llama Q4_K_M" (the mix is in
        `describe`); "" when nothing is known of them."""
        return " ".join(x for x in (self.model.architecture, self.model.quantization_kind) if x)

    def parameter_count(self) -> int:
        """The model's weights as numbers, counted as the unquantized model would hold them (a quantized matrix's
        packed codes count as its rows x columns; its scales and biases not at all), a tied head once."""
        total = 0
        for _, module in self.model.model.named_modules():
            bits = getattr(module, "bits", None)  # MLX's quantized layers and the native kernel's (same shapes)
            for key, value in module.items():
                if not isinstance(value, mx.array) or (bits and key in ("scales", "biases")):
                    continue
                total += value.size * 32 // bits if bits and key == "weight" else value.size
        return total

    def decode_path(self) -> str:
        """The weights and the decode path that run, e.g. "native q4/q8 (avx2, 2 threads) · decode: 30/30 layers
        fused": for the TUI's state line, and the end of `describe`."""
        fused = native_decoder.describe(self.model.model)
        return self.model.weights_path + (f" · {fused}" if fused else "")

    def describe(self) -> str:
        """Where this engine computes, the model's architecture and quantization, and the weights' path: one line
        for --stats, the TUI and the bench."""
        model = " ".join(x for x in (self.model.architecture, self.model.quantization) if x)
        return f"{self.backend.line()} · {model + ' · ' if model else ''}weights {self.decode_path()}"

    def stream(self, prompt: Prompt, *, profile: SamplingProfile | None = None, max_tokens: int | None = None,
               stop: Sequence[str] | None = None, system: str | None = None, trace: int = 0,
               speculative: str | Speculation = "off", tools: Sequence[Tool | dict[str, Any]] | None = None,
               tool_choice: str | dict[str, Any] | None = None,
               parallel_tool_calls: bool | None = None, reasoning_budget: int | None = None,
               enable_thinking: bool | None = None) -> Stream:
        """Generate a reply as events. `trace=K` (1-100) attaches to each TokenEvent the `TokenTrace` of its token
        (the K candidates through every stage of the sampler chain) and keeps them on the result's `traces`.
        `speculative` ("off", "ngram", "draft", "auto"): same text, guessed and verified (core/decode/speculative.py).
        `tools` (OpenAI's function specs, or `Tool`s), `tool_choice` ("auto", the default with tools, "required",
        "none", or ``{"type": "function", "function": {"name": ...}}``) and `parallel_tool_calls` work as the
        server's (core/decode/tools.py): calls arrive as `TokenEvent.tool_calls` and the result's `tool_calls`, never in
        its text; a bad spec raises `ToolError` naming the field. A thinking model's reasoning comes apart
        (`TokenEvent.reasoning`, `GenerationResult.reasoning`; `text` is the answer), at most `reasoning_budget`
        tokens of it; `enable_thinking` is given to a template with a thinking switch (core/decode/reasoning.py)."""
        messages = prompt_messages(prompt, system)
        use = ToolUse.make(list(tools), tool_choice, parallel_tool_calls) if tools is not None else None
        reasoning = Reasoning.make(enable_thinking, reasoning_budget)
        request = self.request(profile, max_tokens, stop, trace, speculative, tools=use, reasoning=reasoning)
        tok = self.model.tokenizer
        rendered, shown = render_messages(messages, use.shown if use else [], tok.knows_tools)

        def run(job: Job) -> None:
            cache = ConversationCache(self.model.model)
            # Kept in the prefix index's memory (when it has room) before the Done goes out.
            self.run_request(job, cache,
                             tok.encode_chat(rendered, tools=shown, template_kwargs=reasoning.template_kwargs()),
                             request, before_done=lambda _: self.prefix_index().insert(cache.tokens, cache.layers))

        return self.submit(run)

    def generate(self, prompt: Prompt, *, profile: SamplingProfile | None = None, max_tokens: int | None = None,
                 stop: Sequence[str] | None = None, system: str | None = None,
                 progress: Callable[[int, int], None] | None = None, trace: int = 0,
                 speculative: str | Speculation = "off", tools: Sequence[Tool | dict[str, Any]] | None = None,
                 tool_choice: str | dict[str, Any] | None = None,
                 parallel_tool_calls: bool | None = None, reasoning_budget: int | None = None,
                 enable_thinking: bool | None = None) -> GenerationResult:
        return self.stream(prompt, profile=profile, max_tokens=max_tokens, stop=stop, system=system,
                           trace=trace, speculative=speculative, tools=tools, tool_choice=tool_choice,
                           parallel_tool_calls=parallel_tool_calls, reasoning_budget=reasoning_budget,
                           enable_thinking=enable_thinking).wait(progress)

    def beam_search(self, prompt: Prompt, *, profile: SamplingProfile | None = None, max_tokens: int | None = None,
                    stop: Sequence[str] | None = None, system: str | None = None,
                    cancelled: Callable[[], bool] = lambda: False) -> list[Beam]:
        """The profile's `beam_size` best continuations (n best, best score first); see core/decode/beam.py. Each beam
        is a reply of the request (`max_tokens`, by default the profile's or 64; stop strings; the profile's penalties
        and bias); `cancelled()` ends the search at the next step."""
        profile = profile or SamplingProfile(beam_size=4)
        ids = self.model.tokenizer.encode_chat(prompt_messages(prompt, system))
        self.check_fits(len(ids))
        request = self.request(profile.model_copy(update={"beam_size": 1}), max_tokens or profile.max_tokens or 64,
                               stop)
        accepted = time.perf_counter()
        return self.run(lambda: beam_search(self.model, request, ids, beam_size=profile.beam_size,
                                            length_penalty=profile.length_penalty, prefill_step=self.prefill_step,
                                            cancelled=cancelled, accepted=accepted))

    def chat(self, *, system: str | None = None, profile: SamplingProfile | None = None,
             max_kv_size: int | None = None, keep: int = 4,
             context_policy: "ContextPolicy" = "truncate", kv_bits: int | None = None,
             kv_group_size: int = 64, speculative: str | Speculation = "off",
             reasoning_budget: int | None = None, enable_thinking: bool | None = None,
             tools: Sequence[Any] | Toolbox | None = None, tool_choice: str = "auto",
             approve: Approve | None = None, max_tool_steps: int = 8) -> "ChatSession":
        """A conversation. `kv_bits` (2-8) stores its keys and values quantized (mlx-lm's QuantizedKVCache: less
        memory for long contexts, small numeric drift); it cannot be combined with a rotating window.
        `reasoning_budget` and `enable_thinking` work as `stream`'s, for every turn (the session's `reasoning`).

        `tools`: MCP servers (`core.chat.mcp.MCPServer`) and plain Python functions the model may call (or a
        `Toolbox`): each `send` then runs the tool loop (core/chat/tool_loop.py) — calls asked of `approve(call,
        source)` ("once", "always", "deny"; None allows every call), run, their results fed back, at most
        `max_tool_steps` rounds; `tool_choice` ("auto", "required", "none") is each turn's first reply's."""
        if tool_choice not in TOOL_CHOICES:
            raise ValueError(f"tool_choice must be one of {', '.join(TOOL_CHOICES)}, got {tool_choice!r}")
        toolbox = tools if isinstance(tools, Toolbox) or tools is None else Toolbox(list(tools))
        return ChatSession(self, system=system, profile=profile, max_kv_size=max_kv_size, keep=keep,
                           context_policy=context_policy,
                           kv=kv_options(kv_bits, kv_group_size,
                                         rotating=max_kv_size is not None or context_policy == "rotate"),
                           speculative=speculative, reasoning=Reasoning.make(enable_thinking, reasoning_budget),
                           toolbox=toolbox, tool_choice=tool_choice, approve=approve, max_tool_steps=max_tool_steps)

    def count_tokens(self, prompt: Prompt, system: str | None = None) -> int:
        return len(self.model.tokenizer.encode_chat(prompt_messages(prompt, system)))

    def run(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the inference thread (where MLX work on this engine's model must run), after the work queued
        before it, and return its value or raise its exception here."""
        return self._worker.run(fn)

    def submit(self, fn: Callable[[Job], Any]) -> Stream:
        """Queue `fn(job)` on the inference thread and return the Stream of the events it emits with `job.emit`.
        `fn` should check `job.cancelled` between steps and end by emitting a `Done`."""
        return Stream(self._worker.submit(fn))

    def close(self) -> None:
        self._worker.stop()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def with_prefill_step(self, prefill_step: int) -> "Engine":
        """The same model on the same inference thread, prefilling in chunks of at most `prefill_step` ids."""
        if prefill_step < 1:
            raise ValueError(f"prefill_step must be at least 1, got {prefill_step}")
        engine = Engine(self.model, self._worker, prefill_step, kv_cache_dir=self.kv_cache_dir,
                        kv_cache_mb=self.kv_cache_mb, prefix_cache_mb=self.prefix_cache_mb)
        engine.draft = self.draft
        return engine

    def with_model(self, model: loader.LoadedModel) -> "Engine":
        """Another loaded model served by this engine's inference thread (closing either engine stops it)."""
        return Engine(model, self._worker, self.prefill_step, kv_cache_dir=self.kv_cache_dir,
                      kv_cache_mb=self.kv_cache_mb, prefix_cache_mb=self.prefix_cache_mb)

    def with_kv_cache(self, folder: str | Path | None, mb: float = DEFAULT_BUDGET_MB) -> "Engine":
        """The same model on the same inference thread, saving chat sessions' KV caches in `folder` (None: not at
        all); an engine loaded elsewhere (e.g. handed to the TUI) gets the app's disk cache this way."""
        return Engine(self.model, self._worker, self.prefill_step, kv_cache_dir=folder, kv_cache_mb=mb,
                      prefix_cache_mb=self.prefix_cache_mb)

    def with_prefix_cache(self, mb: float) -> "Engine":
        """The same model on the same inference thread, keeping one-off prompts' caches in `mb` of memory (0: none;
        `Engine.load`'s `prefix_cache_mb`)."""
        engine = Engine(self.model, self._worker, self.prefill_step, kv_cache_dir=self.kv_cache_dir,
                        kv_cache_mb=self.kv_cache_mb, prefix_cache_mb=mb)
        engine.draft = self.draft
        return engine

    def flush_kv_cache(self, timeout: float = 60.0) -> None:
        """Wait until the KV caches of the replies finished so far are written to disk (a process about to end, the
        bench): their copies are queued on the inference thread after each reply, then written in the background."""
        self.run(lambda: None)
        for store in list(self._kv_stores.values()):
            store.flush(timeout)

    def kv_store(self, kv: KVOptions = KVOptions()) -> KVStore | None:
        """The disk store of this model's KV caches with these options (None without a `kv_cache_dir`, or with a
        budget of 0 MB)."""
        if self.kv_cache_dir is None or self.kv_cache_mb == 0:
            return None
        if kv not in self._kv_stores:
            self._kv_stores[kv] = KVStore(self.kv_cache_dir, self.model, kv, int(self.kv_cache_mb * 2**20))
        return self._kv_stores[kv]

    def prefix_index(self, kv: KVOptions = KVOptions()) -> PrefixIndex:
        """The prefix index requests with these KV options ask (core/cache/prefix.py): `prefix_cache_mb` of memory
        over `kv_store(kv)`."""
        if kv not in self._prefix_indexes:
            self._prefix_indexes[kv] = PrefixIndex(int(self.prefix_cache_mb * 2**20), self.kv_store(kv))
        return self._prefix_indexes[kv]

    # --- requests (run on the inference thread; the text layer is core/decode/reply.py) ------------------------------

    def request(self, profile: SamplingProfile | None = None, max_tokens: int | None = None,
                stop: Sequence[str] | None = None, trace: int = 0, speculative: str | Speculation = "off",
                *, rotating: bool = False, quantized: bool = False, tools: ToolUse | None = None,
                reasoning: Reasoning | None = None) -> Request:
        """Validate a request (`Request.make`: the max_tokens default, stop strings, limits; its speculation)."""
        req = Request.make(profile, max_tokens, stop, trace, speculative, tools, reasoning)
        check(req.speculative, rotating=rotating, quantized=quantized, draft=self.draft is not None)
        return req

    def check_fits(self, prompt_tokens: int, rotating: bool = False) -> None:
        """Raise ContextLengthError if a prompt of this many tokens leaves no room for a reply."""
        if not rotating and prompt_tokens >= self.model.context_length:
            raise ContextLengthError(prompt_tokens, self.model.context_length, self.model.name)

    def run_request(self, job: Job, cache: ConversationCache, prompt: list[int], req: Request,
                    forced: Forced | None = None,
                    before_done: Callable[[GenerationResult], None] | None = None) -> GenerationResult:
        """On the inference thread: answer `prompt` (token ids) into `cache`, emitting PrefillProgress, TokenEvents
        and a final Done on `job`. Tokens come from the step loop (`core.decode.generate.StepLoop`, one row); the text,
        stops, metrics and result from `core.decode.reply.Reply`. `forced` is the start of the reply, already decided (a
        branch): it is fed to the model after the prompt, and the reply continues from it. `before_done(result)`
        runs just before the Done is emitted."""
        m = self.model
        if not prompt:
            raise ValueError("the prompt is empty: type a message first")
        head = forced.ids if forced else ()
        feed = [*prompt, *head]
        self.check_fits(len(feed), cache.rotating)
        reply = Reply(m, req, prompt, job.emit, job.cancelled.is_set, accepted=job.accepted,
                      context=lambda: cache.size, rotating=cache.rotating, kv_window=cache.max_kv_size)
        mx.reset_peak_memory()
        # The longest known prefix: the cache's own, or a longer one from the prefix index (memory, then disk).
        reused, disk = self.prefix_index(cache.kv).reuse(cache, feed)
        reply.begin_prefill(len(feed), reused, disk)
        job.emit(PrefillProgress(reused, len(feed)))
        reason = reply.force(head, forced.traces) if forced else None
        if reason is None:
            draft = self.draft
            reply.speculative, drafter = plan(req.speculative, cache.layers,
                                              (lambda: draft.drafter(cache)) if draft is not None else None)
            row = Row(reply, cache.tokens, logprobs=req.profile.logprobs, context=feed, drafter=drafter,
                      spec=req.speculative)
            with self._device_practices():
                if prefill_all_but_last(m.model, cache.layers, feed[reused:], cache.tokens, self.prefill_step,
                                        job.cancelled.is_set,
                                        lambda _: job.emit(PrefillProgress(len(cache.tokens), len(feed)))):
                    reason = StepLoop(m.model).run(row, cache.layers, feed[-1])
                else:
                    reason = "cancelled"
                # Let the step queued past the reply's end finish before the result goes out: memory read after a
                # reply is then the cache's, not a step's still in flight.
                mx.synchronize()
        if clear_cache_after_prefill(len(feed) - reused):
            mx.clear_cache()  # a long prefill leaves large temporary buffers in MLX's cache
        return reply.finish(reason, before_done)

    @contextlib.contextmanager
    def _device_practices(self) -> Iterator[None]:
        """mlx-lm's practices on a GPU, as core/model/backend.py decides them: a generation stream of its own, and the
        wired-memory limit raised to the recommended working set (mlx-lm's own `wired_limit`). Nothing on the CPU."""
        if not wants_generation_stream(self.backend):
            yield
            return
        from mlx_lm.generate import wired_limit

        if self._generation_stream is None:
            self._generation_stream = mx.new_stream(mx.default_device())
        stream = self._generation_stream
        wired = wired_limit(self.model.model, [stream]) if wants_wired_limit(self.backend) else contextlib.nullcontext()
        with wired, mx.stream(stream):
            try:
                yield
            finally:
                mx.synchronize(stream)  # the step queued past the reply's end is done before the next job (or exit)
