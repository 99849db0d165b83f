"""The convergence study's arithmetic: frames to reach an accuracy, best rates, the table."""

import pytest

from mpitrain.bench.convergence import frames_to_reach

from ..helpers import write_run


def test_frames_to_reach_interpolates_between_evaluations():
    evals = [{"frames": 100, "dev_acc": 0.2}, {"frames": 200, "dev_acc": 0.6},
             {"frames": 300, "dev_acc": 0.5}, {"frames": 400, "dev_acc": 0.9}]
    assert frames_to_reach(evals, 0.4) == pytest.approx(150.0)
    assert frames_to_reach(evals, 0.1) == 100.0          # reached at the first point
    assert frames_to_reach(evals, 0.7) == pytest.approx(350.0)
    assert frames_to_reach(evals, 0.95) is None


def test_best_rates_and_table_of_summarized_runs(tmp_path):
    from mpitrain.bench.convergence import RunSpec, best_rates, markdown_table, summarize_run
    rows = []
    for opt, lr, acc in (("sgd", 0.002, 0.6), ("sgd", 0.004, 0.7), ("ngsgd", 0.004, 0.8)):
        spec = RunSpec(opt, lr, 1)
        write_run(tmp_path / spec.name, acc_at_end=acc)
        rows.append(summarize_run(tmp_path / spec.name, spec, targets=(0.1, 0.5, 0.9)))
    assert best_rates(rows, ranks=1) == {"sgd": 0.004, "ngsgd": 0.004}
    assert best_rates(rows, ranks=4) == {}
    ng = rows[2]
    assert ng["final_dev_acc"] == pytest.approx(0.78)
    # eval accuracies 0.14, 0.30, 0.46, 0.62, 0.78 at 2560-frame steps
    assert ng["frames_to_acc"]["0.5"] == pytest.approx(7680 + 0.25 * 2560)
    assert ng["frames_to_acc"]["0.9"] is None
    for row in rows:
        row["best"] = row["lr"] == 0.004
    table = markdown_table(rows, (0.1, 0.5, 0.9)).splitlines()
    assert len(table) == 2 + 3
    assert table[4].startswith("| NG-SGD | 1 | 0.004 * | 0.7800 |")
    # 0.1 is reached by the first evaluation: only a bound is known
    assert "| <= 3k | 8k | not reached |" in table[4]
    with pytest.raises(ValueError, match="optimizer"):
        RunSpec("adam", 0.1, 1)


def test_a_run_that_fails_is_one_line_naming_its_log(tmp_path, capsys):
    """(it ended the study with a RuntimeError's traceback)"""
    from mpitrain.bench.convergence import main
    for split in ("train", "dev"):
        (tmp_path / "corpus" / split).mkdir(parents=True)      # no corpus.yaml in them
    out = tmp_path / "out"
    assert main(["--corpus", str(tmp_path / "corpus"), "--out", str(out), "--ranks", "1",
                 "--lrs", "0.004"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("convergence: error: ") and err.count("\n") == 1, err
    assert "exited with status 2; see " in err and "train.log" in err, err


def test_a_swept_rate_the_config_cannot_take_is_refused_before_any_run(tmp_path, capsys):
    """An L2 within its bound at the config's rate but not at a swept one: the study
    trained the runs before it, then stopped pointing at a log."""
    from mpitrain.bench.convergence import main
    from ..helpers import QUICKSTART
    config = tmp_path / "l2.yaml"
    # bound at 256 frames: l2 below 1 / (2 x 256 x rate), 0.244 at 0.008
    config.write_text(open(QUICKSTART).read().replace(
        "  max_change_per_layer: 0.75", "  l2_regularize: 0.3\n  max_change_per_layer: 0.75"))
    for split in ("train", "dev"):
        (tmp_path / "corpus" / split).mkdir(parents=True)
    out = tmp_path / "out"
    argv = ["--corpus", str(tmp_path / "corpus"), "--out", str(out), "--config", str(config),
            "--ranks", "1", "--lrs", "0.002,0.008"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"convergence: error: sgd-lr0.008-1r: {config}: "
                          "optimizer.l2_regularize: 0.3 shrinks") and err.count("\n") == 1, err
    assert not out.exists()
    # the runs on more ranks try each swept rate times each factor
    assert main(argv[:-4] + ["--ranks", "1,4", "--lrs", "0.002", "--lr-factors", "1,8"]) == 2
    assert "convergence: error: sgd-lr0.016-4r: " in capsys.readouterr().err


@pytest.mark.parametrize("option, value, said", [
    ("--lrs", "0", "argument --lrs: expected comma-separated positive numbers, got '0'"),
    ("--ngsgd-lrs", "0.004,-1", "argument --ngsgd-lrs: expected comma-separated positive "
                                "numbers, got '0.004,-1'"),
    ("--lr-factors", "0", "argument --lr-factors: expected comma-separated positive numbers, "
                          "got '0'"),
    ("--eval-frames", "-5", "argument --eval-frames: expected a positive integer, got '-5'"),
], ids=["lrs", "ngsgd-lrs", "lr-factors", "eval-frames"])
def test_rates_and_intervals_out_of_range_are_one_line_before_any_run(tmp_path, capsys,
                                                                      option, value, said):
    # a rate of 0 was a traceback of RunSpec; --eval-frames -5 evaluated at every step
    from mpitrain.bench.convergence import main
    for split in ("train", "dev"):
        (tmp_path / "corpus" / split).mkdir(parents=True)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as info:
        main(["--corpus", str(tmp_path / "corpus"), "--out", str(out), option, value])
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == \
        f"python -m mpitrain.bench.convergence: error: {said}"
    assert not out.exists()
