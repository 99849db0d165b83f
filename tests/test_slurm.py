"""The batch scripts in jobs/slurm/ on a real one-node Slurm cluster.

The cluster (Debian's slurmctld + slurmd, and munge) runs on loopback from a
temporary directory; see slurm_cluster.py.  Where Slurm is missing the test installs
it with apt-get (root only); where that or the daemons fail, the tests skip,
unless MPITRAIN_TEST_SLURM=1 says they must run, when they fail instead.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from .slurm_cluster import (FINISHED_STATES, LocalSlurm, SlurmUnavailable, install_packages,
                            missing_programs)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLURM_DIR = os.path.join(REPO, "jobs", "slurm")
SCRIPTS = ("train.sbatch", "train-gpu.sbatch", "bench.sbatch", "bench-gpu.sbatch",
           "prepare.sbatch")
REQUIRED_ENV = "MPITRAIN_TEST_SLURM"
JOB_TIMEOUT = 150

pytestmark = pytest.mark.slow


def _skip_or_fail(reason: str):
    if os.environ.get(REQUIRED_ENV) == "1":
        pytest.fail(f"{REQUIRED_ENV}=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def slurm(request):
    """A running one-node cluster with all of this machine's cores (at least 2)."""
    try:
        if missing_programs():
            install_packages()
        cluster = LocalSlurm.start(cpus=max(2, os.cpu_count() or 1))
    except SlurmUnavailable as exc:
        _skip_or_fail(f"no local Slurm cluster: {exc}")
    request.addfinalizer(cluster.stop)
    return cluster


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The built-in corpus, small: 0.1 h of training speech in 2 shards."""
    from mpitrain.data.synthetic import synthesize
    out = tmp_path_factory.mktemp("synth")
    synthesize(str(out), hours=0.1, speakers=20, shards=2, seed=3, dev_hours=0.03,
               dev_speakers=4)
    return str(out)


def _job_env(cluster, **extra):
    """Environment for sbatch: this interpreter's virtualenv and MPICH, one BLAS thread."""
    env = {"VENV": sys.prefix, "PYTHON": sys.executable,
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    env.update(extra)
    return env


def _srun_mpi():
    """The srun plugin train.sbatch picks for this MPI: MPICH speaks PMI-2, Open MPI 5 PMIx."""
    from mpitrain.testing.mpirun import launcher_is_open_mpi
    return "pmix" if launcher_is_open_mpi() else "pmi2"


def _train_overrides(corpus, **extra):
    values = {"data.train": os.path.join(corpus, "train"), "data.dev": os.path.join(corpus, "dev"),
              "data.chunk_frames": 20000, "model.hidden_dim": 256, "training.epochs": 3,
              "training.log_interval": 50}
    values.update(extra)
    return " ".join(f"{k}={v}" for k, v in values.items())


def _finished_ok(cluster, job_id, output):
    info = cluster.wait(job_id, timeout=JOB_TIMEOUT)
    text = open(output).read() if os.path.exists(output) else "(no output file)"
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), \
        f"job {job_id}: {info['JobState']} {info['ExitCode']}\n{text}\n{cluster.log_tail()}"
    return info, text


def _records(run_dir, kind):
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [r for r in map(json.loads, fh) if r["type"] == kind]


def _majority(corpus):
    from mpitrain.data.corpus import load_manifest
    counts = np.array(load_manifest(os.path.join(corpus, "dev")).class_counts)
    return counts.max() / counts.sum()


# -- without a cluster ------------------------------------------------------------------

@pytest.mark.parametrize("name", SCRIPTS)
def test_script_is_valid_bash_with_directives_before_commands(name):
    path = os.path.join(SLURM_DIR, name)
    assert subprocess.run(["bash", "-n", path]).returncode == 0
    lines = open(path).read().splitlines()
    assert lines[0] == "#!/bin/bash"
    # sbatch stops reading #SBATCH lines at the first command
    first_command = next(i for i, line in enumerate(lines[1:], 1)
                         if line.strip() and not line.startswith("#"))
    directives = [i for i, line in enumerate(lines) if line.startswith("#SBATCH")]
    assert directives and max(directives) < first_command


# -- on the cluster -----------------------------------------------------------------------

def test_train_job_on_two_ranks_learns(slurm, corpus, tmp_path):
    # the CPU script as the README submits it: no GPU options
    run_dir, output = tmp_path / "run", str(tmp_path / "train.out")
    env = _job_env(slurm, RUN_DIR=str(run_dir), MPITRAIN_SET=_train_overrides(corpus))
    job = slurm.sbatch(["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1",
                        f"--output={output}", os.path.join(SLURM_DIR, "train.sbatch"),
                        "jobs/configs/quickstart.yaml"], env=env, cwd=REPO)
    _, text = _finished_ok(slurm, job, output)
    assert f"srun --mpi={_srun_mpi()}" in text    # SRUN_MPI=auto: the plugin of this MPI
    start = _records(run_dir, "start")
    assert [r["ranks"] for r in start] == [2], text
    final = _records(run_dir, "eval")[-1]
    majority = _majority(corpus)
    assert majority < 0.1
    assert final["dev_acc"] > majority + 0.3, (final, text)
    assert (run_dir / "final.h5").exists()
    assert "GPUs none" in text


