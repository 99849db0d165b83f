"""The throughput benchmark's bookkeeping: FLOP counts, result rows, the table, options."""

import json
import types

import numpy as np
import pytest

from mpitrain.bench import machine
from mpitrain.bench import throughput as tp
from mpitrain.bench.models import PARALLEL_MODELS, THROUGHPUT_MODELS, ModelSpec, synthetic_chunk
from mpitrain.bench.steps import TrainerSteps
from mpitrain.bench.throughput import (MODELS, GemmSteps, flops_per_frame, format_table,
                                       gemm_flops, layer_gemms, parse_args, summarize)

TINY = ModelSpec("tiny", hidden_layers=2, hidden_dim=16, num_classes=7, minibatch=8,
                 feat_dim=3, left_context=1, right_context=1, default_steps=1)


def test_each_command_keeps_its_model_names_and_sizes():
    assert tp.MODELS is THROUGHPUT_MODELS
    assert {n: m.describe() for n, m in THROUGHPUT_MODELS.items()} == {
        "quick": "440-3x512-120, minibatch 256", "small": "440-4x1024-2000, minibatch 256",
        "large": "440-4x2048-4000, minibatch 512"}
    # scaling and ddp_compare: "large" has long been the smaller model there
    assert {n: m.describe() for n, m in PARALLEL_MODELS.items()} == {
        "tiny": "440-2x64-32, minibatch 64", "quickstart": "440-3x512-120, minibatch 256",
        "large": "440-4x1024-2000, minibatch 256"}


def test_synthetic_chunk_is_a_chunk_of_whole_utterances():
    chunk, order = synthetic_chunk(TINY, 1000, seed=5)
    again, same = synthetic_chunk(TINY, 1000, seed=5)
    assert np.array_equal(chunk.feats, again.feats) and np.array_equal(order, same)
    assert chunk.feats.shape == (1000, TINY.feat_dim) and chunk.feats.dtype == np.float32
    assert chunk.labels.min() >= 0 and chunk.labels.max() < TINY.num_classes
    assert sorted(order) == list(range(1000))
    # every frame lies inside its utterance, and the last utterance ends at the chunk's end
    frames = np.arange(1000)
    assert np.all(chunk.utt_start <= frames) and np.all(frames < chunk.utt_end)
    assert chunk.utt_end[-1] == 1000


def _by_hand(dims):
    pairs = list(zip(dims[:-1], dims[1:]))
    forward = sum(2 * i * o for i, o in pairs)
    weight_grad = forward
    data_grad = sum(2 * i * o for i, o in pairs[1:])
    return forward + weight_grad + data_grad


def test_layer_gemms_order_and_shapes():
    # forward per layer, then per layer from the top: data grad (not the first), weight grad
    assert layer_gemms([4, 3, 2], 5) == [(5, 4, 3), (5, 3, 2),
                                         (5, 2, 3), (2, 5, 3),
                                         (3, 5, 4)]


@pytest.mark.parametrize("name", ["small", "large"])
def test_flops_per_frame_of_the_spec_models(name):
    dims = MODELS[name].layer_dims
    assert dims[0] == 440 and len(dims) == 6
    assert flops_per_frame(dims) == _by_hand(dims)


def test_flops_per_frame_known_values():
    # 440-4x1024-2000: 2 * (3 * 5_644_288 - 440 * 1024)
    assert flops_per_frame([440, 1024, 1024, 1024, 1024, 2000]) == 32_964_608
    assert flops_per_frame([440, 2048, 2048, 2048, 2048, 4000]) == 128_253_952
    # one layer: no data gradient at all
    assert flops_per_frame([10, 4]) == 2 * 2 * 10 * 4


def test_gemm_flops_scales_with_batch():
    dims = MODELS["small"].layer_dims
    assert gemm_flops(layer_gemms(dims, 256)) == 256 * flops_per_frame(dims)


@pytest.mark.parametrize("dims,batch", [([5], 4), ([5, 0], 4), ([5, 3], 0)])
def test_layer_gemms_rejects_bad_shapes(dims, batch):
    with pytest.raises(ValueError):
        layer_gemms(dims, batch)


def test_gemm_steps_run_exactly_the_counted_gemms():
    steps = GemmSteps(TINY)
    shapes = [(a.shape[0], a.shape[1], b.shape[1]) for a, b, _ in steps.ops]
    assert shapes == layer_gemms(TINY.layer_dims, TINY.minibatch)
    assert steps.flops == TINY.minibatch * flops_per_frame(TINY.layer_dims)
    a, b, out = steps.ops[0]
    steps.step()
    np.testing.assert_allclose(out, a @ b, rtol=1e-5, atol=1e-5)


