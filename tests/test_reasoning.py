"""Thinking models (issue 40): markers found from the template, the reasoning apart from the answer over every chunk
boundary, and an exact budget on the solo, chat and batch paths, on a real thinking model (tests/thinking_models.py:
the embedded weights with a Qwen3-style template that opens the reasoning in the generation prompt)."""

from __future__ import annotations

import queue

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxchat.core import Engine, SamplingProfile
from mlxchat.core.batch import BatchRequest, BatchScheduler
from mlxchat.core.decode.events import Done, TokenEvent
from mlxchat.core.decode.reasoning import (EFFORT_BUDGETS, Reasoning, ReasoningSplitter, find_markers, markers_for,
                                           split_text)
from tests.thinking_models import THINKING_TEMPLATE

STORY = "Write a story about a cat."
MARKERS = ("<think>", "</think>")

# --- markers from the template (no model) -----------------------------------------------------------------------

DEEPSEEK_R1 = ("{% for message in messages %}{% if message['role'] == 'user' %}{{'<｜User｜>' + message['content']}}"
               "{% elif message['role'] == 'assistant' %}{% set content = message['content'] %}"
               "{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}"
               "{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}{% endif %}{% endfor %}"
               "{% if add_generation_prompt %}{{'<｜Assistant｜><think>\\n'}}{% endif %}")
TOOLS_ONLY = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
              "{% if tools %}<tools>{{ tools }}</tools>{% endif %}<tool_call></tool_call>")


def _render(template: str):
    from jinja2 import Environment

    env = Environment()

    def render(messages, add_generation_prompt):
        return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt)
    return render


@pytest.mark.parametrize("template, expected", [
    (THINKING_TEMPLATE, MARKERS), (DEEPSEEK_R1, MARKERS), (TOOLS_ONLY, None),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", None),
    # Another name for the pair: found from what the template does with it, not from a list of names.
    ("{% for m in messages %}{{ m.content.split('</reason>')[-1] }}{% endfor %}"
     "{% if add_generation_prompt %}<reason>{% endif %}", ("<reason>", "</reason>")),
])
def test_markers_come_from_what_the_template_does(template: str, expected) -> None:
    assert find_markers(template, _render(template)) == expected


def test_the_embedded_model_is_not_a_thinking_model(engine: Engine) -> None:
    assert markers_for(engine.model.tokenizer) is None
    result = engine.generate("Hi", profile=SamplingProfile(temperature=0), max_tokens=4, reasoning_budget=2)
    assert result.reasoning == "" and result.metrics.reasoning_tokens == 0


# --- the splitter over every chunk boundary (no model) ---------------------------------------------------------

CASES = [
    ("\nI add 2 and 2.\n</think>\n\nIt is 4.", True, ("I add 2 and 2.", "It is 4.")),
    ("<think>\nhmm </ not yet\n</think>\n\nAnswer <think> kept", False, ("hmm </ not yet", "Answer <think> kept")),
    ("  Plain answer, no reasoning.", False, ("", "  Plain answer, no reasoning.")),
    ("<thin", False, ("", "<thin")),
    ("cut before the close </thi", True, ("cut before the close </thi", "")),
    ("\n\n</think>\n\nAnswer", True, ("", "Answer")),
    ("<think></think>x", False, ("", "x")),
]


def _chunked(text: str, cuts: list[int], thinking: bool) -> tuple[list[str], list[str]]:
    s = ReasoningSplitter(*MARKERS, thinking=thinking)
    thought, said = [], []
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(text))), len(text)]
    for a, b in zip(bounds, bounds[1:]):
        t, x = s.feed(text[a:b])
        thought.append(t)
        said.append(x)
    t, x = s.flush()
    return thought + [t], said + [x]


@pytest.mark.parametrize("text, thinking, expected", CASES)
def test_every_single_and_double_cut_gives_the_same_split(text: str, thinking: bool, expected) -> None:
    assert split_text(text, MARKERS, thinking) == expected
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            thought, said = _chunked(text, [i, j], thinking)
            assert ("".join(thought), "".join(said)) == expected, (i, j)


PIECE = st.text(alphabet=st.sampled_from(list("ab </>\nthink")), max_size=12).filter(
    lambda s: "<think>" not in s and "</think>" not in s)


