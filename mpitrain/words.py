"""Counts and values in words for the lines shown to users: `1 shard`, `2 shards`,
`2` for a NumPy integer read from a file (not `np.int64(2)`), a value cut
short where it is long (a crafted file or setting may hold megabytes), and
the defaults of command-line options in their ``--help``."""

import argparse
import re
import sys

#: The most characters of a value an error line shows; the rest is counted, not shown.
SHOWN_LIMIT = 60


def plural(n, noun: str, nouns: str = "") -> str:
    """``n noun``: the singular for 1, otherwise ``nouns`` (default: noun + 's')."""
    return f"{n} {noun if n == 1 else (nouns or noun + 's')}"


def cut(text: str, limit: int = SHOWN_LIMIT) -> str:
    """``text`` whole when it has at most ``limit`` characters, else its first
    ``limit`` and how many there were, so that an error stays one readable line.

    Example::

        cut("x" * 100, 4)     # "xxxx... (100 characters)"
    """
    text = str(text)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def words_cut(text: str, limit: int = SHOWN_LIMIT) -> str:
    """``text`` with each run of more than ``limit`` non-blank characters cut
    (:func:`cut`): for a message built elsewhere (argparse's) that quotes a value whole."""
    return re.sub(r"\S{%d,}" % (limit + 1), lambda m: cut(m.group(), limit), str(text))


def shown(value, *, limit: int = SHOWN_LIMIT) -> str:
    """``repr`` of a value read from a file, a NumPy scalar as the Python value it
    holds (NumPy 2 writes ``np.int64(2)``, which reads as if it were another value);
    at most ``limit`` characters of it (:func:`cut`)."""
    # (NumPy is not imported here: the command line loads this module before it, and
    # a NumPy scalar exists only once NumPy is loaded)
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 4 * limit:
        # (repr of an int of more than 4300 digits raises; none that long is read whole)
        return f"an integer of about {int(value.bit_length() * 0.30103) + 1} digits"
    if isinstance(value, (str, bytes)) and len(value) > limit:
        # (cut before repr: a 10 MB text is not copied)
        return f"{value[:limit]!r}... ({len(value)} characters)"
    return cut(repr(value), limit)


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` that shows '(default: X)' unless the help already says what the
    default is; a default of None means "computed", and an empty one (a string, a
    list) nothing given, which the help describes.
    Used by ``python -m mpitrain`` and each ``python -m mpitrain.bench.NAME``.

    Example::

        argparse.ArgumentParser(formatter_class=DefaultsFormatter)
    """

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default in (None, "", []) or "default:" in text or "default " in text:
            return text
        return super()._get_help_string(action)
