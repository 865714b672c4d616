"""One tokenizer interface over GGUF metadata and Hugging Face tokenizer files.

GGUF files carry their vocabulary as metadata; transformers already knows how to turn that into a
`tokenizers` backend (byte-level BPE for GPT-2 style files, SentencePiece-style BPE for "llama"
vocabularies), so we hand it our parsed metadata instead of rewriting BPE.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from .heap import collector_paused

# Names models use for "end of turn"; any of these present in the vocabulary stops generation.
_END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "</s>", "<|eom_id|>",
               "<|end_of_text|>", "<｜end▁of▁sentence｜>")

Message = dict[str, str]


class ChatTokenizer:
    """Encode/decode plus the model's chat template and every end-of-turn token id."""

    def __init__(self, hf_tokenizer: Any, eos_ids: Iterable[int] = ()) -> None:
        self.hf = hf_tokenizer
        ids = set(eos_ids)
        if hf_tokenizer.eos_token_id is not None:
            ids.add(int(hf_tokenizer.eos_token_id))
        ids.update(i for t in _END_TOKENS if (i := _token_id(hf_tokenizer, t)) is not None)
        self.eos_ids: frozenset[int] = frozenset(ids)
        # Counted, not listed: get_vocab() builds a dict of the whole vocabulary (~17 ms for 49k tokens) to measure it.
        self.vocab_size: int = len(hf_tokenizer)

    @property
    def chat_template(self) -> str | None:
        return getattr(self.hf, "chat_template", None)

    def encode(self, text: str) -> list[int]:
        _check_unicode(text)
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True)

    @property
    def knows_tools(self) -> bool:
        """Whether the chat template renders tool definitions and calls itself (its `tools` variable)."""
        return "tools" in (self.chat_template or "")

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, template_kwargs: dict[str, Any] | None = None) -> str:
        if not self.chat_template:
            # Base models have no template: plain concatenation is what llama.cpp's completion mode does.
            return "\n\n".join(m["content"] or "" for m in messages)
        # `tools` (OpenAI's function specs) only for a template that uses them (core/decode/tools.py renders the rest).
        # `template_kwargs`: variables for the template (e.g. a thinking model's enable_thinking,
        # core/decode/reasoning.py).
        extra = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
        return self.hf.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
                                           **extra)

    def encode_chat(self, messages: Sequence[Message], replies: Sequence[Sequence[int] | None] | None = None,
                    tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """The conversation's prompt ids. `replies` (aligned with `messages`) may give an assistant message's own
        token ids, the ones the model generated: they are used as they are wherever they decode to the message's
        text and the template writes that text verbatim after the message's generation prompt. A sampled reply is
        often not the tokenizer's own split of its text ("F" "TR" where encoding gives "FT" "R"), and the KV cache
        holds the generated ids: re-encoded, the prompt would part from the cache there and the rest of the
        conversation would be prefilled again (issue 25). `tools`: OpenAI's function specs, for a template that
        renders them (core/decode/tools.py)."""
        for m in messages:
            _check_unicode(m["content"] or "")  # an assistant message that only calls tools has no content
        text = self.render(messages, tools=tools, template_kwargs=template_kwargs)
        # The template writes special tokens (BOS, <|im_start|>) itself as text; they must parse as specials.
        ids: list[int] = []
        done = 0  # characters of `text` tokenized so far
        for i, own in enumerate(replies or ()):
            start = self._reply_start(messages, i, own, text, done, template_kwargs)
            if start is not None:
                ids += self.hf.encode(text[done:start], add_special_tokens=False)
                ids += own
                done = start + len(messages[i]["content"])
        ids += self.hf.encode(text[done:], add_special_tokens=False)
        bos = self.hf.bos_token_id
        if getattr(self.hf, "add_bos_token", False) and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    def _reply_start(self, messages: Sequence[Message], i: int, own: Sequence[int] | None, text: str,
                     done: int, template_kwargs: dict[str, Any] | None = None) -> int | None:
        """Where assistant message `i`'s text starts in the rendered `text` if its ids `own` can stand for it, else
        None: the ids decode to its text, and the conversation up to it, rendered with a generation prompt (what
        the reply was generated after), is how `text` begins, followed by the message's text."""
        content = messages[i]["content"]
        if not own or not content or messages[i]["role"] != "assistant" or not self.chat_template \
                or self.decode(own) != content:
            return None
        head = self.render(messages[:i], template_kwargs=template_kwargs)
        if len(head) < done or not text.startswith(head) or not text.startswith(content, len(head)):
            return None
        return len(head)


def _token_id(hf: Any, token: str) -> int | None:  # noqa: ANN401 - any transformers tokenizer
    """`token`'s id, or None where the vocabulary lacks it (the lookup then answers the unknown token's id)."""
    i = hf.convert_tokens_to_ids(token)
    return i if isinstance(i, int) and hf.convert_ids_to_tokens(i) == token else None


def _check_unicode(text: str) -> None:
    """A lone surrogate (from a lossy decode, e.g. errors="surrogateescape") cannot be encoded: say so, and where,
    instead of the tokenizer's TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the prompt is not valid Unicode: a lone surrogate U+{ord(text[e.start]):04X} at position "
                         f"{e.start}; decode the text strictly (or with errors='replace')") from None


def from_gguf_metadata(metadata: dict[str, Any]) -> ChatTokenizer:
    """The tokenizer a GGUF's metadata describes, as transformers converts it, with its chat template and end ids."""
    with collector_paused():
        return _from_gguf_metadata(metadata)


def _byte_level_backend(architecture: str, fields: dict[str, Any]) -> Any:  # noqa: ANN401 - a tokenizers.Tokenizer
    """transformers' conversion of a byte-level (GPT-2 style) GGUF vocabulary, built the same way in a third of the
    time, or None for any other kind (transformers converts those itself). The same steps as its
    `convert_gguf_tokenizer` (tests/test_loader.py holds the two to the byte of their serialization); two of them cost
    most of the embedded model's load: it checks each of the 49k tokens' spelling in a Python loop (one pass over
    their concatenation here when all are spelled in the byte alphabet, as every file llama.cpp writes is), and it
    builds a dict of the whole vocabulary (~20 ms) to look up USER_DEFINED tokens where a file has none."""
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    from transformers.integrations.gguf import gguf_tokenizer_mapping as mapping

    if mapping.select_tokenizer_builder(architecture, fields.get("tokenizer_type")) is not mapping.byte_level_tokenizer:
        return None
    tokens, types = fields["tokens"], fields.get("token_type") or ()
    alphabet = frozenset(bytes_to_unicode().values())
    if not alphabet.issuperset("".join(tokens)):
        return None  # a token spelled outside the byte alphabet: transformers respells it
    tokenizer = mapping.GPT2Tokenizer(vocab=dict(zip(tokens, range(len(tokens)))), merges=mapping.get_merges(fields))
    control = [AddedToken(token, normalized=False, special=True)
               for token, kind in zip(tokens, types) if kind == 3 and alphabet.issuperset(token)]  # 3: CONTROL
    if control:
        tokenizer.add_special_tokens({"additional_special_tokens": control}, replace_extra_special_tokens=False)
    if 4 in types:  # USER_DEFINED, e.g. <think>: added whole but not special, where the vocabulary has them
        vocab = tokenizer.get_vocab()
        tokenizer.add_tokens([AddedToken(token, normalized=False, special=False)
                              for token, kind in zip(tokens, types) if kind == 4 and token in vocab])
    return mapping.set_split_regex(tokenizer, fields).backend_tokenizer


def _from_gguf_metadata(metadata: dict[str, Any]) -> ChatTokenizer:
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    fields = {name: metadata[f"tokenizer.{key}"] for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
              if f"tokenizer.{key}" in metadata}
    tokens = fields["tokens"]
    architecture = metadata.get("general.architecture", "llama")
    backend = _byte_level_backend(architecture, fields) or convert_gguf_tokenizer(architecture, fields)[0]

    def token(key: str) -> str | None:
        i = metadata.get(f"tokenizer.ggml.{key}")
        return tokens[i] if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(tokens) else None

    add_bos = metadata.get("tokenizer.ggml.add_bos_token", fields.get("tokenizer_type") == "llama")
    # Around `backend` itself: passed as tokenizer_object=, it would be deep-copied (a JSON round trip of the whole
    # vocabulary, ~0.09 s of a 49k vocabulary's 0.23 s build, and a second copy in memory). transformers' own
    # tokenizer classes set `_tokenizer` before their __init__ in the same way.
    hf = PreTrainedTokenizerFast.__new__(PreTrainedTokenizerFast)
    hf._tokenizer = backend
    hf.__init__(
        chat_template=metadata.get("tokenizer.chat_template"),
        bos_token=token("bos_token_id"), eos_token=token("eos_token_id"), unk_token=token("unknown_token_id"),
        pad_token=token("padding_token_id"),
    )
    hf.add_bos_token = bool(add_bos)
    # An id outside the vocabulary (a corrupt or careless file) is ignored: kept, it would fail every request.
    eos = [i for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
           if isinstance(i := metadata.get(k), int) and not isinstance(i, bool) and 0 <= i < len(tokens)]
    return ChatTokenizer(hf, eos)
