"""The chat's logic without a terminal: ChatController on the real embedded model and the real SQLite store.

``drive`` plays the bridge thread's part (EngineWorker.follow): it iterates the reply's stream and hands each event
to the controller, as the chat screen does with the worker's messages."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxchat.app.conversation import CHECKPOINT_S, ChatController, Refused, State
from mlxchat.app.inspection import Inspection
from mlxchat.app.store import Store
from mlxchat.core import SamplingProfile
from mlxchat.core.decode.events import Done, PrefillProgress, TokenEvent

SYSTEM = "You are a helpful assistant."


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture()
def store(tmp_path: Path) -> Store:
    s = Store(tmp_path / "conversations.db")
    yield s
    s.close()


@pytest.fixture()
def make(store, engine, tmp_path):
    """A controller with the engine loaded, greedy, short replies; its notifications go to ``c.notes``."""

    def build(*, with_engine: bool = True, max_tokens: int = 6, clock=None) -> ChatController:
        notes: list[tuple[str, str]] = []
        c = ChatController(store, default_profile=lambda: SamplingProfile(name="greedy", temperature=0),
                           default_system=SYSTEM, max_tokens=max_tokens, exports=tmp_path / "exports",
                           notify=lambda m, s: notes.append((m, s)), clock=clock or Clock())
        c.notes = notes  # type: ignore[attr-defined]
        if with_engine:
            c.engine_ready(engine, None, owned=False)
        return c

    return build


def drive(c: ChatController, reply, each=None):
    """Iterate the reply's stream on this thread, feeding the controller; ``each(event)`` runs after each event."""
    stream = reply.stream
    try:
        for event in stream:
            if isinstance(event, PrefillProgress):
                c.on_prefill(stream, event.done, event.total)
            elif isinstance(event, TokenEvent):
                c.on_tokens(stream, event.text, len(event.token_ids), event.metrics)
            elif isinstance(event, Done):
                return c.on_finished(stream, event.result)
            if each is not None:
                each(event)
    except Exception as e:  # noqa: BLE001 - what the worker posts as Failed
        return c.on_failed(stream, e)


def roles(store: Store, c: ChatController) -> list[tuple[str, str]]:
    return [(m.role, m.content) for m in store.messages(c.record.id)]


def test_a_turn_goes_idle_starting_streaming_idle_and_the_store_and_session_agree(make, store):
    c = make()
    assert c.state is State.IDLE and not c.busy
    reply = c.send("Hi")
    assert c.state is State.STARTING and c.busy
    with pytest.raises(Refused, match="Esc stops it"):
        c.send("again")
    seen: list[State] = []
    drive(c, reply, lambda e: seen.append(c.state))
    assert State.STREAMING in seen and c.state is State.IDLE
    result = c.last_result
    assert result is not None and result.finish_reason in ("stop", "length") and result.text
    assert [(t.role, t.content) for t in c.turns] == [("user", "Hi"), ("assistant", result.text)]
    assert roles(store, c) == [("user", "Hi"), ("assistant", result.text)]
    stored = store.messages(c.record.id)[1]
    assert stored.finish_reason == result.finish_reason and stored.metrics["ttft_s"] > 0
    assert [(m.role, m.content) for m in c.session.messages] == [("system", SYSTEM), ("user", "Hi"),
                                                                  ("assistant", result.text)]
    assert c.record.title == "Hi" and c.record.system_prompt == SYSTEM


