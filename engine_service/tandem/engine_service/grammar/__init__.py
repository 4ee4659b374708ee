"""Structured output in the engine: constraints compiled off the loop, per-request matchers, token bitmasks (no torch)."""
