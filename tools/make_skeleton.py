"""Generate the learner's tree `stages/` from the reference tree `solutions/`.

Every file is copied as it is, except that in .py files each marked region

    <indent># BEGIN EXERCISE: <the task in one line> [#readme-anchor]
    ...solution lines...                    (the anchor may stand alone on the next line: # [#readme-anchor])
    <indent># END EXERCISE

becomes one line at the marker's indentation:

    <indent>raise NotImplementedError("Stage N: <the task> - see stages/sNN_name/README.md#readme-anchor")

Hints come in levels and each is written once: the marker names the task in one line (at most
MAX_TASK_CHARS characters), the README section it points at has the idea and a first hint, and
the full recipe sits in that section's folded "If you are stuck" block.

The skeleton must lint clean. Code after a region in the same block would be dead after the
raise, so a region that ends a function or a loop body ends it (its return inside the region);
an import or a local variable that only the removed region used gets a ``# noqa`` marker
(F401 / F841) saying the linter may let it be: the learner's code will use it.

So nobody edits stages/ by hand: change solutions/ and regenerate.

    python tools/make_skeleton.py            # rewrite stages/ (deletes files solutions/ lacks)
    python tools/make_skeleton.py --check    # exit 1 if stages/ is out of sync
"""

from __future__ import annotations

import argparse
import ast
import re
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SKIP_DIRS = {"__pycache__", ".pytest_cache", ".ipynb_checkpoints", ".mypy_cache"}
SKIP_SUFFIXES = {".pyc", ".pyo"}
STAGE_DIR = re.compile(r"s(\d\d)_\w+")
BEGIN = re.compile(r"^(\s*)# BEGIN EXERCISE: *(\S.*?)(?:\s+\[#([\w-]+)\])?\s*$")
END = re.compile(r"^(\s*)# END EXERCISE\s*$")
ANCHOR_LINE = re.compile(r"^(\s*)# \[#([\w-]+)\]\s*$")  # the anchor, when the marker line has no room for it
ANY_MARKER = re.compile(r"^\s*#\s*(BEGIN|END)\s+EXERCISE")
MAX_TASK_CHARS = 100  # the one line a marker (and so the raise) names the task in
LINE_LENGTH = 120  # pyproject.toml's [tool.ruff] line-length: a longer raise is written on three lines


class MarkerError(ValueError):
    """A malformed exercise marker; the message starts with file:line."""


def skeleton_source(text: str, where: str, stage: int | None, package: str) -> str:
    """Replace every marked region of one .py file's text; `where` names the file in errors."""
    out, origin, region = [], [], None  # origin: the source line of each output line
    source_lines = text.splitlines(keepends=True)
    for number, line in enumerate(source_lines, start=1):
        begin, end = BEGIN.match(line), END.match(line)
        if not (begin or end):
            if ANY_MARKER.match(line):
                raise MarkerError(
                    f"{where}:{number}: malformed marker {line.strip()!r}; write "
                    "'# BEGIN EXERCISE: <what to write>' or '# END EXERCISE'"
                )
            if region is None:
                out.append(line)
                origin.append(number)
        elif begin:
            if region is not None:
                raise MarkerError(
                    f"{where}:{number}: BEGIN EXERCISE inside the region opened at line {region[0]} (regions cannot "
                    "nest)"
                )
            if stage is None or stage == 0:
                raise MarkerError(f"{where}:{number}: exercise markers belong in a stage package s01_..s09_, not here")
            if len(begin.group(2)) > MAX_TASK_CHARS:
                raise MarkerError(
                    f"{where}:{number}: the task is {len(begin.group(2))} characters; name it in one line of at most "
                    f"{MAX_TASK_CHARS} and put the recipe in the README's 'If you are stuck' block"
                )
            anchor = begin.group(3)
            following = ANCHOR_LINE.match(source_lines[number]) if number < len(source_lines) else None
            if anchor is None and following and following.group(1) == begin.group(1):
                anchor = following.group(2)
            region = (number, begin.group(1), begin.group(2), anchor)  # line, indent, task, anchor
        else:
            if region is None:
                raise MarkerError(f"{where}:{number}: END EXERCISE without a BEGIN EXERCISE before it")
            opened, indent, what, anchor = region
            if end.group(1) != indent:
                raise MarkerError(f"{where}:{number}: END EXERCISE is not indented like its BEGIN at line {opened}")
            message = f"Stage {stage}: {what} - see stages/{package}/README.md" + (f"#{anchor}" if anchor else "")
            literal = '"' + message.replace("\\", "\\\\").replace('"', '\\"') + '"'
            newline = line[len(line.rstrip("\r\n")) :]
            raised = f"{indent}raise NotImplementedError({literal})"
            if len(raised) > LINE_LENGTH:  # as `ruff format` writes a call that does not fit one line
                message_line = f"{indent}    {literal}"
                if len(message_line) > LINE_LENGTH:
                    message_line += "  # noqa: E501 (one message, the learner's to read whole)"
                lines = [f"{indent}raise NotImplementedError(", message_line, f"{indent})"]
            else:
                lines = [raised]
            out.extend(line_ + newline for line_ in lines)
            origin.extend([opened] * len(lines))
            region = None
            dead_code_check(text.splitlines(), number, len(indent), where, opened)
    if region is not None:
        raise MarkerError(f"{where}:{region[0]}: BEGIN EXERCISE has no matching END EXERCISE")
    result = "".join(out)
    try:
        compile(result, where, "exec")
    except SyntaxError as err:
        at = origin[min(err.lineno or 1, len(origin)) - 1] if origin else 1
        raise MarkerError(
            f"{where}:{at}: the generated skeleton is not valid Python ({err.msg}); check the markers' placement"
        ) from None
    return mark_unused(keep_generators(text, result))


