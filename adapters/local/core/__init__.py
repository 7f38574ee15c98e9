"""The engine core in its own process (or thread): the typed messages to it, its loop,
the caller's link to it, and the delivery of its outputs."""
