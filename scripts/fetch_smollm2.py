"""Fetch SmolLM2-135M-Instruct offline into the cache folder (``spec_tot.peers.smollm2``).

python scripts/fetch_smollm2.py                 # prints the folder
python scripts/fetch_smollm2.py --gguf FILE --out DIR
"""

from spec_tot.peers.smollm2 import main

if __name__ == "__main__":
    main()
