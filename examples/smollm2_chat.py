"""ChatSpecTot over a real pretrained model: SmolLM2-135M-Instruct on the embedded engine,
offline (the engine core in its own process, the model's own chat template).

    python scripts/fetch_smollm2.py                   # once: fetch and convert (cached)
    python examples/smollm2_chat.py "What is the capital of France?"

``SPEC_TOT_SMOLLM2`` points at another converted folder.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from langchain_core.messages import HumanMessage, SystemMessage

from spec_tot import ChatSpecTot
from spec_tot.adapters.local import create_local
from spec_tot.adapters.local.config import cache_root


def main() -> None:
    default = cache_root() / "models" / "SmolLM2-135M-Instruct"
    folder = Path(os.environ.get("SPEC_TOT_SMOLLM2") or default)
    if not (folder / "config.json").is_file():
        sys.exit(f"{folder} is missing: run python scripts/fetch_smollm2.py first")
    question = " ".join(sys.argv[1:]) or "What is the capital of France? Answer in one sentence."
    backend = create_local(policy_path=str(folder), max_model_len=2048, saturation_batch=8)
    chat = ChatSpecTot(
        backend=backend, to_prompt=backend.render_chat, temperature=0.0, max_tokens=128
    )
    messages = [SystemMessage("You are a concise assistant."), HumanMessage(question)]
    try:
        reply = chat.invoke(messages)
    finally:
        asyncio.run(backend.aclose())
    print(reply.content)
    print(reply.usage_metadata)


if __name__ == "__main__":
    main()
