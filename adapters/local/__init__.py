"""The embedded inference engine (nano-vllm style): the default backend."""
