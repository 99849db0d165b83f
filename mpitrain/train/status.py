"""``mpitrain status RUN_DIR ...``: where each run stands, in a few lines, from
its run directory alone (``metrics.jsonl``, the checkpoints, ``.lock``).

A cluster user has several jobs queued, running, stopped or ended; the log
files of the jobs are somewhere else.  This reads what the run wrote: whether
its latest start ended, was stopped by a signal or neither (still running,
or cut off: a node lost, a job killed), how far it got and how fast, its
held-out figures, and the checkpoint a ``--resume`` would continue from.
Nothing is written, and no lock is taken.

Example::

    for line in run_status("runs/exp1"):
        print(line)
    # runs/exp1: running, or cut off (no end record; metrics.jsonl written 2m10s ago; ...)
    #   step 1968 of 7000 (28%), epoch 0: xent 1.2345 acc 0.6123, 312,000 fr/s, about 1h02m left
"""

from __future__ import annotations

import json
import os
import re
import time

from ..plotting import json_int, metrics_path, read_metrics
from .errors import rank_error_files
from .metrics import format_duration

#: What :class:`~mpitrain.train.run_dir.RunDirLock` writes into ``.lock``.
#: (without "since ...": written by an older version)
_HOLDER = re.compile(r"^pid (\d+) on (\S+)(?: since .+)?$")
#: The largest process id a system gives (a pid_t is a 32-bit int).
_MAX_PID = 2**31 - 1


#: The names a benchmark gives its run directories under ``OUT/runs/`` (bench/report.py).
_BENCH_RUN = re.compile(r"(throughput|accuracy)-\w+-n\d+(-r\d+)?")


def _benchmark_lines(run_dir: str):
    """What a benchmark's ``--out`` is (runs/bench-<config> by default, so in
    ``status runs/*``): not a run, but it holds one run directory per measurement.
    A report marked partial, or runs without a report, are of a benchmark that
    stopped (a time limit, a signal) or is still running.  None for a run."""
    if os.path.exists(metrics_path(run_dir)):
        return None
    runs = os.path.join(run_dir, "runs")
    see = f"its runs: status {os.path.join(runs, '*')}"
    report = os.path.join(run_dir, "bench.json")
    if os.path.isfile(report):
        try:
            with open(report, encoding="utf-8") as fh:
                partial = json.load(fh).get("partial")
            done, planned = partial["sizes_measured"], partial["sizes_planned"]
            sizes = (f"group sizes {', '.join(map(str, done))} of "
                     f"{', '.join(map(str, planned))}")
        except (OSError, ValueError, AttributeError, KeyError, TypeError):
            partial = None      # (a complete report has no "partial"; the rest as it was)
        if partial:
            return [f"{run_dir}: a benchmark's partial report (bench.md, bench.json: {sizes}; "
                    f"it stopped before the rest, or is still running), not a run; {see}"]
        return [f"{run_dir}: a benchmark's report (bench.md, bench.json), not a run; {see}"]
    if os.path.isdir(runs) and any(_BENCH_RUN.fullmatch(name) for name in os.listdir(runs)):
        return [f"{run_dir}: a benchmark without a report (it stopped before its first group "
                f"size was done, or is still running), not a run; {see}"]
    return None


def run_status(run_dir, *, now: float | None = None) -> list:
    """Lines saying where the run in ``run_dir`` stands (the first names it).
    A directory without ``metrics.jsonl`` raises FileNotFoundError naming it."""
    run_dir = os.fspath(run_dir)
    bench = _benchmark_lines(run_dir)
    if bench:
        return bench
    records = read_metrics(run_dir)
    if os.path.isfile(run_dir):             # its metrics.jsonl named: the directory
        run_dir = os.path.dirname(run_dir) or "."
    now = time.time() if now is None else now
    starts = records["start"]
    end, stop, error = _how_the_latest_start_ended(metrics_path(run_dir))
    if end is None and stop is None and error is None:
        error = _rank_error(run_dir)       # a rank other than 0 that failed alone
    pretraining = bool(starts) and starts[-1].get("mode") == "pretrain"
    if end is not None and records.get("end"):
        # the end record on the run's whole clock (read_metrics adds up the clocks
        # of its resumed parts): the time of the whole run, not of its last part
        end = dict(end, seconds=records["end"][-1].get("seconds", end.get("seconds")))
    lines = [f"{run_dir}: " + (_failure(error) if error is not None and end is None
                               and stop is None
                               else _state(run_dir, end, stop, now, pretraining))]
    if end is None:
        lines += _progress(records, starts[-1] if starts else {}, pretraining)
    lines += _held_out(records, end, run_dir)
    newest = _newest_checkpoint(run_dir)
    if newest and end is None and stop is None:
        lines.append(f"  newest checkpoint: {newest} (--resume continues from it)")
    return lines


