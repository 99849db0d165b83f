import numpy as np

from mpitrain.words import plural


def test_plural_is_singular_for_one_only():
    assert plural(1, "shard") == "1 shard"
    assert [plural(n, "step") for n in (0, 2, 10)] == ["0 steps", "2 steps", "10 steps"]
    assert plural(1, "unseen speaker") == "1 unseen speaker"
    assert plural(3, "child", "children") == "3 children"


def test_a_numpy_scalar_is_shown_as_the_value_it_holds():
    from mpitrain.words import shown
    assert [shown(v) for v in (np.int64(-5), np.float64(40.0), np.bytes_(b"m"), "m", 3)] == \
        ["-5", "40.0", "b'm'", "'m'", "3"]


def test_a_long_value_is_cut_to_the_limit():
    from mpitrain.words import shown
    assert shown("x" * 50, limit=10) == "'xxxxxxxxxx'... (50 characters)"
    assert shown("x" * 8, limit=10) == "'xxxxxxxx'"
    assert shown(10 ** 50) == "1" + "0" * 50
    assert shown(list(range(100)), limit=10) == "[0, 1, 2, ... (390 characters)"


def test_a_huge_value_is_shown_short_without_being_copied_whole():
    from mpitrain.words import SHOWN_LIMIT, shown
    text = shown("y" * 10 ** 7)
    assert text == repr("y" * SHOWN_LIMIT) + "... (10000000 characters)"
    # (repr of an int this long raises ValueError in Python 3.11 and later)
    assert shown(10 ** 5000) == "an integer of about 5001 digits"


def test_help_shows_each_default_but_not_an_empty_or_computed_one():
    import argparse

    from mpitrain.cli import build_parser
    from mpitrain.words import DefaultsFormatter
    parser = argparse.ArgumentParser(formatter_class=DefaultsFormatter)
    parser.add_argument("--count", type=int, default=3, help="how many")
    parser.add_argument("--names", default="", help="names; empty: all")
    parser.add_argument("--set", action="append", default=[], help="settings")
    parser.add_argument("--corpus", default=None, help="the corpus (default: the model's)")
    text = " ".join(parser.format_help().split())
    assert "how many (default: 3)" in text
    assert "empty: all --set" in text and "settings --corpus" in text
    assert "(default: the model's)" in text and "None" not in text
    # every command of the command line: '(default: )' and '(default: [])' said nothing
    for name, command in build_parser().commands.items():
        text = " ".join(command.format_help().split())
        assert "(default: )" not in text and "(default: [])" not in text, name
