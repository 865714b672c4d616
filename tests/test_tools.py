"""server/tools.py, the protocol-neutral tool calls (issue 22): the grammar each tool_choice gives, calls parsed from a
whole or streamed reply, and tool messages rendered generically or through a template's `tools` variable."""

from __future__ import annotations

import copy
import json

import pytest

from mlxchat.core import Engine, SamplingProfile
from mlxchat.core.constraint import constraint_for
from mlxchat.core.tokenizer import ChatTokenizer
from mlxchat.server import tools
from mlxchat.server.tools import CallStream, Tool, ToolCall, ToolChoice, ToolError

WEATHER = Tool.from_openai({"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}, 0)
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
HISTORY = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": "", "tool_calls": [
               {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


def test_calls_parse_whole_and_streamed_and_text_streams_at_once() -> None:
    assert tools.split_reply("Hello") == ["Hello"]
    calls = tools.split_reply(CALL + "\n" + CALL.replace("Paris", "Rome"))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == \
        [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    cut = tools.split_reply(CALL + "\n" + CALL[:30])  # max_tokens in the second call: the first still counts
    assert isinstance(cut[0], ToolCall) and cut[1:] == ["\n" + CALL[:30]]
    stream = CallStream()
    pieces = [p for ch in CALL + "\n" + CALL for p in stream.feed(ch)] + stream.finish()
    assert [type(p) for p in pieces] == [ToolCall, ToolCall] and pieces[0].id != pieces[1].id
    text = CallStream()
    assert text.feed("H") == ["H"] and text.feed("i <b>") == ["i <b>"] and text.finish() == []
    cut = CallStream()
    assert cut.feed(CALL[:20]) == [] and cut.finish() == [CALL[:20]]  # max_tokens inside a call: text, not a call


def test_choices_and_bad_specs_name_the_field() -> None:
    assert tools.parse_tool_choice(None, [WEATHER]) == ToolChoice("auto")
    assert tools.parse_tool_choice(None, []) == ToolChoice("none") and tools.response_format([], ToolChoice("none")) \
        is None
    named = tools.response_format([WEATHER], tools.parse_tool_choice(
        {"type": "function", "function": {"name": "get_weather"}}, [WEATHER]), parallel=False)
    assert SamplingProfile(response_format=named).describe_chain() == "Grammar(tool calls: get_weather) → sample"
    for raw, field in [([{"type": "function", "function": {"name": "a b"}}], "tools[0].function.name"),
                       ([{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}],
                        "tools[0].function.parameters"),
                       ([{"type": "function", "function": {"name": "f"}}] * 2, "tools[1].function.name")]:
        with pytest.raises(ToolError) as e:
            tools.parse_tools(raw)
        assert e.value.field == field
    with pytest.raises(ToolError, match="tool_choice: 'required' needs tools"):
        tools.parse_tool_choice("required", [])


def test_generic_rendering_puts_specs_calls_and_results_into_plain_messages() -> None:
    messages, template_tools = tools.render_messages(HISTORY, [WEATHER], template_knows_tools=False)
    assert template_tools is None and [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith("Be brief.\n\nYou may call these functions") and \
        '"name": "get_weather"' in messages[0]["content"]
    assert messages[2]["content"] == CALL
    assert messages[3]["content"] == '<tool_response>{"tool_call_id": "call_1", "content": "sunny"}</tool_response>'


def test_grammars_constrain_calls_and_a_template_with_tools_renders_them(engine: Engine) -> None:
    tok = engine.model.tokenizer
    auto = SamplingProfile(response_format=tools.response_format([WEATHER], ToolChoice("auto"))).response_format
    for text in ("It is sunny.", CALL, CALL + "\n" + CALL):
        constraint_for(auto, tok, engine.model.vocab_size).replay(tok.encode(text))
    with pytest.raises(ValueError, match="does not fit the response format"):  # a call to no tool
        constraint_for(auto, tok, engine.model.vocab_size).replay(tok.encode('<tool_call>{"name": "x"'))
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