def test_a_streaming_reply_is_saved_about_every_second_marked_until_it_ends(make, store):
    clock = Clock()
    c = make(max_tokens=24, clock=clock)
    reply = c.send("Count from one to twenty.")
    saved: list[tuple[str, str | None]] = []

    def tick(event) -> None:
        if isinstance(event, TokenEvent):
            clock.now += CHECKPOINT_S / 4
            rows = store.messages(c.record.id)
            if len(rows) == 2:
                saved.append((rows[1].content, rows[1].finish_reason))

    drive(c, reply, tick)
    result = c.last_result
    assert result.metrics.completion_tokens >= 8
    # Saved at the first tokens, then about every second of streaming, as a stopped reply until it ends...
    assert saved and saved[0][0] and all(reason == "cancelled" for _, reason in saved)
    assert 2 <= len({text for text, _ in saved}) <= result.metrics.completion_tokens // 3 + 2
    assert all(result.text.startswith(text) for text, _ in saved)
    # ...then rewritten in place, final.
    rows = store.messages(c.record.id)
    assert [(r.role, r.position) for r in rows] == [("user", 0), ("assistant", 1)]
    assert rows[1].content == result.text and rows[1].finish_reason == result.finish_reason


def test_quitting_mid_reply_saves_it_as_stopped(make, store):
    c = make(max_tokens=200)
    reply = c.send("Write a long story about a dragon.")
    stream = reply.stream
    for event in stream:
        if isinstance(event, TokenEvent):
            c.on_tokens(stream, event.text, len(event.token_ids), event.metrics)
            if reply.tokens >= 6:
                break
    shown = reply.turn.content
    c.close()  # what the app does on ctrl+q
    rows = store.messages(c.record.id)
    assert [r.role for r in rows] == ["user", "assistant"]
    assert rows[1].content == shown and len(shown) > 0 and rows[1].finish_reason == "cancelled"
    assert rows[1].metrics["completion_tokens"] >= 1


def test_a_store_that_stops_writing_keeps_the_chat_in_memory_and_catches_up(make, store):
    c = make()
    drive(c, c.send("Hi"))
    store._c.execute("PRAGMA query_only = ON")  # the database turns read-only under the app (fault injection)
    try:
        second = drive(c, c.send("And again?"))
        assert second.kept
        third = drive(c, c.send("Once more"))
        errors = [m for m, s in c.notes if s == "error"]
        assert len(errors) == 1 and "Cannot save" in errors[0] and "kept here" in errors[0]  # one line, once
        assert [t.content for t in c.turns if t.role == "user"] == ["Hi", "And again?", "Once more"]
        assert [m.content for m in store.messages(c.record.id) if m.role == "user"] == ["Hi"]
    finally:
        store._c.execute("PRAGMA query_only = OFF")
    drive(c, c.send("Written now?"))
    assert [(m.role, m.content) for m in store.messages(c.record.id)] == [(t.role, t.content) for t in c.turns]
    assert [m.position for m in store.messages(c.record.id)] == list(range(8))
    assert c.notes[-1] == ("The chat is saved again", "information")
    assert third.turn.content and store.messages(c.record.id)[5].content == third.turn.content


def test_a_new_chat_whose_first_write_fails_is_created_when_the_store_comes_back(make, store):
    c = make()
    store._c.execute("PRAGMA query_only = ON")
    try:
        drive(c, c.send("Hello there"))
        assert c.record is None and store.conversations() == []
    finally:
        store._c.execute("PRAGMA query_only = OFF")
    drive(c, c.send("Still here?"))
    assert c.record is not None and c.record.title == "Hello there"
    assert [m.content for m in store.messages(c.record.id) if m.role == "user"] == ["Hello there", "Still here?"]


def test_a_system_prompt_set_mid_chat_is_recorded_and_exported_where_it_was_set(make, store, tmp_path, engine):
    c = make()
    first = drive(c, c.send("Hi")).turn.content
    second = drive(c, c.send("How are you?")).turn.content
    c.set_system_prompt("You are a pirate.")
    assert c.session.system == "You are a pirate."
    third = drive(c, c.send("Where are we?")).turn.content
    text = c.export_markdown(tmp_path / "chat.md").read_text()
    order = [text.index(s) for s in ("## System\n\n" + SYSTEM, first, second, "## System (from here on)\n\nYou are "
                                     "a pirate.", third)]
    assert order == sorted(order)
    assert text.count("## System") == 2
    # Reopened later, the chat goes on with the prompt in effect, and the export is the same.
    other = make()
    other.open(c.record.id)
    assert other.system_prompt == "You are a pirate." and other.session.system == "You are a pirate."
    assert [m.role for m in other.session.messages] == ["system"] + ["user", "assistant"] * 3
    assert other.export_markdown(tmp_path / "again.md").read_text().split("- exported")[1].split("\n", 1)[1] == \
        text.split("- exported")[1].split("\n", 1)[1]


