"""Training curves from run directories: read ``metrics.jsonl``, draw PNG plots.

Matplotlib is imported inside the functions and only its Agg canvas is used,
so importing mpitrain stays light and no display is ever needed.

Example::

    from mpitrain.plotting import plot_runs
    plot_runs(["runs/sgd", "runs/ngsgd"], "curves.png", x="frames")
"""

from __future__ import annotations

import json
import math
import os
from typing import Optional, Sequence

from .files import atomic_path, path_text

#: Record types the trainer writes; read_metrics always returns these keys.
RECORD_TYPES = ("start", "train", "eval", "end")
#: What the curves can be drawn against: frames seen (all ranks) or seconds.
X_AXES = {"frames": ("frames", "frames seen (all ranks)"),
          "time": ("time", "wall time (s)"),
          # the communicator's clock since training began: simulated on virtual ranks
          "seconds": ("seconds", "training seconds (simulated on virtual ranks)")}


def keep_matplotlib_quiet(env=None) -> None:
    """Give Matplotlib a temporary config directory (``MPLCONFIGDIR``, removed at
    exit) when its default ones cannot be written, e.g. a read-only or missing
    HOME on a compute node: Matplotlib would otherwise print two warning lines at
    its import.  Nothing changes when ``MPLCONFIGDIR`` is set or HOME is usable.

    Example::

        keep_matplotlib_quiet()     # before the first import of matplotlib
    """
    env = os.environ if env is None else env
    if env.get("MPLCONFIGDIR"):
        return
    home = os.path.expanduser("~")
    bases = (env.get("XDG_CONFIG_HOME") or os.path.join(home, ".config"),
             env.get("XDG_CACHE_HOME") or os.path.join(home, ".cache"))
    if all(_could_be_written(os.path.join(base, "matplotlib")) for base in bases):
        return
    import atexit
    import shutil
    import tempfile
    directory = tempfile.mkdtemp(prefix="mpitrain-matplotlib-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    env["MPLCONFIGDIR"] = directory


def _could_be_written(path: str) -> bool:
    """Whether ``path`` is, or could be made as, a writable directory (nothing is made)."""
    while not os.path.lexists(path):
        parent = os.path.dirname(path)
        if parent == path:
            return False
        path = parent
    return os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK)


def metrics_path(run_dir) -> str:
    """The metrics file of a run directory (a path to the file itself is kept).

    Example::

        metrics_path("runs/quickstart")    # 'runs/quickstart/metrics.jsonl'
    """
    run_dir = os.fspath(run_dir)
    if run_dir.endswith(".jsonl") and not os.path.isdir(run_dir):
        return run_dir
    return os.path.join(run_dir, "metrics.jsonl")


def read_metrics(run_dir) -> dict[str, list[dict]]:
    """Records of ``RUN_DIR/metrics.jsonl`` grouped by their ``type``, in file order.

    The result always has the keys ``start``, ``train``, ``eval`` and ``end``
    (possibly empty lists), plus any other type found.  A missing file raises
    FileNotFoundError and a garbled line ValueError, both naming the file; a
    last line cut short (no line end: being written, or its run was killed
    then) is left out.

    Example::

        records = read_metrics("runs/quickstart")
        last = records["eval"][-1]        # {'type': 'eval', 'frames': ..., 'dev_acc': ...}
    """
    path = metrics_path(run_dir)
    if not os.path.isfile(path):
        run_dir = os.fspath(run_dir)
        # (a name of a glob such as runs/* that is no directory: its own words, not
        # those of a metrics file under it, a path that cannot exist)
        if path != run_dir and os.path.islink(run_dir) and not os.path.exists(run_dir):
            raise FileNotFoundError(f"{run_dir}: a symbolic link to {os.readlink(run_dir)}, "
                                    "which does not exist")
        if path != run_dir and not os.path.exists(run_dir):
            raise FileNotFoundError(f"{run_dir}: no such run directory")
        if path != run_dir and not os.path.isdir(run_dir):
            raise FileNotFoundError(f"{run_dir}: is a file, not a run directory (which "
                                    "holds metrics.jsonl)")
        if os.path.isfile(os.path.join(run_dir, "bench.json")):
            # a benchmark's --out: its report plots are there already, its runs under runs/
            raise FileNotFoundError(f"{run_dir}: a benchmark's report (bench.md, bench.json), "
                                    "not a run; its runs: "
                                    f"{os.path.join(run_dir, 'runs', '*')}")
        raise FileNotFoundError(f"{path}: no metrics file (a run directory of "
                                "`mpitrain train` has one)")
    records: dict[str, list[dict]] = {kind: [] for kind in RECORD_TYPES}
    clock = _Timeline()
    try:
        _read_records(path, records, clock)
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start} of a line): not a "
                         "metrics file of mpitrain, or damaged") from None
    return records


