"""The real models and serving engines spec-tot is measured against, started offline as a
user would: SmolLM2-135M-Instruct from its PyPI wheel (``smollm2``) and vLLM on CPU
(``vllm_cpu``). The tests, the benchmarks and ``scripts/`` use them from here; nothing in
the executor imports them."""

__all__: list[str] = []