def test_edit_and_regenerate_drop_what_followed_but_keep_a_system_prompt_set_meanwhile(make, store):
    c = make()
    drive(c, c.send("Hi"))
    c.set_system_prompt("Be brief.")
    again = drive(c, c.regenerate())
    assert [t.role for t in c.turns] == ["user", "system", "assistant"]
    assert [(m.role, m.content) for m in store.messages(c.record.id)] == [
        ("user", "Hi"), ("system", "Be brief."), ("assistant", again.turn.content)]
    drive(c, c.resend("Hello"))
    assert [(t.role, t.content) for t in c.turns][:2] == [("system", "Be brief."), ("user", "Hello")]
    assert [m.role for m in store.messages(c.record.id)] == ["system", "user", "assistant"]
    assert [m.content for m in c.session.messages if m.role == "user"] == ["Hello"]


def test_regenerate_keeps_the_old_reply_as_a_branch_in_the_session_and_the_store(make, store):
    c = make()
    first = drive(c, c.send("Hi")).turn
    reply = c.regenerate()
    assert c.turns[-1] is reply.turn and first not in c.turns
    drive(c, reply)
    new = c.turns[-1]
    assert new is reply.turn and Inspection(c).branch_place(new) == (2, 2)
    assert c.session.alternatives(-1)[0] is first.message and c.session.messages[-1] is new.message
    assert [m.content for m in store.branches(c.record.id, new.position).messages] == [first.content, new.content]
    shown = Inspection(c).switch_branch(new, -1)  # [ shows the old reply again, which the chat goes on from
    assert shown.message is first.message and Inspection(c).branch_place(shown) == (1, 2)
    assert c.session.messages[-1] is first.message and roles(store, c)[-1] == ("assistant", first.content)


def test_an_edit_keeps_the_old_message_and_its_reply_as_a_branch(make, store):
    c = make()
    first = drive(c, c.send("Hi"))
    old_user, old_reply = c.turns
    drive(c, c.resend("Hello"))
    user, reply = c.turns
    assert user.content == "Hello" and user.message is c.session.messages[1] and reply.message is c.session.messages[2]
    assert Inspection(c).branch_place(user) == (2, 2) and Inspection(c).branch_place(reply) is None
    assert [m.content for m in store.branches(c.record.id, 0).messages] == ["Hi", "Hello"]
    assert roles(store, c) == [("user", "Hello"), ("assistant", reply.content)]
    shown = Inspection(c).switch_branch(user, 1)  # ] wraps round to the first message, with its reply
    assert shown.message is old_user.message and [t.message for t in c.turns] == [old_user.message, old_reply.message]
    assert roles(store, c) == [("user", "Hi"), ("assistant", first.turn.content)]
    # An edit the engine refuses changes nothing: the old message is back, the new one shown unsent after it.
    _, message = drive(c, c.resend("word " * 9000))
    assert "not sent" in message and c.turns[-1].unsent and not c.busy
    assert [t.message for t in c.turns[:2]] == c.session.messages[1:] == [old_user.message, old_reply.message]
    assert roles(store, c) == [("user", "Hi"), ("assistant", first.turn.content)]
    assert len(store.branches(c.record.id, 0).messages) == 2


def test_a_prompt_longer_than_the_context_leaves_the_session_and_the_store(make, store):
    c = make()
    first = drive(c, c.send("Hi"))
    reply, message = drive(c, c.send("word " * 9000))
    assert "context of 8192" in message and "not sent" in message
    assert c.state is State.IDLE and reply.turn.error
    assert c.turns[-2].unsent
    assert [m.content for m in c.session.messages if m.role == "user"] == ["Hi"]
    assert roles(store, c) == [("user", "Hi"), ("assistant", first.turn.content)]
    with pytest.raises(Refused, match="ctrl\\+t"):
        c.regenerate()
    drive(c, c.resend("Say hello"))  # the refused message is replaced; nothing earlier is edited
    assert [m.content for m in store.messages(c.record.id) if m.role == "user"] == ["Hi", "Say hello"]


