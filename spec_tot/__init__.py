"""spec-tot: fast Tree-of-Thought reasoning."""

__all__: list[str] = []
