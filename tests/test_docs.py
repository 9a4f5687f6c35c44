"""The README and docs/ hold when followed: every test and file they cite exists, every Python block compiles
and names only groupbridge API that exists, and every figure in docs/results.md says when it was measured and
at which revision.

In-process and fast: files are parsed (``ast``, regular expressions), nothing is run. The quickstarts that
run as pasted are in tests/test_examples.py (slow).
"""

from __future__ import annotations

import ast
import importlib
import re
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SOURCE_DIRS = ("groupbridge", "tests", "examples", "scripts")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# ------------------------------------------------------------------------------------ cited tests and files

CITED_TEST = re.compile(r"\b(tests/[\w/]+\.py)::([\w:]+)")
CITED_FILE = re.compile(r"`([\w./-]+\.py)(?:`|::|:)")


def _citations() -> list[tuple[str, str, str]]:
    """(doc, test file, ``name`` or ``Class::name``) for every ``tests/<file>.py::<name>`` a doc cites."""
    return [(_rel(doc), m[1], m[2]) for doc in DOCS for m in CITED_TEST.finditer(doc.read_text())]


def _test_names(path: Path) -> set[str]:
    """The test functions of a test file, as pytest addresses them: ``name`` and ``Class::name``."""
    names = set()
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name.startswith("test"):
                    names.add(f"{node.name}::{item.name}")
    return names


def test_the_docs_cite_tests() -> None:
    assert _citations(), "no tests/<file>.py::<name> found in README.md or docs/: is the pattern stale?"


@pytest.mark.parametrize(("doc", "file", "name"), _citations(), ids=lambda v: str(v))
def test_every_cited_test_exists(doc: str, file: str, name: str) -> None:
    path = ROOT / file
    assert path.is_file(), f"{doc} cites {file}::{name}, and {file} does not exist"
    names = _test_names(path)
    assert name in names, f"{doc} cites {file}::{name}: {file} has no test {name!r}"


def test_every_cited_python_file_exists() -> None:
    """A ``.py`` path in backticks (``tests/test_vllm.py``, ``weights/_shard_plan.py``, ``control.py``) names
    a file of this repository: the path, or the end of one, in groupbridge/, tests/, examples/, scripts/."""
    files = {"/" + _rel(p) for d in SOURCE_DIRS for p in (ROOT / d).rglob("*.py")}
    missing = [
        f"{_rel(doc)}: {cited}"
        for doc in DOCS
        for cited in sorted(set(CITED_FILE.findall(doc.read_text())))
        if not any(f.endswith("/" + cited.removeprefix("./")) for f in files)
    ]
    assert not missing, "cited files that do not exist:\n" + "\n".join(missing)


# --------------------------------------------------------------------------------------------- Python blocks


@dataclass(frozen=True)
class Block:
    doc: str
    line: int
    code: str

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}"


def _python_blocks() -> list[Block]:
    blocks = []
    for doc in DOCS:
        lines = doc.read_text().splitlines()
        start = None
        for i, line in enumerate(lines):
            if start is None and line.strip() == "```python":
                start = i + 1
            elif start is not None and line.strip() == "```":
                blocks.append(Block(_rel(doc), start, "\n".join(lines[start:i]) + "\n"))
                start = None
    return blocks


def _groupbridge_names(tree: ast.AST) -> set[str]:
    """Every dotted name under ``groupbridge`` a block imports or reads: ``from groupbridge.x import Y`` gives
    ``groupbridge.x.Y``, ``gb.StatelessGroup.create`` gives ``groupbridge.StatelessGroup.create``. ``gb`` and
    ``groupbridge`` mean the package even where a fragment does not import it."""
    aliases = {"gb": "groupbridge", "groupbridge": "groupbridge"}
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "groupbridge":
                    names.add(a.name)
                    if a.asname:
                        aliases[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "groupbridge":
            for a in node.names:
                names.add(f"{node.module}.{a.name}")
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain: list[str] = []
            value: ast.expr = node
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in aliases:
                names.add(".".join([aliases[value.id], *reversed(chain)]))
    # a chain's prefixes are checked with it: keep only the longest
    return {n for n in names if not any(o.startswith(n + ".") for o in names)}


class _OptionalDependencyMissing(Exception):
    pass


def _resolve(dotted: str) -> Any:
    """The object a dotted name under groupbridge stands for, importing submodules as needed. Raises
    AttributeError (naming what is missing, or private) or _OptionalDependencyMissing."""
    parts = dotted.split(".")
    obj: Any = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], 1):
        if part.startswith("_"):
            raise AttributeError(f"{'.'.join(parts[:i])}.{part} is private")
        if isinstance(obj, types.ModuleType):
            public = getattr(obj, "__all__", None)
            try:
                obj = importlib.import_module(".".join(parts[: i + 1]))
                continue
            except ModuleNotFoundError as e:
                if e.name is not None and not e.name.startswith("groupbridge"):
                    raise _OptionalDependencyMissing(f"{'.'.join(parts[: i + 1])} needs {e.name}") from e
            if public is not None and part not in public:
                raise AttributeError(f"{'.'.join(parts[:i])} has no public {part!r} (not in its __all__)")
        obj = getattr(obj, part)
    return obj


