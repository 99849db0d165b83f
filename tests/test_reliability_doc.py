"""docs/reliability.md lists at least 60 cases, each backed by a test that exists."""

import ast
import re

from .helpers import REPO

ROW = re.compile(r"^\| (\d+) \|", re.M)
REFERENCE = re.compile(r"([\w/]+\.py)((?:::\w+(?:\[[^\]]*\])?)?)")


def _test_names(path):
    tree = ast.parse((REPO / "tests" / path).read_text())
    return {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}


def test_every_case_is_numbered_and_backed_by_an_existing_test():
    text = (REPO / "docs" / "reliability.md").read_text()
    numbers = [int(n) for n in ROW.findall(text)]
    assert len(numbers) >= 60
    assert numbers == list(range(1, len(numbers) + 1))
    for line in text.splitlines():
        if not ROW.match(line):
            continue
        test_cell = line.rstrip(" |").rsplit("|", 1)[1]
        current = None
        found = 0
        for part in re.split(r",\s*", test_cell.strip()):
            part = part.split(" (")[0].strip()
            if part.startswith("::"):
                assert current, line
                path, name = current, part[2:]
            else:
                m = REFERENCE.fullmatch(part)
                assert m, (part, line)
                path, name = m.group(1), m.group(2)[2:]
                current = path
            assert (REPO / "tests" / path).exists(), (path, line)
            if name:
                assert name.split("[")[0] in _test_names(path), (path, name)
            found += 1
        assert found, line
