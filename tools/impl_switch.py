"""The implementation switch: which tree each stage package is imported from.

Every stage is a top-level package (`s01_naive_generate`, `s02_request_and_sampling`, ...)
that lives twice: in `solutions/` (the reference) and in `stages/` (the learner's copy).
Code always imports them by their bare name, so one finder on `sys.meta_path` decides,
per package, which tree answers:

    ENGINE_IMPL=solutions|stages   the tree under test (default: solutions)
    ENGINE_REFERENCE_UPTO=K        stages <= K still come from solutions (default 0:
                                   s00_foundation is always the provided copy)
    ENGINE_STAGES_DIR=DIR          where the `stages` tree is (default <repo>/stages;
                                   an instructor points it at a student's checkout)
    ENGINE_SOLUTIONS_DIR=DIR       where the `solutions` tree is (default <repo>/solutions;
                                   only the course's own machinery tests change it)

`install()` puts the finder in place; tests/conftest.py calls it before any engine import.
It also exports the settings and puts `tools/switch_site/` (whose sitecustomize.py calls
`install()`) on PYTHONPATH, so child processes - `python -m ...` in a test, multiprocessing
workers of the serving stage, notebook kernels - import from the same trees as their parent.

As a launcher it runs a stage's milestone (`python -m <package>`) from the selected trees:

    python tools/impl_switch.py run 3 [args]             # or: run s03_kv_cache [args]
    python tools/impl_switch.py describe                 # one line: what is under test
"""

from __future__ import annotations

import importlib.machinery
import os
import re
import runpy
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SWITCH_SITE = Path(__file__).resolve().parent / "switch_site"
SWITCH_VARS = (
    "ENGINE_IMPL",
    "ENGINE_REFERENCE_UPTO",
    "ENGINE_STAGES_DIR",
    "ENGINE_SOLUTIONS_DIR",
)  # the settings read below
IMPLS = {"solutions": "the reference code (default)", "stages": "your code in stages/"}
STAGE_PACKAGE = re.compile(r"s(\d\d)_\w+")


class SwitchError(ValueError):
    """A switch setting that cannot be used; the message says which and what is allowed."""


@dataclass(frozen=True)
class Switch:
    impl: str
    reference_upto: int
    stages_dir: Path
    solutions_dir: Path

    @classmethod
    def from_env(cls, environ=None, repo: Path = REPO) -> "Switch":
        """Read and check the ENGINE_* variables (an empty value counts as unset)."""
        env = os.environ if environ is None else environ

        def get(name):
            return env.get(name, "").strip() or None

        impl = get("ENGINE_IMPL") or "solutions"
        if impl not in IMPLS:
            allowed = ", ".join(f"{name} ({what})" for name, what in IMPLS.items())
            raise SwitchError(f"ENGINE_IMPL={impl!r} is not valid; allowed values: {allowed}")

        upto_text = get("ENGINE_REFERENCE_UPTO") or "0"
        if not upto_text.isdigit():
            raise SwitchError(
                f"ENGINE_REFERENCE_UPTO={upto_text!r} is not valid; use a stage number K >= 0 "
                "(stages 0..K are then taken from solutions/)"
            )

        def tree(name, default):
            path = Path(get(name) or default).expanduser().resolve()
            if impl == "stages" and not path.is_dir():
                raise SwitchError(f"{name}={str(path)!r} is not a directory")
            return path

        return cls(
            impl=impl,
            reference_upto=int(upto_text),
            stages_dir=tree("ENGINE_STAGES_DIR", repo / "stages"),
            solutions_dir=tree("ENGINE_SOLUTIONS_DIR", repo / "solutions"),
        )

    def tree_for(self, stage: int) -> tuple[str, Path]:
        """(name, directory) of the tree that stage number `stage` is imported from."""
        if self.impl == "solutions" or stage <= self.reference_upto:
            return "solutions", self.solutions_dir
        return "stages", self.stages_dir

    def describe(self) -> str:
        """One line for humans, e.g. pytest's header."""
        if self.impl == "solutions":
            return f"engine under test: solutions (reference code in {self.solutions_dir})"
        k = self.reference_upto
        borrowed = "s00_foundation" if k == 0 else f"stages 0-{k}"
        return f"engine under test: stages ({self.stages_dir}; {borrowed} from solutions)"

    def sources(self) -> dict[str, str]:
        """Every stage package found in either tree -> the path it is imported from."""
        names = {
            p.name
            for root in (self.solutions_dir, self.stages_dir)
            if root.is_dir()
            for p in root.iterdir()
            if p.is_dir() and STAGE_PACKAGE.fullmatch(p.name)
        }
        return {name: str(self.tree_for(int(name[1:3]))[1] / name) for name in sorted(names)}

    def to_env(self) -> dict[str, str]:
        """The settings as absolute ENGINE_* values, for child processes."""
        return {
            "ENGINE_IMPL": self.impl,
            "ENGINE_REFERENCE_UPTO": str(self.reference_upto),
            "ENGINE_STAGES_DIR": str(self.stages_dir),
            "ENGINE_SOLUTIONS_DIR": str(self.solutions_dir),
        }


