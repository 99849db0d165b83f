"""The benchmark's options: methods from the strategy registry, errors naming the option."""

import math

import pytest

from mpitrain.bench import options as bench_options
from mpitrain.bench.options import BenchOptions
from mpitrain.parallel import registry


def test_methods_come_from_the_strategy_registry(monkeypatch):
    synchronous = tuple(m for m in registry.METHODS if m not in registry.ASYNCHRONOUS_METHODS)
    assert BenchOptions().resolve(2) == ((1, 2), synchronous)
    assert "param_server" not in synchronous     # no common steps, no one-rank group
    monkeypatch.setitem(registry.METHODS, "ring_mix", registry.METHODS["model_averaging"])
    assert "ring_mix" in BenchOptions().resolve(2)[1]
    assert BenchOptions(methods=("ring_mix",)).methods == ("ring_mix",)
    assert bench_options.METHODS is registry.METHODS


def test_bad_options_name_the_option():
    with pytest.raises(ValueError, match="--sizes: must include 1"):
        BenchOptions(sizes=(2, 4))
    with pytest.raises(ValueError, match="--methods: unknown nope"):
        BenchOptions(methods=("nope",))
    with pytest.raises(ValueError, match="--target-accuracy"):
        BenchOptions(target_accuracy=1.5)
    with pytest.raises(ValueError, match="--sizes: 4 ranks asked for, but the job has 2"):
        BenchOptions(sizes=(1, 4)).resolve(2)
    assert not math.isnan(BenchOptions().network.latency_s)


def test_lr_scale_sets_the_rates_of_n_ranks():
    from mpitrain.bench.phases import scaled_rates
    from mpitrain.config import config_from_dict
    cfg = config_from_dict({"optimizer": {"initial_learning_rate": 0.004,
                                          "final_learning_rate": 0.0004}})
    assert scaled_rates(cfg, BenchOptions(), 16) == {}
    assert scaled_rates(cfg, BenchOptions(lr_scale="linear"), 1) == {}
    got = scaled_rates(cfg, BenchOptions(lr_scale="linear"), 16)
    assert got == {"optimizer__initial_learning_rate": pytest.approx(0.064),
                   "optimizer__final_learning_rate": pytest.approx(0.0064)}
    got = scaled_rates(cfg, BenchOptions(lr_scale="sqrt"), 16)
    assert got["optimizer__initial_learning_rate"] == pytest.approx(0.016)
    assert BenchOptions(lr_scale="sqrt").to_dict()["lr_scale"] == "sqrt"
    with pytest.raises(ValueError, match="--lr-scale: expected one of none, linear, sqrt"):
        BenchOptions(lr_scale="cubic")


def test_asynchronous_adpsgd_is_refused_in_one_line():
    from mpitrain.bench.options import check_benchable
    from mpitrain.config import load_config
    from ..helpers import QUICKSTART
    cfg = load_config(QUICKSTART, ["parallel.method=adpsgd", "parallel.asynchronous=true"])
    with pytest.raises(ValueError, match="parallel.asynchronous") as info:
        check_benchable(cfg, ("model_averaging", "adpsgd"))
    assert "\n" not in str(info.value)
    check_benchable(cfg, ("model_averaging",))      # ADPSGD not among the methods: fine


def test_the_accuracy_phase_alone_needs_a_target():
    from mpitrain.bench.options import BenchOptions
    with pytest.raises(ValueError, match="--phases accuracy: .* needs --target-accuracy"):
        BenchOptions(sizes=(1, 2), phases=("accuracy",))
    assert BenchOptions(sizes=(1, 2), phases=("accuracy",), target_accuracy=0.5).phases
    # with the throughput phase as well, the accuracy phase is skipped with a notice
    assert BenchOptions(sizes=(1, 2), phases=("throughput", "accuracy")).phases
    # named twice it is still alone: a benchmark that would measure nothing, and
    # wrote an empty report with status 0
    with pytest.raises(ValueError, match="--phases accuracy: .* needs --target-accuracy"):
        BenchOptions(sizes=(1, 2), phases=("accuracy", "accuracy"))
    assert BenchOptions(phases=("throughput", "throughput")).to_dict()["phases"] == \
        ["throughput"]


