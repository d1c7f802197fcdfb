"""Nothing under tests/ or benchmarks/ reads outside the repository, so a fresh clone runs them with nothing
beside it; the data the tests compare against lives in tests/data/.

Read with `ast`, never by importing. A path built from `__file__` (pathlib's `parent`, `parents[n]` and `/`,
`os.path.dirname` and `join`, and names bound to such paths) is worked out for the file it stands in and
must stay under the repository root. A string, or a chain of joined constants, that names the reference
directory once kept beside the checkout, or climbs with "..", is flagged wherever it is built.
"""

from __future__ import annotations

import ast
import posixpath
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCANNED = ("tests", "benchmarks")
# the directory beside the checkout that held llama.cpp's outputs, and a ".." path segment
FORBIDDEN = re.compile(r"\bshared/+reference\b|(^|[\s/\"'=])\.\.([\s/\"']|$)")
# calls that hand back the path they are given, or a string of it
SAME_PATH = {"Path", "PurePath", "PosixPath", "PurePosixPath", "str", "fspath", "abspath", "realpath", "normpath",
             "resolve", "absolute", "expanduser", "with_suffix"}
UNKNOWN = "*"  # a segment the source does not spell out: a child of the path it is joined to


def _join(base: str, *segments: str) -> str:
    return posixpath.normpath(posixpath.join(base, *segments))


def _short(text: str, width: int = 80) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


class PathWalker(ast.NodeVisitor):
    """Works out every path the source builds from `__file__`, and spells every joined path, in source order."""

    def __init__(self, file: Path, root: Path) -> None:
        self.file = str(file)
        self.root = str(root)
        self.bound: dict[str, str] = {}  # name -> the path from __file__ last assigned to it
        self.found: dict[int, str] = {}  # line -> why it leaves the repository (the first reason on the line)
        self.worked_out: set[int] = set()  # ids of the parts of paths from __file__: those are not read as text

    # -- what an expression is ------------------------------------------------------------------------------
    def path_of(self, node: ast.expr) -> str | None:
        """The absolute path `node` evaluates to where it is derived from `__file__`, else None."""
        if isinstance(node, ast.Name):
            return self.file if node.id == "__file__" else self.bound.get(node.id)
        if isinstance(node, ast.Attribute) and node.attr == "parent":
            base = self.path_of(node.value)
            return None if base is None else posixpath.dirname(base)
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "parents":
            base = self.path_of(node.value.value)
            index = node.slice
            if base is None or not (isinstance(index, ast.Constant) and isinstance(index.value, int)):
                return None
            for _ in range(index.value + 1):
                base = posixpath.dirname(base)
            return base
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            base = self.path_of(node.left)
            return None if base is None else _join(base, self.segment(node.right))
        if isinstance(node, ast.Call):
            name = _name(node.func)
            # a method of a path (p.resolve(), p.joinpath("x")) or a function given one (Path(p), os.path.join(p, "x"))
            receiver = node.func.value if isinstance(node.func, ast.Attribute) else None
            base = self.path_of(receiver) if receiver is not None else None
            args = node.args
            if base is None and args:
                base, args = self.path_of(args[0]), args[1:]
            if base is None:
                return None
            if name in SAME_PATH:
                return base
            if name == "dirname":
                return posixpath.dirname(base)
            if name in ("joinpath", "join", "Path", "PurePath"):
                return _join(base, *(self.segment(a) for a in args))
            if name == "with_name" and args:
                return _join(posixpath.dirname(base), self.segment(args[0]))
        return None

    def segment(self, node: ast.expr) -> str:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        return UNKNOWN

    def spelled(self, node: ast.expr) -> str | None:
        """A joined path as the source spells it (`a / "b"`, `os.path.join(a, "b")`), unknown parts as *."""
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            return "/".join((self.spelled(node.left) or UNKNOWN, self.segment(node.right)))
        if isinstance(node, ast.Call) and _name(node.func) in ("join", "joinpath") and node.args:
            first, *rest = node.args
            return "/".join((self.spelled(first) or UNKNOWN, *(self.segment(a) for a in rest)))
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        return None

    # -- walking --------------------------------------------------------------------------------------------
    def flag(self, node: ast.AST, why: str) -> None:
        self.found.setdefault(node.lineno, why)

    def generic_visit(self, node: ast.AST) -> None:
        if isinstance(node, ast.expr) and id(node) not in self.worked_out:
            path = self.path_of(node)
            if path is not None:
                # every step counts: parents[3] / "main" comes back in only where the checkout is called main
                self.worked_out.update(id(n) for n in ast.walk(node))
                for step in ast.walk(node):
                    reached = self.path_of(step) if isinstance(step, ast.expr) else None
                    if reached is not None and reached != self.root and not reached.startswith(self.root + "/"):
                        self.flag(node, f"{_short(ast.unparse(step))} is {reached}, outside {self.root}")
                        break
            elif (spelled := self.spelled(node)) is not None and (match := FORBIDDEN.search(spelled)):
                self.flag(node, f"{_short(ast.unparse(node))} names {match.group(0).strip()!r}")
        super().generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        self.generic_visit(node)
        self.bind(node.targets, node.value)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self.generic_visit(node)
        if node.value is not None:
            self.bind([node.target], node.value)

    def bind(self, targets: list[ast.expr], value: ast.expr) -> None:
        path = self.path_of(value)
        for target in targets:
            if isinstance(target, ast.Name):
                if path is None:
                    self.bound.pop(target.id, None)
                else:
                    self.bound[target.id] = path


