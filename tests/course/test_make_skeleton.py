"""The skeleton generator, on small trees made here (not graded)."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from make_skeleton import ANCHOR_LINE, BEGIN, MarkerError, skeleton_source

REPO = Path(__file__).resolve().parents[2]
GENERATOR = REPO / "tools" / "make_skeleton.py"

SOLUTION = textwrap.dedent('''\
    """A stage module."""


    def greet(name):
        # BEGIN EXERCISE: build the "hello" line
        text = f"hello {name}"
        return text
        # END EXERCISE


    class Box:
        def size(self):
            total = 0
            # BEGIN EXERCISE: add up the items [#the-box]
            for item in self.items:
                total += item
            return total
            # END EXERCISE
    ''')


def generate(tmp: Path, *flags: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        str(GENERATOR),
        "--solutions",
        str(tmp / "solutions"),
        "--stages",
        str(tmp / "stages"),
        *flags,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


@pytest.fixture
def tree(tmp_path):
    package = tmp_path / "solutions" / "s03_demo"
    package.mkdir(parents=True)
    (package / "work.py").write_text(SOLUTION)
    (package / "README.md").write_text("# Stage 3\n")
    (package / "__pycache__").mkdir()
    (package / "__pycache__" / "work.cpython-311.pyc").write_bytes(b"\0")
    (tmp_path / "solutions" / "s00_foundation").mkdir()
    (tmp_path / "solutions" / "s00_foundation" / "model.py").write_text("WEIGHTS = 1\n")
    return tmp_path


def test_regions_become_one_raise_at_the_markers_indentation(tree):
    assert generate(tree).returncode == 0
    got = (tree / "stages" / "s03_demo" / "work.py").read_text()
    assert got == textwrap.dedent('''\
        """A stage module."""


        def greet(name):
            raise NotImplementedError("Stage 3: build the \\"hello\\" line - see stages/s03_demo/README.md")


        class Box:
            def size(self):
                total = 0  # noqa: F841
                raise NotImplementedError("Stage 3: add up the items - see stages/s03_demo/README.md#the-box")
        ''')
    namespace = {}
    exec(compile(got, "work.py", "exec"), namespace)
    with pytest.raises(NotImplementedError, match='Stage 3: build the "hello" line'):
        namespace["greet"]("you")


def test_other_files_are_copied_verbatim_and_caches_skipped(tree):
    assert generate(tree).returncode == 0
    stages = tree / "stages"
    assert (stages / "s03_demo" / "README.md").read_text() == "# Stage 3\n"
    assert (stages / "s00_foundation" / "model.py").read_text() == "WEIGHTS = 1\n"
    assert not (stages / "s03_demo" / "__pycache__").exists()


def test_regeneration_is_deterministic_and_removes_extra_files(tree):
    assert generate(tree).returncode == 0
    first = {p.relative_to(tree): p.read_bytes() for p in (tree / "stages").rglob("*") if p.is_file()}
    (tree / "stages" / "s03_demo" / "stale.py").write_text("x = 1\n")
    (tree / "stages" / "s99_gone").mkdir()
    (tree / "stages" / "s99_gone" / "old.py").write_text("x = 1\n")
    done = generate(tree)
    assert done.returncode == 0
    again = {p.relative_to(tree): p.read_bytes() for p in (tree / "stages").rglob("*") if p.is_file()}
    assert again == first
    assert not (tree / "stages" / "s99_gone").exists(), "a folder left empty is removed"
    assert generate(tree).stdout.strip().endswith("0 changed")


def test_check_lists_every_out_of_sync_file_with_a_fix(tree):
    assert generate(tree).returncode == 0
    assert generate(tree, "--check").returncode == 0
    stages = tree / "stages"
    (stages / "s03_demo" / "README.md").unlink()
    (stages / "s03_demo" / "work.py").write_text("# edited by hand\n")
    (stages / "s03_demo" / "extra.py").write_text("x = 1\n")
    done = generate(tree, "--check")
    assert done.returncode == 1
    assert "missing: stages/s03_demo/README.md" in done.stdout
    assert "differs: stages/s03_demo/work.py" in done.stdout
    assert "extra:   stages/s03_demo/extra.py" in done.stdout
    assert "run `make skeleton`" in done.stdout
    assert (stages / "s03_demo" / "extra.py").exists(), "--check must not change anything"


@pytest.mark.parametrize(
    "source, expected",
    [
        ("def f():\n    # BEGIN EXERCISE: a\n    return 1\n", "s01_x/m.py:2: BEGIN EXERCISE has no matching END"),
        ("def f():\n    return 1\n    # END EXERCISE\n", "s01_x/m.py:3: END EXERCISE without a BEGIN"),
        (
            "def f():\n    # BEGIN EXERCISE: a\n    # BEGIN EXERCISE: b\n    return 1\n    # END EXERCISE\n    # END "
            "EXERCISE\n",
            "s01_x/m.py:3: BEGIN EXERCISE inside the region opened at line 2",
        ),
        ("def f():\n    # BEGIN EXERCISE a\n    return 1\n    # END EXERCISE\n", "s01_x/m.py:2: malformed marker"),
        ("def f():\n    # BEGIN EXERCISE:\n    return 1\n    # END EXERCISE\n", "s01_x/m.py:2: malformed marker"),
        (
            "def f():\n    # BEGIN EXERCISE: a\n    return 1\n# END EXERCISE\n",
            "s01_x/m.py:4: END EXERCISE is not indented like its BEGIN at line 2",
        ),
        ("def f():\n    if True:\n        # BEGIN EXERCISE: a\n        x = 1\n        # END EXERCISE\n", None),  # fine
    ],
)
def test_malformed_markers_name_file_and_line(source, expected):
    if expected is None:
        assert "raise NotImplementedError" in skeleton_source(source, "s01_x/m.py", 1, "s01_x")
        return
    with pytest.raises(MarkerError) as caught:
        skeleton_source(source, "s01_x/m.py", 1, "s01_x")
    assert str(caught.value).startswith(expected), str(caught.value)


def test_code_after_a_region_in_its_block_is_refused_as_dead_code():
    source = "def f(x):\n    y = x\n    # BEGIN EXERCISE: a\n    y += 1\n    # END EXERCISE\n    return y\n"
    with pytest.raises(MarkerError, match=r"s01_x/m.py:3: code follows this region in the same block \('return y'\)"):
        skeleton_source(source, "s01_x/m.py", 1, "s01_x")
    inner = "def f(x):\n    if x:\n        # BEGIN EXERCISE: a\n        x += 1\n        # END EXERCISE\n    return x\n"
    assert "raise NotImplementedError" in skeleton_source(inner, "s01_x/m.py", 1, "s01_x")  # the block ended


def test_a_task_longer_than_one_line_is_refused():
    task = "do this, then that, " * 6
    source = f"def f():\n    # BEGIN EXERCISE: {task}\n    return 1\n    # END EXERCISE\n"
    with pytest.raises(MarkerError, match=r"s01_x/m.py:2: the task is \d+ characters; name it in one line"):
        skeleton_source(source, "s01_x/m.py", 1, "s01_x")


def test_names_only_the_removed_region_used_are_marked_for_the_linter():
    source = textwrap.dedent("""\
        import heapq
        import math
        from typing import TYPE_CHECKING

        if TYPE_CHECKING:
            from collections import deque


        def f(queue: "deque[int]", x: float) -> float:
            rows, kept = list(queue), 2
            scale = math.sqrt(x)
            # BEGIN EXERCISE: pop the smallest [#pop]
            return heapq.heappop(rows) * scale
            # END EXERCISE
        """)
    got = skeleton_source(source, "s01_x/m.py", 1, "s01_x").splitlines()
    assert got[0] == "import heapq  # noqa: F401"  # only the exercise used it
    assert got[1] == "import math"  # the skeleton still uses it
    assert got[5] == "    from collections import deque"  # a quoted annotation uses it
    assert got[9] == "    rows, kept = list(queue), 2  # noqa: F841"
    assert got[10] == "    scale = math.sqrt(x)  # noqa: F841"
    assert got[11] == '    raise NotImplementedError("Stage 1: pop the smallest - see stages/s01_x/README.md#pop")'


def test_a_skeleton_that_is_not_python_is_refused():
    source = "def f(x):\n    # BEGIN EXERCISE: a\n    if x:\n    # END EXERCISE\n        return 1\n"
    with pytest.raises(MarkerError, match="s01_x/m.py:5: the generated skeleton is not valid Python"):
        skeleton_source(source, "s01_x/m.py", 1, "s01_x")


def test_exercises_outside_a_stage_package_are_refused():
    source = "def f():\n    # BEGIN EXERCISE: a\n    return 1\n    # END EXERCISE\n"
    with pytest.raises(MarkerError, match="s00_foundation/m.py:2: exercise markers belong in a stage package"):
        skeleton_source(source, "s00_foundation/m.py", 0, "s00_foundation")


def test_the_command_reports_marker_errors_with_file_and_line(tree):
    (tree / "solutions" / "s03_demo" / "bad.py").write_text("def f():\n    # BEGIN EXERCISE: a\n    return 1\n")
    done = generate(tree)
    assert done.returncode == 2
    assert "solutions/s03_demo/bad.py:2: BEGIN EXERCISE has no matching END EXERCISE" in done.stderr


def heading_anchors(readme: str) -> set[str]:
    """GitHub's anchors of a Markdown file's headings (lower case, punctuation dropped, spaces -> '-')."""
    anchors = set()
    for line in readme.splitlines():
        if line.startswith("#"):
            text = line.lstrip("#").strip().replace("`", "").lower()
            anchors.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return anchors


def test_every_exercise_names_its_task_in_one_line_and_points_at_a_readme_section():
    problems = []
    for path in sorted((REPO / "solutions").glob("s*/**/*.py")):
        package = path.relative_to(REPO / "solutions").parts[0]
        source = path.read_text(encoding="utf-8")
        if "BEGIN EXERCISE" not in source:
            continue
        readme = (REPO / "solutions" / package / "README.md").read_text(encoding="utf-8")
        lines = source.splitlines()
        for number, line in enumerate(lines, start=1):
            begin = BEGIN.match(line)
            if not begin:
                continue
            where = f"{path.relative_to(REPO)}:{number}"
            own_line = ANCHOR_LINE.match(lines[number]) if number < len(lines) else None
            anchor = begin.group(3) or (own_line.group(2) if own_line else None)
            if anchor is None:
                problems.append(f"{where}: no [#anchor] to the README section of this exercise")
            elif anchor not in heading_anchors(readme):
                problems.append(f"{where}: #{anchor} is no heading of solutions/{package}/README.md")
        if "<summary>If you are stuck" not in readme:
            problems.append(f"solutions/{package}/README.md: no folded 'If you are stuck' recipe")
    assert not problems, "\n".join(problems)


def test_a_generator_whose_yields_were_all_in_the_region_stays_a_generator():
    source = textwrap.dedent("""\
        async def chunks(outputs):
            # BEGIN EXERCISE: one line per output [#chunks]
            async for out in outputs:
                yield out
            # END EXERCISE
        """)
    got = skeleton_source(source, "s09_x/m.py", 9, "s09_x")
    assert got.splitlines()[-1] == "    yield  # keeps chunks a generator until you write it; delete this line then"
    namespace: dict = {}
    exec(compile(got, "m.py", "exec"), namespace)
    assert inspect.isasyncgenfunction(namespace["chunks"]), "async for over it must reach the exercise's message"
