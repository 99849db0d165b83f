"""The NG-SGD step-time benchmark: both optimizers timed, resets where asked."""

from __future__ import annotations

import json

import pytest

from mpitrain.bench import ngsgd_overhead
from mpitrain.optim.ngsgd import NaturalGradientSGD

TINY = dict(hidden=16, layers=1, classes=5, minibatch=8, rounds=1, steps=4)


def test_both_optimizers_are_timed_and_ngsgd_is_not_reset_by_default(monkeypatch):
    resets = []
    monkeypatch.setattr(NaturalGradientSGD, "reset_preconditioners",
                        lambda self: resets.append(1))
    result = ngsgd_overhead.measure(**TINY)
    assert result["sgd_step_ms"] > 0 and result["ngsgd_step_ms"] > 0
    assert result["ratio"] == pytest.approx(result["ngsgd_step_ms"] / result["sgd_step_ms"])
    assert resets == [] and result["reset_every"] == 0


def test_reset_every_k_restarts_the_preconditioners_every_k_steps(monkeypatch):
    resets = []
    real = NaturalGradientSGD.reset_preconditioners

    def counted(self):
        resets.append(1)
        real(self)

    monkeypatch.setattr(NaturalGradientSGD, "reset_preconditioners", counted)
    result = ngsgd_overhead.measure(**TINY, reset_every=2)
    # 12 warm-up steps and 4 timed ones: a reset after every second step
    assert len(resets) == (12 + 4) // 2 and result["reset_every"] == 2


def test_command_line_prints_and_writes_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert ngsgd_overhead.main(["--hidden", "16", "--layers", "1", "--classes", "5",
                                "--minibatch", "8", "--rounds", "1", "--steps", "2",
                                "--reset-every", "4", "--json", str(out)]) == 0
    assert "NG-SGD reset every 4 steps" in capsys.readouterr().out
    assert json.loads(out.read_text())["reset_every"] == 4
    with pytest.raises(SystemExit):
        ngsgd_overhead.main(["--reset-every", "-1"])


@pytest.mark.parametrize("flag", ["--steps", "--rounds", "--hidden", "--minibatch"])
def test_counts_below_one_are_refused(flag, capsys):
    with pytest.raises(SystemExit):
        ngsgd_overhead.main([flag, "0"])
    assert f"{flag} must be >= 1" in capsys.readouterr().err


def test_device_gpu_without_cupy_or_a_gpu_is_one_line(capsys):
    from mpitrain import backend
    from mpitrain.bench.ngsgd_overhead import main
    if backend.gpu_available():
        pytest.skip("a GPU is present: the refusal cannot be seen")
    assert main(["--device", "gpu", "--rounds", "1", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error: device: gpu" in err[0], err


def test_delayed_updates_are_a_third_contender(capsys):
    result = ngsgd_overhead.measure(**TINY, delayed_updates=True)
    assert result["delayed_ngsgd_step_ms"] > 0
    assert result["delayed_ratio"] == pytest.approx(
        result["delayed_ngsgd_step_ms"] / result["sgd_step_ms"])
    assert "delayed_ratio" not in ngsgd_overhead.measure(**TINY)
    assert ngsgd_overhead.main(["--hidden", "16", "--layers", "1", "--classes", "5",
                                "--minibatch", "8", "--rounds", "1", "--steps", "2",
                                "--delayed-updates"]) == 0
    assert "with delayed_updates: NG-SGD" in capsys.readouterr().out


def test_cuda_graph_needs_a_gpu(capsys):
    with pytest.raises(SystemExit):
        ngsgd_overhead.main(["--cuda-graph", "--rounds", "1", "--steps", "1"])
    assert "--cuda-graph needs --device gpu" in capsys.readouterr().err


def test_cuda_graphs_asked_for_and_not_used_are_said_not_claimed(capsys):
    """On the stand-in device (no kernel compiler) the graphs stay off: the line and
    the JSON say so and why, instead of labelling eager steps as CUDA graphs."""
    from mpitrain.testing import standin_cupy
    with standin_cupy.installed():
        assert ngsgd_overhead.main(["--device", "gpu", "--cuda-graph", "--hidden", "16",
                                    "--layers", "1", "--classes", "5", "--minibatch", "8",
                                    "--rounds", "1", "--steps", "2"]) == 0
        result = ngsgd_overhead.measure(**TINY, device="gpu", cuda_graph=True)
    out = capsys.readouterr().out
    assert "(CUDA graphs not used: needs the fused GPU kernels" in out, out
    assert "(CUDA graphs)" not in out, out
    assert result["cuda_graph"] is False
    assert result["cuda_graph_off_because"].startswith("needs the fused GPU kernels")
