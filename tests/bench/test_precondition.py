"""The preconditioner's micro-benchmark (bench/precondition.py)."""

import numpy as np
import pytest

from mpitrain.bench.precondition import time_precondition


def test_a_kind_of_call_not_timed_is_none_not_zero_milliseconds():
    # with fewer timed calls than update_period no update may be among them: the
    # line said "update 0.00" ms, as if an update were free
    few = time_precondition(np, 16, 32, 4, update_period=4, calls=2, rounds=1)
    assert few["update"] is None and few["plain"] > 0, few
    many = time_precondition(np, 16, 32, 4, update_period=4, calls=8, rounds=1)
    assert many["update"] > 0 and many["plain"] > 0, many


@pytest.mark.parametrize("argv, said", [
    (["--model", "44x"], "--model: expected dims like 440-4x2048-4000, got '44x'"),
    (["--model", "440-0x512-10"], "--model: expected dims like 440-4x2048-4000, "
                                  "got '440-0x512-10'"),
    (["--batch", "0"], "--batch must be >= 1, got 0"),
    (["--update-period", "0"], "--update-period must be >= 1, got 0"),
], ids=["model-cut-short", "no-layers", "batch", "update-period"])
def test_bad_options_are_one_line_before_any_timing(capsys, monkeypatch, argv, said):
    # a malformed --model was a traceback after the whole benchmark had run
    import mpitrain.bench.precondition as bench

    def never(*args, **kwargs):
        raise AssertionError("timed before the options were checked")
    monkeypatch.setattr(bench, "time_precondition", never)
    monkeypatch.setattr(bench, "_best_ms", never)
    with pytest.raises(SystemExit) as info:
        bench.main(argv)
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == \
        f"python -m mpitrain.bench.precondition: error: {said}"


def test_parse_model_reads_repeated_layers():
    from mpitrain.bench.precondition import parse_model
    assert parse_model("440-2x1024-2000") == [(440, 1024), (1024, 1024), (1024, 2000)]