def test_summarize_takes_medians_and_per_round_ratios():
    fpf = flops_per_frame(TINY.layer_dims)
    rates = {"mpitrain": [100.0, 300.0, 200.0], "torch": [50.0, 300.0, 250.0],
             "gemm": [fpf * 200.0, fpf * 300.0, fpf * 400.0]}
    row = summarize(TINY, 2, rates)
    assert row["mpitrain_fps"] == 200.0
    assert row["torch_fps"] == 250.0
    # per-round ratios 2.0, 1.0, 0.8 -> median 1.0 (the ratio of medians would be 0.8)
    assert row["mpitrain_vs_torch"] == pytest.approx(1.0)
    assert row["gemm_gflops"] == pytest.approx(fpf * 300.0 / 1e9)
    assert row["gemm_bound_fps"] == pytest.approx(300.0)
    # per-round fractions 0.5, 1.0, 0.5; PyTorch's 0.25, 1.0, 0.625
    assert row["fraction_of_bound"] == pytest.approx(0.5)
    assert row["torch_fraction_of_bound"] == pytest.approx(0.625)
    assert row["threads"] == 2 and row["rounds"] == 3
    json.dumps(row)  # the row goes to --json as it is


def test_summarize_without_torch_and_with_cpu_rates():
    fpf = flops_per_frame(TINY.layer_dims)
    rates = {"mpitrain": [90.0], "gemm": [fpf * 100.0]}
    row = summarize(TINY, 1, rates, cpu_rates={"mpitrain": [95.0], "gemm": [fpf * 100.0]})
    assert row["torch_fps"] is None and row["mpitrain_vs_torch"] is None
    assert row["fraction_of_bound"] == pytest.approx(0.9)
    assert row["cpu_fraction_of_bound"] == pytest.approx(0.95)
    assert row["cpu_mpitrain_vs_torch"] is None and row["torch_fraction_of_bound"] is None
    assert row["cpu_mpitrain_fps"] == 95.0 and row["cpu_gemm_bound_fps"] == pytest.approx(100.0)


def test_summarize_rejects_uneven_rounds():
    with pytest.raises(ValueError, match="one rate per round"):
        summarize(TINY, 1, {"mpitrain": [1.0, 2.0], "gemm": [1.0]})


def test_format_table_columns_and_missing_torch():
    fpf = flops_per_frame(TINY.layer_dims)
    with_torch = summarize(TINY, 1, {"mpitrain": [1250.0], "torch": [1000.0],
                                     "gemm": [fpf * 2500.0]})
    without = summarize(TINY, 2, {"mpitrain": [2000.0], "gemm": [fpf * 4000.0]})
    text = format_table([with_torch, without]).splitlines()
    assert len(text) == 3
    assert text[0].split()[:5] == ["model", "threads", "precision", "mpitrain", "fr/s"]
    assert text[1].split() == ["tiny", "1", "fp32", "1,250", "1,000", "1.25",
                               f"{fpf * 2500.0 / 1e9:.1f}", "2,500", "0.50", "0.40"]
    assert text[2].split()[3:6] == ["2,000", "-", "-"]
    md = format_table([with_torch], markdown=True).splitlines()
    assert md[0].startswith("| model | threads | precision |")
    assert md[1].startswith("|---|---|---|---:")
    assert md[2] == ("| tiny | 1 | fp32 | 1,250 | 1,000 | 1.25 | "
                     f"{fpf * 2500.0 / 1e9:.1f} | 2,500 | 0.50 | 0.40 |")


