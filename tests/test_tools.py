"""core/decode/tools.py, the protocol-neutral tool calls (issues 22 and 36): the grammar each tool_choice gives (one
call when one is forced, no call twice, arguments held to their closed schema, no markup in text), calls taken out of a
whole or streamed reply, tool messages rendered generically or through a template's `tools` variable, and the same rules
in the Python API (`engine.generate(..., tools=...)`)."""

from __future__ import annotations

import copy
import json

import jsonschema
import mlx.core as mx
import pytest

from mlxchat.core import Engine, SamplingProfile
from mlxchat.core.sampling.candidates import Candidates
from mlxchat.core.sampling.constraint import constraint_for
from mlxchat.core.sampling.response_format import ResponseFormat, closed
from mlxchat.core.model.tokenizer import ChatTokenizer
from mlxchat.core.decode import tools
from mlxchat.core.decode.tools import CallStream, RepeatedCall, Tool, ToolCall, ToolChoice, ToolError, ToolUse

CITY = {"type": "object", "properties": {"city": {"type": "string"},
                                         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}  # no additionalProperties: read as false
WEATHER_SPEC = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                 "parameters": CITY}}
TIME_SPEC = {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone",
                                              "parameters": {"type": "object", "required": ["timezone"],
                                                             "properties": {"timezone": {"type": "string"}}}}}
WEATHER = Tool.from_openai(WEATHER_SPEC, 0)
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
HISTORY = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": "", "tool_calls": [
               {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
MARKUP = ("<tool_call", "</tool_call")


def feed(text: str, step: int = 1) -> list[str | ToolCall]:
    stream = CallStream()
    return [p for i in range(0, len(text), step) for p in stream.feed(text[i:i + step])]


def test_a_reply_is_text_or_calls_and_a_repeat_or_an_unfinished_call_is_dropped() -> None:
    assert feed("Hello <b>", 3) == ["Hel", "lo ", "<b>"]
    rome = CALL.replace("Paris", "Rome")
    for step in (1, 7, 1000):  # streamed by characters, by pieces, whole: the same calls
        calls = feed(CALL + "\n" + rome + "\n" + CALL, step)  # the third repeats the first: dropped
        assert [(c.name, json.loads(c.arguments)) for c in calls] == \
            [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
        assert calls[0].id != calls[1].id
        assert [type(p) for p in feed(CALL + "\n" + rome[:30], step)] == [ToolCall]  # cut in the second call
        assert feed(CALL[:20], step) == []  # cut in the first: no call, and no markup as text
    # The same arguments written in another key order are the same call.
    assert len(feed(CALL + "\n" + CALL.replace('{"city": "Paris"}', '{ "city":"Paris" }'))) == 1

    # The constraint's side: True once a repeat has closed, fed the bytes of tokens however they split.
    repeated = RepeatedCall()
    text = (CALL + "\n" + rome + "\n" + CALL).encode()
    answers = [repeated(text[i:i + 5]) for i in range(0, len(text), 5)]
    assert answers[-1] and not any(answers[:-1])


def test_schemas_are_closed_and_what_the_constraint_cannot_enforce_is_refused_by_name() -> None:
    nested = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}}},
                                               "free": {"type": "object"},
                                               "properties": {"type": "string"}},  # a property named "properties"
              "$defs": {"P": {"properties": {"x": {"type": "integer"}}}},
              "allOf": [{"properties": {"y": {"type": "integer"}}}]}
    out = closed(nested)
    assert out["additionalProperties"] is False and out["properties"]["a"]["additionalProperties"] is False
    assert "additionalProperties" not in out["properties"]["free"]  # a bare object stays any object
    assert out["properties"]["properties"] == {"type": "string"} and out["$defs"]["P"]["additionalProperties"] is False
    assert "additionalProperties" not in out["allOf"][0]  # closing a branch would forbid the others' properties
    assert closed({"properties": {}, "additionalProperties": True})["additionalProperties"] is True

    with pytest.raises(ValueError, match=r"response_format.json_schema.schema: the constraint cannot enforce the JSON "
                                         r"Schema keyword\(s\) uniqueItems"):
        ResponseFormat(type="json_schema", json_schema={"schema": {"type": "array", "uniqueItems": True}})
    for params, field, says in [
            ("city", "tools[0].function.parameters", "must be a JSON Schema object"),
            ({"type": "string"}, "tools[0].function.parameters", "must be a schema of \"type\": \"object\""),
            ({"type": "object", "properties": {"a": {"not": {"type": "null"}}}}, "tools[0].function.parameters",
             "the constraint cannot enforce the JSON Schema keyword(s) not"),
            ({"type": "strin"}, "tools[0].function.parameters", "")]:
        with pytest.raises(ToolError) as e:
            tools.parse_tools([{"type": "function", "function": {"name": "f", "parameters": params}}])
        assert e.value.field == field and says in str(e.value), str(e.value)
    for raw, field in [([{"type": "function", "function": {"name": "a b"}}], "tools[0].function.name"),
                       ([{"type": "function", "function": {"name": "f"}}] * 2, "tools[1].function.name")]:
        with pytest.raises(ToolError) as e:
            tools.parse_tools(raw)
        assert e.value.field == field
    with pytest.raises(ToolError, match="tool_choice.function.name: 'clock' is not one of the tools: get_weather"):
        ToolUse.make([WEATHER_SPEC], {"type": "function", "function": {"name": "clock"}})
    with pytest.raises(ToolError, match="tool_choice: 'required' needs tools"):
        tools.parse_tool_choice("required", [])
    assert tools.parse_tool_choice(None, [WEATHER]) == ToolChoice("auto")
    assert tools.parse_tool_choice(None, []) == ToolChoice("none")


