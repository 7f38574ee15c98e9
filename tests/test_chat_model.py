"""ToTChatModel: the langchain-tests standard unit tests, then integration on the scripted
backend (and on the embedded engine with the Game-of-24 models when they are present)."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

from spec_tot.adapters.scripted import ScriptedBackend
from spec_tot.chat_model import ToTChatModel
from spec_tot.errors import ConfigError
from spec_tot.graphs.toy import compile_toy

pytest.importorskip("langchain_tests")
from langchain_tests.unit_tests import ChatModelUnitTests


def _toy_app() -> Any:
    return compile_toy(backend=ScriptedBackend(), search="beam", search_params={"n": 4, "width": 2})


class TestToTChatModelStandard(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ToTChatModel]:
        return ToTChatModel

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"app": _toy_app()}


def test_invoke_answers_with_tree_and_metrics() -> None:
    model = ToTChatModel(app=_toy_app(), extra_state={"target": "24"})
    reply = model.invoke([SystemMessage("be brief"), HumanMessage("toy puzzle 0")])
    assert isinstance(reply, AIMessage)
    direct = _toy_app().invoke({"question": "toy puzzle 0", "target": "24"})
    assert reply.content == direct.answer
    meta = reply.response_metadata
    assert meta["status"] == "ok" and meta["score"] == direct.score
    assert meta["solved"] == (direct.answer == "24")
    assert meta["tree"]["question"] == "toy puzzle 0"
    assert len(meta["tree"]["nodes"]) == len(direct.tree)
    assert meta["metrics"]["queries"] == 1


async def test_ainvoke_batch_and_stop() -> None:
    model = ToTChatModel(app=_toy_app())
    replies = await model.abatch(["toy puzzle 1", "toy puzzle 2"])
    assert all(isinstance(r.content, str) and r.content for r in replies)
    cut = await model.ainvoke("toy puzzle 1", stop=["4"])
    assert "4" not in str(cut.content)


async def test_sync_invoke_inside_a_running_loop() -> None:
    reply = ToTChatModel(app=_toy_app()).invoke("toy puzzle 3")
    assert reply.response_metadata["status"] == "ok"


def test_needs_a_human_message() -> None:
    with pytest.raises(ConfigError, match="human message"):
        ToTChatModel(app=_toy_app()).invoke([SystemMessage("hi")])


def test_game24_on_the_embedded_engine() -> None:
    from spec_tot.graphs import game24, game24_task

    try:
        options = game24.PROGRAM.backend_options("local")
        ready = all((game24_task.asset_dir(k) / "config.json").exists() for k in ("policy", "prm"))
    except Exception as exc:  # the asset helpers may refuse when the folders are absent
        pytest.skip(f"Game-of-24 models not available: {exc}")
    if not ready:
        pytest.skip("Game-of-24 models not in graphs/assets/game24/{policy,prm}")
    app = game24.compile_game24(
        backend="local",
        backend_options=options,
        search="beam",
        search_params={"n": 4, "width": 2, "max_depth": 3},
    )
    puzzle = game24.game24_inputs(1)[0]
    reply = ToTChatModel(app=app).invoke(puzzle["question"])
    assert reply.response_metadata["status"] == "ok"
    assert reply.response_metadata["tree"]["nodes"]
