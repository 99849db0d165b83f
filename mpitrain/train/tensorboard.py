"""TensorBoard event files beside ``metrics.jsonl`` (``training.tensorboard: true``).

Rank 0 writes the scalars of every ``train`` and ``eval`` record to
``RUN_DIR/tensorboard/`` with the ``tensorboard`` package's own event writer
(no torch, no TensorFlow), keyed by step.  ``metrics.jsonl`` stays the record
of the run; the events are a view of it.  A fresh run removes the event
files of the run it replaces; a resumed run adds a new file, which
TensorBoard shows as one curve.

Example::

    board = TensorBoardLog("runs/x", append=False)
    board.record("train", {"step": 100, "xent": 1.2, "acc": 0.6})
    board.close()
"""

from __future__ import annotations

import glob
import math
import os
import time

DIRECTORY = "tensorboard"
#: record fields written as scalars, by record type (TensorBoard tag = type/field)
SCALARS = {"train": ("xent", "acc", "lr", "frames_per_sec", "comm_fraction"),
           "eval": ("dev_xent", "dev_acc")}


def require_tensorboard() -> None:
    """Raise ValueError (one line) unless the ``tensorboard`` package can be imported."""
    try:
        import tensorboard.summary.writer.event_file_writer  # noqa: F401
    except ImportError:
        raise ValueError("training.tensorboard: true needs the tensorboard package "
                         "(pip install tensorboard)") from None


class TensorBoardLog:
    """Scalars of metrics records into an event file under ``run_dir/tensorboard``.

    Example::

        TensorBoardLog(run_dir).record("eval", {"step": 5, "dev_acc": 0.7})
    """

    def __init__(self, run_dir, *, append: bool = False):
        require_tensorboard()
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
        self._event, self._summary = Event, Summary
        directory = os.path.join(str(run_dir), DIRECTORY)
        os.makedirs(directory, exist_ok=True)
        if not append:
            for old in glob.glob(os.path.join(directory, "events.out.tfevents.*")):
                os.remove(old)
        self._writer = EventFileWriter(directory)

    def record(self, kind: str, fields: dict) -> None:
        step = fields.get("step")
        names = SCALARS.get(kind, ())
        values = [self._summary.Value(tag=f"{kind}/{name}", simple_value=float(fields[name]))
                  for name in names if isinstance(fields.get(name), (int, float))
                  and math.isfinite(fields[name])]
        if step is None or not values:
            return
        self._writer.add_event(self._event(step=int(step), wall_time=time.time(),
                                           summary=self._summary(value=values)))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