def _read_records(path: str, records: dict, clock) -> None:
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line, parse_int=json_int)
            except json.JSONDecodeError as exc:
                if not line.endswith("\n"):
                    # the last line cut short: a run writing it now, or one killed
                    # while it wrote (its resume drops the piece)
                    break
                raise ValueError(f"{path}: line {number}: expected one JSON object, "
                                 f"got unreadable text ({exc.msg})") from None
            except RecursionError:
                raise ValueError(f"{path}: line {number}: expected one JSON object, got "
                                 "values nested too deep to read") from None
            if not isinstance(record, dict) or not isinstance(record.get("type"), str):
                raise ValueError(f"{path}: line {number}: field 'type': expected a string "
                                 f"({', '.join(RECORD_TYPES)}) in a JSON object")
            _check_positions(record, path, number)
            record = clock.place(record, records)
            records.setdefault(record["type"], []).append(record)


def json_int(text: str):
    """An integer of a metrics record; one beyond what a float holds becomes inf.

    (Python's int() of thousands of digits is refused in words naming nothing,
    and arithmetic on a huge one overflows; an inf is judged like any other.)"""
    return int(text) if len(text) <= 19 else float(text)


# where a record stands: counts and clocks, never NaN or infinite (the values
# measured, such as a held-out loss, may be NaN; a field of another type is a
# record of another shape, which status shows as '?')
_POSITION_FIELDS = ("step", "steps", "frames", "layer", "time", "seconds")


def _check_positions(record: dict, path: str, number: int) -> None:
    for name in _POSITION_FIELDS:
        value = record.get(name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{path}: line {number}: field '{name}': expected a finite "
                             f"number, got {value!r}")


class _Timeline:
    """One run's records as one timeline.  A resume (a ``start`` record) or a roll
    back continues from an earlier step: the records after that step belong to
    the abandoned stretch and are dropped, and the clocks of a resumed process,
    which start at 0 again, continue from where the kept records ended."""

    CLOCKS = ("time", "seconds")

    def __init__(self):
        self.offset = dict.fromkeys(self.CLOCKS, 0.0)
        self.latest = dict.fromkeys(self.CLOCKS, 0.0)

    def place(self, record: dict, records: dict) -> dict:
        kind, step = record["type"], record.get("step")
        # a start records the frames it continues from: a resume on more ranks numbers
        # its steps lower than the training it continues, so frames decide there
        by, mark = ("frames", record.get("frames")) if kind == "start" and \
            isinstance(record.get("frames"), (int, float)) else ("step", step)
        if kind in ("start", "rollback") and isinstance(mark, (int, float)):
            for key in ("train", "eval"):
                records[key] = [r for r in records.get(key, [])
                                if not isinstance(r.get(by), (int, float))
                                or r[by] <= mark]
            if kind == "start" and any(records.values()):
                # the new process's clocks start at 0: go on from the kept records
                for clock in self.CLOCKS:
                    kept = [r[clock] for key in ("train", "eval") for r in records[key]
                            if isinstance(r.get(clock), (int, float))]
                    self.offset[clock] = max(kept, default=self.latest["time"]
                                             if clock == "time" else 0.0)
        shifted = dict(record)
        for clock in self.CLOCKS:
            if isinstance(record.get(clock), (int, float)):
                shifted[clock] = record[clock] + self.offset[clock]
                self.latest[clock] = max(self.latest[clock], shifted[clock])
            elif kind == "start":
                # where this part begins on the run's clock (what came before it)
                shifted[clock] = self.offset[clock]
        return shifted


def _series(records: list[dict], x_key: str, y_key: str, path: str):
    xs, ys = [], []
    for record in records:
        if y_key not in record:
            continue
        if not isinstance(record.get(x_key), (int, float)) \
                or not isinstance(record[y_key], (int, float)):
            raise ValueError(f"{path}: {record['type']} record at step {record.get('step')}: "
                             f"fields '{x_key}' and '{y_key}': expected numbers")
        xs.append(record[x_key])
        ys.append(record[y_key])
    return xs, ys


def run_label(run_dir) -> str:
    """The name a run is shown under: the last component of its directory.

    Example::

        run_label("bench-out/convergence/sgd-lr0.004-1r/")   # 'sgd-lr0.004-1r'
    """
    path = os.path.normpath(os.fspath(run_dir))
    if path.endswith(".jsonl"):
        path = os.path.dirname(path) or path
    return os.path.basename(path)