def grammar(use: ToolUse) -> str:
    fmt = use.response_format()
    assert fmt is not None
    return fmt.grammar


def test_a_forced_function_is_one_call_and_parallel_calls_may_end_after_each() -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert "calls: call\n" in grammar(ToolUse.make([WEATHER_SPEC, TIME_SPEC], named))  # parallel or not: one call
    assert "calls: call\n" in grammar(ToolUse.make([WEATHER_SPEC], "required", parallel_tool_calls=False))
    assert 'calls: call ("\\n" call)*' in grammar(ToolUse.make([WEATHER_SPEC], "required"))
    assert ToolUse.make([WEATHER_SPEC], "none").shown == []  # and text without markup: see the next test
    assert ResponseFormat.model_validate(ToolUse.make([WEATHER_SPEC], named).response_format().model_dump()).label() \
        == "Grammar(tool calls: get_weather)"


def test_the_grammars_hold_calls_to_their_schema_and_text_to_no_markup(engine: Engine) -> None:
    tok = engine.model.tokenizer

    def constraint(use: ToolUse, ends: RepeatedCall | None = None):  # noqa: ANN202 - the constraint stage
        return constraint_for(use.response_format(), tok, engine.model.vocab_size, ends)

    auto = ToolUse.make([WEATHER_SPEC, TIME_SPEC])
    for text in ("It is sunny.", "Use x < y, not <b>.", CALL, CALL + "\n" + CALL.replace("Paris", "Rome")):
        constraint(auto).replay(tok.encode(text))
    for bad in ('<tool_call>{"name": "x"',  # a call to no tool
                "Sure. <tool_call>",  # call markup inside text
                "Done.</tool_call>",
                '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "type": "x"',  # a key not in it
                '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "city"',  # a key twice
                '<tool_call>{"name": "get_weather", "arguments": {"unit"',  # required city first
                '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "kelvin"'):  # not an enum
        with pytest.raises(ValueError, match="does not fit the response format"):
            constraint(auto).replay(tok.encode(bad))
    none = ToolUse.make([WEATHER_SPEC], "none")
    constraint(none).replay(tok.encode("It is sunny, x < y."))
    with pytest.raises(ValueError, match="does not fit the response format"):  # "none" still never writes a call
        constraint(none).replay(tok.encode("Sure. <tool_call>"))
    with pytest.raises(ValueError, match="does not fit the response format"):  # a forced function: one call
        constraint(ToolUse.make([WEATHER_SPEC], {"type": "function", "function": {"name": "get_weather"}})) \
            .replay(tok.encode(CALL + "\n<tool"))

    # A repeat ends the reply: once it has closed, an end-of-turn id is the only token left.
    zeros = Candidates(mx.zeros((engine.model.vocab_size,)), None)
    for text, ended in ((CALL + "\n" + CALL.replace("Paris", "Rome"), False), (CALL + "\n" + CALL, True)):
        stage = constraint(ToolUse.make([WEATHER_SPEC], "required"), RepeatedCall())
        stage.replay(tok.encode(text))
        allowed = {i for i, v in enumerate(stage(zeros).logits.tolist()) if v > -1e30}
        assert (allowed <= set(tok.eos_ids)) == ended and allowed & set(tok.eos_ids)


