"""Counts and values in words for the lines shown to users: `1 shard`, `2 shards`,
`2` for a NumPy integer read from a file (not `np.int64(2)`)."""

import sys


def plural(n, noun: str, nouns: str = "") -> str:
    """``n noun``: the singular for 1, otherwise ``nouns`` (default: noun + 's')."""
    return f"{n} {noun if n == 1 else (nouns or noun + 's')}"


def shown(value, *, limit: int = 0) -> str:
    """``repr`` of a value read from a file, a NumPy scalar as the Python value it
    holds (NumPy 2 writes ``np.int64(2)``, which reads as if it were another value);
    ``limit``: at most that many characters and ``...`` (a crafted value can be long)."""
    # (NumPy is not imported here: the command line loads this module before it, and
    # a NumPy scalar exists only once NumPy is loaded)
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, np.generic):
        value = value.item()
    text = repr(value)
    return text[:limit] + "..." if limit and len(text) > limit else text
