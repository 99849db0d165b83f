"""Counts in words for the lines shown to users: `1 shard`, `2 shards`."""


def plural(n, noun: str, nouns: str = "") -> str:
    """``n noun``: the singular for 1, otherwise ``nouns`` (default: noun + 's')."""
    return f"{n} {noun if n == 1 else (nouns or noun + 's')}"
