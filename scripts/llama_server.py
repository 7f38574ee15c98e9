"""llama.cpp's ``llama-server`` built from source and serving SmolLM2's GGUF
(``spec_tot.peers.llama_server``).

    python scripts/llama_server.py build               # once: cmake, a few minutes
    python scripts/llama_server.py serve               # prints the URL once /health answers
"""

import sys

from spec_tot.peers.llama_server import main

if __name__ == "__main__":
    sys.exit(main())
