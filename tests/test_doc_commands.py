"""Every command the documentation shows parses with the real argument parsers.

The commands are taken from README.md, docs/*.md and jobs/slurm/README.md (code
blocks and `inline code`), and from the comments of the example configs, the
Slurm scripts and scripts/*.sh: each `python -m mpitrain COMMAND ...` and
`python -m mpitrain.bench.NAME ...`.  A complete command line in a code block
must parse as written; one that shows a synopsis (`[--resume]`, `onnx|torch`,
`...`) or is quoted in prose must name options its command has.  Nothing runs.
"""

import argparse
import contextlib
import importlib
import io
import re
import shlex

import pytest

from mpitrain.cli import build_parser
from mpitrain.config import reference_markdown

from .helpers import REPO

#: the benchmarks with a command line (python -m mpitrain.bench.NAME)
BENCH_MODULES = ("collectives", "convergence", "ddp_compare", "ngsgd_overhead",
                 "precondition", "scaling", "soak", "throughput")

_COMMAND = re.compile(r"mpitrain(?: (?P<command>[a-z]+)|\.bench\.(?P<bench>[a-z_]+))(?=\s|$)"
                      r"(?P<rest>.*)")
#: where a shell command ends inside a line
_END = re.compile(r"\s(?:\||;|&&|#|>|2>)(?:\s|$)|`|\)\s|\)$")
#: a synopsis rather than a command line
_SYNOPSIS = re.compile(r"\[|\]|\.\.\.|…|\w\|\w|^-+\w+\|")


def _sources():
    """(file, text, kind): kind 'md' for Markdown, 'comments' for the comment lines
    of configs and scripts."""
    for path in [REPO / "README.md", REPO / "jobs" / "slurm" / "README.md",
                 *sorted((REPO / "docs").glob("*.md"))]:
        yield path, path.read_text(), "md"
    for path in [*sorted((REPO / "jobs" / "configs").glob("*.yaml")),
                 *sorted((REPO / "jobs" / "slurm").glob("*.sbatch")),
                 *sorted((REPO / "scripts").glob("*.sh"))]:
        comments = [line.lstrip()[1:] for line in path.read_text().splitlines()
                    if line.lstrip().startswith("#") and not line.startswith("#!")]
        yield path, "\n".join(comments), "comments"


def _code_lines(text: str, kind: str):
    """(line, in_code): the lines of code blocks (in_code True) and the `inline code`
    of the prose (False); a line continued with a backslash is joined to the next."""
    if kind == "comments":
        text = re.sub(r"\\\n\s*", " ", text)
        for line in text.splitlines():
            yield line, True
        return
    fenced, block = False, []
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced or (line.startswith("    ") and not line.lstrip().startswith(("|", "- "))):
            block.append(line)
            continue
        yield from ((code, True) for code in re.sub(r"\\\n\s*", " ", "\n".join(block))
                    .splitlines())
        block = []
        for span in re.findall(r"`([^`]+)`", line):
            yield span, False
    yield from ((code, True) for code in re.sub(r"\\\n\s*", " ", "\n".join(block)).splitlines())


def documented_commands():
    """(where, parser key, words after the command, complete): every command shown."""
    found = []
    for path, text, kind in _sources():
        name = path.relative_to(REPO).as_posix()
        for line, in_code in _code_lines(text, kind):
            for match in _COMMAND.finditer(line):
                command = match.group("command") or f"bench.{match.group('bench')}"
                rest = _END.split(match.group("rest"), maxsplit=1)[0].strip()
                complete = in_code and not _SYNOPSIS.search(rest)
                found.append((f"{name}: {line.strip()}", command, rest, complete))
    return found


def _parsers() -> dict:
    parsers = dict(build_parser(hold_errors=True).commands)
    for name in BENCH_MODULES:
        parsers[f"bench.{name}"] = importlib.import_module(f"mpitrain.bench.{name}").build_parser()
    return parsers


def _options(parser: argparse.ArgumentParser) -> set:
    return {option for action in parser._actions for option in action.option_strings}


