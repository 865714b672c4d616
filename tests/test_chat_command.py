"""`mlxchat chat`'s flags (issue 27 item 10): the same as `generate`'s (mlx_lm.chat's --system, --profile, the
sampler flags, --max-kv-size), applied to the TUI's new chat; and config.toml's `reopen_last`. The app is built from
the flags the way `mlxchat chat` builds it (`cli.chat_options`), on the session's engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxchat.app.cli import build_parser, chat_options, main, parse_args
from mlxchat.app.store import Store
from mlxchat.core.chat.messages import ChatMessage

SIZE = (100, 30)


def options(*argv: str) -> dict:
    return chat_options(build_parser().parse_args(["chat", *argv]))


@pytest.fixture(autouse=True)
def folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLXCHAT_DATA_DIR", str(tmp_path / "data"))  # where the new_app fixture puts them too
    monkeypatch.setenv("MLXCHAT_CONFIG_DIR", str(tmp_path / "config"))


def test_chat_and_generate_take_the_same_reply_flags() -> None:
    def flags(command: str) -> set[str]:
        parser = build_parser()
        sub = next(a for a in parser._actions if a.dest == "command").choices[command]  # noqa: SLF001 - argparse's
        return {s for a in sub._actions for s in a.option_strings}  # noqa: SLF001 - only way to list flags

    shared = {"--model", "--max-tokens", "--temperature", "--top-p", "--top-k", "--min-p", "--seed", "--profile",
              "--stop", "--system", "--context-policy", "--kv-window", "--max-kv-size"}
    assert shared <= flags("chat") and shared <= flags("generate")


@pytest.mark.anyio
async def test_the_flags_set_up_the_new_chat(new_app, wait_for) -> None:
    app = new_app(**options("--profile", "precise", "--temperature", "0.3", "--top-k", "5", "--seed", "7",
                            "--stop", "END", "--system", "Be brief.", "--max-kv-size", "64", "--max-tokens", "9"))
    async with app.run_test(size=SIZE) as pilot:
        controller = app.chat_screen.controller
        await wait_for(pilot, lambda: controller.session is not None, what="the engine")
        p = controller.profile
        assert (p.name, p.temperature, p.top_k, p.seed, p.stop) == ("precise", 0.3, 5, 7, ["END"])
        assert controller.system_prompt == "Be brief." and controller.max_tokens == 9
        assert (controller.context_policy, controller.kv_window) == ("rotate", 64)
        await app.chat_screen.action_new_chat()  # every new chat of the session starts from them
        assert controller.profile.temperature == 0.3 and controller.system_prompt == "Be brief."


@pytest.mark.parametrize("argv, expected", [
    (["--temperature", "3"], "temperature must be between 0 and 2"),
    (["--profile", "wild"], "unknown profile 'wild'"),
    (["--kv-window", "8"], "--kv-window must be at least 16 tokens"),
    (["--context-policy", "error", "--max-kv-size", "64"], "--kv-window goes with --context-policy rotate"),
])
def test_bad_chat_flags_are_one_line_before_the_app_opens(argv: list[str], expected: str, capsys) -> None:
    assert main(["chat", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mlxchat: error: ") and expected in err and err.count("\n") == 1


def test_the_chats_flags_without_the_chat_subcommand_open_the_chat() -> None:
    args = parse_args(["--model", "other.gguf", "--temperature", "0"])  # was an argparse error
    assert (args.command, args.model, args.temperature) == ("chat", "other.gguf", 0)
    assert parse_args([]).command == "chat" and parse_args(["models"]).command == "models"
    assert parse_args(["generate", "hi"]).command == "generate"


def test_a_bad_flag_without_the_subcommand_is_the_chats_one_line(capsys) -> None:
    assert main(["--temperature", "3"]) == 2
    assert "temperature must be between 0 and 2" in capsys.readouterr().err


def _saved_chat(tmp_path: Path) -> int:
    store = Store(tmp_path / "data" / "conversations.db")
    conversation = store.create_conversation("about lighthouses")
    store.add_message(conversation.id, ChatMessage("user", "Tell me about lighthouses."))
    store.close()
    return conversation.id


@pytest.mark.anyio
async def test_reopen_last_opens_the_last_chat_unless_the_command_line_asks_for_a_new_one(
        tmp_path: Path, new_app, wait_for) -> None:
    saved = _saved_chat(tmp_path)
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.toml").write_text("reopen_last = true\n")
    app = new_app(**options())
    async with app.run_test(size=SIZE) as pilot:
        controller = app.chat_screen.controller
        await wait_for(pilot, lambda: controller.record is not None, what="the last chat")
        assert controller.record.id == saved and controller.turns[0].content == "Tell me about lighthouses."
    for argv in (["--new"], ["--system", "Be brief."]):
        app = new_app(**options(*argv))
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause(0.2)
            assert app.chat_screen.controller.record is None


@pytest.mark.anyio
async def test_without_reopen_last_the_app_starts_a_new_chat(tmp_path: Path, new_app) -> None:
    _saved_chat(tmp_path)
    app = new_app(**options())
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause(0.2)
        assert app.chat_screen.controller.record is None