def test_a_message_sent_while_the_model_loads_waits_for_it_and_esc_drops_the_wait(make, store, engine):
    c = make(with_engine=False)
    with pytest.raises(Refused, match="No model is loaded"):
        c.send("Hi")
    c.model_loading(None)
    reply = c.send("Hi")
    assert c.state is State.LOADING and reply.stream is None
    assert c.stop() == "dropped" and c.state is State.IDLE
    assert [t.role for t in c.turns] == ["user"]  # the message stays, unanswered
    waiting = c.send("Are you there?")
    old, started = c.engine_ready(engine, None, owned=False)
    assert old is None and started is waiting and c.state is State.STARTING
    drive(c, started)
    assert [m.content for m in c.session.messages if m.role == "user"] == ["Hi", "Are you there?"]
    assert [m.role for m in store.messages(c.record.id)] == ["user", "user", "assistant"]


def test_a_reply_stopped_by_opening_another_chat_lands_in_its_own(make, store):
    c = make(max_tokens=200)
    drive(c, c.send("Hi"))
    other = c.record.id
    c.new_chat()
    reply = c.send("Tell me a long story")
    mine = c.record.id
    stream = reply.stream
    events = iter(stream)
    for event in events:
        if isinstance(event, TokenEvent):
            c.on_tokens(stream, event.text, len(event.token_ids), event.metrics)
            break
    c.open(other)  # stops the reply in flight
    assert c.state is State.IDLE and c.reply is None
    for event in events:
        if isinstance(event, TokenEvent):
            c.on_tokens(stream, event.text, len(event.token_ids), event.metrics)
        elif isinstance(event, Done):
            c.on_finished(stream, event.result)
    assert event.result.finish_reason == "cancelled"
    stored = store.messages(mine)
    assert [m.role for m in stored] == ["user", "assistant"] and stored[1].content == event.result.text
    assert stored[1].finish_reason == "cancelled"
    assert [m.role for m in store.messages(other)] == ["user", "assistant"]


def test_clearing_deletes_the_messages_and_a_reply_in_flight_is_never_stored(make, store):
    c = make(max_tokens=200)
    drive(c, c.send("Hi"))
    reply = c.send("Tell me a long story")
    c.clear()
    drive(c, reply)
    assert c.turns == [] and store.messages(c.record.id) == []
    assert [m.role for m in c.session.messages] == ["system"]


# --- branches (issue 14) -----------------------------------------------------------------------------------------

def _traced(make):
    """A controller that traces every reply, with one answered message."""
    c = make()
    c.trace_k = 4
    drive(c, c.send("Name a colour."))
    return c


def test_a_branch_replaces_the_reply_and_both_stay_in_the_store(make, store):
    c = _traced(make)
    first = c.turns[-1]
    assert first.traces is not None and len(first.traces) == len(first.token_ids)
    other = next(x for x in first.traces[1].candidates if not x.chosen)
    with pytest.raises(Refused, match="the token it chose"):
        Inspection(c).branch(first, 1, first.traces[1].chosen.token_id)
    reply = Inspection(c).branch(first, 1, other.token_id)
    assert c.turns[-1] is reply.turn and first not in c.turns and reply.turn.branches == (1, 2)
    with pytest.raises(Refused, match="Esc stops it"):
        Inspection(c).branch(first, 0, other.token_id)
    drive(c, reply)
    new = c.turns[-1]
    assert new.token_ids[:2] == (first.token_ids[0], other.token_id) and new.content != first.content
    assert Inspection(c).branch_place(new) == (2, 2) and Inspection(c).branch_place(c.turns[0]) is None
    assert [m.content for m in store.branches(c.record.id, new.position).messages] == [first.content, new.content]
    # The session goes on from the branch shown; [ switches back, in the store and the session.
    shown = Inspection(c).switch_branch(new, -1)
    assert shown.content == first.content and Inspection(c).branch_place(shown) == (1, 2)
    assert c.session.messages[-1].content == first.content
    assert roles(store, c)[-1] == ("assistant", first.content)