def test_gpu_script_asks_one_gpu_per_task_and_runs_train_sbatch(slurm, corpus, tmp_path):
    script = os.path.join(SLURM_DIR, "train-gpu.sbatch")
    test_only = slurm.run(["sbatch", "--test-only", "--ntasks-per-node=2", "--cpus-per-task=1",
                           script, "jobs/configs/quickstart.yaml"], env=_job_env(slurm),
                          cwd=REPO, check=False)
    if not slurm.gpus:
        # a node without GPUs cannot run it: sbatch says so at once
        assert test_only.returncode != 0, test_only.stdout
        return
    assert test_only.returncode == 0, test_only.stdout + test_only.stderr
    assert "to start at" in test_only.stdout + test_only.stderr
    # On the node's (fake) GPUs, trained with DEVICE=cpu: the allocation and the hand-over
    # to train.sbatch are the GPU script's own part.
    run_dir, output = tmp_path / "run", str(tmp_path / "train.out")
    env = _job_env(slurm, RUN_DIR=str(run_dir), DEVICE="cpu",
                   MPITRAIN_SET=_train_overrides(corpus, **{"training.epochs": 1}))
    job = slurm.sbatch(["--ntasks-per-node=2", "--cpus-per-task=1", f"--output={output}",
                        script, "jobs/configs/quickstart.yaml"], env=env, cwd=REPO)
    _, text = _finished_ok(slurm, job, output)
    assert f"GPUs {','.join(map(str, range(2)))}" in text
    assert "--set device=cpu" in text
    assert (run_dir / "final.h5").exists()


def test_requeued_job_resumes_from_its_checkpoint(slurm, corpus, tmp_path):
    """USR1 (what Slurm sends near the time limit) requeues; the rerun resumes."""
    run_dir, output = tmp_path / "run", str(tmp_path / "train.out")
    from mpitrain.testing.mpirun import find_mpiexec
    env = _job_env(slurm, RUN_DIR=str(run_dir), LAUNCHER="mpirun",
                   MPITRAIN_SET=_train_overrides(corpus, **{"model.hidden_dim": 512,
                                                            "training.epochs": 6,
                                                            "training.checkpoint_interval": 10}))
    # the launcher the other MPI tests use ($MPIEXEC, or the venv's), not whatever
    # mpiexec the job's PATH finds first
    launcher = find_mpiexec()
    if launcher is not None:
        env["MPIEXEC"] = launcher
        if _srun_mpi() == "pmix" and os.geteuid() == 0:
            env["MPIEXEC"] += " --allow-run-as-root"     # as the README says for Open MPI
    job = slurm.sbatch(["--ntasks-per-node=2", "--cpus-per-task=1", f"--output={output}",
                        os.path.join(SLURM_DIR, "train.sbatch"),
                        "jobs/configs/quickstart.yaml"], env=env, cwd=REPO)

    def checkpoint_or_finished(info):
        if info["JobState"] not in ("PENDING", "RUNNING"):
            return True
        return run_dir.exists() and any(name.startswith("ckpt-") and name.endswith(".h5")
                                        for name in os.listdir(run_dir))
    info = slurm.wait(job, timeout=JOB_TIMEOUT, until=checkpoint_or_finished)
    assert info["JobState"] == "RUNNING", open(output).read()
    slurm.run(["scancel", "--signal=USR1", "--batch", job])
    # Slurm holds a requeued job for two minutes; let it start again soon.  (Not at
    # once: slurmd refuses to launch a batch job it is still ending, "already killed".)
    slurm.wait(job, timeout=60, until=lambda info: info["Restarts"] == "1"
               and info["JobState"] == "PENDING")
    slurm.run(["scontrol", "update", f"JobId={job}", "StartTime=now+5"])
    info, text = _finished_ok(slurm, job, output)
    assert info["Restarts"] == "1"
    assert "requeueing to resume from the newest checkpoint" in text
    assert re.search(r"(mpiexec|mpirun)( --allow-run-as-root)? -n 2 ", text), text
    steps = [r["step"] for r in _records(run_dir, "start")]
    assert len(steps) == 2 and steps[0] == 0 and steps[1] > 0, (steps, text)
    assert "--resume" in text.split("restart 1", 1)[1]
    assert _records(run_dir, "end")[-1]["steps"] == _records(run_dir, "start")[0]["total_steps"]
    assert (run_dir / "final.h5").exists()