def _generators(tree: ast.AST) -> set[str]:
    """The qualified names of the functions whose own body yields."""
    return {name for name, function in _all_functions(tree).items() if _yields(function)}


def _yields(function: ast.AST) -> bool:
    stack = list(ast.iter_child_nodes(function))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Yield, ast.YieldFrom)):
            return True
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))
    return False


def keep_generators(solution: str, skeleton: str) -> str:
    """A generator whose every yield was in a removed region would become a plain function, and an
    async one would fail with a TypeError instead of the exercise's message: after its raise, a
    bare ``yield`` keeps it the kind of function it is (the raise comes when it is iterated)."""
    lost = _generators(ast.parse(solution)) - _generators(ast.parse(skeleton))
    if not lost:
        return skeleton
    lines = skeleton.splitlines(keepends=True)
    tree = ast.parse(skeleton)
    inserts = []
    for qualname, function in _all_functions(tree).items():
        last = function.body[-1]
        if qualname in lost and isinstance(last, ast.Raise) and last.end_lineno is not None:
            indent = lines[last.lineno - 1][: len(lines[last.lineno - 1]) - len(lines[last.lineno - 1].lstrip())]
            # Left after a learner's code, a bare yield would give one more item (None): say to delete it.
            note = f"keeps {function.name} a generator until you write it; delete this line then"
            inserts.append((last.end_lineno, f"{indent}yield  # {note}\n"))
    for after, line in sorted(inserts, reverse=True):
        lines.insert(after, line)
    return "".join(lines)


def _all_functions(tree: ast.AST) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    found: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    found[name] = child
                visit(child, name + ".")

    visit(tree, "")
    return found


def dead_code_check(lines: list[str], end_number: int, indent: int, where: str, opened: int) -> None:
    """Refuse code after a region in the same block: after the skeleton's raise it never runs."""
    for following in lines[end_number:]:
        stripped = following.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if len(following) - len(following.lstrip()) == indent:
            raise MarkerError(
                f"{where}:{opened}: code follows this region in the same block ({stripped[:60]!r}); after the "
                "skeleton's "
                "raise it would be dead code. End the region at the end of its block (take the code in)"
            )
        return


def _is_type_checking(test: ast.expr) -> bool:
    return isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"


