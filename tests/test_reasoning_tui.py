"""A thinking model in the TUI (issue 40): its reasoning streams into a collapsed block above the answer ("thought
for 0.1 s · 4 tokens", expanded to read), both are stored, the stats line says when the answer began, and a
reopened chat shows the block again. The model: tests/thinking_models.py, with config.toml's reasoning_budget."""

from __future__ import annotations

import pytest

from mlxchat.app.widgets.transcript import ThinkingBlock

SIZE = (100, 40)
BUDGET = 3


@pytest.mark.anyio
async def test_thinking_block_streams_collapsed_and_is_stored(thinking_engine, new_app, wait_for, ready, reply):
    app = new_app(engine=thinking_engine, max_tokens=10, settings={"reasoning_budget": BUDGET},
                  sampling={"temperature": 0.0})
    async with app.run_test(size=SIZE) as pilot:
        screen = await ready(pilot)
        result = await reply(pilot, "Write a story about a cat.")
        assert result.reasoning and result.text and result.metrics.reasoning_tokens == BUDGET
        view = screen.transcript.messages[-1]
        block = view.query_one(ThinkingBlock)
        assert block.collapsed and block.title.startswith("thought for ") and block.title.endswith(
            f" · {BUDGET} tokens")
        assert view.text == result.text and "think>" not in view.text  # the answer alone, below the block
        assert block.text == result.reasoning
        assert "to the answer" in view.stats and "to first token" in view.stats
        block.collapsed = False  # expanded: the reasoning is there to read
        await pilot.pause()
        assert str(block.query_one(".thinking-text").render()) == result.reasoning
        [conv] = app.store.conversations()
        stored = app.store.messages(conv.id)[-1]
        assert (stored.content, stored.reasoning) == (result.text, result.reasoning)
    again = new_app(engine=thinking_engine, settings={"reopen_last": True})
    async with again.run_test(size=SIZE) as pilot:
        screen = await ready(pilot)
        await wait_for(pilot, lambda: len(screen.transcript.messages) == 2, what="the reopened chat")
        shown = screen.transcript.messages[-1].query_one(ThinkingBlock)
        assert shown.text == result.reasoning and shown.title.startswith("thought for ")
