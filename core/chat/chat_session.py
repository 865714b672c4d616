"""A conversation on an engine whose KV cache lives between turns: each turn prefills only the new suffix, and
replies can be regenerated, edited or branched from any of their tokens (`ChatSession`)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol, get_args

from ..cache.kv_cache import ConversationCache
from ..cache.prefix import PrefixIndex
from ..decode.events import GenerationResult
from ..decode.reasoning import Reasoning
from ..decode.reply import Request
from ..decode.speculative import DraftModel, Speculation, check
from ..decode.tools import ToolUse, render_messages
from ..decode.worker import Job, Stream
from ..errors import ContextLengthError
from ..model.backend import KVOptions
from ..model.loader import LoadedModel
from ..sampling.profile import SamplingProfile
from .messages import ChatMessage, ContextPolicy, Forced, Fork, ReplyTree, prompt_messages
from .tool_loop import Approve, Toolbox, ToolStream


CONTEXT_POLICIES: tuple[str, ...] = get_args(ContextPolicy)


class Host(Protocol):
    """What a session needs of its engine: core/engine.py's `Engine` (or the split model's `SplitEngine`), which
    sits above this stage and hands itself in (`Engine.chat`), so nothing in core/chat imports it."""

    model: LoadedModel
    draft: DraftModel | None

    @property
    def name(self) -> str: ...

    @property
    def context_length(self) -> int: ...

    def request(self, profile: SamplingProfile | None = None, max_tokens: int | None = None,
                stop: Sequence[str] | None = None, trace: int = 0, speculative: str | Speculation = "off",
                *, rotating: bool = False, quantized: bool = False, tools: ToolUse | None = None,
                reasoning: Reasoning | None = None) -> Request: ...

    def run_request(self, job: Job, cache: ConversationCache, prompt: list[int], req: Request,
                    forced: Forced | None = None,
                    before_done: Callable[[GenerationResult], None] | None = None) -> GenerationResult: ...

    def submit(self, fn: Callable[[Job], Any]) -> Stream: ...

    def prefix_index(self, kv: KVOptions = KVOptions()) -> PrefixIndex: ...


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

    def __init__(self, engine: Host, *, system: str | None = None, profile: SamplingProfile | None = None,
                 max_kv_size: int | None = None, keep: int = 4, context_policy: ContextPolicy = "truncate",
                 kv: KVOptions = KVOptions(), speculative: str | Speculation = "off",
                 reasoning: Reasoning = Reasoning(), toolbox: Toolbox | None = None, tool_choice: str = "auto",
                 approve: Approve | None = None, max_tool_steps: int = 8) -> None:
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
        # A thinking model's switch and budget for every turn (core/decode/reasoning.py); may be replaced between turns.
        self.reasoning = reasoning
        # A mode that cannot run with this cache is refused now, not at the first turn.
        check(Speculation.make(speculative), rotating=max_kv_size is not None, quantized=kv.quantized,
              draft=engine.draft is not None)
        self._cache: ConversationCache | None = None
        self._lock = threading.Lock()  # guards `messages` between the caller and the inference thread
        # Tools (core/chat/tool_loop.py): with a toolbox, a turn is a loop of replies and calls (`ToolStream`), each
        # call asked of `approve` (None: every call allowed), at most `max_tool_steps` rounds of calls.
        self.toolbox, self.tool_choice, self.approve = toolbox, tool_choice, approve
        self.max_tool_steps = max_tool_steps

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
                 speculative: str | Speculation | None = None, profile: SamplingProfile | None = None,
                 tools: ToolUse | None = None) -> Request:
        return self.engine.request(profile or self.profile, max_tokens, stop, trace,
                                   self.speculative if speculative is None else speculative,
                                   rotating=self.max_kv_size is not None, quantized=self.kv.quantized,
                                   reasoning=self.reasoning, tools=tools)

    def _with_tools(self, start: Callable[[ToolUse | None], Stream], tool_choice: str | None,
                    max_tokens: int | None, stop: Sequence[str] | None) -> Stream:
        """`start(tools)` as a turn: a plain reply without a toolbox, else the tool loop's `ToolStream`."""
        if self.toolbox is None:
            return start(None)
        return ToolStream(self, start, tool_choice or self.tool_choice, max_tokens, stop)  # type: ignore[return-value]

    def continue_tools(self, tools: ToolUse | None, *, max_tokens: int | None = None,
                       stop: Sequence[str] | None = None) -> Stream:
        """Go on with the last reply once its calls have results (`ToolStream` does this): the model reads them and
        writes on; what it writes joins that reply (its text, or further calls as the reply's next round)."""
        with self._lock:
            last = self._tree.path[-1] if self._tree.path else None
        if last is None or last.role != "assistant" or not last.tool_calls:
            raise ValueError("the last message is not a reply that called tools")
        return self._reply(self._request(max_tokens, stop, 0, None, tools=tools), continuing=last)

    def send(self, text: str, *, max_tokens: int | None = None, stop: Sequence[str] | None = None,
             trace: int = 0, speculative: str | Speculation | None = None, tool_choice: str | None = None) -> Stream:
        """Answer `text`; `trace=K` traces each token's K candidates (see `Engine.stream`). With a toolbox the turn
        runs the tool loop (`tool_choice`: "auto", "required" or "none" for its first reply; the session's when
        None)."""
        prompt_messages(text, None)  # the same checks as a one-off prompt, before anything is recorded
        return self._with_tools(lambda use: self._send(text, max_tokens, stop, trace, speculative, use),
                                tool_choice, max_tokens, stop)

    def _send(self, text: str, max_tokens: int | None, stop: Sequence[str] | None, trace: int,
              speculative: str | Speculation | None, tools: ToolUse | None) -> Stream:
        request = self._request(max_tokens, stop, trace, speculative, tools=tools)
        message = ChatMessage("user", text)
        with self._lock:
            self._tree.path.append(message)
        return self._reply(request, message)

    def regenerate(self, *, max_tokens: int | None = None, stop: Sequence[str] | None = None,
                   trace: int = 0, keep: bool = False, speculative: str | Speculation | None = None) -> Stream:
        """Answer the last user message again. The last reply is dropped, or with `keep` it stays an alternative:
        the new reply becomes the active one at its place once it is done (see `alternatives`)."""
        return self._with_tools(lambda use: self._regenerate(max_tokens, stop, trace, keep, speculative, use),
                                None, max_tokens, stop)

    def _regenerate(self, max_tokens: int | None, stop: Sequence[str] | None, trace: int, keep: bool,
                    speculative: str | Speculation | None, tools: ToolUse | None) -> Stream:
        request = self._request(max_tokens, stop, trace, speculative, tools=tools)
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
        prompt_messages(text, None)
        return self._with_tools(lambda use: self._edit_last(text, max_tokens, stop, trace, keep, speculative, use),
                                None, max_tokens, stop)

    def _edit_last(self, text: str, max_tokens: int | None, stop: Sequence[str] | None, trace: int, keep: bool,
                   speculative: str | Speculation | None, tools: ToolUse | None) -> Stream:
        request = self._request(max_tokens, stop, trace, speculative, tools=tools)
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
               lead: ChatMessage | None = None, continuing: ChatMessage | None = None) -> Stream:
        """Answer the path (up to `branch`'s position, then `lead` if given: an edit kept as a branch). `continuing`
        (the path's last message, a reply whose calls have results): what is written joins it."""
        engine = self.engine
        toolbox = self.toolbox

        def record(cache: ConversationCache, result: GenerationResult) -> None:
            # The KV cache is queued for disk before the Done goes out: a script that exits as soon as it has read
            # the reply still finds it saved (the store's writer finishes queued saves at exit; a save queued after
            # the Done raced the interpreter's exit and was lost).
            if (index := self._prefix_index()) is not None:
                index.save(cache.tokens, cache.layers)  # cut here (views), written by the disk store's own thread
            if not result.text and not result.reasoning and result.finish_reason == "cancelled":
                return
            earlier = continuing.tool_calls if continuing is not None else ()
            next_round = max((c.get("round", 0) for c in earlier), default=-1) + 1
            calls = tuple({"id": c.id, "name": c.name, "arguments": c.arguments, "round": next_round,
                           "source": toolbox.source(c.name) if toolbox is not None else None, "result": None}
                          for c in result.tool_calls)
            message = ChatMessage("assistant", result.text, result.finish_reason, result.metrics.as_dict(),
                                  result.profile, result.token_ids, result.seed, result.traces, result.sampler,
                                  engine.name,
                                  # a tool turn's reasoning: each round's, in order
                                  "\n\n".join(r for r in (continuing.reasoning if continuing else "",
                                                            result.reasoning) if r),
                                  (*earlier, *calls))
            with self._lock:
                if continuing is not None:
                    if self._tree.path and self._tree.path[-1] is continuing:
                        self._tree.path[-1] = message
                    return
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
            rendered, replies, shown = self._rendered(answered, request.tools)
            try:
                prompt = self._fitted_prompt(rendered, replies, request, shown)
                # The reply joins the conversation before its Done is emitted: whoever reads `messages` on Done
                # finds it.
                engine.run_request(job, cache, prompt, request, branch[2] if branch else None,
                                   lambda result: record(cache, result))
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

        return engine.submit(run)

    def _conversation_cache(self) -> ConversationCache:
        if self._cache is None:
            self._cache = ConversationCache(self.engine.model.model, self.max_kv_size, self.keep, self.kv)
        return self._cache

    def _prefix_index(self) -> PrefixIndex | None:
        """The prefix index that saves this conversation's KV cache on disk and loads it back (core/cache/prefix.py):
        none for a rotating window, whose ids no longer say what it holds (core/cache/kv_store.py)."""
        return None if self.max_kv_size is not None else self.engine.prefix_index(self.kv)

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
        index = self._prefix_index()
        with self._lock:
            messages = list(self._tree.path)
        if index is None or index.disk is None or not any(m.role != "system" for m in messages):
            return 0
        ids = self.engine.model.tokenizer.encode_chat([m.as_prompt() for m in messages],
                                                      [m.token_ids for m in messages],
                                                      template_kwargs=self.reasoning.template_kwargs())
        return index.warm(self._conversation_cache(), ids)

    def _rendered(self, messages: list[ChatMessage], tools: ToolUse | None
                  ) -> tuple[list[dict[str, Any]], list[tuple[int, ...] | None], list[dict[str, Any]] | None]:
        """The messages for the chat template, each reply's ids aligned with them (a reply that called tools is
        several messages: core.chat.messages.ChatMessage.as_prompts), and the tool specs for a template that takes them
        (a template that does not gets core/decode/tools.py's generic rendering)."""
        rendered: list[dict[str, Any]] = []
        replies: list[tuple[int, ...] | None] = []
        for m in messages:
            parts = m.as_prompts()
            rendered += parts
            own = m.token_ids if parts[-1]["role"] == "assistant" and not parts[-1].get("tool_calls") else None
            replies += [None] * (len(parts) - 1) + [own]
        if tools is None and not any(m.tool_calls for m in messages):
            return rendered, replies, None
        before = len(rendered)
        rendered, shown = render_messages(rendered, tools.shown if tools else [],
                                          self.engine.model.tokenizer.knows_tools)
        if len(rendered) > before:  # the generic rendering put a system prompt in front
            replies = [None] + replies
        return rendered, replies, shown

    def _fitted_prompt(self, rendered: list[dict[str, Any]], replies: list[tuple[int, ...] | None],
                       request: Request, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The conversation's token ids, each reply as the ids it was generated as (`ChatTokenizer.encode_chat`);
        under "truncate", without its oldest turns if it would not fit with room for a reply (a quarter of the
        context at most)."""
        kwargs = request.reasoning.template_kwargs()

        def encode(messages: list[dict[str, Any]], ids: list[tuple[int, ...] | None]) -> list[int]:
            return self.engine.model.tokenizer.encode_chat(messages, ids, tools=tools, template_kwargs=kwargs)

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