def test_hierarchical_adpsgd_without_ranks_per_node_is_refused_in_one_line():
    from mpitrain.bench.options import check_benchable
    from mpitrain.config import load_config
    from ..helpers import QUICKSTART
    cfg = load_config(QUICKSTART, ["parallel.method=adpsgd", "parallel.hierarchical=true"])
    with pytest.raises(ValueError, match="parallel.ranks_per_node") as info:
        check_benchable(cfg, ("adpsgd",))
    assert "\n" not in str(info.value)
    check_benchable(cfg, ("model_averaging",))      # ADPSGD not among the methods: fine
    cfg = load_config(QUICKSTART, ["parallel.method=adpsgd", "parallel.hierarchical=true",
                                   "parallel.ranks_per_node=2"])
    check_benchable(cfg, ("adpsgd",))


def test_a_setting_of_one_method_is_refused_before_measuring_naming_the_methods():
    """``straggler_policy: adapt`` (model averaging's) or ``hierarchical`` (ADPSGD's)
    with other methods benchmarked: the benchmark measured the first method, then
    aborted the job at the next one's config."""
    from mpitrain.bench.options import BenchSettingsError
    from mpitrain.bench.phases import check_groups
    from mpitrain.config import load_config
    from ..helpers import QUICKSTART
    cfg = load_config(QUICKSTART, ["parallel.straggler_policy=adapt"])
    with pytest.raises(BenchSettingsError) as info:
        check_groups(cfg, ("model_averaging", "allreduce"), (1, 2))
    assert str(info.value) == (
        "parallel.straggler_policy: adapt works with parallel.method model_averaging, not "
        "allreduce; the benchmark runs the config with parallel.method allreduce: benchmark "
        "the methods the config's settings fit (--methods model_averaging), or leave the "
        "setting out")
    check_groups(cfg, ("model_averaging",), (1, 2))
    # the hint names only the methods that take the settings (it named every other)
    with pytest.raises(BenchSettingsError, match=r"\(--methods model_averaging\), or"):
        check_groups(cfg, ("allreduce", "model_averaging", "kaldi", "bmuf"), (1, 2))
    with pytest.raises(BenchSettingsError, match="no method asked for takes them"):
        check_groups(cfg, ("allreduce", "kaldi"), (1, 2))
    cfg = load_config(QUICKSTART, ["parallel.method=adpsgd", "parallel.hierarchical=true",
                                   "parallel.ranks_per_node=2"])
    with pytest.raises(BenchSettingsError, match="hierarchical.*--methods adpsgd"):
        check_groups(cfg, ("adpsgd", "model_averaging"), (1, 2, 4))


def test_a_slow_rank_is_slow_in_the_groups_that_have_it():
    """``parallel.straggler.ranks: [1]``: the one-rank group (always measured first)
    has no rank 1; the benchmark could never run."""
    from mpitrain.bench.phases import _with, check_groups, group_settings, straggler_within
    from mpitrain.config import load_config
    from ..helpers import QUICKSTART
    cfg = load_config(QUICKSTART, ["parallel.straggler.ranks=[1, 3]"])
    assert straggler_within(cfg, 1) == {"parallel__straggler__ranks": ()}
    assert straggler_within(cfg, 2) == {"parallel__straggler__ranks": (1,)}
    assert straggler_within(cfg, 4) == {}
    assert _with(cfg, **group_settings(cfg, "allreduce", 2)).parallel.straggler.ranks == (1,)
    check_groups(cfg, ("model_averaging", "allreduce"), (1, 2, 4))
    # a rank that no group has is refused (it was dropped without a word)
    from mpitrain.bench.options import BenchSettingsError
    with pytest.raises(BenchSettingsError, match=r"rank 3 is in none of the benchmark's "
                                                 r"groups \(the largest has 2 rank"):
        check_groups(cfg, ("model_averaging",), (1, 2))


