"""Progress lines on the console and a JSON-lines metrics file (rank 0 only)."""

from __future__ import annotations

import json
import os
import sys
import time


def resident_mb() -> float | None:
    """This process's resident memory in MiB now (Linux), else None."""
    try:
        with open("/proc/self/statm", encoding="ascii") as fh:
            pages = int(fh.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


class MetricsLog:
    """Writes one JSON object per line to ``metrics.jsonl`` and echoes a summary.

    Example::

        log = MetricsLog(run_dir, enabled=(rank == 0))
        log.write("train", step=100, xent=1.2, acc=0.6)
    """

    def __init__(self, run_dir, *, enabled: bool = True, stream=None, append: bool = False):
        self.enabled = enabled
        self.stream = stream or sys.stdout
        self.start = time.time()
        self._fh = None
        if enabled:
            os.makedirs(run_dir, exist_ok=True)
            self._fh = open(os.path.join(run_dir, "metrics.jsonl"), "a" if append else "w",
                            encoding="utf-8")

    def write(self, kind: str, **fields) -> None:
        if not self.enabled:
            return
        record = {"type": kind, "time": round(time.time() - self.start, 3), **fields}
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()

    def say(self, text: str) -> None:
        if self.enabled:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
