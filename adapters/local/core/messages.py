"""The typed messages between ``LocalBackend`` and its engine core, and their wire format.

Every command the backend sends and every output the core returns is a ``msgspec`` struct
below; nothing else crosses, and nothing is pickled. Requests, results and configs travel
as the project's own frozen dataclasses (``GenerateRequest``, ``GenerateResult``,
``EngineConfig``, ...), which msgspec encodes field by field and decodes through their
``__post_init__`` checks, so a field added to one of them (an engine option, a stats
counter, a request field) crosses without a protocol change. Stats are ``dict[str,
float]`` for the same reason. ``PROTOCOL`` changes only when a message changes shape; the
core refuses a ``Start`` of another version.

Wire format (process cores): frames of MessagePack (``multiprocessing.connection`` length
prefixes), a ``list[Command]`` from the backend (the commands queued since its last send),
one ``Output`` from the core. The thread core passes the same objects without encoding.

Requests are identified by a ``ticket`` the backend assigns (unique per backend): a result
that arrives after its caller gave up and reused the request id reaches nobody, never the
new caller.
"""

from __future__ import annotations

from typing import Any

import msgspec

from spec_tot.errors import BackendError, ConfigError
from spec_tot.requests import GenerateRequest, GenerateResult, RewardItem, StreamUpdate

from ..config import EngineConfig, PrmConfig

__all__ = [
    "PROTOCOL",
    "Abort",
    "Add",
    "Cancel",
    "Classify",
    "Command",
    "CommandCodec",
    "Done",
    "ErrorInfo",
    "Exited",
    "Failed",
    "Fatal",
    "Flush",
    "FlushPrefixCache",
    "ForkRequest",
    "ForkServerMessage",
    "Forked",
    "Inspect",
    "Output",
    "OutputCodec",
    "Ping",
    "PolicyInfo",
    "Pong",
    "PoolReport",
    "Ready",
    "RewardInfo",
    "Rewards",
    "Score",
    "Scores",
    "Start",
    "StartFailed",
    "StepBatch",
    "Stop",
]

PROTOCOL = 1


class ErrorInfo(msgspec.Struct, frozen=True):
    """An exception as data: ``kind`` ``"config"`` (a ``ConfigError`` naming ``field``),
    ``"backend"`` (a ``BackendError`` of endpoint ``field``) or ``"internal"``."""

    kind: str
    field: str
    message: str

    @classmethod
    def of(cls, exc: BaseException) -> ErrorInfo:
        if isinstance(exc, ConfigError):
            return cls("config", exc.field, str(exc).removeprefix(f"{exc.field}: "))
        if isinstance(exc, BackendError):
            return cls("backend", exc.endpoint, str(exc).removeprefix(f"{exc.endpoint}: "))
        return cls("internal", type(exc).__name__, repr(exc))

    def to_exception(self) -> Exception:
        if self.kind == "config":
            return ConfigError(self.field, self.message)
        if self.kind == "backend":
            return BackendError(self.field, self.message)
        return BackendError("local", self.message)


# -- the backend's commands ------------------------------------------------------------------
class Start(msgspec.Struct, tag="start", frozen=True):
    """The first message to a core: what to load. ``threads`` None leaves torch's setting
    alone (a thread core shares its caller's process)."""

    protocol: int
    engine: EngineConfig | None
    prm: PrmConfig | None
    cache_dir: str | None
    threads: int | None = None
    hook: str | None = None


class Add(msgspec.Struct, tag="add", frozen=True):
    ticket: int
    request: GenerateRequest
    stream: bool = False


class Cancel(msgspec.Struct, tag="cancel", frozen=True):
    """Abort one request whose caller is gone: nothing is returned for it."""

    request_id: str


class Abort(msgspec.Struct, tag="abort", frozen=True):
    """Abort by prefix: the partial results come in a ``StepBatch``, then ``Done(count)``."""

    call: int
    prefix: str


class Flush(msgspec.Struct, tag="flush", frozen=True):
    call: int


class FlushPrefixCache(msgspec.Struct, tag="flush_prefix_cache", frozen=True):
    call: int


class Score(msgspec.Struct, tag="score", frozen=True):
    call: int
    items: list[RewardItem]


class Classify(msgspec.Struct, tag="classify", frozen=True):
    call: int
    texts: list[str | list[int]]


class Ping(msgspec.Struct, tag="ping", frozen=True):
    call: int


class Inspect(msgspec.Struct, tag="inspect", frozen=True):
    call: int


class Stop(msgspec.Struct, tag="stop", frozen=True):
    pass


Command = (
    Start
    | Add
    | Cancel
    | Abort
    | Flush
    | FlushPrefixCache
    | Score
    | Classify
    | Ping
    | Inspect
    | Stop
)


# -- the core's outputs ----------------------------------------------------------------------
class PolicyInfo(msgspec.Struct, frozen=True):
    """What the caller's side needs to know of the policy engine: limits for validating
    requests before they are sent, and where its tokenizer lives."""

    model: str | None
    vocab_size: int
    max_len: int
    max_prompt_chars: int
    max_num_seqs: int
    num_kv_blocks: int
    block_size: int
    eos_token_ids: tuple[int, ...]