def mark_unused(source: str) -> str:
    """Append ``# noqa: F401`` to imports and ``# noqa: F841`` to local assignments that only a
    removed region used, so the skeleton lints clean and the learner keeps them."""
    if "raise NotImplementedError(" not in source:
        return source
    tree = ast.parse(source)
    loaded = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Store)}
    for node in ast.walk(tree):  # names in quoted annotations count as used, as they do for pyflakes
        for annotation in _annotations(node):
            for sub in ast.walk(annotation):
                if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                    loaded.update(re.findall(r"[A-Za-z_]\w*", sub.value))
    marks: dict[int, str] = {}
    statements = list(tree.body)
    for statement in tree.body:  # imports under `if TYPE_CHECKING:` count too
        if isinstance(statement, ast.If) and _is_type_checking(statement.test):
            statements.extend(statement.body)
    for statement in statements:
        if isinstance(statement, (ast.Import, ast.ImportFrom)) and getattr(statement, "module", "") != "__future__":
            names = [(alias.asname or alias.name).split(".")[0] for alias in statement.names]
            if any(name not in loaded for name in names):
                marks[statement.lineno] = "F401"
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        used = {n.id for n in ast.walk(function) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Store)}
        for node in ast.walk(function):
            targets: list[ast.expr]
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets = [node.target]
            else:
                continue
            parts = [t for target in targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
            ids = [t.id for t in parts if isinstance(t, ast.Name)]
            if len(ids) == len(parts) and any(name not in used for name in ids):
                marks[node.lineno] = "F841"
    if not marks:
        return source
    lines = source.splitlines(keepends=True)
    for number, code in marks.items():
        line = lines[number - 1]
        body = line.rstrip("\r\n")
        lines[number - 1] = f"{body}  # noqa: {code}{line[len(body) :]}"
    return "".join(lines)


def _annotations(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.arg) and node.annotation is not None:
        return [node.annotation]
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns is not None:
        return [node.returns]
    if isinstance(node, ast.AnnAssign):
        return [node.annotation]
    return []


def source_files(root: Path) -> list[Path]:
    """Files under `root` that belong to the tree, sorted, as paths relative to it."""
    if not root.is_dir():
        return []
    found = []
    for path in root.rglob("*"):
        relative = path.relative_to(root)
        if path.is_file() and not SKIP_DIRS & set(relative.parts) and path.suffix not in SKIP_SUFFIXES:
            found.append(relative)
    return sorted(found)


def expected_tree(solutions: Path) -> dict[Path, bytes]:
    """What stages/ must hold: relative path -> content."""
    tree = {}
    for relative in source_files(solutions):
        data = (solutions / relative).read_bytes()
        if relative.suffix == ".py":
            package = relative.parts[0] if len(relative.parts) > 1 else ""
            match = STAGE_DIR.fullmatch(package)
            stage = int(match.group(1)) if match else None
            where = f"{solutions.name}/{relative.as_posix()}"
            data = skeleton_source(data.decode("utf-8"), where, stage, package).encode("utf-8")
        tree[relative] = data
    return tree


def differences(expected: dict[Path, bytes], stages: Path) -> list[str]:
    """One line per out-of-sync file of `stages`, in path order."""
    actual = set(source_files(stages))
    lines = []
    for relative in sorted(set(expected) | actual):
        shown = f"{stages.name}/{relative.as_posix()}"
        if relative not in actual:
            lines.append(f"missing: {shown}")
        elif relative not in expected:
            lines.append(f"extra:   {shown} (no counterpart in solutions/)")
        elif (stages / relative).read_bytes() != expected[relative]:
            lines.append(f"differs: {shown}")
    return lines


def write_tree(expected: dict[Path, bytes], stages: Path) -> list[str]:
    """Make `stages` hold exactly `expected`; touches only files that change."""
    changes = []
    for relative in source_files(stages):
        if relative not in expected:
            (stages / relative).unlink()
            changes.append(f"deleted {relative.as_posix()}")
    for relative, data in expected.items():
        target = stages / relative
        if not target.is_file() or target.read_bytes() != data:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            changes.append(f"wrote   {relative.as_posix()}")
    for folder in sorted((p for p in stages.rglob("*") if p.is_dir()), reverse=True):
        if not SKIP_DIRS & set(folder.relative_to(stages).parts) and not any(
            p for p in folder.iterdir() if p.name not in SKIP_DIRS
        ):
            shutil.rmtree(folder)  # a folder left with nothing but caches
    return changes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only report files out of sync; exit 1 if any")
    parser.add_argument("--solutions", type=Path, default=REPO / "solutions", help="source tree (default: solutions/)")
    parser.add_argument("--stages", type=Path, default=REPO / "stages", help="generated tree (default: stages/)")
    args = parser.parse_args(argv)

    try:
        expected = expected_tree(args.solutions)
    except MarkerError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    exercised = {r.parts[0] for r, data in expected.items() if data != (args.solutions / r).read_bytes()}
    for package in sorted(exercised):
        if Path(package, "README.md") not in expected:
            print(
                f"warning: {args.solutions.name}/{package}/README.md is missing (the lesson the skeleton points to)",
                file=sys.stderr,
            )

    if args.check:
        lines = differences(expected, args.stages)
        for line in lines:
            print(line)
        if lines:
            print(
                f"{args.stages.name}/ is out of sync with {args.solutions.name}/ ({len(lines)} files): "
                "run `make skeleton` (python tools/make_skeleton.py) to regenerate it"
            )
            return 1
        print(f"{args.stages.name}/ is in sync with {args.solutions.name}/ ({len(expected)} files)")
        return 0

    args.stages.mkdir(parents=True, exist_ok=True)
    changes = write_tree(expected, args.stages)
    for line in changes:
        print(line)
    print(f"{args.stages.name}/ generated from {args.solutions.name}/: {len(expected)} files, {len(changes)} changed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