def test_parse_args_defaults_and_errors(capsys):
    args = parse_args([])
    assert args.threads == [1, 2] and args.models == ["small", "large"]
    assert parse_args(["--threads", "2", "--models", "large"]).threads == [2]
    for bad in (["--threads", "0"], ["--threads", "a"], ["--models", "huge"],
                ["--rounds", "0"], ["--frames", "100"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
    assert "--models: unknown model 'huge'" in capsys.readouterr().err


def test_measure_runs_the_trainer_step_without_torch():
    row = tp.measure(TINY, 1, steps=1, rounds=2, warmup=1, frames=200, use_torch=False,
                     breakdown=True)
    assert row["torch_fps"] is None and len(row["per_round"]["mpitrain"]) == 2
    assert row["mpitrain_fps"] > 0 and row["gemm_gflops"] > 0
    assert set(row["mpitrain_pieces_ms"]) == {"splice", "forward", "softmax_xent",
                                              "backward", "optimizer"}


def test_mpitrain_step_trains_the_model():
    chunk, perm = synthetic_chunk(TINY, 64)
    steps = TrainerSteps(TINY, chunk, perm)
    assert tp.MpitrainSteps is TrainerSteps      # the contender is the shared step
    before = steps.net.params.copy()
    steps.step()
    steps.step()
    assert steps.step_count == 2 and steps.optimizer.num_steps == 2
    assert not np.array_equal(before, steps.net.params)
    loss_sum, _, frames, _ = steps.training_step.take_sums()
    assert loss_sum > 0 and frames == 2 * TINY.minibatch
    # minibatches walk through the shuffled order
    assert np.array_equal(steps.next_batch()[1], perm[2 * TINY.minibatch:3 * TINY.minibatch])


def test_main_without_torch_reports_mpitrain_and_gemm(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(tp, "MODELS", {"tiny": TINY})
    monkeypatch.setattr(machine, "import_torch", lambda: None)
    out = tmp_path / "rows.json"
    assert tp.main(["--models", "tiny", "--threads", "1", "--rounds", "1", "--frames", "100",
                    "--json", str(out)]) == 0
    captured = capsys.readouterr()
    assert "pip install torch" in captured.err
    assert "tiny" in captured.out
    saved = json.loads(out.read_text())
    assert saved["machine"]["torch"] is None
    assert [r["model"] for r in saved["rows"]] == ["tiny"]


def test_device_gpu_without_cupy_or_a_gpu_is_one_line(capsys):
    from mpitrain import backend
    if backend.gpu_available():
        pytest.skip("a GPU is present: the refusal cannot be seen")
    assert tp.main(["--device", "gpu", "--models", "quick", "--rounds", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("python -m mpitrain.bench.throughput: error: "
                                               "device: gpu"), err


def test_the_gemm_bounds_own_stream_waits_for_the_operands_uploads(monkeypatch):
    """On a GPU the bound's GEMMs move to a non-blocking stream of their own, which
    does not wait for the stream their operands were uploaded on: it must wait
    for that stream first (a GEMM could read operands not yet written)."""
    from mpitrain import backend
    said = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def synchronize(self):
            said.append(f"{self.name} finished")

        def use(self):
            said.append(f"{self.name} current")

    current = Stream("upload stream")
    cuda = types.SimpleNamespace(get_current_stream=lambda: current,
                                 Stream=lambda non_blocking: Stream("own stream"))
    steps = GemmSteps(TINY)
    steps.xp = types.SimpleNamespace(cuda=cuda)
    monkeypatch.setattr(backend, "fused_kernels", lambda xp: True)
    monkeypatch.setattr(backend, "gemm", lambda *args, **kwargs: said.append("gemm"))
    monkeypatch.setattr(backend, "capture_graph", lambda xp, work: (None, "no graphs here"))
    steps.step()
    assert said.index("upload stream finished") < said.index("own stream current") \
        < said.index("gemm"), said


def test_bf16_on_a_gpu_without_it_is_one_line(monkeypatch, capsys):
    # (a traceback from set_precision)
    from mpitrain.testing import standin_cupy
    with standin_cupy.installed():
        monkeypatch.setitem(standin_cupy.DEVICE, "compute_capability", "70")
        assert tp.main(["--device", "gpu", "--models", "quick", "--rounds", "1",
                        "--precision", "bf16", "--no-torch"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "python -m mpitrain.bench.throughput: error: --precision: precision: bf16 needs a "
        "GPU of compute capability 8.0 or newer"), err


def test_cuda_graph_needs_a_gpu(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--cuda-graph"])
    assert "--cuda-graph needs --device gpu" in capsys.readouterr().err


def test_cuda_graphs_asked_for_and_not_used_are_said_under_the_table(capsys):
    """On the stand-in device (no kernel compiler) the graphs stay off: the figures
    are eager steps', and a line under the table says so and why."""
    from mpitrain.testing import standin_cupy
    with standin_cupy.installed():
        assert tp.main(["--device", "gpu", "--models", "quick", "--rounds", "1",
                        "--steps", "1", "--warmup", "1", "--frames", "2000",
                        "--no-torch", "--cuda-graph"]) == 0
    out = capsys.readouterr().out
    assert "# quick fp32: CUDA graphs not used: needs the fused GPU kernels" in out, out
