"""The preconditioner's micro-benchmark (bench/precondition.py)."""

import numpy as np

from mpitrain.bench.precondition import time_precondition


def test_a_kind_of_call_not_timed_is_none_not_zero_milliseconds():
    # with fewer timed calls than update_period no update may be among them: the
    # line said "update 0.00" ms, as if an update were free
    few = time_precondition(np, 16, 32, 4, update_period=4, calls=2, rounds=1)
    assert few["update"] is None and few["plain"] > 0, few
    many = time_precondition(np, 16, 32, 4, update_period=4, calls=8, rounds=1)
    assert many["update"] > 0 and many["plain"] > 0, many