#: Settings left out of the labels: where the files are, not what was trained.
_PLACE_KEYS = ("data.train", "data.dev", "model.init_from")
#: Differing settings named in a label at most.
MAX_LABEL_SETTINGS = 3


def labels_with_settings(run_dirs: Sequence, *, ignore: Sequence[str] = (),
                         unused=None) -> list:
    """Each run's :func:`run_label` with the settings in which the runs'
    ``config.yaml`` differ (``lr-0 (optimizer.initial_learning_rate=0.008)``), so
    the runs of a sweep are told apart in a legend; a run without a readable
    ``config.yaml`` keeps its bare name.  ``ignore``: settings not worth naming
    (those that do not change what is trained), besides the corpus paths;
    ``unused``: dotted settings -> prefixes of those the run does not use (a
    setting no run uses is not named).

    Example::

        labels_with_settings(["runs/lr-0", "runs/lr-1"])
    """
    from .files import dotted_keys, read_yaml
    settings = []
    for run_dir in run_dirs:
        path = os.path.join(os.path.dirname(metrics_path(run_dir)), "config.yaml")
        try:
            data = read_yaml(path, what="config")
        except (OSError, ValueError):
            data = None
        settings.append(dotted_keys(data) if isinstance(data, dict) else None)
    known = [s for s in settings if s is not None]
    left_out = set(_PLACE_KEYS) | set(ignore)
    if unused is not None and known:
        unused_by_all = set.intersection(*(set(unused(s)) for s in known))
        left_out |= {k for k in set().union(*known) if k.startswith(tuple(unused_by_all))}
    distinct = {k: len({repr(s.get(k)) for s in known})
                for k in set().union(*known) if k not in left_out} if len(known) > 1 else {}
    # the settings that tell the most runs apart first (a sweep's method before a
    # rate two of them share), then by name
    keys = sorted((k for k, n in distinct.items() if n > 1), key=lambda k: (-distinct[k], k))
    labels = []
    for run_dir, flat in zip(run_dirs, settings):
        label = run_label(run_dir)
        if flat is not None and keys:
            shown = [f"{k}={flat.get(k)}" for k in keys[:MAX_LABEL_SETTINGS]]
            more = f", +{len(keys) - MAX_LABEL_SETTINGS}" if len(keys) > MAX_LABEL_SETTINGS else ""
            label += f" ({', '.join(shown)}{more})"
        labels.append(label)
    return labels


#: Legend labels up to this long fit inside the accuracy panel; longer ones (a
#: sweep's differing settings) go under both panels, wrapped to the second width.
INSET_LEGEND_CHARS, BELOW_LEGEND_CHARS = 32, 150


def place_legend(fig, axes) -> str:
    """Lay out ``fig`` with the legend of ``axes``'s curves: inside the panel when
    the labels are short, else under the panels, the figure made taller for its
    lines, so that no label runs over a curve or off the figure.  Returns
    ``"inside"``, ``"below"`` or ``"none"``."""
    import textwrap
    handles, names = axes.get_legend_handles_labels()
    if not names:
        fig.tight_layout()
        return "none"
    if max(len(n) for n in names) <= INSET_LEGEND_CHARS:
        axes.legend(fontsize="small", loc="lower right")
        fig.tight_layout()
        return "inside"
    wrapped = [textwrap.fill(n, BELOW_LEGEND_CHARS, subsequent_indent="    ") for n in names]
    lines = sum(w.count("\n") + 1 for w in wrapped)
    width, height = fig.get_size_inches()
    below = 0.19 * lines + 0.25                 # inches: small text, a line apart
    fig.set_size_inches(width, height + below)
    fig.legend(handles, wrapped, fontsize="small", loc="lower left", ncol=1,
               frameon=False, bbox_to_anchor=(0.01, 0.0))
    fig.tight_layout(rect=(0, below / (height + below), 1, 1))
    return "below"


#: The marker of each run's curves, by its tenth: runs 0-9 take the ten colours with
#: the first, runs 10-19 the same colours with the second, and so on.
RUN_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def _nothing_to_draw(path: str, records: dict, train: bool) -> str:
    """Why a run with no curve to draw is not drawn."""
    if any(r.get("mode") == "pretrain" for r in records["start"]):
        # (its reconstruction error is a curve of another kind: not drawn here)
        return (f"{path}: a pretraining run (mpitrain pretrain): plot draws the held-out "
                "and training curves of train runs; the RBMs' reconstruction error is in "
                "its pretrain records")
    return f"{path}: no eval or train records to plot"