class StageFinder:
    """A sys.meta_path finder for top-level `sNN_*` packages: look only in the selected tree.

    A package missing from its tree is an error rather than a fall-through to sys.path,
    so a test can never silently run the other tree's code.
    """

    is_engine_switch = True  # lets install() replace a finder made by another copy of this module

    def __init__(self, switch: Switch):
        self.switch = switch

    def find_spec(self, fullname, path=None, target=None):
        match = STAGE_PACKAGE.fullmatch(fullname)
        if path is not None or match is None:
            return None  # submodules are found by their package's own __path__
        tree_name, tree = self.switch.tree_for(int(match.group(1)))
        spec = importlib.machinery.PathFinder.find_spec(fullname, [str(tree)])
        if spec is None:
            raise ModuleNotFoundError(
                f"No module named {fullname!r} in the {tree_name} tree ({tree}); {self.switch.describe()}",
                name=fullname,
            )
        return spec


def install(switch: Switch | None = None, propagate: bool = True) -> Switch:
    """Put the finder first on sys.meta_path (replacing an earlier one) and return the switch.

    With `propagate`, child processes inherit it: the resolved settings go into os.environ
    and tools/switch_site/ goes on PYTHONPATH.
    """
    switch = switch or Switch.from_env()
    wrong = []
    for name, module in list(sys.modules.items()):
        match = STAGE_PACKAGE.fullmatch(name)
        file = getattr(module, "__file__", None)
        if match and file and not Path(file).resolve().is_relative_to(switch.tree_for(int(match.group(1)))[1]):
            wrong.append(f"{name} ({file})")
    if wrong:
        raise SwitchError("already imported from another tree before the switch: " + ", ".join(wrong))

    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "is_engine_switch", False)]
    sys.meta_path.insert(0, StageFinder(switch))
    if propagate:
        os.environ.update(switch.to_env())
        paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        if str(SWITCH_SITE) not in paths:
            os.environ["PYTHONPATH"] = os.pathsep.join([str(SWITCH_SITE), *paths])
    return switch


def stage_package(stage: str, switch: Switch) -> str:
    """'3' or 's03_kv_cache' -> 's03_kv_cache' (looked up in the tree stage 3 comes from)."""
    if STAGE_PACKAGE.fullmatch(stage):
        return stage
    if not stage.isdigit():
        raise SwitchError(f"{stage!r} is neither a stage number nor a package name like s03_kv_cache")
    tree = switch.tree_for(int(stage))[1]
    found = sorted(p.name for p in tree.glob(f"s{int(stage):02d}_*") if p.is_dir())
    if not found:
        raise SwitchError(f"no package for stage {stage} in {tree}")
    return found[0]


def earlier_stage_hint(package: str, message: str) -> str:
    """For an exercise of an earlier stage than the milestone's: how to run it without that stage."""
    found = re.match(r"Stage (\d+)", message)
    stage = int(package[1:3])
    if found is None or int(found.group(1)) >= stage:
        return ""
    return (
        f"\n   (stage {found.group(1)} comes before stage {stage}: finish it, or run stage {stage} on the reference "
        f"stages 1-{stage - 1}: make run-{stage} REFERENCE_UPTO={stage - 1})"
    )


def stage_9_server_of_your_own(package: str, switch: Switch, args: list[str]) -> bool:
    """Whether this runs the learner's stage 9 server with no overlap flag, stages 10-11 theirs too."""
    overlap_flags = {"--disable-overlap", "--enable-overlap"}
    return (
        package.startswith("s09_")
        and switch.impl == "stages"
        and switch.reference_upto < 10
        and not overlap_flags & set(args)
    )


def main(argv: list[str]) -> int:
    usage = "usage: impl_switch.py run STAGE|PACKAGE [ARGS...]  |  impl_switch.py describe"
    try:
        if argv[:1] == ["describe"]:
            print(Switch.from_env().describe())
            return 0
        if argv[:1] != ["run"] or len(argv) < 2:
            print(usage, file=sys.stderr)
            return 2
        switch = install()
        package = stage_package(argv[1], switch)
    except SwitchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"[{package}] {switch.describe()}", file=sys.stderr)
    args = argv[2:]
    if stage_9_server_of_your_own(package, switch, args):
        # Its server would build the newest engine (stage 11's, overlapped), so every request of a
        # learner who has not written stages 10-11 would fail: stage 9's milestone serves stage 8's
        # engine, as its tests do.
        args.append("--disable-overlap")
        print(
            f"[{package}] serving stage 8's engine, as stage 9's tests do (--disable-overlap; once stages 10-11 are "
            "written, ARGS=--enable-overlap serves the newest)",
            file=sys.stderr,
        )
    sys.argv = [package, *args]
    sys.path[0] = os.getcwd()  # as `python -m` would have it, not tools/
    try:
        runpy.run_module(package, run_name="__main__", alter_sys=True)
    except NotImplementedError as err:
        if not str(err).startswith("Stage "):
            raise
        print(f"not written yet -> {err}{earlier_stage_hint(package, str(err))}", file=sys.stderr)  # not a crash
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
