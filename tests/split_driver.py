"""Rank 0 of a split model for tests/test_distributed_procs.py, run as its own process (a ring group lives as long
as its process, and a fault test breaks it). It prints one JSON object per line on stdout; the test reads them.

    python tests/split_driver.py HOSTS replies N     greedy and seeded replies, a two-turn chat, per-rank memory
    python tests/split_driver.py HOSTS greedy N      one greedy reply (SPLIT_PARALLEL=tensor: heads over the ranks;
                                                     SPLIT_MODEL=PATH: that model instead of the embedded one)
    python tests/split_driver.py HOSTS fault N       a reply the test breaks (it kills or stops the worker once
                                                     "streaming" is printed), then the chat goes on on one machine
"""

from __future__ import annotations

import json
import os
import sys
import time

import mlxchat.core  # noqa: F401 - the optimized BLAS before MLX
from mlxchat.core import Engine, SamplingProfile
from mlxchat.core.distributed.leader import PeerLostError, SplitEngine
from mlxchat.core.decode.events import TokenEvent

PROMPT = "What is the capital of France?"
STORY = "Write a long story about a dragon who learns to read."


def say(**kw: object) -> None:
    print(json.dumps(kw), flush=True)


def replies(engine: SplitEngine, n: int) -> None:
    greedy = engine.generate(PROMPT, profile=SamplingProfile(temperature=0), max_tokens=n)
    sampled = engine.generate(PROMPT, profile=SamplingProfile(temperature=1.0, top_p=0.95, seed=7), max_tokens=n)
    chat = engine.chat(profile=SamplingProfile(temperature=0))
    first = chat.send("Hi!", max_tokens=n).wait()
    second = chat.send("What is 2+2?", max_tokens=n).wait()
    say(event="replies", greedy=list(greedy.token_ids), sampled=list(sampled.token_ids),
        chat=[list(first.token_ids), list(second.token_ids)], cached=second.metrics.cached_tokens,
        history=[m.content for m in chat.messages], memory=engine.worker_memory(),
        decode_tps=greedy.metrics.decode_tokens_per_s)


def greedy(engine: SplitEngine, n: int) -> None:
    reply = engine.generate(PROMPT, profile=SamplingProfile(temperature=0), max_tokens=n)
    say(event="greedy", greedy=list(reply.token_ids), memory=engine.memory)


def fault(engine: SplitEngine, n: int) -> None:
    chat = engine.chat(profile=SamplingProfile(temperature=0))
    stream = chat.send(STORY, max_tokens=n)
    queued = engine.stream("Hi", max_tokens=2)  # waits behind the reply for the inference thread
    try:
        for event in stream:
            if isinstance(event, TokenEvent) and event.token_ids:
                say(event="streaming")
                time.sleep(0.05)  # slow the reply down so the test's signal lands mid-reply
        say(event="finished")
        return
    except PeerLostError as e:
        say(event="failed", error=str(e), usable=engine.usable, queued=_outcome(queued))
    # The session stays usable: the same conversation goes on with the model on this machine.
    local = Engine.load()
    again = local.chat(profile=SamplingProfile(temperature=0))
    again.replace_history([m for m in chat.messages if m.role != "system"])
    again.drop_last_user()
    reply = again.send("Hello again", max_tokens=4).wait()
    say(event="reloaded", tokens=len(reply.token_ids), later_request=_later(engine))


def _outcome(stream: object) -> str:
    """What a request queued behind the failed one got (it must not wait forever on a blocked thread)."""
    try:
        stream.wait()  # type: ignore[attr-defined]
    except PeerLostError:
        return "failed"
    return "answered"


def _later(engine: SplitEngine) -> str:
    """What a request to the failed split engine gets now: the same error, at once."""
    started = time.perf_counter()
    try:
        engine.generate("Hi", max_tokens=2)
    except PeerLostError as e:
        return f"{time.perf_counter() - started:.2f}s {e}"
    return "answered"


def main() -> None:
    hosts, mode, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    timeout = float(os.environ.get("SPLIT_CONNECT_TIMEOUT", "30"))
    started = time.perf_counter()
    try:
        engine = SplitEngine.start(hosts, os.environ.get("SPLIT_MODEL"), connect_timeout_s=timeout,
                                   parallel=os.environ.get("SPLIT_PARALLEL", "pipeline"))
    except Exception as e:  # noqa: BLE001 - the test checks the message
        say(event="start_failed", error=f"{type(e).__name__}: {e}", after_s=time.perf_counter() - started)
        os._exit(0)
    say(event="loaded", memory=engine.memory)
    {"replies": replies, "greedy": greedy, "fault": fault}[mode](engine, n)
    if engine.usable:
        engine.close()
    os._exit(0)  # a failed group's inference thread may be blocked for good


if __name__ == "__main__":
    main()