def test_generic_rendering_puts_specs_calls_and_results_into_plain_messages() -> None:
    messages, template_tools = tools.render_messages(HISTORY, [WEATHER], template_knows_tools=False)
    assert template_tools is None and [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith("Be brief.\n\nYou may call these functions") and \
        '"name": "get_weather"' in messages[0]["content"]
    assert messages[2]["content"] == CALL
    assert messages[3]["content"] == '<tool_response>{"tool_call_id": "call_1", "content": "sunny"}</tool_response>'


def test_a_template_with_tools_renders_them(engine: Engine) -> None:
    tok = engine.model.tokenizer
    hf = copy.copy(tok.hf)
    hf.chat_template = ("{% for t in tools %}TOOL {{ t.function.name }}|{% endfor %}{% for m in messages %}"
                        "{{ m.role }}: {{ m.content }}{% for c in m.tool_calls or [] %}CALL {{ c.function.name }}"
                        "{{ c.function.arguments | tojson }}{% endfor %}|{% endfor %}")
    templated = ChatTokenizer(hf, tok.eos_ids)
    assert templated.knows_tools and not tok.knows_tools
    messages, template_tools = tools.render_messages(HISTORY, [WEATHER], templated.knows_tools)
    text = templated.render(messages, add_generation_prompt=False, tools=template_tools)
    assert text == ('TOOL get_weather|system: Be brief.|user: Weather in Paris?|assistant: CALL get_weather'
                    '{"city": "Paris"}|tool: sunny|')


SCHEMAS = {"get_weather": CITY, "get_time": TIME_SPEC["function"]["parameters"]}


def check_reply(result, choice: object, parallel: bool | None) -> None:  # noqa: ANN001 - a GenerationResult
    """What a reply with tools promises: calls end (never "length"), valid under their schema and never twice, as
    many as the choice allows, and no markup in the text. A text reply (auto) may run to max_tokens as any text
    does: the seed model can loop in prose ("fashion, fashion, ...", seed 1), which is not a tool call's doing."""
    calls = result.tool_calls
    text_reply = choice == "auto" and not calls
    assert result.finish_reason in (("stop", "length") if text_reply else ("stop",)), (choice, parallel, result)
    assert not any(m in result.text for m in MARKUP)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert len({(c.name, json.dumps(json.loads(c.arguments), sort_keys=True)) for c in calls}) == len(calls)
    if isinstance(choice, dict):
        assert [c.name for c in calls] == [choice["function"]["name"]]
    elif choice == "required":
        assert len(calls) == 1 if parallel is False else len(calls) >= 1
    else:  # auto: text, or calls and no text
        assert bool(calls) != bool(result.text.strip())


@pytest.mark.parametrize("choice,parallel", [({"type": "function", "function": {"name": "get_weather"}}, None),
                                             ("required", None), ("required", False), ("auto", None)])
def test_the_python_api_makes_calls_that_end(engine: Engine, choice: object, parallel: bool | None) -> None:
    # tests/test_tool_clients.py runs the whole matrix (seeds 1-3, streamed or not) through the server.
    for specs, profile in [([WEATHER_SPEC], SamplingProfile(temperature=0)),
                           ([WEATHER_SPEC, TIME_SPEC], SamplingProfile(temperature=0)),
                           ([WEATHER_SPEC, TIME_SPEC], SamplingProfile(temperature=0.7, seed=1))]:
        stream = engine.stream("What is the weather in Paris?", profile=profile, max_tokens=200, tools=specs,
                               tool_choice=choice, parallel_tool_calls=parallel)
        events = list(stream)
        result = events[-1].result
        check_reply(result, choice, parallel)
        streamed = [e for e in events[:-1] if hasattr(e, "tool_calls")]
        assert "".join(e.text for e in streamed) == result.text
        assert tuple(c for e in streamed for c in e.tool_calls) == result.tool_calls


def test_a_reply_cut_inside_a_call_keeps_the_calls_that_closed(engine: Engine) -> None:
    # Greedy, "required" with two tools makes two calls, of ~35 and ~30 tokens (measured): 50 cuts the second one.
    whole = engine.generate("What is the weather in Paris?", profile=SamplingProfile(temperature=0), max_tokens=200,
                            tools=[WEATHER_SPEC, TIME_SPEC], tool_choice="required")
    assert whole.finish_reason == "stop" and len(whole.tool_calls) == 2
    cut = engine.generate("What is the weather in Paris?", profile=SamplingProfile(temperature=0), max_tokens=50,
                          tools=[WEATHER_SPEC, TIME_SPEC], tool_choice="required")
    assert cut.finish_reason == "length" and cut.text == "" and \
        [(c.name, c.arguments) for c in cut.tool_calls] == [(whole.tool_calls[0].name, whole.tool_calls[0].arguments)]
    with pytest.raises(ValueError, match="response_format and tool_choice 'required' both constrain"):
        engine.generate("Hi", profile=SamplingProfile(response_format={"type": "json_object"}), tools=[WEATHER_SPEC],
                        tool_choice="required")
    with pytest.raises(ToolError, match=r"tools\[0\].function.parameters"):
        engine.generate("Hi", tools=[{"type": "function", "function": {"name": "f", "parameters": []}}])


def test_tool_choice_none_answers_in_text_even_after_calls_in_the_history(engine: Engine) -> None:
    # The history shows the model a call written as markup (the generic rendering); "none" must not imitate it.
    history = [*HISTORY[1:], {"role": "user", "content": "And in Rome?"}]
    r = engine.generate(history, profile=SamplingProfile(temperature=0), max_tokens=40, tools=[WEATHER_SPEC],
                        tool_choice="none")
    assert not r.tool_calls and r.text.strip() and not any(m in r.text for m in MARKUP)
    assert r.sampler.startswith("Grammar(text, no tool calls)")
