"""The engine core in its own process: typed messages, start on first use, crash and
restart, no orphans when the backend's process dies (SIGKILL, SIGTERM, Ctrl-C), clean
close, the PRM in a process of its own, and the in-thread engine kept for debugging."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from engine_fixtures import assert_backend_free, make_backend, tiny_llama, tiny_prm

from spec_tot.adapters.local.config import EngineConfig, PrmConfig
from spec_tot.adapters.local.core.messages import (
    PROTOCOL,
    Add,
    CommandCodec,
    ErrorInfo,
    OutputCodec,
    Score,
    Start,
    StepBatch,
)
from spec_tot.adapters.local.core.proc import _CLOSE_S
from spec_tot.errors import BackendError, ConfigError
from spec_tot.requests import (
    Completion,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    Priority,
    RewardItem,
    SamplingParams,
    StreamUpdate,
    TokenLogprob,
)

__all__ = ["make_backend", "tiny_llama", "tiny_prm"]

LONG = SamplingParams(temperature=1.0, seed=1, max_tokens=400, ignore_eos=True)


def test_messages_cross_as_typed_msgpack_not_pickle() -> None:
    params = SamplingParams(temperature=0.5, stop=("\n",), logprobs=2, seed=7)
    request = GenerateRequest("q/1", params, prompt="hi", n=3, priority=Priority.SPECULATIVE)
    start = Start(PROTOCOL, EngineConfig(model_config={"hidden_size": 8}), PrmConfig("p"), None)
    commands = [start, Add(5, request, True), Score(2, [RewardItem("r", "q", ("a", "b"))])]
    frame = CommandCodec().encode(commands)
    assert b"\x80\x04" not in frame[:2]  # not a pickle stream: MessagePack
    assert msgspec.msgpack.decode(frame)[1]["request"]["prompt"] == "hi"  # plain data
    assert CommandCodec().decode(frame) == commands
    completion = Completion("x", (1, 2), 2, FinishReason.LENGTH, (TokenLogprob(1, -0.5),), 3)
    batch = StepBatch(
        [(5, GenerateResult("q/1", (completion,), 2))],
        [(5, StreamUpdate("q/1", 0, (1,), "x"))],
        [(6, ErrorInfo.of(ConfigError("prompt", "too long")))],
        {"num_steps": 3.0, "num_drafted_tokens": 12.0},  # any counter crosses as it is
    )
    back = OutputCodec().decode(OutputCodec().encode(batch))
    assert back == batch
    error = back.failures[0][1].to_exception()
    assert isinstance(error, ConfigError) and error.field == "prompt" and "too long" in str(error)


async def test_the_core_runs_in_a_child_started_on_first_use(make_backend: Any) -> None:
    backend = make_backend()
    assert backend.stats() == {}  # nothing started yet
    pid = await backend.check_health()
    assert pid != os.getpid()
    assert backend.engine is None  # the engine lives in that process
    out = await backend.generate(GenerateRequest("a", SamplingParams(max_tokens=4), prompt="x"))
    assert out.completions[0].num_tokens <= 4
    assert await backend.check_health() == pid


async def test_process_false_keeps_the_engine_in_this_process(make_backend: Any) -> None:
    backend = make_backend(process=False)
    assert await backend.check_health() == os.getpid()
    assert backend.engine is not None and backend.engine.block_manager.num_free_blocks > 0


async def test_a_crash_fails_requests_in_flight_and_the_next_call_starts_afresh(
    make_backend: Any,
) -> None:
    backend = make_backend()
    pid = await backend.check_health()
    tasks = [
        asyncio.create_task(backend.generate(GenerateRequest(f"c/{i}", LONG, prompt=f"go {i}")))
        for i in range(3)
    ]
    while backend.stats().get("num_running", 0) < 3:  # distinct prompts: three sequences
        await asyncio.sleep(0.005)
    os.kill(pid, signal.SIGKILL)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for error in results:
        assert isinstance(error, BackendError), error
        text = str(error)
        assert f"pid {pid}" in text and "SIGKILL" in text, text
        assert "next call starts a fresh engine" in text
    assert backend.num_inflight == 0
    params = SamplingParams(temperature=0.0, max_tokens=5)
    out = await backend.generate(GenerateRequest("after", params, prompt="hello"))
    assert out.completions[0].num_tokens == 5
    assert await backend.check_health() not in (pid, os.getpid())
    await assert_backend_free(backend)


async def test_aclose_fails_what_is_in_flight_and_stops_the_core(make_backend: Any) -> None:
    backend = make_backend()
    pid = await backend.check_health()
    task = asyncio.create_task(backend.generate(GenerateRequest("x", LONG, prompt="go")))
    while backend.stats().get("num_running", 0) < 1:
        await asyncio.sleep(0.005)
    await backend.aclose()
    with pytest.raises(BackendError, match="backend closed"):
        await task
    assert _gone(pid, 10.0)
    with pytest.raises(BackendError):
        await backend.generate(GenerateRequest("y", LONG, prompt="go"))


async def test_a_start_error_names_the_field(make_backend: Any, tmp_path: Path) -> None:
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "gpt2"}')
    (folder / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    backend = make_backend(policy_path=str(folder))
    with pytest.raises(ConfigError) as info:
        await backend.generate(GenerateRequest("a", SamplingParams(), prompt="x"))
    assert info.value.field == "model" and "gpt2" in str(info.value)
    with pytest.raises(ConfigError, match=r"no config\.json"):
        make_backend(policy_path=str(tmp_path))  # refused before anything starts


async def test_the_prm_in_a_process_of_its_own(make_backend: Any, tiny_prm: Path) -> None:
    backend = make_backend(prm_path=str(tiny_prm), prm_process=True)
    request = GenerateRequest("g", SamplingParams(temperature=0.0, max_tokens=6), prompt="ab")
    out, scores = await asyncio.gather(
        backend.generate(request), backend.score([RewardItem("r", "1 2 3 4", ("1+2=3",))])
    )
    assert out.completions[0].num_tokens == 6 and len(scores[0]) == 1
    assert backend.capabilities.reward_batch_tokens is not None


def test_the_prm_shares_the_engine_process_on_cuda_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes share a GPU by time slices: on CUDA the default puts the PRM beside the
    engine; on CPU it gets its own child; an explicit setting wins either way."""
    from spec_tot.adapters.local.config import CoreOptions
    from spec_tot.adapters.local.core import cores as backend_module

    engine = EngineConfig(model_config={})
    prm = PrmConfig(path="unused")
    apart = backend_module._prm_apart
    assert apart(CoreOptions(), engine, prm) and not apart(CoreOptions(), engine, None)
    monkeypatch.setattr(backend_module, "resolve_device", lambda name: "cuda")
    assert not apart(CoreOptions(), engine, prm)
    assert apart(CoreOptions(prm_process=True), engine, prm)
    with pytest.raises(ConfigError, match="prm_process"):
        CoreOptions(prm_process="yes")  # type: ignore[arg-type]