def outside_reads(source: str, file: Path, root: Path) -> list[str]:
    """`line: why` for each line of `source` (the text of `file`) that reaches outside `root`."""
    if file.suffix != ".py":
        return [f"{n}: names {m.group(0).strip()!r}" for n, line in enumerate(source.splitlines(), 1)
                if (m := FORBIDDEN.search(line))]
    walker = PathWalker(file, root)
    walker.visit(ast.parse(source, filename=str(file)))
    return [f"{line}: {why}" for line, why in sorted(walker.found.items())]


def scanned_files(root: Path, folder: str) -> list[Path]:
    # this file spells the patterns it looks for; shell scripts are read as text
    files = [*(root / folder).rglob("*.py"), *(root / folder).rglob("*.sh")]
    return sorted(f for f in files if f.resolve() != Path(__file__).resolve())


@pytest.mark.parametrize("folder", SCANNED)
def test_no_source_reads_outside_the_repository(folder: str) -> None:
    files = scanned_files(REPO, folder)
    assert files, f"nothing to scan under {folder}/"
    found = [f"{f.relative_to(REPO)}:{where}" for f in files for where in outside_reads(f.read_text(), f, REPO)]
    assert not found, "\n".join(found)


# -- the scan itself, on planted sources ---------------------------------------------------------------------

ROOT = Path("/checkouts/repo")
PLANTED = {  # each leaves /checkouts/repo from /checkouts/repo/tests/engine/test_x.py
    "parents_above_root": 'REF = Path(__file__).resolve().parents[3] / "data"',
    "parent_chain": "ROOT = Path(__file__).parent.parent.parent.parent",
    "dotdot_join": 'ROOT = Path(__file__).resolve().parents[2] / ".." / "elsewhere"',
    "through_a_name": 'ROOT = Path(__file__).resolve().parents[2]\nREF = ROOT.parent / "x"',
    "os_path": "ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))",
    "os_path_join": 'REF = os.path.join(os.path.dirname(__file__), "..", "..", "..", "x")',
    "inside_a_function": 'def f():\n    return open(Path(__file__).parents[5] / "x.json")',
    "reference_dir_joined": 'REF = Path(os.environ["HOME"]) / "shared" / "reference" / "smollm2"',
    "reference_dir_as_text": 'REF = "/srv/shared//reference/smollm2/chat.json"',
    "dotdot_text": 'REF = "../data/chat.json"',
    "back_in_by_name": 'REF = Path(__file__).resolve().parents[3] / "repo" / "tests" / "data"',
}
KEPT_INSIDE = {
    "repo_root": 'ROOT = Path(__file__).resolve().parents[2]\nDATA = ROOT / "tests" / "data"',
    "sibling_file": 'FACTORY = Path(__file__).with_name("gguf_factory.py")',
    "climb_then_descend": 'X = Path(__file__).parents[1] / "engine" / ".." / "data"',
    "other_roots": 'BIN = Path(triton.__file__).parent / "bin"\nTMP = Path("/tmp") / "x"',
    "unknown_child": "P = Path(__file__).parents[2] / name / f'{stem}.json'",
    "not_a_path": 'TEXT = "a shared reference, two dots.. and an ellipsis..."',
}


@pytest.mark.parametrize("source", PLANTED.values(), ids=PLANTED.keys())
def test_scan_flags_a_planted_path_out_of_the_repository(source: str) -> None:
    found = outside_reads(f"import os\nfrom pathlib import Path\n{source}\n", ROOT / "tests/engine/test_x.py", ROOT)
    assert len(found) == 1, found


@pytest.mark.parametrize("source", KEPT_INSIDE.values(), ids=KEPT_INSIDE.keys())
def test_scan_passes_paths_that_stay_inside(source: str) -> None:
    assert outside_reads(f"{source}\n", ROOT / "tests/engine/test_x.py", ROOT) == []


def test_scan_reads_shell_scripts_as_text() -> None:
    found = outside_reads("cp x ../out\nls shared/reference\n", ROOT / "benchmarks/env.sh", ROOT)
    assert [line.split(":")[0] for line in found] == ["1", "2"]
