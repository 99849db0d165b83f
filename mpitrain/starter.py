"""The example configurations shipped with the package, and ``mpitrain init``.

The examples are ``jobs/configs/*.yaml`` of the source tree; the build copies
them into the package as ``mpitrain/configs/`` (setup.py), so an installed
mpitrain has them too.  ``init`` writes one of them as ``DIR/mpitrain.yaml``
with the corpus paths filled in, the file ``python -m mpitrain`` with no
command trains.

Example::

    path = write_starter("exp1", corpus="data/synth")     # exp1/mpitrain.yaml
    sorted(example_configs())                             # ['bench', 'ngsgd', ...]
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from .files import atomic_open, output_file_problem, removed_if_failed

DEFAULT_CONFIG = "mpitrain.yaml"
DEFAULT_EXAMPLE = "quickstart"
DEFAULT_CORPUS = "data/synth"     # where `mpitrain synth data/synth` writes


def examples_dir() -> Path:
    """Where the example configs are: in the package, else in the source tree."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "configs", here.parent / "jobs" / "configs"):
        if candidate.is_dir() and any(candidate.glob("*.yaml")):
            return candidate
    raise FileNotFoundError(f"{here / 'configs'}: the example configurations are missing "
                            "from this installation")


def example_configs() -> dict[str, Path]:
    """{name: path} of the shipped example configurations."""
    return {p.stem: p for p in sorted(examples_dir().glob("*.yaml"))}


def write_starter(out_dir, *, corpus: str | None = None, train: str | None = None,
                  dev: str | None = None, example: str = DEFAULT_EXAMPLE,
                  overwrite: bool = False, warn=None) -> Path:
    """Write ``out_dir/mpitrain.yaml`` from an example with absolute corpus paths.

    ``train`` and ``dev`` default to ``corpus/train`` and ``corpus/dev`` (the
    layout ``mpitrain synth`` writes; the ``speech`` example's held-out set is
    ``corpus/dev_seen`` where that corpus exists, utterances of the training
    speakers as its recipe asks); ``corpus`` None: the built-in corpus
    (``data/synth``) when neither is given.  ``warn(message)`` hears of a corpus
    directory without a ``corpus.yaml`` (it may be written later).
    """
    for flag, value in (("--corpus", corpus), ("--train", train), ("--dev", dev)):
        if value is not None and not str(value).strip():
            # (a variable left unset in a script) not the built-in corpus's path
            raise ValueError(f"{flag} is empty; name a corpus directory, or leave the "
                             "option out")
    if corpus is None and bool(train) != bool(dev):
        # one named, the other left to the built-in corpus: a pair that belongs to
        # no one corpus, taken without a word
        given, missing = ("--train", "--dev") if train else ("--dev", "--train")
        raise ValueError(f"{given} is given but not {missing}; name {missing} too "
                         "(or --corpus DIR holding both)")
    if corpus is None:
        corpus = DEFAULT_CORPUS
    elif not (train and dev) and os.path.isfile(os.path.join(corpus, "corpus.yaml")) \
            and not os.path.isfile(os.path.join(corpus, "train", "corpus.yaml")):
        # one corpus named where the directory of both belongs (init --corpus
        # data/train): the config would name DIR/train/train and DIR/train/dev
        raise ValueError(f"--corpus {corpus}: is a corpus itself (it holds corpus.yaml); "
                         "--corpus names a directory holding train/ and dev/ corpora; "
                         f"give --train {corpus} --dev DEV_CORPUS")
    examples = example_configs()
    if example not in examples:
        raise ValueError(f"--example: no example configuration {example!r}; "
                         f"choose one of {', '.join(examples)}")
    train = train or (os.path.join(corpus, "train") if corpus else None)
    if not dev and corpus:
        dev = os.path.join(corpus, "dev")
        preferred = _DEV.get(example)
        if preferred and os.path.isfile(os.path.join(corpus, preferred, "corpus.yaml")):
            dev = os.path.join(corpus, preferred)
    if not train or not dev:
        raise ValueError("give --corpus DIR, or both --train and --dev")
    if not str(out_dir).strip():
        raise ValueError("DIR is empty; name the directory to write "
                         f"{DEFAULT_CONFIG} into (. for this one)")
    target = Path(out_dir) / DEFAULT_CONFIG
    # said before the corpus warnings, and instead of makedirs' "File exists"
    problem = output_file_problem(target)
    if problem:
        raise ValueError(f"{target}: cannot be written: {problem}")
    if target.exists() and not overwrite:
        raise ValueError(f"{target}: already exists; pass --overwrite to replace it")
    text = examples[example].read_text(encoding="utf-8")
    text = _without_run_comment(text)
    for key, value in (("train", train), ("dev", dev)):
        path = os.path.abspath(value)
        # the run may start in another directory: absolute paths always resolve
        # quoted: '#', ': ' and the like stay in the path
        text, found = re.subn(rf"^(  {key}:)[^\n]*$",
                              lambda m: f"{m.group(1)} {_quoted(path)}",
                              text, count=1, flags=re.M)
        if not found:
            raise ValueError(f"{examples[example]}: no 'data.{key}' line to fill in")
        if warn and not os.path.isfile(os.path.join(path, "corpus.yaml")):
            warn(f"warning: {path}/corpus.yaml does not exist yet (write it with "
                 "`mpitrain synth` or `mpitrain prepare`)")
    header = (f"# Written by `mpitrain init` from the example '{example}'.\n"
              f"# Run it from this directory: {run_command(example)}\n")
    # (a full disk: the directory made for the config goes with it)
    with removed_if_failed(out_dir):
        os.makedirs(out_dir, exist_ok=True)
        with atomic_open(target, "w") as f:
            f.write(header + text)
    return target


