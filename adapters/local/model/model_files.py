"""What a model folder must hold, checked before anything loads: every error names the
option (``policy_path``, ``prm_path``, ``model``) and the file, and exits 2 in the CLI.

Files are opened only if they are regular files (a FIFO's ``open()`` blocks until a writer
comes; a device never ends) and read with a size bound; JSON that does not parse, a
tokenizer that does not load and a weight file whose header lies are refused here, not in
the middle of a model load in a child process.
"""

from __future__ import annotations

import json
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from spec_tot.errors import BackendError, ConfigError

__all__ = ["MAX_JSON_BYTES", "check_model_folder", "read_json_file"]

# config.json, generation_config.json, prm.json, tokenizer_config.json are kilobytes; a
# tokenizer.json of a 256k vocabulary with its merges is tens of megabytes.
MAX_JSON_BYTES = 512 * 2**20
_JSON_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


def _regular(file: Path, field: str) -> int:
    """``file``'s size; a ``ConfigError`` naming ``field`` unless it is a regular file."""
    info = file.stat()
    if not stat.S_ISREG(info.st_mode):  # a FIFO's open() blocks until a writer comes
        raise ConfigError(field, f"{file} is not a regular file (a FIFO, device or socket?)")
    return info.st_size


def read_json_file(file: Path, field: str) -> Any:
    """The parsed JSON of ``file`` (regular, at most ``MAX_JSON_BYTES``); a ``ConfigError``
    naming ``field`` and the file otherwise."""
    size = _regular(file, field)
    if size > MAX_JSON_BYTES:
        raise ConfigError(field, f"{file} is {size} bytes, over the {MAX_JSON_BYTES} allowed")
    try:
        return json.loads(file.read_bytes())
    except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError included
        raise ConfigError(field, f"{file} is not valid JSON ({exc})") from None


def check_model_folder(path: str | Path, field: str, needs: Sequence[str] = ()) -> Path:
    """``path`` as a Hugging Face folder: ``config.json``, at least one ``*.safetensors``
    and every file of ``needs``; else a ``ConfigError`` naming ``field`` (cheap: it reads
    only the weight files' headers, so a typo costs no model load)."""
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(field, f"{folder} is not a folder")
    for name in ("config.json", *needs):
        if not (folder / name).exists():
            raise ConfigError(field, f"{folder} has no {name}")
    for name in sorted({*_JSON_FILES, *(n for n in needs if n.endswith(".json"))}):
        if (folder / name).exists():
            data = read_json_file(folder / name, field)
            if not isinstance(data, dict):
                raise ConfigError(field, f"{folder / name} must hold a JSON object")
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        raise ConfigError(field, f"{folder} has no *.safetensors file")
    for file in weights:
        _check_safetensors(file, field)
    return folder


def _check_safetensors(file: Path, field: str) -> None:
    """The file's header parses and its tensors fit in it: a truncated or broken download
    fails here (a ``BackendError``: the option is right, the file is not), before any
    process starts, not in the middle of a model load."""
    import struct

    size = _regular(file, field)
    try:
        with file.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > size - 8:
                raise ValueError(f"header of {length} bytes in a file of {size}")
            header = json.loads(f.read(length))
        end = max(
            (int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"),
            default=0,
        )
    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error) as exc:
        raise BackendError("local", f"{file} is not a readable safetensors file ({exc})") from None
    if 8 + length + end > size:
        raise BackendError("local", f"{file} is truncated: {size} bytes, {8 + length + end} needed")