def test_a_sweep_array_trains_each_line_on_the_cluster(slurm, corpus, tmp_path):
    # `SWEEP=lrs.txt sbatch --array=0-1 train.sbatch`: two runs side by side, each
    # with its own line of settings and run directory
    from mpitrain.config import load_config
    sweep = tmp_path / "lrs.txt"
    sweep.write_text("optimizer.initial_learning_rate=0.008\n"
                     "optimizer.initial_learning_rate=0.002\n")
    env = _job_env(slurm, RUN_DIR=str(tmp_path / "run"), SWEEP=str(sweep),
                   MPITRAIN_SET=_train_overrides(corpus, **{"model.hidden_dim": 32,
                                                            "training.max_steps": 20}))
    array = slurm.sbatch(["--array=0-1", "--ntasks-per-node=1", "--cpus-per-task=1",
                          f"--output={tmp_path}/train-%a.out",
                          os.path.join(SLURM_DIR, "train.sbatch"),
                          "jobs/configs/quickstart.yaml"], env=env, cwd=REPO)
    tasks = []

    def every_task_finished(_):
        tasks[:] = [j for j in slurm.jobs() if j.get("ArrayJobId") == array]
        return len(tasks) == 2 and all(j["JobState"] in FINISHED_STATES for j in tasks)
    slurm.wait(array, timeout=JOB_TIMEOUT, until=every_task_finished)
    logs = "\n".join(open(f"{tmp_path}/train-{i}.out").read() for i in range(2)
                     if os.path.exists(f"{tmp_path}/train-{i}.out"))
    assert sorted((j["ArrayTaskId"], j["JobState"], j["ExitCode"]) for j in tasks) == \
        [("0", "COMPLETED", "0:0"), ("1", "COMPLETED", "0:0")], logs + slurm.log_tail()
    rates = [load_config(str(tmp_path / f"run-{i}" / "config.yaml"))
             .optimizer.initial_learning_rate for i in range(2)]
    assert rates == [0.008, 0.002], logs
    assert all((tmp_path / f"run-{i}" / "final.h5").exists() for i in range(2)), logs


def test_prepare_array_and_merge_make_one_corpus(slurm, tmp_path):
    import kaldiio
    from mpitrain.data.check import check_corpus
    from mpitrain.data.corpus import load_manifest
    rng = np.random.default_rng(0)
    feats = {f"spk{u % 3}-utt{u:02d}": rng.standard_normal((int(rng.integers(20, 60)), 13))
             .astype(np.float32) for u in range(17)}
    with kaldiio.WriteHelper(f"ark,scp:{tmp_path}/feats.ark,{tmp_path}/feats.scp") as writer:
        for utt, matrix in feats.items():
            writer(utt, matrix)
    unaligned = "spk1-utt04"
    with open(tmp_path / "ali.txt", "w") as f:
        for utt, matrix in feats.items():
            if utt != unaligned:
                f.write(utt + " " + " ".join(str(int(v)) for v in rng.integers(0, 9, len(matrix)))
                        + "\n")
    out = tmp_path / "corpus"
    env = _job_env(slurm, SHARDS_PER_PART="2")
    array = slurm.sbatch(["--array=0-2", f"--output={tmp_path}/prepare-%a.out",
                          f"--chdir={tmp_path}", os.path.join(SLURM_DIR, "prepare.sbatch"),
                          "feats.scp", "ark,t:ali.txt", "corpus", "--num-classes", "10"],
                         env=env, cwd=str(tmp_path))
    merges = []

    def merge_submitted(_):
        merges[:] = [j for j in slurm.jobs() if j["JobName"] == "mpitrain-prepare-merge"]
        return bool(merges)
    slurm.wait(array, timeout=JOB_TIMEOUT, until=merge_submitted)
    merge_out = str(tmp_path / f"mpitrain-prepare-merge-{merges[0]['JobId']}.out")
    _, text = _finished_ok(slurm, merges[0]["JobId"], merge_out)
    tasks = [j for j in slurm.jobs() if j.get("ArrayJobId") == array]
    assert sorted((j["ArrayTaskId"], j["JobState"], j["ExitCode"]) for j in tasks) == \
        [(str(i), "COMPLETED", "0:0") for i in range(3)]

    assert check_corpus(str(out)) == []
    manifest = load_manifest(str(out))
    assert manifest.num_utterances == len(feats) - 1
    assert manifest.num_frames == sum(len(m) for u, m in feats.items() if u != unaligned)
    assert manifest.num_classes == 10
    assert len(manifest.shards) == 6
    assert manifest.shards[0].path == "part-00000/shard-00000.h5"
    report = (out / "import-report.yaml").read_text()
    assert unaligned in report and "alignments_without_features: 0" in report, report
    # the parts are contiguous blocks of feats.scp lines: 6, 6 and 5 utterances
    sizes = [len((out / f"part-{i:05d}" / "feats.scp").read_text().splitlines())
             for i in range(3)]
    assert sizes == [6, 6, 5]
    assert f"{len(feats) - 1} utterances" in text


@pytest.mark.parametrize("cpu,gpu", [("train.sbatch", "train-gpu.sbatch"),
                                     ("bench.sbatch", "bench-gpu.sbatch")])
