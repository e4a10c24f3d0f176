"""Structured output: grammars (grammars.py) and per-path logits processors (processors.py)."""