def _words(rest: str) -> list:
    """The words of a command line; a placeholder in capitals (`--virtual N`, `--run-dir
    RUN`) stands for a value, which "1" is of any type here, and a `$VARIABLE` for
    words the shell puts there, which are left out."""
    try:
        words = shlex.split(rest)
    except ValueError:          # a quote the prose cut off
        words = rest.split()
    return ["1" if re.fullmatch(r"[A-Z][A-Z0-9_]*", word) else word
            for word in words if not re.fullmatch(r"\$\w+", word)]


def test_every_documented_set_names_a_config_key():
    keys = set(re.findall(r"^\| `([^`]+)` \|", reference_markdown(), re.M))
    assert {"data.train", "parallel.method", "optimizer.ngsgd.reset_on_average"} <= keys
    settings = []
    for path, text, kind in _sources():
        name = path.relative_to(REPO).as_posix()
        for line, _ in _code_lines(text, kind):
            settings += [(name, key) for key in re.findall(r"--set[= ]([\w.]+)=", line)]
        for value in re.findall(r'MPITRAIN_SET="([^"]*)"', text):    # the Slurm scripts'
            settings += [(name, word.split("=")[0]) for word in value.split() if "=" in word]
    assert len(settings) > 50
    # (`--set key=value` is the synopsis; docs/reliability.md quotes wrong ones on purpose)
    unknown = [f"{where}: --set {key}" for where, key in settings
               if key not in keys and key != "key" and where != "docs/reliability.md"]
    assert not unknown, "\n".join(unknown)


def test_the_documentation_shows_commands_of_every_kind():
    commands = documented_commands()
    kinds = {command for _, command, _, _ in commands}
    assert {"train", "synth", "prepare", "export", "bench", "bench.throughput"} <= kinds, kinds
    assert sum(complete for *_, complete in commands) > 50


def test_every_documented_option_exists():
    parsers = _parsers()
    unknown = []
    for where, command, rest, _ in documented_commands():
        if command not in parsers:
            continue            # `mpitrain reads ...`: prose, or a module without options
        options = _options(parsers[command])
        for word in re.split(r"[\s\[\]|]+", rest):
            option = word.split("=")[0].rstrip(".,:;)")
            if re.fullmatch(r"--[a-z][a-z0-9-]*", option) and option not in options:
                unknown.append(f"{where}  ({command} has no {option})")
    assert not unknown, "\n".join(unknown)


def test_every_documented_command_line_parses():
    parsers = _parsers()
    wrong = []
    for where, command, rest, complete in documented_commands():
        words = _words(rest)
        if not complete or command not in parsers or {"-h", "--help"} & set(words):
            continue
        try:
            if command.startswith("bench."):
                with contextlib.redirect_stderr(io.StringIO()):
                    parsers[command].parse_args(words)
            else:
                build_parser(hold_errors=True).parse_args([command, *words])
        except SystemExit as exc:       # a benchmark's parser said what is wrong
            wrong.append(f"{where}  (exit status {exc.code})")
        except Exception as exc:        # the command line's, held
            wrong.append(f"{where}  ({exc})")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("name", BENCH_MODULES)
def test_every_benchmark_option_says_what_it_does_and_its_default(name):
    parser = importlib.import_module(f"mpitrain.bench.{name}").build_parser()
    text = parser.format_help()
    text = text[text.index("\noptions:"):]          # (not the usage)
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        shown = action.option_strings[0] if action.option_strings else action.dest
        assert action.help, f"{name}: {shown} has no help"
        if action.default is not None and not action.required:
            block = text[text.index("\n  " + shown):]
            following = block.find("\n  -", 1)
            block = block[:following] if following > 0 else block
            assert "default" in block, f"{name}: {shown}'s default is not shown"


def test_max_change_share_script_names_a_missing_corpus_in_one_line(tmp_path, capsys):
    # (it trained at import time, from a fixed path: --help trained, and a missing
    # corpus was a traceback)
    import sys
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import max_change_share
    finally:
        sys.path.remove(str(REPO / "scripts"))
    with pytest.raises(SystemExit) as exc:
        max_change_share.main(["--corpus", str(tmp_path / "none")])
    assert exc.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"--corpus: {tmp_path / 'none' / 'train'}/corpus.yaml not found" in error