@settings(max_examples=300, deadline=None)
@given(thinking=PIECE, answer=PIECE, opened=st.booleans(), cuts=st.lists(st.integers(0, 60), max_size=8))
def test_fuzz_no_marker_and_no_reasoning_in_the_answer(thinking: str, answer: str, opened: bool,
                                                       cuts: list[int]) -> None:
    text = ("" if opened else "<think>") + thinking + "</think>" + answer
    thought, said = _chunked(text, cuts, opened)
    assert "".join(thought) == thinking.strip()
    assert "".join(said) == answer.lstrip()
    assert "".join(thought) + "".join(said) == split_text(text, MARKERS, opened)[0] + split_text(text, MARKERS,
                                                                                                 opened)[1]


def test_bad_settings_get_one_line_naming_the_field() -> None:
    with pytest.raises(ValueError, match="reasoning_budget must be an integer of 0 or more"):
        Reasoning.make(budget=-1)
    with pytest.raises(ValueError, match="reasoning_effort must be one of minimal, low, medium, high"):
        Reasoning.make(effort="max")
    assert Reasoning.make(effort="low").budget == EFFORT_BUDGETS["low"]


# --- the real thinking model ----------------------------------------------------------------------------------

@pytest.fixture()
def greedy_short() -> SamplingProfile:
    return SamplingProfile(temperature=0)


def _check_budget(result, budget: int, tokenizer) -> None:
    assert result.metrics.reasoning_tokens == budget
    assert "think>" not in result.text and "think>" not in result.reasoning
    assert result.text and result.reasoning or budget <= 1
    # The model saw the closing marker: it is in the sequence, right after `budget` reasoning tokens.
    decoded = tokenizer.decode(result.token_ids)
    assert "</think>" in decoded and decoded.split("</think>")[1].strip() == result.text.strip()


def test_generate_budget_is_exact_and_streamed_deltas_add_up(thinking_engine: Engine,
                                                             greedy_short: SamplingProfile) -> None:
    tok = thinking_engine.model.tokenizer
    markers = markers_for(tok)
    assert markers is not None and markers.toggle and (markers.open, markers.close) == MARKERS
    for budget in (0, 8):
        events = list(thinking_engine.stream(STORY, profile=greedy_short, max_tokens=14, reasoning_budget=budget))
        result = next(e.result for e in events if isinstance(e, Done))
        _check_budget(result, budget, tok)
        deltas = [e for e in events if isinstance(e, TokenEvent)]
        assert "".join(e.reasoning for e in deltas) == result.reasoning
        assert "".join(e.text for e in deltas) == result.text
        assert result.metrics.answer_ttft_s >= result.metrics.ttft_s > 0
    assert result.reasoning.startswith("The cat")


def test_thinking_switch_and_no_budget(thinking_engine: Engine, greedy_short: SamplingProfile) -> None:
    off = thinking_engine.generate(STORY, profile=greedy_short, max_tokens=8, enable_thinking=False)
    assert off.reasoning == "" and off.text and off.metrics.reasoning_tokens == 0
    unbounded = thinking_engine.generate(STORY, profile=greedy_short, max_tokens=8)
    assert unbounded.text == "" and unbounded.reasoning and unbounded.finish_reason == "length"


def test_chat_session_budget_and_history_without_old_thinking(thinking_engine: Engine,
                                                              greedy_short: SamplingProfile) -> None:
    chat = thinking_engine.chat(profile=greedy_short, reasoning_budget=4)
    first = chat.send(STORY, max_tokens=12).wait()
    _check_budget(first, 4, thinking_engine.model.tokenizer)
    reply = chat.messages[-1]
    assert (reply.content, reply.reasoning) == (first.text, first.reasoning)
    second = chat.send("And a dog?", max_tokens=12).wait()
    _check_budget(second, 4, thinking_engine.model.tokenizer)
    # The template strips old thinking from the history sent back: the first reasoning is not in the prompt.
    prompt = thinking_engine.model.tokenizer.render([m.as_prompt() for m in chat.messages[:-1]])
    assert f"<|im_start|>assistant\n{first.text}<|im_end|>" in prompt and prompt.count("<think>") == 1


def test_batch_budget_equals_solo(thinking_engine: Engine, greedy_short: SamplingProfile) -> None:
    s = BatchScheduler(thinking_engine, max_batch=2, prefix_cache_bytes=0)
    tok = thinking_engine.model.tokenizer
    queues = []
    for text in (STORY, "Tell me about the sea."):
        q: queue.Queue = queue.Queue()
        s.submit(BatchRequest(tok.encode_chat([{"role": "user", "content": text}]), greedy_short, q.put,
                              max_tokens=12, reasoning=Reasoning(budget=5)))
        queues.append(q)
    for q, text in zip(queues, (STORY, "Tell me about the sea.")):
        events = []
        while not events or not isinstance(events[-1], Done):
            events.append(q.get(timeout=120))
        result = events[-1].result
        _check_budget(result, 5, tok)
        assert "".join(e.reasoning for e in events[:-1]) == result.reasoning
        solo = thinking_engine.generate(text, profile=greedy_short, max_tokens=12, reasoning_budget=5)
        assert (solo.reasoning, solo.text) == (result.reasoning, result.text)


