"""Config validation: each kind of bad value gives a one-line error naming the key."""

import os

import pytest

from mpitrain.config import ConfigError, config_from_yaml, config_to_yaml, load_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _error(tmp_path, text, overrides=()):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(str(path), overrides)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(str(path))
    return message


def test_unknown_key(tmp_path):
    msg = _error(tmp_path, "optimizer:\n  learning_rat: 0.1\n")
    assert "optimizer.learning_rat: unknown key" in msg and "initial_learning_rate" in msg


def test_unknown_section(tmp_path):
    assert "optimiser: unknown key" in _error(tmp_path, "optimiser: {}\n")


def test_wrong_type(tmp_path):
    msg = _error(tmp_path, "training:\n  minibatch: lots\n")
    assert "training.minibatch: expected an integer" in msg and "'lots'" in msg


def test_bool_is_not_an_integer(tmp_path):
    assert "model.hidden_dim" in _error(tmp_path, "model:\n  hidden_dim: true\n")


def test_out_of_range(tmp_path):
    msg = _error(tmp_path, "optimizer:\n  momentum: 1.5\n")
    assert "optimizer.momentum: expected a number in [0, 1), got 1.5" in msg


def test_exclusive_bound(tmp_path):
    assert "training.epochs" in _error(tmp_path, "training:\n  epochs: 0\n")


def test_bad_choice(tmp_path):
    msg = _error(tmp_path, "parallel:\n  method: ring\n")
    assert "parallel.method: expected one of" in msg and "'bmuf'" in msg


def test_section_must_be_mapping(tmp_path):
    assert "model: expected a mapping" in _error(tmp_path, "model: 3\n")


def test_invalid_yaml_names_line(tmp_path):
    msg = _error(tmp_path, "model:\n  hidden_dim: [1,\n")
    assert "not valid YAML" in msg


def test_cross_field_check(tmp_path):
    msg = _error(tmp_path, "model:\n  nonlinearity: pnorm\n  hidden_dim: 100\n"
                           "  pnorm_output_dim: 30\n")
    assert "model.pnorm_output_dim" in msg


@pytest.mark.parametrize("text, expected", [
    ("optimizer: {initial_learning_rate: 0.001, final_learning_rate: 10000}\n",
     "optimizer.final_learning_rate: implausibly larger than optimizer.initial_learning_rate"),
    ("training: {early_stop: {patience: 2}}\n",
     "training.early_stop.patience: early stopping watches held-out results; set data.dev"),
    ("optimizer: {schedule: newbob}\n",
     "optimizer.schedule: newbob decides on held-out results; set data.dev"),
    ("optimizer: {schedule: search, search_factors: [2, 3]}\n",
     "optimizer.search_factors: needs a factor of at most 1 (with only larger ones the rate "
     "rises at every chunk until the run diverges), got [2.0, 3.0]"),
    ("parallel: {method: adpsgd, hierarchical: true, asynchronous: true}\n",
     "parallel.asynchronous: hierarchical ADPSGD mixes lock-step without delay; "
     "set parallel.asynchronous: false"),
    ("parallel: {method: adpsgd, hierarchical: true, delay_by_one: true}\n",
     "parallel.delay_by_one: hierarchical ADPSGD mixes lock-step without delay; "
     "set parallel.delay_by_one: false"),
    ("parallel: {method: adpsgd, asynchronous: true, delay_by_one: true}\n",
     "parallel.delay_by_one: the delay-by-one ring is lock-step; set parallel.asynchronous: "
     "false or delay_by_one: false"),
    ("data: {dev: d}\nparallel: {method: param_server}\ntraining: {early_stop: {patience: 2}}\n",
     "training.early_stop.patience: not available with parallel.method param_server (rank 0 "
     "evaluates alone while the others train on)"),
], ids=["final-rate", "early-stop-no-dev", "newbob-no-dev", "search-factors",
        "hierarchical-async", "hierarchical-delay", "async-delay", "early-stop-own-steps"])
def test_settings_that_cannot_go_together_are_one_line_naming_the_key(tmp_path, text,
                                                                        expected):
    assert _error(tmp_path, text) == f"{tmp_path / 'run.yaml'}: {expected}"