def test_cpu_scripts_ask_no_gpu_and_gpu_scripts_one_per_task(cpu, gpu):
    def directives(name):
        return [line.split()[1] for line in open(os.path.join(SLURM_DIR, name))
                if line.startswith("#SBATCH")]
    assert not [d for d in directives(cpu) if d.startswith("--gpus")]
    assert "--gpus-per-task=1" in directives(gpu)
    text = open(os.path.join(SLURM_DIR, gpu)).read()
    assert 'export DEVICE=${DEVICE:-gpu}' in text and f"jobs/slurm/{cpu}" in text
    assert 'cpu|gpu) sets+=(--set "device=$DEVICE")' in open(os.path.join(SLURM_DIR, cpu)).read()


def test_bench_job_writes_its_report(slurm, corpus, tmp_path):
    # the CPU script as the README submits it: no GPU options
    out, output = tmp_path / "bench", str(tmp_path / "bench.out")
    env = _job_env(slurm, BENCH_OUT=str(out), MPITRAIN_SET=_train_overrides(corpus))
    job = slurm.sbatch(["--ntasks-per-node=2", "--cpus-per-task=1", f"--output={output}",
                        os.path.join(SLURM_DIR, "bench.sbatch"),
                        "jobs/configs/bench.yaml", "--sizes", "1,2", "--methods",
                        "model_averaging", "--phases", "throughput", "--steps", "8",
                        "--warmup-steps", "2"], env=env, cwd=REPO)
    _, text = _finished_ok(slurm, job, output)
    assert f"srun --mpi={_srun_mpi()}" in text
    report = json.loads((out / "bench.json").read_text())
    assert report, text


