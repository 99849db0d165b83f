"""Checks of the fields a saved state holds (a checkpoint's optimizer, schedule and
strategy parts): each a number of the right kind and range, or a ValueError that
names the field and shows the value (cut short, ``words.shown``).

A checkpoint's checksum proves only that nothing changed the file since it was
written, and a crafted file can carry a correct one: what a state holds must be
what the code that wrote it can produce, or training would go on from garbage.

Example::

    steps = count(state, "num_steps", "optimizer state")
    rho = number(state, "rho", "preconditioner 'layer0_in'", low=0.0, low_open=True,
                 high=FLOAT32_MAX)
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from .words import shown

#: The largest float32: a value that a float32 buffer takes, or a statistic of
#: float32 data (a Fisher estimate, a sum of squares) can reach, is below it.
FLOAT32_MAX = 3.4028234663852886e+38
#: The largest count any state holds (an int64 in the file).
COUNT_MAX = (1 << 62)
_MISSING = object()


def _value(state, key: str, where: str, default):
    if not isinstance(state, dict):
        raise ValueError(f"{where}: expected a group of fields, got {type(state).__name__}")
    value = state.get(key, default)
    if value is _MISSING:
        raise ValueError(f"{where}: field '{key}' is missing")
    return value


def is_number(value) -> bool:
    """An int or a float, NumPy's too (text, a flag or an array is not one)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_integer(value) -> bool:
    """An int, NumPy's too (a flag, a float or text is not one)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def count(state, key: str, where: str, *, default=_MISSING, low: int = 0,
          high: int = COUNT_MAX) -> int:
    """``state[key]`` as an int in [low, high] (``default`` when absent, else missing
    is an error); a float, text or flag is refused, as is one out of range."""
    value = _value(state, key, where, default)
    if not is_integer(value) or not low <= value <= high:
        raise ValueError(f"{where}: field '{key}': expected an int in [{low}, {high}], "
                         f"got {shown(value)}")
    return int(value)


def number(state, key: str, where: str, *, default=_MISSING, low: float = -FLOAT32_MAX,
           high: float = FLOAT32_MAX, low_open: bool = False) -> float:
    """``state[key]`` as a finite float in [low, high] (``(low, high]`` with
    ``low_open``); ``default`` when absent (None: an absent value stays None)."""
    value = _value(state, key, where, default)
    if value is None and default is None:
        return None
    good = is_number(value) and math.isfinite(value) and \
        (value > low if low_open else value >= low) and value <= high
    if not good:
        bound = "(" if low_open else "["
        raise ValueError(f"{where}: field '{key}': expected a finite number in {bound}{low:g}, "
                         f"{high:g}], got {shown(value)}")
    return float(value)


def flag(state, key: str, where: str, *, default=_MISSING) -> bool:
    """``state[key]`` as a bool: True, False, 1 or 0 (how a flag is stored)."""
    value = _value(state, key, where, default)
    if isinstance(value, bool) or (is_integer(value) and value in (0, 1)):
        return bool(value)
    raise ValueError(f"{where}: field '{key}': expected 0 or 1, got {shown(value)}")


def described(value) -> str:
    """What a field holds, for an error: an array's shape and dtype (not its values,
    which a forged file may make huge), else the value cut short."""
    if isinstance(value, np.ndarray):
        return f"an array of shape {value.shape} and dtype {value.dtype}"
    return shown(value)


def int_array(value, where: str, *, low: int = 0, high: int = COUNT_MAX,
              empty: bool = True):
    """``value`` as a 1-D array of ints, each in [low, high] (``empty``: may hold
    none); ValueError naming ``where`` otherwise."""
    good = isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype.kind in "iu" \
        and (value.size > 0 or empty) \
        and (not value.size or (value.min() >= low and value.max() <= high))
    if not good:
        raise ValueError(f"{where}: expected a list of ints in [{low}, {high}], got "
                         f"{described(value)}")
    return value


def float32_buffer(value, shape: tuple, where: str, *, low: float = -FLOAT32_MAX):
    """``value`` as a float32 array of ``shape`` for a float32 buffer: an array of
    floats, each finite and in [low, FLOAT32_MAX] (a float64 of 1e300 would be
    infinite there); ValueError naming ``where`` otherwise."""
    if not isinstance(value, np.ndarray) or value.dtype.kind != "f" \
            or tuple(value.shape) != tuple(shape):
        raise ValueError(f"{where}: expected {tuple(shape)} floats, got {described(value)}")
    inside = np.isfinite(value) & (value >= low) & (value <= FLOAT32_MAX)
    if not inside.all():
        index = int(np.flatnonzero(~inside.ravel())[0])
        raise ValueError(f"{where}: expected finite floats in [{low:g}, {FLOAT32_MAX:g}] "
                         f"(a float32 buffer), got {shown(float(value.ravel()[index]))} at "
                         f"index {index}")
    return value.astype(np.float32, copy=False)