def test_a_set_value_that_is_not_yaml_or_under_a_value_names_the_set(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("{}\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(path), ["training.seed=[1"])
    assert str(info.value) == "--set training.seed: value '[1' is not a YAML scalar"
    with pytest.raises(ConfigError) as info:
        load_config(str(path), ["training=5", "training.seed=1"])
    assert str(info.value) == "--set training.seed: training is not a section"


def test_a_corpus_manifest_given_as_the_config_is_named_as_one(tmp_path):
    # said as "class_counts: unknown key" of a run configuration
    from mpitrain.data.synthetic import synthesize
    synthesize(str(tmp_path / "c"), hours=0.01, speakers=2, shards=1, dev_hours=0.005,
               dev_speakers=1)
    path = tmp_path / "c" / "train" / "corpus.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    assert str(info.value) == (f"{path}: a corpus manifest, not a run configuration; name its "
                               f"directory ({tmp_path / 'c' / 'train'}) as data.train or "
                               "data.dev in a config (`mpitrain init` writes one)")


def test_pretraining_and_combination_errors_name_the_key(tmp_path):
    msg = _error(tmp_path, "pretrain:\n  learning_rate_gaussian: -0.01\n")
    assert "pretrain.learning_rate_gaussian" in msg
    msg = _error(tmp_path, "pretrain:\n  momentum_final: 1.0\n")
    assert "pretrain.momentum_final" in msg
    msg = _error(tmp_path, "model:\n  init_from: pre.h5\n  nonlinearity: relu\n")
    assert "model.nonlinearity" in msg and "model.init_from" in msg
    # a normalize layer between pretrained RBM layers would change their input
    msg = _error(tmp_path, "model:\n  init_from: pre.h5\n  nonlinearity: sigmoid\n"
                           "  normalize: true\n")
    assert "model.normalize:" in msg and "model.init_from" in msg
    load_config(None, ["model.init_from=pre.h5", "model.nonlinearity=sigmoid"])
    load_config(None, ["model.normalize=true"])
    msg = _error(tmp_path, "training:\n  combine: true\nparallel:\n  method: param_server\n")
    assert "training.combine" in msg
    msg = _error(tmp_path, "training:\n  combine_models: 0\n")
    assert "training.combine_models" in msg


def test_more_parameter_servers_than_layers_is_refused_naming_the_key(tmp_path):
    # every client rank stopped at its first step with its own line and aborted the job
    msg = _error(tmp_path, "model:\n  hidden_layers: 1\nparallel:\n  method: param_server\n"
                           "  servers: 3\n")
    assert "parallel.servers: 3 servers for a model of 2 affine layer(s)" in msg
    load_config(None, ["model.hidden_layers=1", "parallel.method=param_server",
                       "parallel.servers=2"])


@pytest.mark.parametrize("schedule", ["search", "newbob"])
def test_schedules_that_need_a_common_step_are_refused_with_the_parameter_server(tmp_path,
                                                                                 schedule):
    # its loop follows the rate of its update count only: the run trained at
    # initial_learning_rate throughout, with no search and no newbob decision
    msg = _error(tmp_path, f"data:\n  dev: dev\noptimizer:\n  schedule: {schedule}\n"
                           "parallel:\n  method: param_server\n")
    assert f"optimizer.schedule: {schedule} needs every rank at the same step; not " \
           "available with parallel.method param_server" in msg


def test_override_errors_name_the_key(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("{}\n")
    with pytest.raises(ConfigError, match="optimizer.momentum"):
        load_config(str(path), ["optimizer.momentum=2"])
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        load_config(str(path), ["optimizer.momentum"])


def test_overrides_from_python_that_are_no_list_of_strings_are_named(tmp_path):
    # load_config(path, "training.epochs=1") took the string a character at a time and
    # said "--set t: expected KEY=VALUE"
    path = tmp_path / "ok.yaml"
    path.write_text("{}\n")
    for bad in ("training.epochs=1", {"training.epochs": 1}, [1]):
        with pytest.raises(TypeError, match=r"overrides: expected a list of 'KEY=VALUE' "
                                            r"strings"):
            load_config(str(path), bad)
    assert load_config(str(path), iter(["training.epochs=1"])).training.epochs == 1
    assert load_config(str(path), ("training.epochs=2",)).training.epochs == 2


def test_a_negative_block_momentum_other_than_minus_one_is_refused(tmp_path):
    # BMUF took every negative value as -1, the default 1 - 1/N: -0.5 ran at 0.75
    # on 4 ranks without a word
    path = tmp_path / "run.yaml"
    path.write_text("parallel: {method: bmuf}\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(path), ["parallel.block_momentum=-0.5"])
    assert str(info.value) == (f"{path}: parallel.block_momentum: expected -1 (1 - 1/ranks) "
                               "or a number in [0, 1), got -0.5")
    assert load_config(str(path), ["parallel.block_momentum=-1"]).parallel.block_momentum == -1
    assert load_config(str(path), ["parallel.block_momentum=0"]).parallel.block_momentum == 0


def test_overrides_are_typed_and_round_trip(tmp_path):
    cfg = load_config(os.path.join(REPO, "jobs", "configs", "quickstart.yaml"),
                      ["optimizer.name=ngsgd", "training.epochs=1", "data.prefetch=false"])
    assert cfg.optimizer.name == "ngsgd" and cfg.training.epochs == 1.0
    assert cfg.data.prefetch is False
    assert config_from_yaml(config_to_yaml(cfg)) == cfg


def test_every_example_config_is_valid():
    folder = os.path.join(REPO, "jobs", "configs")
    names = [n for n in os.listdir(folder) if n.endswith(".yaml")]
    assert "quickstart.yaml" in names
    for name in names:
        load_config(os.path.join(folder, name))


def test_user_guide_documents_every_key():
    from mpitrain.config import reference_markdown
    with open(os.path.join(REPO, "docs", "user-guide.md")) as fh:
        guide = fh.read()
    assert reference_markdown() in guide, "regenerate the table in docs/user-guide.md"


def test_update_period_help_counts_the_initial_updates():
    # the table says after how many minibatches the period starts: every call
    # updates until then (natural-gradient.md: the first 11 calls)
    import dataclasses
    from mpitrain.config import NgsgdConfig
    from mpitrain.optim.natural_gradient import OnlineNaturalGradient
    pre = OnlineNaturalGradient(rank=2, update_period=4)
    initial = 0
    while pre.updating():
        initial, pre.t = initial + 1, pre.t + 1
    (field,) = [f for f in dataclasses.fields(NgsgdConfig) if f.name == "update_period"]
    assert f"after the first {initial}," in field.metadata["help"]


@pytest.mark.parametrize("content,message", [
    ("- a\n- b\n", "expected a mapping of sections"),
    (b"optimizer:\n  name: \xff\n", "not UTF-8"),
    ("optimizer: [1,\n", "not valid YAML at line 2"),
])
def test_bad_config_files_give_one_line_naming_the_file(tmp_path, content, message):
    path = tmp_path / "run.yaml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    assert str(info.value).startswith(str(path)) and message in str(info.value)
    assert "\n" not in str(info.value)


def test_exponent_numbers_are_numbers(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("optimizer:\n  initial_learning_rate: 1e-3\n  final_learning_rate: 1E-4\n")
    cfg = load_config(str(path), ["optimizer.momentum=5e-1"])
    assert cfg.optimizer.initial_learning_rate == 0.001
    assert cfg.optimizer.final_learning_rate == 0.0001 and cfg.optimizer.momentum == 0.5


def test_an_unbounded_range_is_written_open_and_infinity_is_refused(tmp_path):
    msg = _error(tmp_path, "optimizer:\n  initial_learning_rate: .inf\n")
    assert "optimizer.initial_learning_rate: expected a number in (0, inf), got .inf" in msg


def test_a_number_where_text_is_expected_is_taken_as_its_text(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  dropout_schedule: 0.3\n")
    assert load_config(str(path)).model.dropout_schedule == "0.3"
    assert load_config(str(path), ["model.dropout_schedule=0.2"]).model.dropout_schedule == "0.2"
    assert "model.dropout_schedule" in _error(tmp_path, "model:\n  dropout_schedule: [1]\n")
    # its syntax is checked with the file, which the message names (_error)
    assert "model.dropout_schedule: '0.5@x' in '0,0.5@x' is not value[@fraction]" in _error(
        tmp_path, "model:\n  dropout_schedule: 0,0.5@x\n")


def test_a_text_setting_given_with_set_is_taken_as_typed():
    cfg = load_config(None, ["data.train=corpus #1/train", "data.dev=k: v/dev",
                             "optimizer.name='ngsgd'", "training.epochs=2"])
    assert cfg.data.train == "corpus #1/train"       # YAML would have cut it at ' #'
    assert cfg.data.dev == "k: v/dev"                 # and refused ': '
    assert cfg.optimizer.name == "ngsgd" and cfg.training.epochs == 2.0


def test_ngsgd_settings_the_preconditioners_refuse_name_the_key(tmp_path):
    """Values the natural-gradient preconditioners would refuse at run time (Kaldi's
    asserts) are refused here, naming the file and the key."""
    msg = _error(tmp_path, "optimizer:\n  name: ngsgd\n  ngsgd:\n    num_samples_history: 2e6\n")
    assert "optimizer.ngsgd.num_samples_history: expected a number in (0, 1e+06]" in msg
    msg = _error(tmp_path, "optimizer:\n  name: ngsgd\n  ngsgd:\n    variant: simple\n"
                           "    alpha: 0\n")
    assert "optimizer.ngsgd.alpha: the simple variant needs alpha >= 1e-08" in msg
    path = tmp_path / "ok.yaml"
    path.write_text("optimizer:\n  name: ngsgd\n  ngsgd:\n    alpha: 0\n")
    assert load_config(str(path)).optimizer.ngsgd.alpha == 0.0   # online: alpha >= 0



def test_tf32_on_the_cpu_is_refused_naming_the_file(tmp_path):
    msg = _error(tmp_path, "precision: tf32\n")
    assert "precision: tf32 needs device: gpu" in msg
    path = tmp_path / "ok.yaml"
    path.write_text("precision: tf32\ndevice: gpu\n")
    assert load_config(str(path)).precision == "tf32"

def test_max_change_per_sample_is_refused_with_a_parameter_server(tmp_path):
    message = _error(tmp_path, "optimizer:\n  max_change_per_sample: 0.075\n"
                               "parallel:\n  method: param_server\n")
    assert "optimizer.max_change_per_sample: not available with parallel.method " \
        "param_server" in message
    # ranks sharing an averaged gradient would scale it each by its own bound and
    # drift apart
    for parallel in ("  method: allreduce\n",
                     "  method: adpsgd\n  hierarchical: true\n  ranks_per_node: 2\n"):
        message = _error(tmp_path, "optimizer:\n  max_change_per_sample: 0.075\n"
                                   "parallel:\n" + parallel)
        assert "not available where ranks share an averaged gradient" in message, message


def test_a_value_is_named_as_it_was_written(tmp_path):
    """A boolean where a number belongs said "got True"; a date, a null or an empty
    value were Python's words too."""
    msg = _error(tmp_path, "optimizer:\n  max_change_per_sample: on\n")
    assert msg.endswith("optimizer.max_change_per_sample: expected a number in [0, inf), "
                        "got on (which YAML reads as true)")
    msg = _error(tmp_path, "{}\n", ["optimizer.max_change_per_sample=yes"])
    assert msg.endswith("got yes (which YAML reads as true)")
    assert _error(tmp_path, "model:\n  hidden_dim: true\n").endswith("got true")
    assert _error(tmp_path, "training:\n  epochs: 2024-01-01\n").endswith("got 2024-01-01")
    assert _error(tmp_path, "training:\n  epochs:\n").endswith("got nothing (an empty value)")
    assert _error(tmp_path, "training:\n  epochs: ~\n").endswith("got ~")
    msg = _error(tmp_path, "optimizer:\n  search_factors: [1, no]\n")
    assert msg.endswith("got [1, no (which YAML reads as false)]")
    assert _error(tmp_path, "model: {x: [1, off]}\n").endswith(
        "model.x: unknown key; expected one of " + ", ".join(sorted(
            ("hidden_layers", "hidden_dim", "nonlinearity", "pnorm_output_dim", "pnorm_p",
             "normalize", "init_from", "dropout", "dropout_schedule"))))


def test_a_nul_character_in_a_text_setting_is_named(tmp_path):
    """A double-quoted "\\0" in a path reached the OS, whose "embedded null byte"
    was the whole error line, naming neither the file nor the key."""
    msg = _error(tmp_path, 'data:\n  train: "data/tr\\0ain"\n')
    assert msg.endswith("data.train: expected text without a NUL character (\\0), got "
                        "'data/tr\\x00ain'"), msg
    assert "run.yaml" in msg


def test_numbers_yaml_reads_as_other_numbers_are_refused(tmp_path):
    # YAML 1.1 reads 010 as octal 8 and 1:30 in base 60 as 90: the run took them
    msg = _error(tmp_path, "training:\n  minibatch: 010\n")
    assert "training.minibatch: expected an integer in [1, inf), got 010, which YAML reads " \
           "as 8" in msg
    assert "got 1:30, which YAML reads as 90" in _error(tmp_path, "training:\n  epochs: 1:30\n")
    path = tmp_path / "ok.yaml"
    path.write_text("training:\n  minibatch: 256.0\n  seed: 0x10\n  epochs: 1_000\n")
    cfg = load_config(str(path))
    assert (cfg.training.minibatch, cfg.training.seed, cfg.training.epochs) == (256, 16, 1000.0)


def test_a_text_setting_keeps_the_text_as_written(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  train: 010\n  dev: 2024-01-01\nmodel:\n  dropout_schedule: 0.30\n")
    cfg = load_config(str(path))
    # (they were '8', a refused datetime.date, and '0.3')
    assert (cfg.data.train, cfg.data.dev, cfg.model.dropout_schedule) == \
        ("010", "2024-01-01", "0.30")
    assert load_config(str(path), ["data.train=1e3"]).data.train == "1e3"
    assert "device: expected one of 'cpu', 'gpu', got 'on'" in _error(tmp_path, "device: on\n")


def test_keys_yaml_reads_as_numbers_or_booleans_are_named_as_written(tmp_path):
    # keys of two types could not be sorted: a TypeError traceback
    assert "run.yaml: 1: unknown key; expected one of blas_threads" in _error(
        tmp_path, "1: 2\nzz: 3\n")
    assert "training.yes: unknown key" in _error(tmp_path, "training:\n  yes: 2\n")


def test_an_integer_too_large_to_store_is_refused(tmp_path):
    msg = _error(tmp_path, "training:\n  seed: 99999999999999999999\n")
    assert msg.endswith("training.seed: expected an integer in [0, inf), got "
                        "99999999999999999999, beyond the largest integer stored "
                        "(9223372036854775807)")
    # a float past 2^53 is no exact integer (it was taken as one of 301 digits)
    assert _error(tmp_path, "training:\n  minibatch: 1e300\n").endswith(
        "training.minibatch: expected an integer in [1, inf), got 1e300")
    # blas_threads of that size ended in a ctypes OverflowError traceback
    assert "blas_threads" in _error(tmp_path, "blas_threads: 99999999999999999999999\n")


def test_sizes_no_run_can_take_are_refused_naming_the_key(tmp_path):
    # training.epochs: 1e19 trained, then failed writing its first checkpoint with an
    # h5py TypeError traceback (the planned steps overflowed int64); hidden_dim: 1e11
    # said only NumPy's "Maximum allowed dimension exceeded"; blas_threads: 1e11 was
    # handed to the BLAS library
    assert _error(tmp_path, "training:\n  epochs: 1e19\n").endswith(
        "training.epochs: expected a number in (0, 1e+06], got 1e19")
    assert "pretrain.epochs_per_layer: expected a number in (0, 1e+06]" in _error(
        tmp_path, "pretrain:\n  epochs_per_layer: 1e7\n")
    assert _error(tmp_path, "model:\n  hidden_dim: 100000000000\n").endswith(
        "model.hidden_dim: expected an integer in [1, 65536], got 100000000000")
    assert "blas_threads: expected an integer in [0, 1024]" in _error(
        tmp_path, "blas_threads: 100000000000\n")


def test_a_stored_config_reads_back_as_written_and_beyond_todays_limits():
    # text YAML 1.2 reads as a number was written unquoted and came back as 0.1: a
    # resume then saw a changed setting
    cfg = load_config(None, ["model.dropout_schedule=1e-1", "data.train=+2E-3",
                             "data.dev=010"])
    assert config_from_yaml(config_to_yaml(cfg)) == cfg
    assert cfg.model.dropout_schedule == "1e-1"
    # a checkpoint of a run started before a limit existed still resumes
    # (the settings are then compared with the config's, not refused)
    stored = config_to_yaml(cfg).replace("epochs: 3.0", "epochs: 2000000.0")
    assert "epochs: 2000000.0" in stored
    assert config_from_yaml(stored).training.epochs == 2e6
    with pytest.raises(ConfigError, match="training.epochs"):
        config_from_yaml(stored.replace("epochs: 2000000.0", "epochs: many"))


def test_a_stored_config_from_before_a_setting_existed_has_the_old_behaviour():
    # a parameter server's checkpoint written before its rate was damped by staleness
    # resumes as a change of that setting, not silently damped
    cfg = load_config(None, ["parallel.method=param_server"])
    stored = config_to_yaml(cfg).replace("  damp_staleness: true\n", "")
    assert "damp_staleness" not in stored
    assert config_from_yaml(stored).parallel.damp_staleness is False
    assert config_from_yaml(config_to_yaml(cfg)).parallel.damp_staleness is True
    from mpitrain.train.run_dir import changed_settings
    assert changed_settings(config_from_yaml(stored), cfg) == [
        "parallel.damp_staleness: False -> True"]
    # another method's run does not use it: nothing changed
    other = load_config(None, [])
    older = config_to_yaml(other).replace("  damp_staleness: true\n", "")
    assert changed_settings(config_from_yaml(older), other) == []


def test_a_path_the_locale_cannot_spell_names_its_key(tmp_path):
    """Under a locale whose encoding lacks a path's characters (LC_ALL=C with Python's
    UTF-8 mode off: ASCII) the codec's own words named no file or key."""
    import subprocess
    import sys
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    config = tmp_path / "run.yaml"
    config.write_text('data:\n  train: "corpora/\u65e5\u672c/train"\n', encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LC_", "LANG"))}
    env.update(LC_ALL="C", PYTHONUTF8="0", PYTHONPATH=repo, OPENBLAS_NUM_THREADS="1")
    env.pop("PYTHONIOENCODING", None)
    result = subprocess.run([sys.executable, "-m", "mpitrain", "train", str(config),
                             "--dry-run"], capture_output=True, text=True, timeout=120,
                            cwd=tmp_path, env=env)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert "run.yaml: data.train: " in result.stderr
    assert "cannot be a file name in this locale's encoding (ascii)" in result.stderr
    assert "LC_ALL=C.UTF-8" in result.stderr


@pytest.mark.parametrize("key,value,message", [
    ("data.train", "~/corpora/train", "data.train: ~/corpora/train: starts with ~, which "
                                      "mpitrain does not expand"),
    ("data.dev", "$SCRATCH/corpora/dev", "data.dev: $SCRATCH/corpora/dev: does not exist; "
                                         "mpitrain does not expand $VARIABLES"),
    ("model.init_from", "${WORK}/pre/pretrain.h5", "model.init_from: ${WORK}/pre/pretrain.h5: "
                                                   "does not exist; mpitrain does not expand"),
])
def test_a_tilde_or_variable_left_in_a_config_path_is_named(tmp_path, key, value, message):
    # the path was taken as written: "~/corpora/train/corpus.yaml: not found"
    config = tmp_path / "run.yaml"
    section, name = key.split(".")
    config.write_text(f"{section}:\n  {name}: '{value}'\n"
                      + ("  nonlinearity: sigmoid\n" if section == "model" else ""))
    with pytest.raises(ConfigError) as info:
        load_config(str(config))
    assert str(info.value).startswith(f"{config}: {message}"), info.value


def test_a_dollar_in_a_config_path_that_exists_is_a_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "$corpus").mkdir()
    assert load_config(None, ["data.train=$corpus"]).data.train == "$corpus"


def test_a_path_that_only_its_utf8_spelling_names_is_said_under_a_latin1_locale(tmp_path):
    """A config written where file names are UTF-8, run under a Latin-1 locale: the
    same text names other bytes there, and the corpus was said not to exist."""
    import subprocess
    import sys
    from .helpers import locale_env
    env = locale_env(tmp_path, "latin-1")
    os.makedirs(os.fsencode(tmp_path) + b"/c\xc3\xb6rpus/train")
    (tmp_path / "run.yaml").write_text('data:\n  train: "c\u00f6rpus/train"\n',
                                       encoding="utf-8")
    result = subprocess.run([sys.executable, "-m", "mpitrain", "train", "run.yaml",
                             "--dry-run"], capture_output=True, timeout=120, cwd=tmp_path,
                            env=env)
    err = result.stderr.decode("latin-1")
    assert result.returncode == 2 and err.count("\n") == 1, err
    assert err == ("mpitrain train: error: run.yaml: data.train: c\u00f6rpus/train: not found "
                   "in this locale's encoding (iso8859-1), but its UTF-8 spelling names a "
                   "file; run under a UTF-8 locale, e.g. LC_ALL=C.UTF-8\n"), err


def test_an_l2_that_zeroes_or_flips_the_weights_in_one_step_is_refused(tmp_path):
    # L2 shrinks the weights by 2 lr l2 B a step: 1e30 was clipped by max-change
    # each step and wore the model down to zero without a word
    path = tmp_path / "run.yaml"
    path.write_text("optimizer: {initial_learning_rate: 0.002, final_learning_rate: 0.0002}\n"
                    "training: {minibatch: 250}\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(path), ["optimizer.l2_regularize=1e30"])
    assert str(info.value) == (
        f"{path}: optimizer.l2_regularize: 1e+30 shrinks the weights by 2 x 0.002 "
        "(optimizer.initial_learning_rate, the largest rate) x 1e+30 x 250 "
        "(training.minibatch) = 1e+30 of themselves a step, which zeroes or flips them; "
        "expected below 1 (Kaldi's values: 1e-5 to 1e-3)")
    msg = _error(tmp_path, path.read_text(), ["optimizer.l2_regularize_output=1"])
    assert "optimizer.l2_regularize_output: 1 shrinks" in msg
    # the bound is strict: 1 exactly zeroes them; just below is a (very strong) L2
    assert "= 1 of themselves" in _error(tmp_path, path.read_text(),
                                         ["optimizer.l2_regularize=1"])
    assert load_config(str(path), ["optimizer.l2_regularize=0.999"]).optimizer \
        .l2_regularize == 0.999
    # the limit shown is rounded down, so a value below it is accepted: at minibatch
    # 256 the limit is 0.9765625 (shown to nearest, 0.977 was itself refused)
    msg = _error(tmp_path, path.read_text(), ["training.minibatch=256",
                                              "optimizer.l2_regularize=1"])
    assert msg.endswith("expected below 0.976 (Kaldi's values: 1e-5 to 1e-3)"), msg
    assert load_config(str(path), ["training.minibatch=256",
                                   "optimizer.l2_regularize=0.9759"]).optimizer \
        .l2_regularize == 0.9759


def test_the_l2_bound_is_at_the_largest_rate_the_schedule_sets(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("optimizer: {initial_learning_rate: 0.002, final_learning_rate: 0.02}\n"
                    "training: {minibatch: 250}\n")
    # an exponential schedule that rises ends at final_learning_rate
    msg = _error(tmp_path, path.read_text(), ["optimizer.l2_regularize=0.5"])
    assert "2 x 0.02 (optimizer.final_learning_rate, the largest rate)" in msg
    assert "expected below 0.1 " in msg
    # the others start at the initial rate and only lower it (final is not used)
    for schedule in ("hand", "adapt", "search"):
        cfg = load_config(str(path), [f"optimizer.schedule={schedule}",
                                      "optimizer.l2_regularize=0.5"])
        assert cfg.optimizer.l2_regularize == 0.5
    assert "optimizer.initial_learning_rate, the largest rate" in _error(
        tmp_path, path.read_text(), ["optimizer.schedule=hand", "optimizer.l2_regularize=2"])
    # adapt's rate per parameter is gamma / sqrt(K + G): a K above 1 lowers the most
    # it can be (K = 100: a tenth), and such a config was refused at gamma
    cfg = load_config(str(path), ["optimizer.schedule=adapt", "optimizer.adapt_k=100",
                                  "optimizer.l2_regularize=2"])
    assert cfg.optimizer.l2_regularize == 2
    assert ("2 x 0.0002 (optimizer.initial_learning_rate / sqrt(optimizer.adapt_k), the "
            "largest rate) x 20 x 250") in _error(
        tmp_path, path.read_text(), ["optimizer.schedule=adapt", "optimizer.adapt_k=100",
                                     "optimizer.l2_regularize=20"])
    # Kaldi's J jobs train at J times the rate with the term scaled by 1/J: the
    # same shrink, so the same bound however many jobs
    cfg = load_config(str(path), ["optimizer.l2_regularize=0.09", "parallel.method=kaldi",
                                  "parallel.num_jobs_final=8"])
    assert cfg.optimizer.l2_regularize == 0.09


def test_an_l2_that_bmufs_block_step_turns_into_a_zeroing_one_is_refused(tmp_path):
    # the block step is block_lr times the K local steps' change: at block_lr 3 a
    # shrink of 0.05 a step took 3 x (1 - 0.95^8) = 1.01 of the weights a block and
    # the run ended at chance with exit 0
    path = tmp_path / "run.yaml"
    path.write_text("optimizer: {initial_learning_rate: 0.004}\ntraining: {minibatch: 256}\n"
                    "parallel: {method: bmuf, block_lr: 3, average_every: 8}\n")
    msg = _error(tmp_path, path.read_text(), ["optimizer.l2_regularize_output=0.0244"])
    assert msg == (f"{path}: optimizer.l2_regularize_output: 0.0244 shrinks the weights by "
                   "0.05 of themselves a step, and BMUF's block step takes 3 "
                   "(parallel.block_lr) x (1 - (1 - 0.05)^8 (steps between syncs, "
                   "parallel.average_every)) = 1.01 of them a block, which zeroes or flips "
                   "them; expected below 0.0241, or a lower parallel.block_lr"), msg
    assert load_config(str(path), ["optimizer.l2_regularize_output=0.024"])
    # average_every_frames sets K when given
    assert "^4 (steps between syncs, parallel.average_every_frames)" in _error(
        tmp_path, path.read_text(), ["optimizer.l2_regularize=0.05",
                                     "parallel.average_every_frames=1024"])
    # a block_lr of 1 or less never takes more than the K steps did; other methods
    # have no block step
    for settings in (["parallel.block_lr=1"], ["parallel.method=model_averaging",
                                               "parallel.block_lr=1"]):
        assert load_config(str(path), settings + ["optimizer.l2_regularize=0.4"])


@pytest.mark.parametrize("text,overrides", [
    ("optimizer:\n  schedule: " + "z" * 10 ** 6 + "\n", ()),
    ("model:\n  hidden_dim: '" + "x" * 10 ** 6 + "'\n", ()),
    ("", ["model.hidden_dim=" + "x" * 10 ** 6]),
    ("", ["model." + "k" * 10 ** 6 + "=3"]),
    ("", ["model.hidden_dim=" + "9" * 10 ** 6]),
    ("", ["data.train=$HOME" + "a" * 10 ** 6]),
    ("", ["model.dropout_schedule=0,0.1@" + "5" * 10 ** 6 + ",0"]),
])
def test_a_huge_value_is_shown_cut_short_in_one_line(tmp_path, text, overrides):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(str(path), overrides)
    message = str(err.value)
    assert "\n" not in message and len(message) < 600
    assert "(1000" in message and "characters)" in message