def plot_runs(run_dirs: Sequence, out_png, *, x: str = "frames",
              labels: Optional[Sequence[str]] = None, title: Optional[str] = None,
              train: bool = True, dpi: int = 100, warn=None) -> str:
    """Draw held-out frame accuracy and cross-entropy of several runs into one PNG.

    Two panels side by side; one colour per run, held-out curves solid,
    training curves (the averages the trainer logs every ``log_interval``
    steps) dashed when ``train`` is true.  ``x`` is ``"frames"`` (frames seen,
    summed over ranks), ``"time"`` (wall seconds since the run started) or
    ``"seconds"`` (training seconds on the communicator's clock: simulated
    seconds for virtual ranks).  ``warn(message)`` given: a run with nothing
    to draw yet (a job of a sweep just started) is left out and named to it,
    so long as another run has curves; without it such a run is an error.
    Returns the path written.

    Example::

        plot_runs(["runs/a", "runs/b"], "ab.png", x="time", labels=["SGD", "NG-SGD"])
    """
    if x not in X_AXES:
        raise ValueError(f"plot_runs: x: expected one of {', '.join(X_AXES)}, got {x!r}")
    run_dirs = list(run_dirs)
    if not run_dirs:
        raise ValueError("plot_runs: run_dirs: expected at least one run directory")
    if labels is None:
        labels = [run_label(d) for d in run_dirs]
    elif len(labels) != len(run_dirs):
        raise ValueError(f"plot_runs: labels: expected {len(run_dirs)} labels "
                         f"(one per run), got {len(labels)}")
    if dpi < 10:
        raise ValueError(f"plot_runs: dpi: expected at least 10, got {dpi}")
    # (Matplotlib draws only text UTF-8 can hold, not a name's raw Latin-1 bytes)
    labels = [path_text(label) for label in labels]
    title = path_text(title) if title else title
    runs = [(metrics_path(d), read_metrics(d)) for d in run_dirs]
    empty = [(i, _nothing_to_draw(path, records, train)) for i, (path, records)
             in enumerate(runs) if not records["eval"] and not (train and records["train"])]
    if empty and (warn is None or len(empty) == len(runs)):
        raise ValueError(empty[0][1])
    for _, why in empty:
        warn(f"{why}; left out of the plot")
    left_out = {i for i, _ in empty}
    runs = [run for i, run in enumerate(runs) if i not in left_out]
    labels = [label for i, label in enumerate(labels) if i not in left_out]

    keep_matplotlib_quiet()
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ValueError("plotting needs matplotlib: pip install matplotlib "
                         "(or the [plot] extra)") from None

    x_key, x_title = X_AXES[x]
    fig = Figure(figsize=(11, 4.2))
    FigureCanvasAgg(fig)
    ax_acc, ax_xent = fig.subplots(1, 2)
    for i, ((path, records), label) in enumerate(zip(runs, labels)):
        # ten colours, then another marker for each further ten runs: the eleventh
        # run of a sweep is not drawn as the first
        colour, marker = f"C{i % 10}", RUN_MARKERS[i // 10 % len(RUN_MARKERS)]
        for ax, dev_key, train_key in ((ax_acc, "dev_acc", "acc"), (ax_xent, "dev_xent", "xent")):
            xs, ys = _series(records["eval"], x_key, dev_key, path)
            if xs:
                ax.plot(xs, ys, color=colour, marker=marker, markersize=3, label=label)
            if train:
                xs, ys = _series(records["train"], x_key, train_key, path)
                if xs:
                    # (a lone point shows only with a marker; past ten runs the marker
                    # tells a training curve from the one of the same colour)
                    ax.plot(xs, ys, color=colour, linestyle="--", linewidth=1,
                            marker="." if len(xs) == 1 and i < 10 else
                            (marker if i >= 10 else None), markersize=3,
                            alpha=0.7, label=None if records["eval"] else f"{label} (train)")
    ax_acc.set_title("frame accuracy")
    ax_xent.set_title("cross-entropy per frame")
    ax_acc.set_ylabel("accuracy")
    ax_xent.set_ylabel("cross-entropy")
    for ax in (ax_acc, ax_xent):
        ax.set_xlabel(x_title)
        ax.grid(True, alpha=0.3)
    note = "solid: held-out" + (", dashed: training" if train else "")
    fig.suptitle(f"{title}  ({note})" if title else note, fontsize="medium")
    place_legend(fig, ax_acc)
    out_png = os.fspath(out_png)
    with atomic_path(out_png) as tmp:          # (it makes the missing directories)
        fig.savefig(tmp, dpi=dpi, format="png")
    return out_png