class RewardInfo(msgspec.Struct, frozen=True):
    """The PRM's prompt layout and limits (``PrmScorer``'s)."""

    folder: str
    step_tag: str
    tag_ids: tuple[int, ...]
    vocab_size: int
    max_len: int
    max_chars: int
    tokens_per_char: float

    def item_tokens(self, item: RewardItem) -> int:
        """Tokens scoring ``item`` computes, estimated from length (tokenizing every item
        on the event loop cost a third of the executor's CPU at 64 queries): the PRM reuses
        the question and earlier steps, so an item costs its last step (and the question,
        for a first step)."""
        chars = len(item.steps[-1]) + len(self.step_tag) + 1 if item.steps else 0
        if len(item.steps) <= 1:
            chars += len(item.question) + 1
        return max(1, round(chars * self.tokens_per_char))


class Ready(msgspec.Struct, tag="ready", frozen=True):
    """The core is up: its limits and its calibration (see ``calibrate.py``)."""

    protocol: int
    pid: int
    threads: int
    policy: PolicyInfo | None
    reward: RewardInfo | None
    saturation_batch: int
    step_curve: dict[int, float]
    reward_knee: tuple[int, float] | None
    stats: dict[str, float]


class StartFailed(msgspec.Struct, tag="start_failed", frozen=True):
    error: ErrorInfo


class StepBatch(msgspec.Struct, tag="step", frozen=True):
    """What one step (or one abort) produced, by ticket: finished results, per-token
    updates of streamed requests, requests that failed alone, and the engine's counters
    after it (set before any waiter wakes). ``received``: the last request ticket the core
    has read (tickets rise, so every lower one was read too): a request above it when the
    core dies was never read, and a fresh core can take it."""

    results: list[tuple[int, GenerateResult]]
    updates: list[tuple[int, StreamUpdate]]
    failures: list[tuple[int, ErrorInfo]]
    stats: dict[str, float]
    received: int = 0


class Done(msgspec.Struct, tag="done", frozen=True):
    """A call finished; ``stats`` (when set) are the counters as of its end."""

    call: int
    value: int | bool | None = None
    stats: dict[str, float] | None = None


class Scores(msgspec.Struct, tag="scores", frozen=True):
    """Scores of a ``Score`` call; ``stats``: the PRM's counters after it."""

    call: int
    scores: list[tuple[float, ...]]
    stats: dict[str, float] | None = None


class Rewards(msgspec.Struct, tag="rewards", frozen=True):
    call: int
    rewards: list[float]
    stats: dict[str, float] | None = None


class PoolReport(msgspec.Struct, frozen=True):
    """Whether every KV block is back: the policy pool, and the PRM's (``-1``: none)."""

    free_blocks: int
    total_blocks: int
    referenced_blocks: int
    running: int
    waiting: int
    requests: int
    prm_free_blocks: int = -1
    prm_total_blocks: int = -1

    @property
    def all_free(self) -> bool:
        return (
            self.free_blocks == self.total_blocks
            and self.referenced_blocks == 0
            and self.running == self.waiting == self.requests == 0
            and self.prm_free_blocks == self.prm_total_blocks
        )


class Pong(msgspec.Struct, tag="pong", frozen=True):
    call: int
    pid: int
    report: PoolReport | None = None


class Failed(msgspec.Struct, tag="failed", frozen=True):
    call: int
    error: ErrorInfo


class Fatal(msgspec.Struct, tag="fatal", frozen=True):
    """The core is going down (an error its loop could not survive)."""

    error: ErrorInfo


Output = Ready | StartFailed | StepBatch | Done | Scores | Rewards | Pong | Failed | Fatal


# -- the fork server's messages (proc.ForkServer <-> core_process.fork_server) --------------
class ForkRequest(msgspec.Struct, tag="fork", frozen=True):
    """Fork one core (its socket comes with the message) that sees the backend's
    environment, working directory and import path, not the fork server's."""

    env: dict[str, str]
    cwd: str
    sys_path: list[str]


class Forked(msgspec.Struct, tag="forked", frozen=True):
    pid: int


class Exited(msgspec.Struct, tag="exited", frozen=True):
    """A core the fork server started has exited: ``code`` as ``Popen.returncode`` gives
    it (negative: killed by that signal)."""

    pid: int
    code: int


ForkServerMessage = ForkRequest | Forked | Exited


class CommandCodec:
    """Frames of commands (the backend encodes, the core decodes)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(list[Command])  # type: ignore[valid-type]

    def encode(self, commands: list[Any]) -> bytes:
        return self._encoder.encode(commands)

    def decode(self, frame: bytes) -> list[Any]:
        return self._decoder.decode(frame)  # type: ignore[no-any-return]


class OutputCodec:
    """Frames of one output each (the core encodes, the backend decodes)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Output)  # type: ignore[valid-type]

    def encode(self, output: Any) -> bytes:
        return self._encoder.encode(output)

    def decode(self, frame: bytes) -> Any:
        return self._decoder.decode(frame)
