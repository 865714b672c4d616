"""The engine: a loaded model on its inference thread, and the chat sessions that feed it.

MLX streams are per thread, so loading, prefill and decode all run on one thread (core/worker.py: `Job`,
`InferenceThread`, `Stream`); callers (a script, the CLI, the TUI) talk to it through queues. Each request gets its
own event queue and a cancel flag checked between prefill chunks and between decode steps. What a request's tokens
become (text, stops, metrics, the result) is core/reply.py's `Reply`, shared with the batched server.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

import mlx.core as mx

from . import loader, native_decoder
from .backend import (Backend, KVOptions, clear_cache_after_prefill, kv_options, memory_warning,
                      wants_generation_stream, wants_wired_limit)
from .beam import Beam, beam_search
from .cache import ConversationCache
from .errors import ContextLengthError
from .events import GenerationResult, PrefillProgress
from .kv_store import DEFAULT_BUDGET_MB, KVStore
from .messages import ChatMessage, ContextPolicy, Fork, ReplyTree
from .profile import SamplingProfile
from .reply import DEFAULT_MAX_TOKENS, Reply, Request
from .speculative import DraftModel, Speculation, check, decode, load_draft, plan
from .trace import TokenTrace
from .worker import InferenceThread, Job, Stream

# Re-exported: scripts, the server's schedulers and tests import these from here.
__all__ = ["DEFAULT_MAX_TOKENS", "DEFAULT_PREFILL_STEP", "ChatSession", "Engine", "Forced", "InferenceThread", "Job",
           "Request", "Stream"]

log = logging.getLogger(__name__)

Prompt = str | Sequence[dict[str, str] | ChatMessage]
CONTEXT_POLICIES: tuple[str, ...] = get_args(ContextPolicy)
DEFAULT_PREFILL_STEP = 512


def _messages(prompt: Prompt, system: str | None) -> list[dict[str, str]]:
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [
        m.as_prompt() if isinstance(m, ChatMessage) else dict(m) for m in prompt]
    for m in messages:
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError("each message needs a string 'role' and a string 'content'")
    if not messages or not any(m["content"].strip() for m in messages if m["role"] != "system"):
        raise ValueError("the prompt is empty: type a message first")
    if system is not None and not (messages and messages[0]["role"] == "system"):
        messages.insert(0, {"role": "system", "content": system})
    return messages


@dataclass(frozen=True)
class Forced:
    """The start of a reply already decided (`ChatSession.branch`): its token ids, and their traces (aligned with
    the ids, or empty)."""

    ids: tuple[int, ...]
    traces: tuple[TokenTrace, ...] = ()


class Engine:
    """A loaded model and its inference thread. See docs/architecture.md §7 for the surface scripts rely on."""

    def __init__(self, model: loader.LoadedModel, worker: InferenceThread, prefill_step: int, *,
                 kv_cache_dir: str | Path | None = None, kv_cache_mb: float = DEFAULT_BUDGET_MB) -> None:
        self.model = model
        self._worker = worker
        self.prefill_step = prefill_step
        self.backend = Backend.current()
        self._generation_stream: mx.Stream | None = None  # made on the inference thread, on a GPU only
        if kv_cache_mb < 0:
            raise ValueError(f"kv_cache_mb must be at least 0, got {kv_cache_mb:g}")
        # KV caches saved to disk (core/kv_store.py), one store per KV setting, made when first used.
        self.kv_cache_dir = Path(kv_cache_dir).expanduser() if kv_cache_dir is not None else None
        self.kv_cache_mb = kv_cache_mb
        self._kv_stores: dict[KVOptions, KVStore] = {}
        self.draft: DraftModel | None = None  # the draft model of speculative="draft" (core/speculative.py)

    @classmethod
    def load(cls, model: str | Path | None = None, *, weights: loader.WeightPolicy | None = None,
             prefill_step: int = DEFAULT_PREFILL_STEP, kv_cache_dir: str | Path | None = None,
             kv_cache_mb: float = DEFAULT_BUDGET_MB, draft_model: str | Path | None = None) -> "Engine":
        """Load a model. With `kv_cache_dir`, chat sessions save their KV cache there after each reply (kept under
        `kv_cache_mb` in all), and a prompt that starts with a saved conversation loads it instead of prefilling
        it (core/kv_store.py). `draft_model` is the draft of speculative="draft" (core/speculative.py
        `load_draft`)."""
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
        engine = cls(loaded, worker, prefill_step, kv_cache_dir=kv_cache_dir, kv_cache_mb=kv_cache_mb)
        engine.draft = draft
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

    def describe(self) -> str:
        """Where this engine computes and with which weights: one line for --stats, the TUI and the bench."""
        fused = native_decoder.describe(self.model.model)
        return f"{self.backend.line()} · weights {self.model.weights_path}" + (f" · {fused}" if fused else "")

    def stream(self, prompt: Prompt, *, profile: SamplingProfile | None = None, max_tokens: int | None = None,
               stop: Sequence[str] | None = None, system: str | None = None, trace: int = 0,
               speculative: str | Speculation = "off") -> Stream:
        """Generate a reply as events. `trace=K` (1-100) attaches to each TokenEvent the `TokenTrace` of its token
        (the K candidates through every stage of the sampler chain) and keeps them on the result's `traces`.
        `speculative` ("off", "ngram", "draft", "auto"): same text, guessed and verified (core/speculative.py)."""
        messages = _messages(prompt, system)
        request = self.request(profile, max_tokens, stop, trace, speculative)

        def run(job: Job) -> None:
            self.run_request(job, ConversationCache(self.model.model), self.model.tokenizer.encode_chat(messages),
                             request)

        return self.submit(run)

    def generate(self, prompt: Prompt, *, profile: SamplingProfile | None = None, max_tokens: int | None = None,
                 stop: Sequence[str] | None = None, system: str | None = None,
                 progress: Callable[[int, int], None] | None = None, trace: int = 0,
                 speculative: str | Speculation = "off") -> GenerationResult:
        return self.stream(prompt, profile=profile, max_tokens=max_tokens, stop=stop, system=system,
                           trace=trace, speculative=speculative).wait(progress)

    def beam_search(self, prompt: Prompt, *, profile: SamplingProfile | None = None, max_tokens: int | None = None,
                    system: str | None = None) -> list[Beam]:
        """The profile's `beam_size` best continuations (n best, best score first); see core/beam.py."""
        profile = profile or SamplingProfile(beam_size=4)
        ids = self.model.tokenizer.encode_chat(_messages(prompt, system))
        return self.run(lambda: beam_search(
            self.model.model, self.model.tokenizer, ids, beam_size=profile.beam_size,
            length_penalty=profile.length_penalty, max_tokens=max_tokens or profile.max_tokens or 64,
            prefill_step=self.prefill_step))

    def chat(self, *, system: str | None = None, profile: SamplingProfile | None = None,
             max_kv_size: int | None = None, keep: int = 4,
             context_policy: "ContextPolicy" = "truncate", kv_bits: int | None = None,
             kv_group_size: int = 64, speculative: str | Speculation = "off") -> "ChatSession":
        """A conversation. `kv_bits` (2-8) stores its keys and values quantized (mlx-lm's QuantizedKVCache: less
        memory for long contexts, small numeric drift); it cannot be combined with a rotating window."""
        return ChatSession(self, system=system, profile=profile, max_kv_size=max_kv_size, keep=keep,
                           context_policy=context_policy,
                           kv=kv_options(kv_bits, kv_group_size,
                                         rotating=max_kv_size is not None or context_policy == "rotate"),
                           speculative=speculative)

    def count_tokens(self, prompt: Prompt, system: str | None = None) -> int:
        return len(self.model.tokenizer.encode_chat(_messages(prompt, system)))

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
                        kv_cache_mb=self.kv_cache_mb)
        engine.draft = self.draft
        return engine

    def with_model(self, model: loader.LoadedModel) -> "Engine":
        """Another loaded model served by this engine's inference thread (closing either engine stops it)."""
        return Engine(model, self._worker, self.prefill_step, kv_cache_dir=self.kv_cache_dir,
                      kv_cache_mb=self.kv_cache_mb)

    def with_kv_cache(self, folder: str | Path | None, mb: float = DEFAULT_BUDGET_MB) -> "Engine":
        """The same model on the same inference thread, saving chat sessions' KV caches in `folder` (None: not at
        all); an engine loaded elsewhere (e.g. handed to the TUI) gets the app's disk cache this way."""
        return Engine(self.model, self._worker, self.prefill_step, kv_cache_dir=folder, kv_cache_mb=mb)

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

    # --- requests (run on the inference thread; the text layer is core/reply.py) ------------------------------

    def request(self, profile: SamplingProfile | None = None, max_tokens: int | None = None,
                stop: Sequence[str] | None = None, trace: int = 0, speculative: str | Speculation = "off",
                *, rotating: bool = False, quantized: bool = False) -> Request:
        """Validate a request (`Request.make`: the max_tokens default, stop strings, limits; its speculation)."""
        req = Request.make(profile, max_tokens, stop, trace, speculative)
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
        and a final Done on `job`. Tokens come from `core.generate.generate_step` (or `core.speculative`); the text,
        stops, metrics and result from `core.reply.Reply`. `forced` is the start of the reply, already decided (a
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
        if not cache.rotating and (store := self.kv_store(cache.kv)) is not None:
            store.warm(cache, feed)  # a longer prefix saved on disk than the cache holds is loaded
        reused = cache.reuse(feed)
        reply.begin_prefill(len(feed), reused, min(cache.take_from_disk(), reused))
        job.emit(PrefillProgress(reused, len(feed)))
        reason = reply.force(head, forced.traces) if forced else None
        if reason is None:
            reply.speculative, drafter = plan(req.speculative, cache, self.draft)
            tokens = decode(
                m.model, cache.layers, feed[reused:], reply.sample, max_tokens=reply.room, fed=cache.tokens,
                context=feed, spec=req.speculative, drafter=drafter, stats=reply.speculation,
                logprobs=req.profile.logprobs, prefill_step=self.prefill_step, cancelled=job.cancelled.is_set,
                on_prefill=lambda _: job.emit(PrefillProgress(len(cache.tokens), len(feed))))
            with self._device_practices():
                reason = reply.follow(tokens)
        if clear_cache_after_prefill(len(feed) - reused):
            mx.clear_cache()  # a long prefill leaves large temporary buffers in MLX's cache
        return reply.finish(reason, before_done)

    @contextlib.contextmanager
    def _device_practices(self) -> Iterator[None]:
        """mlx-lm's practices on a GPU, as core/backend.py decides them: a generation stream of its own, and the
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

class ChatSession:
    """A conversation whose KV cache lives between turns: each turn prefills only the new suffix.

    `context_policy` says what happens when the conversation no longer fits the model's context:

    * ``"truncate"`` (the default, as Ollama and LM Studio do): the oldest turns are left out of the prompt (the
      system prompt is always kept) until it fits with room for a reply; the history itself keeps every message.
      The next turn prefills again from the first changed position.
    * ``"rotate"``: a rotating KV window (`max_kv_size`, or the model's context when not given) keeps the first
      `keep` tokens and the latest ones; nothing is re-prefilled, and the model forgets the middle.
    * ``"error"``: the turn is refused with a ContextLengthError (prompt tokens and limit as attributes).

    A `max_kv_size` always means a rotating window. A single message longer than the context is refused under
    "truncate" and "error" alike.
    """

    def __init__(self, engine: Engine, *, system: str | None = None, profile: SamplingProfile | None = None,
                 max_kv_size: int | None = None, keep: int = 4, context_policy: ContextPolicy = "truncate",
                 kv: KVOptions = KVOptions(), speculative: str | Speculation = "off") -> None:
        if context_policy not in CONTEXT_POLICIES:
            raise ValueError(f"context_policy must be one of {', '.join(CONTEXT_POLICIES)}, got {context_policy!r}")
        self.engine = engine
        self.profile = profile or SamplingProfile()
        self._tree = ReplyTree([ChatMessage("system", system)] if system else [])
        self.context_policy = context_policy
        if max_kv_size is None and context_policy == "rotate":
            max_kv_size = engine.context_length
        self.max_kv_size, self.keep, self.kv = max_kv_size, keep, kv
        self.speculative = speculative  # each turn's default; a turn's own `speculative=` wins
        # A mode that cannot run with this cache is refused now, not at the first turn.
        check(Speculation.make(speculative), rotating=max_kv_size is not None, quantized=kv.quantized,
              draft=engine.draft is not None)
        self._cache: ConversationCache | None = None
        self._lock = threading.Lock()  # guards `messages` between the caller and the inference thread

    @property
    def messages(self) -> list[ChatMessage]:
        """A copy of the conversation, system prompt first; change it with the methods below."""
        with self._lock:
            return list(self._tree.path)

    @property
    def system(self) -> str | None:
        with self._lock:
            return self._tree.path[0].content if self._tree.path and self._tree.path[0].role == "system" else None

    def replace_history(self, messages: Sequence[ChatMessage | dict[str, Any]],
                        forks: dict[int, Fork] | None = None) -> None:
        """Replace every message but the system prompt (e.g. a stored conversation reopened), and the alternatives
        along them: `forks` maps a position of `messages` (0 = the first message after the system prompt) to its
        `Fork`. The KV cache stays: the next turn re-matches it by prefix and prefills only what differs."""
        history = [ChatMessage.coerce(m) for m in messages]
        if any(m.role == "system" for m in history):
            raise ValueError("the history must not contain a system message: set it with the session's system")
        with self._lock:
            system = [m for m in self._tree.path[:1] if m.role == "system"]
            shift = len(system)
            self._tree = ReplyTree(system + history, {p + shift: f.shifted(shift) for p, f in (forks or {}).items()})

    def history(self) -> tuple[list[ChatMessage], dict[int, Fork]]:
        """The messages after the system prompt and the alternatives along them, as `replace_history` takes them
        (e.g. to carry a conversation over to a session with another system prompt or model)."""
        with self._lock:
            shift = 1 if self._tree.path and self._tree.path[0].role == "system" else 0
            return (list(self._tree.path[shift:]),
                    {p - shift: f.shifted(-shift) for p, f in self._tree.forks.items()})

    def drop_last_user(self) -> ChatMessage | None:
        """Take back the last message if it is an unanswered user message (one the engine refused); return it."""
        with self._lock:
            if self._tree.path and self._tree.path[-1].role == "user":
                return self._tree.path.pop()
        return None

    @property
    def cache(self) -> ConversationCache | None:
        """The conversation's KV cache (None before the first turn), for size and memory readouts."""
        return self._cache

    def _request(self, max_tokens: int | None, stop: Sequence[str] | None, trace: int,
                 speculative: str | Speculation | None = None, profile: SamplingProfile | None = None) -> Request:
        return self.engine.request(profile or self.profile, max_tokens, stop, trace,
                                   self.speculative if speculative is None else speculative,
                                   rotating=self.max_kv_size is not None, quantized=self.kv.quantized)

    def send(self, text: str, *, max_tokens: int | None = None, stop: Sequence[str] | None = None,
             trace: int = 0, speculative: str | Speculation | None = None) -> Stream:
        """Answer `text`; `trace=K` traces each token's K candidates (see `Engine.stream`)."""
        _messages(text, None)  # the same checks as a one-off prompt, before anything is recorded
        request = self._request(max_tokens, stop, trace, speculative)
        message = ChatMessage("user", text)
        with self._lock:
            self._tree.path.append(message)
        return self._reply(request, message)

    def regenerate(self, *, max_tokens: int | None = None, stop: Sequence[str] | None = None,
                   trace: int = 0, keep: bool = False, speculative: str | Speculation | None = None) -> Stream:
        """Answer the last user message again. The last reply is dropped, or with `keep` it stays an alternative:
        the new reply becomes the active one at its place once it is done (see `alternatives`)."""
        request = self._request(max_tokens, stop, trace, speculative)
        with self._lock:
            path = self._tree.path
            last = len(path) - 1
            branch = (last, path[last], None) if keep and path and path[last].role == "assistant" else None
            if branch is None and path and path[last].role == "assistant":
                self._tree.truncate(last)
            answered = path[:branch[0]] if branch else path
            if not answered or answered[-1].role != "user":
                raise ValueError("there is no user message to answer again")
        return self._reply(request, branch=branch)

    def edit_last(self, text: str, *, max_tokens: int | None = None, stop: Sequence[str] | None = None,
                  trace: int = 0, keep: bool = False, speculative: str | Speculation | None = None) -> Stream:
        """Replace the last user message (dropping what followed it) and answer it. With `keep` the old message and
        what followed it stay an alternative: the new message and its reply take its place once the reply is done
        (see `alternatives`); a reply stopped before its first token or failed changes nothing."""
        _messages(text, None)
        request = self._request(max_tokens, stop, trace, speculative)
        message = ChatMessage("user", text)
        with self._lock:
            last = max((i for i, m in enumerate(self._tree.path) if m.role == "user"), default=None)
            if last is None:
                raise ValueError("there is no user message to edit")
            if keep:
                branch = (last, self._tree.path[last], None)
            else:
                self._tree.truncate(last)
                self._tree.path.append(message)
        if keep:
            return self._reply(request, branch=branch, lead=message)
        return self._reply(request, message)

    def clear(self) -> None:
        """Forget every message but the system prompt; the cache starts again on the next turn."""
        with self._lock:
            self._tree = ReplyTree([m for m in self._tree.path[:1] if m.role == "system"])
            self._cache = None

    def branch(self, reply_index: int, token_index: int, token_id: int, *, max_tokens: int | None = None,
               stop: Sequence[str] | None = None, trace: int = 0,
               speculative: str | Speculation | None = None) -> Stream:
        """Continue a reply from one of its tokens with another token: a new alternative of that reply.

        `reply_index` is the reply's index in `messages` (negative counts from the end); the new reply keeps the
        reply's first `token_index` token ids, then `token_id` (e.g. another candidate of its trace), then
        generates with the reply's profile and seed: the sampler's key and penalties continue as if those tokens
        had been drawn, so forcing the token the reply had reproduces it (while the cache still holds the reply;
        a prefill computes logits on another path than decode, so after a restart a close draw may differ). The
        KV cache is trimmed to the kept tokens, not prefilled again (`metrics.cached_tokens`; a wrapped rotating
        window cannot be trimmed).

        The stream's first TokenEvent carries the kept and forced ids at once (with their traces when the reply
        was traced and `token_id` is one of its traced candidates there); `metrics.completion_tokens` counts what
        was generated after them, `max_tokens` caps the whole reply. When done, the new reply is the active
        alternative at `reply_index` (see `alternatives`, `select_branch`); the messages that followed the old
        reply stay in its branch."""
        with self._lock:
            position = self._position(reply_index)
            if not 0 <= position < len(self._tree.path) or self._tree.path[position].role != "assistant":
                raise ValueError(f"reply_index must point at an assistant reply in messages (0.."
                                 f"{len(self._tree.path) - 1}), got {reply_index}")
            reply = self._tree.path[position]
        ids = reply.token_ids
        if not ids:
            raise ValueError(f"reply {reply_index} has no token ids to branch from (a reply made before they were "
                             "kept): regenerate it first")
        if not 0 <= token_index <= len(ids):
            raise ValueError(f"token_index must be between 0 and {len(ids)}, got {token_index}")
        vocab = self.engine.model.vocab_size
        if not 0 <= token_id < vocab:
            raise ValueError(f"token_id must be between 0 and {vocab - 1}, got {token_id}")
        profile = SamplingProfile.model_validate(reply.profile) if reply.profile else self.profile
        if reply.seed is not None:
            profile = profile.model_copy(update={"seed": reply.seed})
        request = self._request(max_tokens, stop, trace, speculative, profile)
        traced = len(reply.traces) == len(ids) and token_index < len(ids)
        chosen = reply.traces[token_index].choose(token_id) if traced else None
        forced = Forced((*ids[:token_index], token_id), (*reply.traces[:token_index], chosen) if chosen else ())
        return self._reply(request, branch=(position, reply, forced))

    def alternatives(self, index: int) -> list[ChatMessage]:
        """The alternatives of the message at `index` in `messages` (each its first message), oldest first; a
        message that was never branched is its only alternative. ``< active + 1 / len >`` is what a UI shows."""
        with self._lock:
            return self._tree.alternatives(self._position(index))

    def active_branch(self, index: int) -> int:
        """Which of `alternatives(index)` the conversation follows now."""
        with self._lock:
            return self._tree.active(self._position(index))

    def select_branch(self, index: int, branch: int) -> None:
        """Follow alternative `branch` at `index`: `messages` then continues with that alternative and what followed
        it. The KV cache is left as it is; the next turn re-matches it by prefix."""
        with self._lock:
            self._tree.select(self._position(index), branch)

    def _position(self, index: int) -> int:
        return index + len(self._tree.path) if index < 0 else index

    def _reply(self, request: Request, sent: ChatMessage | None = None,
               branch: tuple[int, ChatMessage, Forced | None] | None = None,
               lead: ChatMessage | None = None) -> Stream:
        """Answer the path (up to `branch`'s position, then `lead` if given: an edit kept as a branch)."""
        engine = self.engine

        def record(result: GenerationResult) -> None:
            if not result.text and result.finish_reason == "cancelled":
                return
            message = ChatMessage("assistant", result.text, result.finish_reason, result.metrics.as_dict(),
                                  result.profile, result.token_ids, result.seed, result.traces, result.sampler,
                                  engine.name)
            with self._lock:
                if branch:
                    self._tree.add_alternative(branch[0], lead or message)
                if lead is not None or not branch:
                    self._tree.path.append(message)

        def run(job: Job) -> None:
            cache = self._conversation_cache()
            with self._lock:
                if branch and (len(self._tree.path) <= branch[0] or self._tree.path[branch[0]] is not branch[1]):
                    raise ValueError("the conversation changed before the branch started: branch again")
                answered = [*self._tree.path[:branch[0] if branch else None], *([lead] if lead else [])]
            rendered = [m.as_prompt() for m in answered]
            try:
                prompt = self._fitted_prompt(rendered, [m.token_ids for m in answered], request)
                # The reply joins the conversation before its Done is emitted: whoever reads `messages` on Done
                # finds it.
                engine.run_request(job, cache, prompt, request, branch[2] if branch else None, record)
            except BaseException as e:
                # The turn did not happen: take back the message it answered (or a message that cannot be
                # answered, e.g. one longer than the context, fails every later turn too). A ContextLengthError
                # comes before any model call; after any other failure the cache's keys/values may be ahead of
                # its ids, so it is dropped.
                if not isinstance(e, ContextLengthError):
                    self._cache = None
                with self._lock:
                    if sent is not None and self._tree.path and self._tree.path[-1] is sent:
                        self._tree.path.pop()
                raise
            if (store := self._kv_store()) is not None:
                store.save(cache.tokens, cache.layers)  # cut here (views), written by the store's own thread

        return engine.submit(run)

    def _conversation_cache(self) -> ConversationCache:
        if self._cache is None:
            self._cache = ConversationCache(self.engine.model.model, self.max_kv_size, self.keep, self.kv)
        return self._cache

    def _kv_store(self) -> KVStore | None:
        """Where this conversation's KV cache is saved on disk: none for a rotating window (core/kv_store.py)."""
        return None if self.max_kv_size is not None else self.engine.kv_store(self.kv)

    def warm(self) -> "Future[int]":
        """Load this conversation's KV cache from disk, in the background (e.g. a stored chat reopened), so that the
        next turn prefills only its new message; the future gives how many ids were loaded (0: nothing saved for
        it, no disk cache, or a rotating window). The next reply counts them in `metrics.disk_tokens`."""
        loaded: Future[int] = Future()

        def run(_: Job) -> None:
            try:
                loaded.set_result(self._warm())
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
                loaded.set_exception(e)

        self.engine.submit(run)
        return loaded

    def _warm(self) -> int:
        store = self._kv_store()
        with self._lock:
            messages = list(self._tree.path)
        if store is None or not any(m.role != "system" for m in messages):
            return 0
        ids = self.engine.model.tokenizer.encode_chat([m.as_prompt() for m in messages],
                                                      [m.token_ids for m in messages])
        return store.warm(self._conversation_cache(), ids)

    def _fitted_prompt(self, rendered: list[dict[str, str]], replies: list[tuple[int, ...]],
                       request: Request) -> list[int]:
        """The conversation's token ids, each reply as the ids it was generated as (`ChatTokenizer.encode_chat`);
        under "truncate", without its oldest turns if it would not fit with room for a reply (a quarter of the
        context at most)."""
        encode = self.engine.model.tokenizer.encode_chat
        prompt = encode(rendered, replies)
        if self.context_policy != "truncate" or self.max_kv_size is not None:
            return prompt
        limit = self.engine.context_length
        room = min(request.max_tokens, limit // 4)
        system = 1 if rendered and rendered[0]["role"] == "system" else 0
        first = system  # the oldest turn kept
        while len(prompt) + room > limit and len(rendered) - first > 1:
            first += 1
            while len(rendered) - first > 1 and rendered[first]["role"] != "user":  # a prompt starts with a user turn
                first += 1
            prompt = encode(rendered[:system] + rendered[first:], replies[:system] + replies[first:])
        return prompt