def _failure(error: dict) -> str:
    message = error.get("message")
    message = message if isinstance(message, str) else "?"
    where = f"step {_num(error, 'step', 'd')}"
    if "layer" in error:                                  # a pretraining's layer
        where = f"layer {_num(error, 'layer', 'd')}, {where}"
    if "rank" in error:                                   # (its own file: errors.py)
        where = f"{where} on rank {_num(error, 'rank', 'd')}"
    if error.get("error") == "KeyboardInterrupt":        # (not a failure of the run's)
        return f"{message} at {where}"
    return f"failed at {where}: {message}"


def _rank_error(run_dir) -> dict | None:
    """The record of the first rank other than 0 that failed alone in the latest
    start (train/errors.py), or None."""
    for path in rank_error_files(run_dir):
        try:
            with open(path, encoding="utf-8") as fh:
                record = json.loads(fh.read(100_000), parse_int=json_int)
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and record.get("type") == "error":
            return record
    return None


def _how_the_latest_start_ended(path) -> tuple:
    """``(end, stop, error)``: each the record written after the file's last ``start``
    record, or None: an earlier attempt's end does not end a resumed run."""
    end = stop = error = None
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            try:
                record = json.loads(line, parse_int=json_int)
            except json.JSONDecodeError:
                continue        # (read_metrics has judged the file already)
            kind = record.get("type") if isinstance(record, dict) else None
            if kind == "start":
                end = stop = error = None
            elif kind == "end":
                end = record
            elif kind == "stop":
                stop = record
            elif kind == "error":
                error = record
    return end, stop, error


def _state(run_dir, end, stop, now, pretraining) -> str:
    if end is not None:
        result = os.path.join(run_dir, "pretrain.h5" if pretraining else "final.h5")
        what = (f"{_num(end, 'layers', 'd')} RBMs" if pretraining
                else f"{_num(end, 'steps', 'd')} steps")
        seconds = end.get("seconds")
        took = format_duration(seconds) if _is_number(seconds) else "?"
        if not os.path.isfile(result):
            # (a benchmark's runs keep their records, not their models)
            result = f"no {os.path.basename(result)} in {run_dir}"
        return f"ended: {what} in {took}; {result}"
    if stop is not None:
        where = (f"layer {_num(stop, 'layer', 'd')}, step {_num(stop, 'step', 'd')}"
                 if pretraining else f"step {_num(stop, 'step', 'd')}")
        written = stop.get("checkpoint")
        if isinstance(written, str) and written:
            # the record holds the path the run used: a run directory moved since (to
            # other storage, for a job elsewhere) holds that checkpoint under its new path
            written = os.path.join(run_dir, os.path.basename(written))
        return (f"stopped at {where} on {stop.get('signal')}: "
                + (f"checkpoint {written}; --resume continues from it" if written
                   else "no checkpoint written then"))
    age = format_duration(now - os.path.getmtime(metrics_path(run_dir)))
    holder = _lock_holder(run_dir)
    if holder is not None and holder[1] == os.uname().nodename:
        # a run of this host: whether its rank 0 is still there says which
        pid, host = holder
        if _alive(pid) and not _started_after(pid, os.path.join(run_dir, ".lock")):
            return f"running (rank 0 is pid {pid} on {host}; metrics.jsonl written {age} ago)"
        return (f"cut off: rank 0 (pid {pid} on {host}) is gone without an end record; "
                f"metrics.jsonl written {age} ago")
    where = f"; rank 0 was pid {holder[0]} on {holder[1]}" if holder else ""
    return f"running, or cut off (no end record; metrics.jsonl written {age} ago{where})"


def _lock_holder(run_dir):
    """``(pid, host)`` that ``.lock`` names: rank 0 of the run that took it last
    (it may have ended since); None when it names none."""
    try:
        # (a damaged lock file's bytes are no text: it then names none)
        with open(os.path.join(run_dir, ".lock"), encoding="utf-8", errors="replace") as fh:
            text = fh.read(200)
    except OSError:
        return None
    m = _HOLDER.match(text.strip())
    if not m or not 0 < int(m.group(1)) <= _MAX_PID:
        return None     # (pid 0 would ask after our own process group, a huge one overflows)
    return int(m.group(1)), m.group(2)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True         # there, but another user's
    return True