def test_a_branch_that_fails_gives_the_reply_back(make, store):
    c = _traced(make)
    first = c.turns[-1]
    other = next(x for x in first.traces[0].candidates if not x.chosen)
    reply = Inspection(c).branch(first, 0, other.token_id)
    reply.stream.cancel()
    list(reply.stream)  # drained here; the controller is told it failed, as the bridge posts an engine error
    _, message = c.on_failed(reply.stream, RuntimeError("the engine failed"))
    assert message == "the engine failed" and not c.busy
    assert c.turns[-1] is first and Inspection(c).branch_place(first) is None
    assert c.session.messages[-1].content == first.content  # the next turn follows the reply shown
    assert roles(store, c)[-1] == ("assistant", first.content)  # nothing was saved for the branch
    assert store.branches(c.record.id, first.position).active == 0


def test_branching_an_earlier_reply_keeps_what_followed_it_in_the_old_branch(make, store):
    c = _traced(make)
    first = c.turns[-1]
    drive(c, c.send("And another one?"))
    later = [t.content for t in c.turns]
    other = next(x for x in first.traces[0].candidates if not x.chosen)
    drive(c, Inspection(c).branch(first, 0, other.token_id))
    assert [t.role for t in c.turns] == ["user", "assistant"] and Inspection(c).branch_place(c.turns[-1]) == (2, 2)
    assert c.session.messages[-1].content == c.turns[-1].content
    # wraps round to the first branch, with the exchange that followed
    shown = Inspection(c).switch_branch(c.turns[-1], 1)
    assert shown.content == first.content and [t.content for t in c.turns] == later
    assert [m.content for m in store.messages(c.record.id)] == later


def test_a_replay_of_a_branch_replays_the_branch_shown(make, engine):
    c = _traced(make)
    first = c.turns[-1]
    other = next(x for x in first.traces[1].candidates if not x.chosen)
    drive(c, Inspection(c).branch(first, 1, other.token_id))
    shown = c.turns[-1]
    source = Inspection(c).replay_source(shown)
    assert source.start == (first.token_ids[0], other.token_id)
    as_written, changed = source.plan("temperature=0.8").run(engine, trace=4)
    # Both sides start as the branch did (the kept token, then the candidate), not as the reply it branched from.
    assert as_written.token_ids[:2] == changed.token_ids[:2] == shown.token_ids[:2]


# --- the bridge's batch pacing (plain logic; the screen feeds it the UI thread's CPU time per batch) --------------

def test_each_batch_pays_for_drawing_the_last_one_within_the_budget():
    from mlxchat.app.engine_worker import BATCH_S, MAX_BATCH_S, next_batch_s

    # 10 ms of drawing a batch at a 4% budget needs 0.25 s until the next one.
    assert next_batch_s(0.010, 0.04) == pytest.approx(0.25)
    # A cheap batch after a costly one (a layout) brings the short batches back at once: each pays for its own.
    assert next_batch_s(0.002, 0.04) == pytest.approx(0.05)
    assert next_batch_s(0.0, 0.04) == BATCH_S  # never below the shortest batch
    assert next_batch_s(1.0, 0.04) == MAX_BATCH_S  # nor longer than the longest, however slow the drawing


def test_the_transcripts_arrows_step_through_its_messages_and_stop_at_either_end() -> None:
    from mlxchat.app.turns import step_to

    assert [step_to(4, None, -1), step_to(4, None, 1), step_to(4, 3, -1), step_to(4, 0, 1)] == [3, 0, 2, 1]
    assert step_to(4, 0, -1) is None and step_to(4, 3, 1) is None and step_to(0, None, -1) is None
