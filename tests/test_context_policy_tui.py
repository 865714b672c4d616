"""The TUI's context policy (issue 12 item 7): config.toml's ``context_policy`` (and the palette's Context policy
commands, through ``ChatController.set_context_policy``) choose what a chat longer than the context does, and a
refusal names the TUI's setting, never a CLI flag or Python advice."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxchat.app.config import ConfigError, Settings
from mlxchat.app.conversation import ChatController
from mlxchat.app.store import Store
from mlxchat.core import Engine, SamplingProfile
from mlxchat.core.decode.events import Done

# ~110 tokens each: two of them and the template overflow the tiny model's context of 256.
FIRST = "Tell me about the sea. " + "The sea is wide and deep and blue. " * 12
SECOND = "Tell me about the hills. " + "The hills are green and high and old. " * 12


@pytest.fixture(scope="module")
def tiny_engine(tiny: Path) -> Engine:
    e = Engine.load(str(tiny))
    yield e
    e.close()


def controller(engine: Engine, tmp_path: Path, policy: str) -> ChatController:
    c = ChatController(Store(tmp_path / f"{policy}.db"), default_profile=lambda: SamplingProfile(temperature=0),
                       default_system="Be brief.", max_tokens=3, context_policy=policy)  # type: ignore[arg-type]
    c.engine_ready(engine, None, owned=False)
    return c


def finish(c: ChatController, reply) -> str:  # noqa: ANN001 - app.conversation.Reply
    """Follow the reply as the bridge thread does; the line the chat shows if it failed, else ""."""
    try:
        for event in reply.stream:
            if isinstance(event, Done):
                c.on_finished(reply.stream, event.result)
                return ""
    except Exception as e:  # noqa: BLE001 - what the bridge posts as Failed
        return c.on_failed(reply.stream, e)[1]
    raise AssertionError("the stream ended without Done")


def test_truncate_drops_the_oldest_turn_and_error_refuses_naming_the_tui_setting(tiny_engine, tmp_path) -> None:
    c = controller(tiny_engine, tmp_path, "truncate")
    assert finish(c, c.send(FIRST)) == ""
    assert finish(c, c.send(SECOND)) == ""  # went through without the first turn
    assert c.last_result is not None and c.last_result.metrics.prompt_tokens < 256

    c = controller(tiny_engine, tmp_path, "error")
    assert finish(c, c.send(FIRST)) == ""
    message = finish(c, c.send(SECOND))
    assert "context of 256" in message and "context_policy" in message and "truncate" in message
    assert "--context-policy" not in message and "max_kv_size" not in message and "errors=" not in message
    c.set_context_policy("truncate")  # the palette's "Context policy: truncate"
    assert finish(c, c.resend(SECOND)) == ""


def test_a_single_message_longer_than_the_context_names_rotate(tiny_engine, tmp_path) -> None:
    c = controller(tiny_engine, tmp_path, "truncate")
    message = finish(c, c.send(FIRST * 3))
    assert "context of 256" in message and "context_policy to rotate" in message and "--" not in message
    c.set_context_policy("rotate")
    assert finish(c, c.resend(FIRST * 3)) == ""


def test_config_context_policy_and_kv_window(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text('context_policy = "error"\n')
    assert Settings.load(path).context_policy == "error"
    path.write_text("kv_window = 512\n")  # a window alone keeps meaning a rotating one
    assert Settings.load(path).context_policy == "rotate"
    path.write_text('kv_window = 512\ncontext_policy = "truncate"\n')
    with pytest.raises(ConfigError, match='kv_window goes with context_policy = "rotate", not "truncate"'):
        Settings.load(path)
    path.write_text('context_policy = "drop"\n')
    with pytest.raises(ConfigError, match="context_policy: Input should be 'truncate', 'rotate' or 'error'"):
        Settings.load(path)