@pytest.mark.mpi
def test_settings_refused_before_measuring_are_one_line_from_rank_0(small_corpus, tmp_path):
    from mpitrain.testing.mpirun import run_mpi
    from ..helpers import QUICKSTART, small_overrides
    for n, extra in enumerate((["--set", "data.dev=", "--target-accuracy", "0.2"],
                               ["--set", "parallel.straggler_policy=adapt",
                                "--methods", "model_averaging,allreduce"])):
        args = ["-m", "mpitrain", "bench", QUICKSTART, "--out", str(tmp_path / f"b{n}")]
        for item in small_overrides(small_corpus):
            args += ["--set", item]
        result = run_mpi(2, args + extra, timeout=120)
        lines = result.stderr.strip().splitlines()
        # (each rank printed its line, and the job ended in an MPI abort)
        assert result.returncode == 2 and len(lines) == 1, result.stderr + result.stdout
        assert lines[0].startswith("mpitrain bench: error: "), lines
        assert "Abort" not in result.stderr and not (tmp_path / f"b{n}").exists()
    # refused before an earlier benchmark in --out is cleared (--overwrite)
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "bench.json").write_text("{}")
    args = ["-m", "mpitrain", "bench", QUICKSTART, "--out", str(earlier), "--overwrite",
            "--set", "parallel.straggler_policy=adapt"]
    for item in small_overrides(small_corpus):
        args += ["--set", item]
    result = run_mpi(2, args, timeout=120)
    assert result.returncode == 2 and "leave the setting out" in result.stderr, result.stderr
    assert (earlier / "bench.json").exists() and "removed" not in result.stdout


@pytest.mark.parametrize("flag,value,said", [
    ("--compute-ms", "nan", "--compute-ms: expected a step time in ms >= 0"),
    ("--compute-ms", "inf", "--compute-ms: expected a step time in ms >= 0"),
    ("--compute-ms", "-2", "got -2"),
    ("--max-seconds", "nan", "--max-seconds: expected a number >= 0"),
    ("--max-frames", "-1", "--max-frames: expected a number >= 0"),
    ("--steps", "0", "--steps: expected an integer >= 1"),
    ("--warmup-steps", "0", "--warmup-steps: expected an integer >= 1"),
    ("--repeats", "0", "--repeats: expected an integer >= 1"),
    ("--latency-us", "-1", "--latency-us: expected a latency in microseconds >= 0"),
    ("--bandwidth-gbit", "inf", "--bandwidth-gbit: expected a bandwidth in Gbit/s > 0"),
])
@pytest.mark.parametrize("virtual", [False, True], ids=["ranks", "virtual"])
def test_a_bad_number_is_refused_naming_its_flag_before_anything_runs(
        small_corpus, tmp_path, capsys, flag, value, said, virtual):
    # a nan or inf budget passed every check, and bench.json (which cannot hold
    # it) refused the report only after the whole benchmark had run
    from mpitrain.cli import main
    from ..helpers import QUICKSTART
    out = tmp_path / "out"
    argv = ["bench", QUICKSTART, "--out", str(out), "--set", f"data.train={small_corpus}/train",
            "--set", f"data.dev={small_corpus}/dev", f"{flag}={value}",
            *(["--virtual", "1,2"] if virtual else [])]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("mpitrain bench: error: ") and err.count("\n") == 1, err
    assert said in err, err
    assert not out.exists()


