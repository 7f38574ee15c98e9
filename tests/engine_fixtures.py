"""Tiny random Llama / Qwen2 checkpoints with a char-level tokenizer, saved like a real
Hugging Face folder (config.json + safetensors + tokenizer files). CPU, well under a second."""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

import pytest
import torch

__all__ = [
    "CHARS",
    "assert_backend_free",
    "assert_pool_free",
    "break_bookkeeping",
    "build_tokenizer",
    "built_kernel",
    "make_backend",
    "make_engine",
    "make_prm_folder",
    "make_tiny_model",
    "refuse_huge_encode",
    "run_all",
    "skip_validation",
    "tiny_llama",
    "tiny_prm",
]

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARS = string.ascii_letters + string.digits + string.punctuation + " \n"
VOCAB_SIZE = 128


def build_tokenizer() -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in CHARS:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )


def make_tiny_model(
    folder: Path,
    family: str = "llama",
    seed: int = 0,
    tie: bool = False,
    rope: dict[str, Any] | None = None,
    layers: int = 2,
    hidden: int = 64,
) -> Path:
    """Save a random model (GQA: 4 heads, 2 KV heads) and the tokenizer into ``folder``."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    options: dict[str, Any] = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.3,  # well-separated logits: greedy comparisons are not ties
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=tie,
    )
    if rope is not None:
        options["rope_parameters"] = rope
    torch.manual_seed(seed)
    if family == "llama":
        model: Any = LlamaForCausalLM(LlamaConfig(**options))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**options))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):  # Qwen2 q/k/v biases: make them matter
                param.normal_(0.0, 0.3)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    build_tokenizer().save_pretrained(folder)
    return folder


def make_prm_folder(folder: Path, seed: int = 1) -> Path:
    """A tiny causal LM plus ``prm.json`` (step tag ``#``, good ``+``, bad ``-``)."""
    make_tiny_model(folder, seed=seed)
    (folder / "prm.json").write_text(
        json.dumps({"step_tag": "#", "good_token": "+", "bad_token": "-"})
    )
    return folder


# -- pytest fixtures (import them into a test module to use them) ---------------------------


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("llama"), family="llama")


@pytest.fixture(scope="session")
def tiny_prm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_prm_folder(tmp_path_factory.mktemp("prm"))


def assert_pool_free(engine: Any) -> None:
    """Every KV block of ``engine`` (an ``LLMEngine``) is free and no request is left."""
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks, "KV blocks leaked"
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert not engine.scheduler.running and engine.scheduler.num_waiting == 0
    assert not engine.requests


async def assert_backend_free(backend: Any) -> None:
    """After every command sent so far: no request in flight on ``backend`` (a
    ``LocalBackend``, in a process or a thread) and every KV block free, PRM's included."""
    await backend.flush()
    assert backend.num_inflight == 0
    report = await backend.pool_report()
    assert report.all_free, f"KV blocks or requests left: {report}"


@pytest.fixture
def make_engine(tiny_llama: Path) -> Any:
    """Factory of engines on the tiny Llama; after the test every pool must be 100% free."""
    from spec_tot.adapters.local.config import EngineConfig
    from spec_tot.adapters.local.engine.llm_engine import LLMEngine

    engines: list[Any] = []

    def make(path: Path | None = None, **options: Any) -> Any:
        options.setdefault("block_size", 4)
        options.setdefault("num_kv_blocks", 256)
        options.setdefault("max_model_len", 256)
        options.setdefault("max_num_batched_tokens", 1024)
        engine = LLMEngine(EngineConfig(model=str(path or tiny_llama), **options))
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        assert_pool_free(engine)


@pytest.fixture
async def make_backend(tiny_llama: Path) -> Any:
    """Factory of LocalBackends (the engine in its own process unless ``process=False``);
    teardown flushes, checks every pool is free, and closes."""
    from spec_tot.adapters.local import create_local

    backends: list[Any] = []

    def make(**options: Any) -> Any:
        options.setdefault("policy_path", str(tiny_llama))
        options.setdefault("block_size", 4)
        options.setdefault("num_kv_blocks", 256)
        options.setdefault("max_model_len", 512)
        options.setdefault("max_num_batched_tokens", 1024)
        options.setdefault("saturation_batch", 8)
        options.setdefault("threads", 1)  # the engine's child process, on a shared machine
        backend = create_local(**options)
        backends.append(backend)
        return backend

    yield make
    for backend in backends:
        if backend.running:
            await assert_backend_free(backend)
        await backend.aclose()


def run_all(engine: Any) -> dict[str, Any]:
    """Step the engine until idle; results by request id."""
    out: dict[str, Any] = {}
    while engine.has_unfinished():
        for result in engine.step():
            out[result.request_id] = result
    return out


def step_graph(*, max_tokens: int, depth: int) -> Any:
    """A one-thought-per-step ToT graph for the tiny engine models: ``depth`` steps, each
    scored by the backend's PRM."""
    from spec_tot import END, START, SamplingParams, ThoughtGraph

    graph = ThoughtGraph()
    graph.add_thought(
        "step",
        lambda s: s["question"] + "\n" + "".join(x + "\n" for x in s["steps"]),
        sampling=SamplingParams(temperature=1.0, max_tokens=max_tokens, stop=("\n",)),
    )
    graph.add_reward("prm")
    graph.add_edge(START, "step")
    graph.add_edge("step", "prm")
    graph.add_conditional_edges(
        "prm", lambda s: "end" if len(s["steps"]) >= depth else "more", {"more": "step", "end": END}
    )
    return graph


# -- core hooks (``create_local(core_hook="engine_fixtures:NAME")``): they run where the
# engine runs, its child process included, and change it as a test needs ------------------


def _mark_hooked(core: Any) -> None:
    engine = core.engine
    real_stats = engine.stats
    engine.stats = lambda: {**real_stats(), "hooked": 1.0}


def refuse_huge_encode(core: Any) -> None:
    """Tokenising a text over 10,000 characters raises: a test that gets its ConfigError
    anyway knows the text was refused before the tokenizer."""
    tokenizer = core.engine.tokenizer
    real_encode = tokenizer.encode

    def encode(text: str, *args: Any, **kw: Any) -> Any:
        if len(text) > 10_000:
            raise AssertionError("a huge prompt reached the tokenizer")
        return real_encode(text, *args, **kw)

    tokenizer.encode = encode
    _mark_hooked(core)


def skip_validation(core: Any) -> None:
    """The engine's own checks let anything through (a request that breaks the forward)."""
    validator = core.engine.validator
    validator.check_request = lambda request: None
    validator.check_ids = lambda ids, field: None
    _mark_hooked(core)


def break_bookkeeping(core: Any) -> None:
    """``good/3``'s bookkeeping raises after its third token."""
    post = core.engine.post
    real_append = post.append

    def append(seq: Any, *args: Any) -> None:
        if any(m.request.request_id == "good/3" for m in seq.members) and seq.num_output_tokens > 2:
            raise RuntimeError("bookkeeping broke")
        real_append(seq, *args)

    post.append = append
    _mark_hooked(core)


def built_kernel(load: Any, root: Path, what: str) -> Any:
    """``load(root)``'s kernel; CI has gcc, so a kernel that does not build is a failure
    there, not a skip."""
    kernel, why = load(root)
    if kernel is None:
        pytest.fail(f"{what} did not build: {why}")
    return kernel