def test_an_attempt_stopped_before_its_first_checkpoint_starts_again(small_corpus, tmp_path):
    """A requeued job whose first attempt wrote no checkpoint has nothing to resume:
    the script replaces that attempt's files instead of stopping on them."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("training:\n  epochs: 1\n")    # the lost attempt's
    (run_dir / "metrics.jsonl").write_text("")
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    env = dict(os.environ, **_job_env(None, RUN_DIR=str(run_dir), LAUNCHER="mpirun",
                                      SLURM_NTASKS="1",
                                      MPITRAIN_SET=_train_overrides(small_corpus, **{
                                          "model.hidden_dim": 16, "training.max_steps": 4})))
    if os.path.exists(mpiexec):
        env["MPIEXEC"] = mpiexec
    result = subprocess.run(["bash", os.path.join(SLURM_DIR, "train.sbatch"),
                             "jobs/configs/quickstart.yaml"], env=env, cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "holds an attempt without a checkpoint; starting again" in result.stderr
    assert (run_dir / "final.h5").exists()


def _sweep_task(tmp_path, corpus, sweep, task):
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    env = dict(os.environ, **_job_env(None, RUN_DIR=str(tmp_path / "run"), LAUNCHER="mpirun",
                                      SLURM_NTASKS="1", SWEEP=str(sweep),
                                      MPITRAIN_SET=_train_overrides(corpus, **{
                                          "model.hidden_dim": 16, "training.max_steps": 4})))
    if task is not None:
        env["SLURM_ARRAY_TASK_ID"] = str(task)
    if os.path.exists(mpiexec):
        env["MPIEXEC"] = mpiexec
    return subprocess.run(["bash", os.path.join(SLURM_DIR, "train.sbatch"),
                           "jobs/configs/quickstart.yaml"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def test_a_sweep_task_trains_its_line_of_settings_into_a_run_directory_of_its_own(
        small_corpus, tmp_path):
    from mpitrain.config import load_config
    sweep = tmp_path / "sweep.txt"
    sweep.write_text("# learning rates\n\noptimizer.initial_learning_rate=0.008\n"
                     "optimizer.initial_learning_rate=0.002 training.seed=5\n")
    result = _sweep_task(tmp_path, small_corpus, sweep, 1)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "sweep task 1 of 2: optimizer.initial_learning_rate=0.002 training.seed=5" \
        in result.stdout
    cfg = load_config(str(tmp_path / "run-1" / "config.yaml"))
    assert (cfg.optimizer.initial_learning_rate, cfg.training.seed) == (0.002, 5)
    assert (tmp_path / "run-1" / "final.h5").exists() and not (tmp_path / "run").exists()
    # a task without its line, or a sweep outside an array, is one line
    result = _sweep_task(tmp_path, small_corpus, sweep, 2)
    assert result.returncode == 2 and "holds 2 settings line(s), none for array task 2 " \
        "(submit with --array=0-1)" in result.stderr, result.stderr
    result = _sweep_task(tmp_path, small_corpus, sweep, None)
    assert result.returncode == 2 and "SWEEP needs a job array" in result.stderr, result.stderr


def test_usr1_near_the_time_limit_reaches_the_run_which_then_is_requeued(tmp_path):
    """USR1 near the time limit: the script passes it to the launcher (which passes
    it to the ranks), waits for the run to write its checkpoint and stop with status
    75, then requeues the job.  Paths with spaces throughout."""
    _time_limit_signal(tmp_path, requeue_works=True)


def test_a_refused_requeue_at_the_time_limit_leaves_the_run_going(tmp_path):
    """The same when `scontrol requeue` fails (a job submitted with --no-requeue,
    requeues disabled): the run is not cut short by the script's end; it stops
    itself with its checkpoint, and the script says the requeue failed."""
    _time_limit_signal(tmp_path, requeue_works=False)


def _time_limit_signal(tmp_path, *, requeue_works):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    run_dir = tmp_path / "run dir"
    config = tmp_path / "my configs" / "run.yaml"
    config.parent.mkdir()
    config.write_text("training:\n  epochs: 1\n")
    started, requeued = tmp_path / "launched", tmp_path / "requeued"
    # the MPI launcher: on USR1 the run writes a checkpoint and stops with status 75
    (bin_dir / "launch").write_text(
        "#!/bin/bash\n"
        f"trap 'touch {json.dumps(str(run_dir))}/ckpt-00000020.h5; echo run-stopped; exit 75'"
        " USR1\n"
        f"touch {json.dumps(str(started))}\n"
        "for i in $(seq 300); do sleep 0.1; done\necho run-finished\n")
    (bin_dir / "scontrol").write_text(
        f"#!/bin/bash\necho \"$@\" > {json.dumps(str(requeued))}\n" + (
            "exit 0\n" if requeue_works else
            "echo 'scontrol: error: Requested operation is presently disabled' >&2\nexit 1\n"))
    for name in ("launch", "scontrol"):
        (bin_dir / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
               RUN_DIR=str(run_dir), LAUNCHER="mpirun", MPIEXEC=str(bin_dir / "launch"),
               SLURM_NTASKS="2", SLURM_JOB_ID="77", VENV=str(tmp_path / "no-venv"))
    script = subprocess.Popen(["bash", os.path.join(SLURM_DIR, "train.sbatch"), str(config)],
                              env=env, cwd=str(tmp_path), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert started.exists()
    script.send_signal(signal.SIGUSR1)
    out, err = script.communicate(timeout=60)
    assert script.returncode == 75, out + err
    assert "run-stopped" in out and "run-finished" not in out, out + err
    assert "requeueing to resume from the newest checkpoint" in out, out + err
    assert requeued.read_text().split() == ["requeue", "77"]
    assert ("scontrol requeue failed" in err) != requeue_works, out + err


def test_a_run_that_ends_before_the_signal_is_not_requeued(tmp_path):
    """USR1 to a run that finishes anyway (status 0): no requeue, status 0."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    run_dir, started = tmp_path / "run", tmp_path / "launched"
    (bin_dir / "launch").write_text(
        f"#!/bin/bash\ntrap 'echo got-usr1' USR1\ntouch {json.dumps(str(started))}\n"
        "for i in $(seq 10); do sleep 0.1; done\necho run-finished\n")
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho scontrol-called\n")
    for name in ("launch", "scontrol"):
        (bin_dir / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
               RUN_DIR=str(run_dir), LAUNCHER="mpirun", MPIEXEC=str(bin_dir / "launch"),
               SLURM_NTASKS="2", SLURM_JOB_ID="77", VENV=str(tmp_path / "no-venv"))
    script = subprocess.Popen(["bash", os.path.join(SLURM_DIR, "train.sbatch"), "run.yaml"],
                              env=env, cwd=str(tmp_path), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    script.send_signal(signal.SIGUSR1)
    out, err = script.communicate(timeout=60)
    assert script.returncode == 0, out + err
    assert "got-usr1" in out and "run-finished" in out, out + err
    assert "scontrol-called" not in out, out + err


@pytest.mark.parametrize("name", ["run[1]", "run *", "run?"])
def test_a_run_directory_named_with_glob_characters_is_resumed_not_overwritten(tmp_path,
                                                                               name):
    # a requeued job whose RUN_DIR holds checkpoints must resume them, whatever the
    # name: '--overwrite' would delete them
    run_dir = tmp_path / name
    run_dir.mkdir()
    for done in ("config.yaml", "metrics.jsonl", "ckpt-00000010.h5"):
        (run_dir / done).write_text("")
    launch = tmp_path / "launch"
    launch.write_text("#!/bin/bash\nprintf '<%s>' \"$@\"\n")
    launch.chmod(0o755)
    env = dict(os.environ, RUN_DIR=str(run_dir), LAUNCHER="mpirun", MPIEXEC=str(launch),
               SLURM_NTASKS="2", VENV=str(tmp_path / "no-venv"))
    result = subprocess.run(["bash", os.path.join(SLURM_DIR, "train.sbatch"), "run.yaml"],
                            env=env, cwd=str(tmp_path), capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    launched = result.stdout.splitlines()[-1]
    assert f"<--run-dir><{run_dir}><--resume>" in launched, result.stdout + result.stderr
    assert "--overwrite" not in launched


def _prepare_tasks(tmp_path, ids, *, lines=10, first=None, last=None, count=None, parts=None,
                   out="corpus", env_extra=None):
    """prepare.sbatch run as each task of an array with ``ids`` (without Slurm: a stand-in
    `sbatch` keeps the merge job's command, a stand-in python the prepare commands);
    returns [(task id, exit status, stderr)], the merge command and the parts' scp lines."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(
        "#!/bin/bash\nfor a in \"$@\"; do case $a in --wrap=*) "
        f"printf '%s\\n' \"${{a#--wrap=}}\" >> {json.dumps(str(tmp_path / 'merge'))};; "
        "esac; done\necho 99\n")
    (bin_dir / "python").write_text("#!/bin/bash\nexit 0\n")
    for name in ("sbatch", "python"):
        (bin_dir / name).chmod(0o755)
    (tmp_path / "feats.scp").write_text("".join(f"utt{i} feats.ark:{i}\n" for i in range(lines)))
    array = {"SLURM_ARRAY_JOB_ID": "7", "SLURM_ARRAY_TASK_COUNT": str(count or len(ids)),
             "SLURM_ARRAY_TASK_MIN": str(min(ids) if first is None else first),
             "SLURM_ARRAY_TASK_MAX": str(max(ids) if last is None else last)}
    if parts is not None:
        array["PARTS"] = str(parts)
    results = []
    for task in ids:
        env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
                   VENV=str(tmp_path / "no-venv"), SLURM_ARRAY_TASK_ID=str(task), **array,
                   **(env_extra or {}))
        if parts is None:
            env.pop("PARTS", None)
        done = subprocess.run(["bash", os.path.join(SLURM_DIR, "prepare.sbatch"), "feats.scp",
                               "ark:ali.ark", out], env=env, cwd=str(tmp_path),
                              capture_output=True, text=True, timeout=60)
        results.append((task, done.returncode, done.stderr))
    merge = (tmp_path / "merge").read_text() if (tmp_path / "merge").exists() else ""
    written = {p.parent.name: p.read_text().splitlines()
               for p in sorted((tmp_path / out).glob("part-*/feats.scp"))}
    return results, merge, written


def test_prepare_array_from_0_writes_each_line_into_one_part_and_merges_them(tmp_path):
    results, merge, written = _prepare_tasks(tmp_path, [0, 1, 2])
    assert [r[1] for r in results] == [0, 0, 0], results
    assert sorted(written) == ["part-00000", "part-00001", "part-00002"]
    assert sum(written.values(), []) == [f"utt{i} feats.ark:{i}" for i in range(10)]
    assert merge.count("mpitrain merge") == 1
    assert all(f"corpus/{p}" in merge for p in written), merge


@pytest.mark.parametrize("ids", [[1, 2, 3], [0, 2, 4], [0, 1, 5]],
                         ids=["array=1-3", "array=0-4:2", "array=0,1,5"])
def test_prepare_array_not_numbering_the_parts_is_refused_before_anything_is_written(
        tmp_path, ids):
    # (before, --array=1-3 wrote no part 0 and failed its last task; a step or a
    # list left parts unwritten)
    results, merge, written = _prepare_tasks(tmp_path, ids)
    for task, status, err in results:
        assert status == 2, (task, err)
        lines = [line for line in err.splitlines() if line]
        assert len(lines) == 1 and lines[0].startswith("prepare.sbatch: array tasks "), err
        assert "--array=0-2" in lines[0], err
    assert merge == "" and written == {}


def test_prepare_rerun_of_some_parts_numbers_them_by_task_id(tmp_path):
    results, merge, written = _prepare_tasks(tmp_path, [1], parts=3)
    assert results[0][1] == 0, results
    assert list(written) == ["part-00001"]
    # floor(i * 3 / 10) == 1: the lines part 1 had in the first run
    assert written["part-00001"] == [f"utt{i} feats.ark:{i}" for i in range(4, 7)]
    # the first task of the re-run submits the merge of all three parts
    assert all(f"corpus/part-0000{i}" in merge for i in range(3)), merge


def test_prepare_with_parts_not_a_number_is_one_line(tmp_path):
    results, merge, written = _prepare_tasks(tmp_path, [0], parts="eight")
    assert results[0][1] == 2 and results[0][2].strip() == \
        "prepare.sbatch: PARTS=eight: expected a number of parts >= 1"
    assert merge == "" and written == {}


@pytest.mark.parametrize("script,variable,args", [
    ("train.sbatch", "RUN_DIR", ["run.yaml"]),
    ("train.sbatch", "SWEEP", ["run.yaml"]),
    ("bench.sbatch", "BENCH_OUT", ["run.yaml"]),
    ("prepare.sbatch", "OUT_DIR", ["feats.scp", "ark:ali.ark", "~/corpus"]),
])
def test_a_path_variable_starting_with_a_quoted_tilde_is_refused_before_any_mkdir(
        tmp_path, script, variable, args):
    # RUN_DIR="~/runs/x" (quoted: the shell leaves the ~) made a directory named ~ in
    # the submit directory, which looks like the home directory
    env = dict(os.environ, VENV=str(tmp_path / "no-venv"), LAUNCHER="mpirun",
               SLURM_NTASKS="1", SLURM_ARRAY_TASK_ID="0")
    if variable != "OUT_DIR":
        env[variable] = "~/runs/x"
    result = subprocess.run(["bash", os.path.join(SLURM_DIR, script), *args], env=env,
                            cwd=str(tmp_path), capture_output=True, text=True, timeout=60)
    shown = "~/corpus" if variable == "OUT_DIR" else "~/runs/x"
    assert result.returncode == 2 and result.stderr == (
        f"{script}: {variable}={shown}: starts with ~, which the shell does not expand "
        f"inside quotes; write the path out ($HOME{shown[1:]})\n"), result.stderr
    assert os.listdir(tmp_path) == []


def _launched(tmp_path, script, env_extra, args=("run.yaml",), bin_extra=None):
    """``script`` run by hand with a stand-in launcher that prints its arguments as
    <a><b>...; returns the CompletedProcess (launched line last in stdout)."""
    launch = tmp_path / "launch"
    launch.write_text("#!/bin/bash\nprintf '<%s>' \"$@\"\necho\n")
    launch.chmod(0o755)
    env = dict(os.environ, LAUNCHER="mpirun", MPIEXEC=str(launch), SLURM_NTASKS="2",
               VENV=str(tmp_path / "no-venv"), **env_extra)
    return subprocess.run(["bash", os.path.join(SLURM_DIR, script), *args], env=env,
                          cwd=str(tmp_path), capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("script", ["train.sbatch", "bench.sbatch"])
def test_mpitrain_set_over_several_lines_sets_every_line(tmp_path, script):
    # MPITRAIN_SET="$(cat overrides.txt)": the settings after the first line were dropped
    result = _launched(tmp_path, script, {
        "RUN_DIR": str(tmp_path / "run"), "BENCH_OUT": str(tmp_path / "bench"),
        "MPITRAIN_SET": "training.epochs=2 model.hidden_dim=64\n\ttraining.seed=5\n"})
    assert result.returncode == 0, result.stdout + result.stderr
    launched = result.stdout.splitlines()[-1]
    assert "<--set><training.epochs=2><--set><model.hidden_dim=64><--set><training.seed=5>" \
        in launched, launched


@pytest.mark.parametrize("script", ["train.sbatch", "bench.sbatch", "train-gpu.sbatch"])
def test_the_banner_says_the_blas_threads_the_ranks_will_use(tmp_path, script):
    """On a GPU the ranks use one BLAS thread (mpitrain.threads); the banner said
    --cpus-per-task's count whatever the device."""
    import shutil
    shutil.copy(os.path.join(REPO, "jobs", "configs", "quickstart.yaml"), tmp_path / "run.yaml")
    home = {"MPITRAIN_HOME": REPO} if script.endswith("-gpu.sbatch") else {}
    gpu = script.endswith("-gpu.sbatch")

    def banner(env_extra=(), args=()):
        result = _launched(tmp_path, script, dict(
            home, RUN_DIR=str(tmp_path / "run"), BENCH_OUT=str(tmp_path / "bench"),
            PYTHON=sys.executable, PYTHONPATH=REPO, SLURM_CPUS_PER_TASK="4", **dict(env_extra)),
            args=("run.yaml", *args))
        assert result.returncode == 0, result.stdout + result.stderr
        return next(line for line in result.stdout.splitlines() if " ranks, " in line)

    assert f"2 ranks, {1 if gpu else 4} BLAS thread(s) each" in banner(), banner()
    assert "2 ranks, 1 BLAS thread(s) each" in banner({"DEVICE": "gpu"})
    assert "2 ranks, 1 BLAS thread(s) each" in banner(args=("--set", "device=gpu"))
    assert "2 ranks, 3 BLAS thread(s) each" in banner({"MPITRAIN_SET": "blas_threads=3"})
    assert "2 ranks, 2 BLAS thread(s) each" in banner({"DEVICE": "cpu", "BLAS_THREADS": "2"})


def test_a_job_submitted_with_export_none_gives_the_ranks_the_scripts_environment(
        slurm, corpus, tmp_path):
    # `sbatch --export=NONE` (as many sites ask) leaves SLURM_EXPORT_ENV=NONE in the
    # job, and srun took it: the ranks started without PATH, PYTHONPATH or the BLAS
    # thread counts the script exports.  The settings come from a job script of the
    # user's, as they would under --export=NONE.
    run_dir, output = tmp_path / "run", str(tmp_path / "train.out")
    settings = dict(_job_env(slurm), RUN_DIR=str(run_dir), BLAS_THREADS="2",
                    MPITRAIN_SET=_train_overrides(corpus, **{"model.hidden_dim": 32,
                                                             "training.max_steps": 4}))
    job_script = tmp_path / "job.sbatch"
    job_script.write_text("#!/bin/bash\n" + "".join(
        f"export {k}={json.dumps(v)}\n" for k, v in settings.items())
        + f"exec bash {json.dumps(os.path.join(SLURM_DIR, 'train.sbatch'))} \"$@\"\n")
    job = slurm.sbatch(["--export=NONE", "--ntasks-per-node=2", "--cpus-per-task=1",
                        f"--output={output}", str(job_script), "jobs/configs/quickstart.yaml"],
                       cwd=REPO)
    _, text = _finished_ok(slurm, job, output)
    start = _records(run_dir, "start")
    assert [(r["ranks"], r["blas_threads"]) for r in start] == [(2, 2)], (start, text)
    assert (run_dir / "final.h5").exists()


@pytest.mark.parametrize("script", ["train.sbatch", "bench.sbatch"])
def test_srun_passes_the_whole_environment_on_under_export_none(tmp_path, script):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/bash\necho \"export=$SLURM_EXPORT_ENV "
                                  "omp=$OMP_NUM_THREADS\"\n")
    (bin_dir / "srun").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
               SLURM_EXPORT_ENV="NONE", SLURM_NTASKS="2", SLURM_CPUS_PER_TASK="3",
               SRUN_MPI="pmi2", VENV=str(tmp_path / "no-venv"),
               RUN_DIR=str(tmp_path / "run"), BENCH_OUT=str(tmp_path / "bench"))
    result = subprocess.run(["bash", os.path.join(SLURM_DIR, script), "run.yaml"], env=env,
                            cwd=str(tmp_path), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[-1] == "export=ALL omp=3", result.stdout


def test_a_finished_run_without_checkpoints_is_refused_not_overwritten(tmp_path):
    # a run that ended and whose checkpoints were removed to save space, submitted
    # again (or requeued): '--overwrite' deleted its final.h5 and trained from step 0
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for done in ("config.yaml", "metrics.jsonl", "best.h5", "final.h5"):
        (run_dir / done).write_text("kept")
    result = _launched(tmp_path, "train.sbatch", {"RUN_DIR": str(run_dir)})
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr == (f"train.sbatch: {run_dir} holds a finished run (final.h5) and "
                             "no checkpoint to resume; choose another RUN_DIR, or remove that "
                             "run to train again\n"), result.stderr
    assert "<-n>" not in result.stdout
    assert sorted(os.listdir(run_dir)) == ["best.h5", "config.yaml", "final.h5", "metrics.jsonl"]
    assert (run_dir / "final.h5").read_text() == "kept"


@pytest.mark.parametrize("script,variable,args", [
    ("train.sbatch", "RUN_DIR", ["run.yaml"]),
    ("train-gpu.sbatch", "RUN_DIR", ["run.yaml"]),
    ("bench.sbatch", "BENCH_OUT", ["run.yaml"]),
    ("bench-gpu.sbatch", "BENCH_OUT", ["run.yaml"]),
    ("prepare.sbatch", "OUT_DIR", ["feats.scp", "ark:ali.ark", "~/corpus"]),
])
def test_a_script_run_with_sh_runs_under_bash(tmp_path, script, variable, args):
    # `sh train.sbatch ...` by hand: dash stopped at once on `set -o pipefail`
    env = dict(os.environ, VENV=str(tmp_path / "no-venv"), MPITRAIN_HOME=REPO,
               SLURM_ARRAY_TASK_ID="0")
    if variable != "OUT_DIR":
        env[variable] = "~/runs/x"
    result = subprocess.run(["sh", os.path.join(SLURM_DIR, script), *args], env=env,
                            cwd=str(tmp_path), capture_output=True, text=True, timeout=60)
    shown = "~/corpus" if variable == "OUT_DIR" else "~/runs/x"
    name = script.replace("-gpu", "")
    assert result.returncode == 2 and result.stderr.startswith(
        f"{name}: {variable}={shown}: starts with ~"), result.stderr


@pytest.mark.parametrize("out", ["corpus fran\u00e7ais", "it's corpus", "a$b `c` \\d"])
def test_prepare_merge_job_names_the_parts_as_sh_reads_them(tmp_path, out):
    # sbatch --wrap runs the merge under /bin/sh; bash's %q quoting gave $'...' for a
    # non-ASCII name under the C locale, which sh reads as other text
    results, merge, written = _prepare_tasks(tmp_path, [0, 1], out=out,
                                             env_extra={"LC_ALL": "C"})
    assert [r[1] for r in results] == [0, 0], results
    assert sorted(written) == ["part-00000", "part-00001"]
    words = subprocess.run(["sh", "-c", f"set -- {merge.strip()}; printf '%s\\n' \"$@\""],
                           capture_output=True, text=True, check=True).stdout.splitlines()
    assert words == ["python", "-m", "mpitrain", "merge", out, f"{out}/part-00000",
                     f"{out}/part-00001", "--overwrite"], merge
