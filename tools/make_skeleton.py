"""Generate the learner's tree `stages/` from the reference tree `solutions/`.

Every file is copied as it is, except that in .py files each marked region

    <indent># BEGIN EXERCISE: <what to write>
    ...solution lines...
    <indent># END EXERCISE

becomes one line at the marker's indentation:

    <indent>raise NotImplementedError("Stage N: <what to write> - see stages/sNN_name/README.md")

So nobody edits stages/ by hand: change solutions/ and regenerate.

    python tools/make_skeleton.py            # rewrite stages/ (deletes files solutions/ lacks)
    python tools/make_skeleton.py --check    # exit 1 if stages/ is out of sync
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SKIP_DIRS = {"__pycache__", ".pytest_cache", ".ipynb_checkpoints", ".mypy_cache"}
SKIP_SUFFIXES = {".pyc", ".pyo"}
STAGE_DIR = re.compile(r"s(\d\d)_\w+")
BEGIN = re.compile(r"^(\s*)# BEGIN EXERCISE: *(\S.*?)\s*$")
END = re.compile(r"^(\s*)# END EXERCISE\s*$")
ANY_MARKER = re.compile(r"^\s*#\s*(BEGIN|END)\s+EXERCISE")


class MarkerError(ValueError):
    """A malformed exercise marker; the message starts with file:line."""


def skeleton_source(text: str, where: str, stage: int | None, package: str) -> str:
    """Replace every marked region of one .py file's text; `where` names the file in errors."""
    out, origin, region = [], [], None  # origin: the source line of each output line
    for number, line in enumerate(text.splitlines(keepends=True), start=1):
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
                raise MarkerError(f"{where}:{number}: BEGIN EXERCISE inside the region opened at line {region[0]} (regions cannot nest)")
            if stage is None or stage == 0:
                raise MarkerError(f"{where}:{number}: exercise markers belong in a stage package s01_..s09_, not here")
            region = (number, begin.group(1), begin.group(2))  # line, indent, what to write
        else:
            if region is None:
                raise MarkerError(f"{where}:{number}: END EXERCISE without a BEGIN EXERCISE before it")
            opened, indent, what = region
            if end.group(1) != indent:
                raise MarkerError(f"{where}:{number}: END EXERCISE is not indented like its BEGIN at line {opened}")
            message = f"Stage {stage}: {what} - see stages/{package}/README.md"
            literal = '"' + message.replace("\\", "\\\\").replace('"', '\\"') + '"'
            newline = line[len(line.rstrip("\r\n")):]
            out.append(f"{indent}raise NotImplementedError({literal}){newline}")
            origin.append(opened)
            region = None
    if region is not None:
        raise MarkerError(f"{where}:{region[0]}: BEGIN EXERCISE has no matching END EXERCISE")
    result = "".join(out)
    try:
        compile(result, where, "exec")
    except SyntaxError as err:
        line = origin[min(err.lineno or 1, len(origin)) - 1] if origin else 1
        raise MarkerError(f"{where}:{line}: the generated skeleton is not valid Python ({err.msg}); check the markers' placement") from None
    return result


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
            print(f"warning: {args.solutions.name}/{package}/README.md is missing (the lesson the skeleton points to)", file=sys.stderr)

    if args.check:
        lines = differences(expected, args.stages)
        for line in lines:
            print(line)
        if lines:
            print(f"{args.stages.name}/ is out of sync with {args.solutions.name}/ ({len(lines)} files): "
                  "run `make skeleton` (python tools/make_skeleton.py) to regenerate it")
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
