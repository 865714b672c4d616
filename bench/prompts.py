"""Prompts of an exact token count, cut from real English text.

The text is CPython's own language reference as it ships with every interpreter (``pydoc_data.topics``, the text
``help()`` shows), so nothing is downloaded and nothing large is vendored. Topics are taken in sorted order; the
prompt is a chat (a short system message and one user message asking the model to continue the text), and the
user message is trimmed token by token until the *rendered chat* is exactly the asked length, so every system is
fed the very same token ids.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from typing import Any

SYSTEM = "You are a helpful assistant."
INSTRUCTION = "Continue this text:\n\n"  # short: the 32-token prompt still has some text in it

CHAT_QUESTIONS = (
    "What is a code block in Python?", "And what is a namespace?", "How does name resolution work?",
    "What does the global statement do?", "What about nonlocal?", "How are exceptions raised?",
    "What happens to an exception nobody catches?", "What is a module?", "How does import find a module?",
    "What is a package?", "What is a class definition?", "What is an instance attribute?",
    "What does __init__ do?", "What is a generator?", "What does yield do?", "What is a context manager?",
    "What is a decorator?", "What is a lambda?", "What is a list comprehension?", "Summarise our chat briefly.",
)


@lru_cache(maxsize=1)
def corpus() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k].strip() for k in sorted(topics))


def corpus_digest() -> str:
    return hashlib.sha256(corpus().encode()).hexdigest()[:16]


def messages_for(body: str, system: str | None = SYSTEM, instruction: str = INSTRUCTION) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": system}] if system is not None else []
    return msgs + [{"role": "user", "content": instruction + body}]


def exact_prompt(tokenizer: Any, n_tokens: int, *, offset_chars: int = 0, system: str | None = SYSTEM,
                 instruction: str = INSTRUCTION) -> tuple[list[dict[str, str]], list[int]]:
    """Messages whose rendered chat is exactly ``n_tokens`` ids, and those ids.

    ``tokenizer`` is a ``core.model.tokenizer.ChatTokenizer`` (``encode``, ``decode``, ``encode_chat``)."""
    base = len(tokenizer.encode_chat(messages_for("", system, instruction)))
    if n_tokens <= base:
        raise ValueError(f"a {n_tokens}-token prompt is too short: the chat template alone takes {base} tokens")
    text = corpus()
    # ~4 characters a token in English prose; take twice what is needed (wrapping around for very long prompts).
    want = 8 * n_tokens + 256
    # Cutting between tokens may merge or split a token at the seam (some lengths cannot be hit at one start):
    # search the nearest cut that lands exactly, then start a little further into the text and search again.
    for attempt in range(32):
        start = offset_chars + 17 * attempt
        source = (text * (1 + (start + want) // len(text)))[start:start + want]
        body_ids = tokenizer.encode(source)
        if len(body_ids) < n_tokens:
            raise ValueError(f"not enough text for a {n_tokens}-token prompt")
        k0 = n_tokens - base
        for k in sorted(range(max(1, k0 - 12), k0 + 13), key=lambda k: (abs(k - k0), k)):
            body = tokenizer.decode(body_ids[:k])
            msgs = messages_for(body, system, instruction)
            ids = tokenizer.encode_chat(msgs)
            if len(ids) == n_tokens:
                return msgs, ids
    raise ValueError(f"could not cut the text to exactly {n_tokens} tokens")