@pytest.mark.parametrize("virtual", [False, True], ids=["ranks", "virtual"])
def test_an_empty_out_is_one_line_not_the_default_directory(small_corpus, tmp_path, capsys,
                                                            monkeypatch, virtual):
    # --out '' (a variable left unset in a batch script) benchmarked into
    # runs/bench-<config name>
    from mpitrain.cli import main
    from ..helpers import QUICKSTART
    monkeypatch.chdir(tmp_path)
    argv = ["bench", QUICKSTART, "--out", "", "--set", f"data.train={small_corpus}/train",
            "--phases", "throughput", "--steps", "1", "--warmup-steps", "1",
            "--methods", "bmuf", *(["--virtual", "1"] if virtual else [])]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--out is empty" in err, err
    assert not (tmp_path / "runs").exists()


def test_a_run_whose_scaled_rate_the_l2_bound_refuses_is_named_before_measuring():
    """An L2 within the bound at the config's rate but not at N times it: the
    benchmark measured the smaller groups, then stopped with a line naming neither
    the config nor the run."""
    from mpitrain.bench.options import BenchSettingsError
    from mpitrain.bench.phases import check_bench
    from mpitrain.config import load_config
    from ..helpers import QUICKSTART
    # bound at rate 0.004 and 256 frames: 0.488; x2: 0.244; x4: 0.122
    cfg = load_config(QUICKSTART, ["optimizer.l2_regularize=0.2"])
    linear = BenchOptions(sizes=(1, 2, 4), lr_scale="linear")
    with pytest.raises(BenchSettingsError) as info:
        check_bench(cfg, linear, (1, 2, 4), ("model_averaging", "allreduce"))
    message = str(info.value)
    assert message.startswith("optimizer.l2_regularize: 0.2 shrinks the weights by 2 x 0.016 ")
    assert message.endswith(
        "; the benchmark's throughput run of model_averaging on 4 rank(s) scales the "
        "config's rates x4 (--lr-scale linear): lower the setting, or give a smaller "
        "--lr-scale or group sizes"), message
    check_bench(cfg, linear, (1, 2), ("model_averaging", "allreduce"))
    check_bench(cfg, BenchOptions(sizes=(1, 2, 4), lr_scale="sqrt"), (1, 2, 4),
                ("allreduce",))
    # the time-to-accuracy runs scale their rates alike
    accuracy = BenchOptions(sizes=(1, 4), lr_scale="linear", phases=("accuracy",),
                            target_accuracy=0.5)
    with pytest.raises(BenchSettingsError, match="the benchmark's accuracy run of allreduce "
                                                 r"on 4 rank\(s\) scales"):
        check_bench(cfg, accuracy, (1, 4), ("allreduce",))
    # newbob's throughput runs are timed on an exponential schedule, whose bound is
    # at its larger end
    cfg = load_config(QUICKSTART, ["optimizer.schedule=newbob", "optimizer.l2_regularize=0.2",
                                   "optimizer.final_learning_rate=0.016"])
    with pytest.raises(BenchSettingsError, match=r"on 1 rank\(s\) times newbob's rates as an "
                                                 "exponential schedule: lower the setting$"):
        check_bench(cfg, BenchOptions(sizes=(1,)), (1,), ("allreduce",))


def test_a_refused_bench_run_names_the_config_file(small_corpus, tmp_path, capsys):
    from mpitrain.cli import main
    from ..helpers import QUICKSTART, small_overrides
    out = tmp_path / "bench"
    argv = ["bench", QUICKSTART, "--virtual", "1,2,4", "--methods", "allreduce",
            "--phases", "throughput", "--lr-scale", "linear", "--steps", "4",
            "--warmup-steps", "2", "--compute-ms", "2", "--out", str(out)]
    for item in small_overrides(small_corpus) + ["optimizer.l2_regularize=0.2"]:
        argv += ["--set", item]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mpitrain bench: error: {QUICKSTART}: optimizer.l2_regularize: "
                          "0.2 shrinks") and err.count("\n") == 1, err
    assert "throughput run of allreduce on 4 rank(s)" in err and not out.exists()