def test_the_docs_have_python_blocks() -> None:
    assert len(_python_blocks()) >= 10, "the ```python blocks of README.md and docs/ were not found"


@pytest.mark.parametrize("block", _python_blocks(), ids=str)
def test_every_python_block_compiles_and_names_groupbridge_api_that_exists(block: Block) -> None:
    try:
        tree = compile(block.code, str(block), "exec", ast.PyCF_ONLY_AST, dont_inherit=True)
    except SyntaxError as e:
        pytest.fail(f"{block.doc}, block at line {block.line}: {e}")
    compile(tree, str(block), "exec", dont_inherit=True)
    missing, optional = [], []
    for name in sorted(_groupbridge_names(tree)):
        try:
            _resolve(name)
        except _OptionalDependencyMissing as e:
            optional.append(str(e))
        except (AttributeError, ModuleNotFoundError) as e:
            missing.append(f"{name}: {e}")
    assert not missing, f"{block} names groupbridge API that does not exist:\n" + "\n".join(missing)
    if optional:
        pytest.skip(f"{block}: not checked here, an optional dependency is missing: {'; '.join(optional)}")


# -------------------------------------------------------------------------------- dated figures in results

DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
REVISION = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
FIGURE = re.compile(r"\d(?:\.\d+)?\s?(?:s|us|ms|GB/s|GB|GiB|MB|MiB|x|%)(?![\w/])")


def _dated(text: str) -> bool:
    return bool(DATE.search(text) and REVISION.search(text))


def _sections(path: Path) -> list[tuple[str, list[str]]]:
    """(heading, blocks) per section of a Markdown file; a block is the text between blank lines (a whole
    fenced code block is one block)."""
    sections: list[tuple[str, list[str]]] = [("(top)", [])]
    block: list[str] = []
    fenced = False

    def end_block() -> None:
        if block:
            sections[-1][1].append("\n".join(block))
            block.clear()

    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if not fenced and line.startswith("#"):
            end_block()
            sections.append((line.lstrip("# "), []))
        elif not fenced and not line.strip():
            end_block()
        else:
            block.append(line)
    end_block()
    return sections


def _is_table(block: str) -> bool:
    return block.lstrip().startswith("|")


def _is_image(block: str) -> bool:
    return block.lstrip().startswith("![")


RESULTS = ROOT / "docs" / "results.md"


def test_every_table_of_results_says_when_and_at_which_revision_it_was_measured() -> None:
    """The paragraph just before each table (its caption) names a date (YYYY-MM-DD) and a revision (7 to 40
    hex digits)."""
    undated = []
    for heading, blocks in _sections(RESULTS):
        for i, block in enumerate(blocks):
            if _is_table(block) and not (i and _is_table(blocks[i - 1])):
                caption = blocks[i - 1] if i and not _is_image(blocks[i - 1]) else ""
                if not _dated(caption):
                    undated.append(f"{heading}: the table beginning {block.splitlines()[0][:70]!r}")
    assert not undated, "tables, no date and revision in the paragraph before them:\n" + "\n".join(undated)


def test_every_section_of_results_with_figures_is_dated_in_its_first_paragraph() -> None:
    """A section that states a measured figure (a table, a plot, or a number with a unit) names a date and a
    revision in its first paragraph: the figures of the section without their own date are from that run."""
    undated = []
    for heading, blocks in _sections(RESULTS):
        if any(_is_table(b) or _is_image(b) or FIGURE.search(b) for b in blocks):
            first = next((b for b in blocks if not _is_table(b) and not _is_image(b)), "")
            if not _dated(first):
                undated.append(heading)
    assert not undated, "sections, no date and revision in the first paragraph: " + ", ".join(undated)


def test_every_dated_paragraph_of_results_names_its_revision() -> None:
    """A paragraph that dates a measurement also says which revision was measured."""
    bare = [
        f"{heading}: {block[:90]!r}"
        for heading, blocks in _sections(RESULTS)
        for block in blocks
        if DATE.search(block) and not REVISION.search(block)
    ]
    assert not bare, "dated paragraphs without a revision:\n" + "\n".join(bare)


def test_the_figure_rules_see_what_they_check() -> None:
    """The rules above find the tables and plots of results.md, and tell a dated caption from a bare one."""
    sections = _sections(RESULTS)
    assert sum(_is_table(b) for _, bs in sections for b in bs) >= 10
    assert sum(_is_image(b) for _, bs in sections for b in bs) >= 5
    assert _dated("Ten runs on 2026-12-04 at 631786a (the code of 8f783c1)")
    assert not _dated("Measured on 2026-11-30.")
    # digits alone, or letters alone, are no revision
    assert not _dated("1000000 bytes on 2026-11-30, deadbeef")
