"""The TUI when a split model loses a machine (issue 16): the failed reply says which rank failed, a notification
says how to go on, and picking the same model in the model picker (F3) loads it on this machine, where the
conversation goes on. The split engine is simulated (every reply fails as a lost peer makes it fail, and the engine
reports itself unusable): tests/test_distributed_procs.py covers the real processes."""

from __future__ import annotations

import pytest

from mlxchat.app.screens import ModelPicker
from mlxchat.core import Engine
from mlxchat.core.distributed.leader import PeerLostError
from mlxchat.core.engine import Job, Stream

SIZE = (100, 40)


@pytest.mark.anyio
async def test_a_lost_machine_leaves_the_tui_usable_and_f3_reloads_here(engine: Engine, new_app, wait_for, send,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    lost = PeerLostError(1, "10.0.0.2:5000", "it closed the connection (the process ended)")

    def failing(self: Engine, fn: object) -> Stream:
        job = Job(fn)  # type: ignore[arg-type]
        job.fail(lost)
        return Stream(job)

    app = new_app()
    async with app.run_test(size=SIZE) as pilot:
        screen = app.chat_screen
        await wait_for(pilot, lambda: screen.controller.session is not None, what="the engine")
        with monkeypatch.context() as m:
            m.setattr(Engine, "submit", failing)
            m.setattr(Engine, "usable", property(lambda self: self is not engine))  # the session's engine "split"
            screen.input.focus()
            await send(pilot, "Hello")
            await wait_for(pilot, lambda: any("split model stopped" in (n.title or "") for n in app._notifications),
                           what="the notification")
            assert any("rank 1 (10.0.0.2:5000) failed" in n.message for n in app._notifications)
            await pilot.press("f3")
            picker = app.screen
            assert isinstance(picker, ModelPicker)
            picker.action_load()  # the model in use, highlighted first: loaded again, on this machine
            await wait_for(pilot, lambda: screen.controller.engine is not engine and not screen.busy, timeout=60,
                           what="the model loaded on this machine")
        assert app.store.conversations()[0].title  # the conversation is stored
        screen.input.focus()
        await send(pilot, "Hello")
        await wait_for(pilot, lambda: screen.controller.last_result is not None, timeout=60, what="a reply")
