"""The soak check (bench/soak.py) reads a run's memory and speed and judges flatness."""

import json

import pytest

from mpitrain.bench.soak import main, summarize


def _write(run_dir, rss, fps):
    run_dir.mkdir(exist_ok=True)
    lines = [{"type": "start", "step": 0}]
    for i, (m, f) in enumerate(zip(rss, fps)):
        lines.append({"type": "train", "time": float(i), "step": 10 * (i + 1), "rss_mb": m,
                      "frames_per_sec": f})
        if i % 5 == 0:
            lines.append({"type": "checkpoint", "step": 10 * (i + 1), "seconds": 0.01})
    (run_dir / "metrics.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")


def test_flat_run_passes_despite_slow_checkpoint_windows(tmp_path, capsys):
    fps = [1000.0 if i % 5 else 600.0 for i in range(40)]     # checkpoint windows slower
    _write(tmp_path / "run", [200.0 + (i % 3) for i in range(40)], fps)
    s = summarize(tmp_path / "run")
    assert s["flat"] and abs(s["rss_growth_mb"]) < 3 and s["slowdown"] == 1.0
    assert s["checkpoints"] == 8
    assert main([str(tmp_path / "run")]) == 0
    assert "flat: yes" in capsys.readouterr().out


@pytest.mark.parametrize("rss,fps", [
    ([200.0 + 5 * i for i in range(40)], [1000.0] * 40),                # leaks 5 MiB a window
    ([200.0] * 40, [1000.0 - 10 * i for i in range(40)]),               # slows down
])
def test_growth_or_slowdown_fails(tmp_path, rss, fps):
    _write(tmp_path / "run", rss, fps)
    assert not summarize(tmp_path / "run")["flat"]
    assert main([str(tmp_path / "run")]) == 1


def test_too_short_or_missing_metrics_is_one_line(tmp_path, capsys):
    _write(tmp_path / "run", [1.0] * 3, [1.0] * 3)
    assert main([str(tmp_path / "run")]) == 2
    assert main([str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "at least 8" in err[0] and "none: no such run directory" in err[1]


def test_cpu_time_per_step_is_judged_when_recorded(tmp_path):
    # the machine got busy (wall clock halves) but the run itself did not slow down
    run = tmp_path / "run"
    _write(run, [200.0] * 40, [1000.0] * 20 + [500.0] * 20)
    lines = [__import__("json").loads(x) for x in (run / "metrics.jsonl").read_text().split("\n")
             if x]
    for r in lines:
        if r["type"] == "train":
            r["cpu_ms_per_step"] = 4.0
    (run / "metrics.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")
    s = summarize(run)
    assert s["wall_slowdown"] == 2.0 and s["slowdown"] == 1.0 and s["flat"]
    for r in lines:
        if r["type"] == "train" and r["step"] > 200:
            r["cpu_ms_per_step"] = 6.0
    (run / "metrics.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")
    assert not summarize(run)["flat"]


def test_a_resumed_run_is_read_on_one_clock_as_plot_reads_it(tmp_path, capsys):
    # the minutes were the last part's clock, the stretch trained again after the
    # resume was counted twice, and a run still writing its last line (or killed
    # while it wrote) was "cannot read the run's metrics"; a speed-up read "slower"
    run = tmp_path / "run"
    run.mkdir()
    lines = [{"type": "start", "step": 0, "frames": 0}]
    lines += [{"type": "train", "time": 60.0 * (i + 1), "step": 10 * (i + 1), "frames": i + 1,
               "rss_mb": 200.0, "frames_per_sec": 1000.0} for i in range(20)]
    # killed at step 200; resumed from the checkpoint of step 100, on a new clock
    lines += [{"type": "start", "step": 100, "frames": 10}]
    lines += [{"type": "train", "time": 60.0 * (i + 1), "step": 100 + 10 * (i + 1),
               "frames": 11 + i, "rss_mb": 200.0, "frames_per_sec": 2000.0}
              for i in range(20)]
    text = "\n".join(map(json.dumps, lines)) + '\n{"type": "train", "ti'
    (run / "metrics.jsonl").write_text(text)
    s = summarize(run)
    assert s["windows"] == 30 and s["steps"] == 300 and s["seconds"] == 30 * 60.0
    assert main([str(run)]) == 0
    out = capsys.readouterr().out
    assert "30.0 min" in out and "x2.000 faster" in out, out
