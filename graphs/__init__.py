"""Ready ToT programs expressed as ThoughtGraphs."""