def test_generate_cli_json_and_hide_thinking(thinking_engine: Engine, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture) -> None:
    import json

    from mlxchat.app.cli import main

    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, model=None, **kw: thinking_engine))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(thinking_engine.model.source) + ".config")
    flags = ["generate", STORY, "--temperature", "0", "--max-tokens", "12", "--reasoning-budget", "4"]
    assert main([*flags, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["reasoning"] and got["text"] and got["metrics"]["reasoning_tokens"] == 4
    assert "think>" not in got["text"] + got["reasoning"]
    assert main([*flags, "--json", "--hide-thinking"]) == 0
    hidden = json.loads(capsys.readouterr().out)
    assert "reasoning" not in hidden and hidden["text"] == got["text"]
    assert main([*flags, "--hide-thinking"]) == 0
    assert capsys.readouterr().out == got["text"] + "\n"  # a script reads the answer alone
    assert main(flags) == 0
    assert capsys.readouterr().out == got["reasoning"] + "\n\n" + got["text"] + "\n"
    assert main([*flags, "--no-enable-thinking", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["reasoning"] == ""
    assert main([*flags[:-1], "-3"]) == 2
    assert capsys.readouterr().err.strip() == "mlxchat: error: --reasoning-budget must be 0 or more tokens, got -3"
    # The chat takes the same flags, as its new chat's settings (config.toml's reasoning_budget, enable_thinking).
    from mlxchat.app.cli import chat_options, parse_args

    settings = chat_options(parse_args(["chat", "--reasoning-budget", "5", "--no-enable-thinking"]))["settings"]
    assert (settings["reasoning_budget"], settings["enable_thinking"]) == (5, False)


# --- the store (no model) -------------------------------------------------------------------------------------

def test_store_migration_keeps_what_was_saved_and_stores_reasoning(tmp_path) -> None:
    import json
    import sqlite3

    from mlxchat.app.store import MIGRATIONS, Store
    from mlxchat.core.chat.messages import ChatMessage

    db = tmp_path / "conversations.db"
    c = sqlite3.connect(db, isolation_level=None)
    for step, migrate in enumerate(MIGRATIONS[:3]):  # a database as version 3 wrote it
        migrate(c)
        c.execute("UPDATE schema_version SET version = ?", (step + 1,))
    c.execute("INSERT INTO conversations (title, model, created_at, updated_at) VALUES ('old', 'm', 1, 1)")
    old = ["assistant", "<think>old way</think>kept", 1, "stop", None, None, None, None, "m", "[1,2]", None]
    c.execute("INSERT INTO messages (conversation_id, position, role, content, created_at, finish_reason, metrics, "
              "profile, sampler, seed, model, token_ids, traces) VALUES (1, 1, ?,?,?,?,?,?,?,?,?,?,?)", old)
    c.execute("INSERT INTO messages (conversation_id, position, role, content, created_at) VALUES "
              "(1, 0, 'user', 'hi', 1)")
    # A branch saved by version 3: its tail's messages have one value fewer than version 4's.
    c.execute("INSERT INTO forks (conversation_id, position, active, tails) VALUES (1, 1, 1, ?)",
              (json.dumps([{"messages": [["assistant", "older", 1, "stop", None, None, None, None, "m", None,
                                          None]], "forks": {}}, None]),))
    c.close()
    store = Store(db)
    assert store.version == 5 and (tmp_path / "conversations.db.v3.bak").exists()
    user, reply = store.messages(1)
    assert (reply.content, reply.reasoning, reply.token_ids) == ("<think>old way</think>kept", "", (1, 2))
    store.select_branch(1, 1, 0)  # the old branch comes back as rows of version 4
    assert store.messages(1)[1].content == "older"
    store.select_branch(1, 1, 1)
    new = store.add_message(1, ChatMessage("assistant", "answer", "stop", reasoning="why"))
    assert Store(db).messages(1)[-1].reasoning == "why" and new.reasoning == "why"
    store.update_message(1, new.position, ChatMessage("assistant", "answer 2", "stop", reasoning="why 2"))
    assert (Store(db).messages(1)[-1].content, Store(db).messages(1)[-1].reasoning) == ("answer 2", "why 2")


def test_the_template_authors_nudge_is_forced_before_the_close(thinking_engine: Engine,
                                                               greedy_short: SamplingProfile) -> None:
    import copy
    from dataclasses import replace

    from mlxchat.core.model.tokenizer import ChatTokenizer

    hf = copy.copy(thinking_engine.model.tokenizer.hf)
    hf.chat_template = '{%- set reasoning_budget_message = "Time is up, answering now." %}' + THINKING_TEMPLATE
    nudged = thinking_engine.with_model(replace(thinking_engine.model, tokenizer=ChatTokenizer(hf,
                                                thinking_engine.model.tokenizer.eos_ids)))
    result = nudged.generate(STORY, profile=greedy_short, max_tokens=24, reasoning_budget=3)
    assert result.metrics.reasoning_tokens == 3  # the nudge is forced: not counted
    assert result.reasoning.endswith("\nTime is up, answering now.") and result.text
    assert "Time is up" not in result.text and "think>" not in result.text


def test_speculation_with_a_budget_is_refused_in_one_line() -> None:
    from mlxchat.core.decode.reply import Request

    with pytest.raises(ValueError, match="reasoning_budget does not combine with speculative decoding"):
        Request.make(speculative="ngram", reasoning=Reasoning(budget=4))


@pytest.fixture(scope="module")
def special_engine(thinking_engine: Engine) -> Engine:
    """The thinking model with its markers as single special tokens (two of the vocabulary's control tokens
    renamed), which a plain decode skips: the tokenizer built by the real GGUF path from the changed metadata."""
    from dataclasses import replace

    from mlxchat.core.model.tokenizer import from_gguf_metadata
    from tests.model_files import embedded_metadata

    meta = dict(embedded_metadata())
    tokens = list(meta["tokenizer.ggml.tokens"])
    tokens[14], tokens[15] = MARKERS  # <jupyter_output>, <jupyter_script>: control tokens, never generated here
    meta.update({"tokenizer.ggml.tokens": tokens, "tokenizer.chat_template": THINKING_TEMPLATE})
    return thinking_engine.with_model(replace(thinking_engine.model, tokenizer=from_gguf_metadata(meta)))


def test_special_token_markers_and_a_branch_that_closes(special_engine: Engine,
                                                        greedy_short: SamplingProfile) -> None:
    tok = special_engine.model.tokenizer
    markers = markers_for(tok)
    assert markers is not None and (markers.open_ids, markers.close_ids) == ((14,), (15,)) and markers.hidden
    assert tok.decode([15]) == ""  # a plain decode drops it: the text layer puts it back while reasoning
    chat = special_engine.chat(profile=greedy_short, reasoning_budget=3)
    result = chat.send(STORY, max_tokens=10).wait()
    assert result.metrics.reasoning_tokens == 3 and result.token_ids[3] == 15 and result.token_ids.count(15) == 1
    assert result.reasoning and result.text and "think>" not in result.text
    # A branch that keeps two reasoning tokens and then takes the closing token itself (as a model that closes on
    # its own): the reasoning ends there, the answer follows, through the forced-ids path (Reply.force).
    branch = chat.branch(-1, 2, 15, max_tokens=10).wait()
    assert branch.token_ids[:3] == (*result.token_ids[:2], 15)
    assert branch.reasoning == tok.decode(result.token_ids[:2]).strip() and branch.text
    assert branch.metrics.reasoning_tokens == 2 and "think>" not in branch.text


def test_speculation_without_a_budget_splits_the_same(thinking_engine: Engine, greedy_short: SamplingProfile) -> None:
    plain = thinking_engine.generate(STORY, profile=greedy_short, max_tokens=12, enable_thinking=False)
    guessed = thinking_engine.generate(STORY, profile=greedy_short, max_tokens=12, enable_thinking=False,
                                       speculative="ngram")
    assert (guessed.reasoning, guessed.text) == (plain.reasoning, plain.text)
    thought = thinking_engine.generate(STORY, profile=greedy_short, max_tokens=12, speculative="ngram")
    assert thought.reasoning and thought.text == "" and thought.metrics.reasoning_tokens == 12


def test_export_folds_the_reasoning() -> None:
    from mlxchat.app.export import markdown
    from mlxchat.app.turns import Turn
    from mlxchat.core.chat.messages import ChatMessage

    reply = ChatMessage("assistant", "It is 4.", "stop", {"reasoning_tokens": 5, "reasoning_s": 0.25},
                        reasoning="2 and 2 make 4.")
    text = markdown("Sum", [Turn(ChatMessage("user", "2+2?")), Turn(reply)], now=0)
    assert ("<details>\n<summary>thought for 0.2 s · 5 tokens</summary>\n\n2 and 2 make 4.\n\n</details>\n\nIt is 4."
            in text)