def test_the_prm_pool_and_the_core_start_have_bounds() -> None:
    from spec_tot.adapters.local.config import CoreOptions

    with pytest.raises(ConfigError, match="prm_num_kv_blocks: 1000000000 is over the bound"):
        PrmConfig(path="unused", num_kv_blocks=10**9)
    with pytest.raises(ConfigError, match=r"start_timeout_s: 1000000000000\.0 is over the bound"):
        CoreOptions(start_timeout_s=1e12)


def test_default_threads_split_the_spare_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every core but one for the children; split, a third of them to the PRM's, one each
    at least."""
    from spec_tot.adapters.local.core import proc

    for cores, shared, split in ((1, (1, 1), (1, 1)), (2, (1, 1), (1, 1)), (16, (15, 15), (10, 5))):
        monkeypatch.setattr(proc, "usable_cores", lambda n=cores: n)
        assert proc.default_threads() == shared and proc.default_threads(True) == split


def test_without_a_caller_core_the_engine_takes_every_core(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``caller_core=False`` (``spec-tot serve``): the engine gets every core, a split PRM a
    third of them, one at least."""
    from spec_tot.adapters.local.core import proc

    for cores, shared, split in ((1, (1, 1), (1, 1)), (2, (2, 2), (2, 1)), (16, (16, 16), (16, 5))):
        monkeypatch.setattr(proc, "usable_cores", lambda n=cores: n)
        assert proc.default_threads(False, caller_core=False) == shared
        assert proc.default_threads(True, caller_core=False) == split
    with pytest.raises(ConfigError, match="caller_core"):
        from spec_tot.adapters.local.config import CoreOptions

        CoreOptions(caller_core="no")  # type: ignore[arg-type]


def test_an_in_thread_core_is_given_no_thread_count(make_backend: Any) -> None:
    """``threads`` is the children's: an in-thread core runs on the caller's torch setting
    (the core would otherwise call ``torch.set_num_threads`` in the caller's process)."""
    backend = make_backend(process=False, threads=3)
    assert backend._policy.start.threads is None
    assert make_backend(threads=3)._policy.start.threads == 3


async def test_a_spawned_core_serves_like_a_forked_one(make_backend: Any) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8)
    texts = []
    for launcher in ("spawn", "fork"):
        backend = make_backend(launcher=launcher)
        texts.append(
            (await backend.generate(GenerateRequest("a", params, prompt="ab"))).completions
        )
    assert texts[0] == texts[1]