#: The held-out split of ``--corpus`` an example takes, where it exists, instead of
#: ``dev``: the speech recipe picks its model and stops early on utterances of the
#: training speakers (Kaldi's valid set), which ``synth --seen-dev-hours`` writes.
_DEV = {"speech": "dev_seen"}


#: How to run what ``init`` wrote, by example (None: every other one trains).
_RUN = {
    None: "mpiexec -n N python -m mpitrain",
    "bench": (f"mpiexec -n N python -m mpitrain bench {DEFAULT_CONFIG} "
              "--target-accuracy A --max-seconds S --out runs/bench"),
    "pretrain": (f"mpiexec -n N python -m mpitrain pretrain {DEFAULT_CONFIG} --run-dir "
                 f"runs/pre,\n#   then: mpiexec -n N python -m mpitrain train {DEFAULT_CONFIG} "
                 "--set model.init_from=runs/pre/pretrain.h5"),
}


def run_command(example: str) -> str:
    """How to run, from its directory, the configuration ``init`` wrote from ``example``."""
    return _RUN.get(example, _RUN[None])


def _without_run_comment(text: str) -> str:
    """``text`` less the example's own "# Run..." comment and its indented
    continuation lines: they speak of its place in the source tree."""
    kept, in_run = [], False
    for line in text.splitlines(keepends=True):
        if line.startswith("# Run"):
            in_run = True
            continue
        if in_run and line.startswith("#  "):
            continue
        in_run = False
        kept.append(line)
    return "".join(kept)


def _quoted(path: str) -> str:
    """``path`` as a YAML double-quoted scalar in which its letters stay as they are
    (an accented or CJK letter, not its \\u escape): a JSON escape (a YAML one too)
    only for a quote, a backslash, what is not printable (line breaks YAML would
    fold) and the bytes of a name that are not UTF-8."""
    return '"' + "".join(
        c if c.isprintable() and c not in '"\\' and not 0xD800 <= ord(c) <= 0xDFFF
        else _escaped(c) for c in path) + '"'


def _escaped(c: str) -> str:
    """``c`` as a YAML escape: JSON's, but ``\\U`` beyond the basic plane (JSON's
    surrogate pair reads in YAML as two lone surrogates)."""
    return f"\\U{ord(c):08x}" if ord(c) > 0xFFFF else json.dumps(c)[1:-1]