def _started_after(pid: int, lock: str) -> bool:
    """Whether process ``pid`` started after ``lock`` was written: another process
    that took the number of a rank 0 gone since (process ids are reused).  False
    where the system does not tell (no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            # (the command name, in parentheses, may hold spaces)
            ticks = int(fh.read().rsplit(b")", 1)[1].split()[19])     # field 22, starttime
        with open("/proc/stat", encoding="ascii") as fh:
            boot = next(int(line.split()[1]) for line in fh if line.startswith("btime "))
        started = boot + ticks / os.sysconf("SC_CLK_TCK")
        # (boot time is whole seconds: a second's margin)
        return started > os.path.getmtime(lock) + 1.0
    except (OSError, ValueError, IndexError, StopIteration):
        return False


def _progress(records, start, pretraining) -> list:
    if pretraining:
        return _pretraining_progress(records, start)
    train = records["train"]
    if not train:
        return ["  no progress line yet"]
    last, total = train[-1], start.get("total_steps")
    step, first_step = last.get("step"), start.get("step", 0)
    known = all(_is_number(v) for v in (step, total, first_step))
    done = f"step {_num(last, 'step', 'd')}" + (
        f" of {total} ({step / total:.0%})" if known and total > 0 else "")
    left = ""
    # the steps this part trained, a roll back's abandoned ones too (step - first_step
    # undercounts them: after a roll back to step 0 it gave many times the time left);
    # older logs and methods without roll backs have no count
    trained = last.get("steps_trained")
    trained = trained if _is_number(trained) else (step - first_step if known else 0)
    if known and total > 0 and trained > 0 and _is_number(last.get("seconds")):
        # the clock adds up the resumed parts (read_metrics), and the start record
        # stands where this part began on it
        before = start.get("seconds") if _is_number(start.get("seconds")) else 0.0
        per_step = (last["seconds"] - before) / trained
        left = f", about {format_duration(per_step * max(total - step, 0))} left"
    return [f"  {done}, epoch {_num(last, 'epoch', 'd')}: xent {_num(last, 'xent', '.4f')} "
            f"acc {_num(last, 'acc', '.4f')}, {_num(last, 'frames_per_sec', ',.0f')} "
            f"fr/s{left}"]


def _pretraining_progress(records, start) -> list:
    last = (records.get("pretrain") or [None])[-1]
    if last is None:
        return ["  no progress line yet"]
    layers = start.get("layers") or []
    of = len(layers) - 1 if isinstance(layers, list) and layers else "?"
    steps, layer, step = start.get("layer_steps"), last.get("layer"), last.get("step")
    known = isinstance(steps, list) and steps and all(_is_number(s) for s in steps) \
        and isinstance(layer, int) and 1 <= layer <= len(steps) and _is_number(step)
    where = f"layer {_num(last, 'layer', 'd')} of {of}, step {_num(last, 'step', 'd')}"
    left = ""
    if known:
        where += f" of {steps[layer - 1]}"
        done = sum(steps[:layer - 1]) + step
        first_layer, first_step = start.get("layer"), start.get("step")
        if isinstance(first_layer, int) and 1 <= first_layer <= len(steps) \
                and _is_number(first_step) and _is_number(last.get("time")) \
                and _is_number(start.get("time")):
            # this process's pace: the start record stands where it began
            begun = sum(steps[:first_layer - 1]) + first_step
            if done > begun and last["time"] > start["time"]:
                per_step = (last["time"] - start["time"]) / (done - begun)
                left = f", about {format_duration(per_step * max(sum(steps) - done, 0))} left"
    return [f"  {where}: recon mse {_num(last, 'recon_mse', '.4f')}, "
            f"{_num(last, 'frames_per_sec', ',.0f')} fr/s{left}"]


def _held_out(records, end, run_dir) -> list:
    evals = records["eval"]
    if not evals:
        return []
    last = evals[-1]
    line = f"  held-out acc {_num(last, 'dev_acc', '.4f')} at step {_num(last, 'step', 'd')}"
    chosen = end if end is not None and "best_step" in end else \
        (records.get("selection") or [None])[-1]
    if chosen is not None and _is_number(chosen.get("best_step")):
        if chosen["best_step"] >= 0:
            # the figure that selects: accuracy, or cross-entropy (runs that did not
            # record which show the number alone)
            figure = chosen.get("select_by")
            figure = f"{figure} " if figure in ("acc", "xent") else ""
            kept = "best.h5" if os.path.isfile(os.path.join(run_dir, "best.h5")) \
                else "no best.h5 here"
            line += (f"; best {figure}{_num(chosen, 'best_value', '.4f')} at step "
                     f"{_num(chosen, 'best_step', 'd')} ({kept})")
        else:               # no finite held-out result yet, so no best.h5
            line += "; no best model yet (no finite held-out result)"
    return [line]


def _newest_checkpoint(run_dir):
    """The checkpoint ``--resume`` tries first: the newest in the training it holds
    (a run resumed on more ranks numbers its steps lower than the one it came from)."""
    from .checkpoint import list_checkpoints
    found = list_checkpoints(run_dir)
    return os.path.basename(found[-1]) if found else None


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _num(record: dict, key: str, spec: str) -> str:
    """``record[key]`` formatted by ``spec``, or "?" when it is not a number (a
    record of an older or another writer)."""
    value = record.get(key)
    if not _is_number(value):
        return "?"
    if spec == "d":
        return str(int(value))
    return format(value, spec)