# -- the backend's process dies ----------------------------------------------------------------
_PARENT = """
import asyncio, faulthandler, signal, sys
faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's view of a hang
# Ctrl-C as a terminal gives it, whatever this process inherited: a shell's background job
# starts with SIGINT ignored, and asyncio.run then installs no handler of its own.
signal.signal(signal.SIGINT, signal.default_int_handler)
from spec_tot.adapters.local import create_local
from spec_tot.adapters.local.core.fork_server import ForkServer
from spec_tot.requests import GenerateRequest, SamplingParams

async def main():
    backend = create_local(policy_path=sys.argv[1], prm_path=sys.argv[2], block_size=4,
                           num_kv_blocks=256, max_model_len=512, saturation_batch=8, threads=1)
    pid = await backend.check_health()  # starts both cores: the PRM has a child of its own
    prm_pid = backend._reward.current().pid
    params = SamplingParams(temperature=1.0, max_tokens=400, ignore_eos=True)
    task = asyncio.ensure_future(backend.generate(GenerateRequest("r", params, prompt="go")))
    while backend.stats().get("num_running", 0) < 1:
        await asyncio.sleep(0.005)
    print(pid, ForkServer.shared().pid, prm_pid, flush=True)
    try:
        await asyncio.sleep(60)
    finally:
        await backend.aclose()
        print("closed", flush=True)

asyncio.run(main())
"""


def _wait_or_dump(parent: subprocess.Popen[str], sig: signal.Signals) -> None:
    """Wait for ``parent`` to end; one still running fails the test with its threads'
    stacks. The bound is the backend's own worst case: a core that ignores Stop is killed
    after ``_CLOSE_S``, its reader and its exit are each waited for as long again."""
    try:
        parent.wait(3 * _CLOSE_S + 15)
    except subprocess.TimeoutExpired:
        parent.send_signal(signal.SIGUSR1)
        time.sleep(1.0)
        parent.kill()
        _, err = parent.communicate(timeout=10)
        pytest.fail(f"the parent ended by {sig!r} did not exit; its threads:\n{err[-6000:]}")


def _gone(pid: int, within: float) -> bool:
    """``pid`` has exited (a zombie nobody reaped yet counts as gone) within ``within`` s."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_no_orphan_when_the_backends_process_dies(tiny_llama: Path, tiny_prm: Path) -> None:
    """Three backend processes at once, each with a generation in flight and a PRM in a
    child of its own (the default), ended by SIGKILL, SIGTERM and SIGINT (Ctrl-C: the
    program's own ``finally`` closes its backend): no core of either kind outlives it."""
    script = textwrap.dedent(_PARENT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    how = (signal.SIGKILL, signal.SIGTERM, signal.SIGINT)
    parents = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(tiny_llama), str(tiny_prm)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in how
    ]
    try:
        pids = []
        for parent in parents:
            assert parent.stdout is not None
            pids.append([int(x) for x in parent.stdout.readline().split()])
        for parent, sig in zip(parents, how, strict=True):
            parent.send_signal(sig)
        for parent, sig, (core, server, prm) in zip(parents, how, pids, strict=True):
            assert len({core, server, prm}) == 3
            _wait_or_dump(parent, sig)
            if sig == signal.SIGINT:
                assert parent.stdout is not None and parent.stdout.read().strip() == "closed"
            assert _gone(core, 10.0), f"engine core {core} outlived its backend ({sig!r})"
            assert _gone(server, 10.0), f"fork server {server} outlived its backend ({sig!r})"
            assert _gone(prm, 10.0), f"PRM core {prm} outlived its backend ({sig!r})"
    finally:
        for parent in parents:
            if parent.poll() is None:
                parent.kill()


@pytest.mark.parametrize("delay_s", [0.0, 0.01])
async def test_a_batch_sent_as_an_idle_core_dies_runs_on_a_fresh_core(
    make_backend: Any, delay_s: float
) -> None:
    """A core SIGKILLed while idle takes a few milliseconds to die; a batch sent meanwhile
    failed whole ("the requests in flight on it failed"), though none was in flight when it
    died. The core had read none of it, so a fresh core serves it (issue 46)."""
    backend = make_backend()
    pid = await backend.check_health()
    os.kill(pid, signal.SIGKILL)
    await asyncio.sleep(delay_s)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    outs = await asyncio.gather(
        *(backend.generate(GenerateRequest(f"b{i}/x", params, prompt=f"go {i}")) for i in range(4))
    )
    assert [o.completions[0].num_tokens for o in outs] == [4] * 4
    assert await backend.check_health() != pid
    await assert_backend_free(backend)
