"""The implementation switch loads each stage package from the tree it says (not graded).

Two tiny fake trees stand in for solutions/ and stages/; a fresh Python process per case
imports from them under given ENGINE_* settings and reports where each module came from.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from impl_switch import SWITCH_VARS

REPO = Path(__file__).resolve().parents[2]
TOOLS = REPO / "tools"

REPORT = f"""
import json, sys
sys.path.insert(0, {str(TOOLS)!r})
import impl_switch
switch = impl_switch.install()
import s97_alpha, s98_fake
print(json.dumps({{"alpha": s97_alpha.__file__, "fake": s98_fake.__file__,
                   "fake_sees_alpha_from": s98_fake.ALPHA_TREE, "describe": switch.describe()}}))
"""


@pytest.fixture
def trees(tmp_path):
    """tmp/solutions and tmp/stages, each with s97_alpha and s98_fake saying which tree they are."""
    for tree in ("solutions", "stages"):
        (tmp_path / tree / "s97_alpha").mkdir(parents=True)
        (tmp_path / tree / "s97_alpha" / "__init__.py").write_text(f"TREE = {tree!r}\n")
        fake = tmp_path / tree / "s98_fake"
        fake.mkdir()
        # a later stage imports an earlier one by its bare name, as the course's stages do
        (fake / "__init__.py").write_text("from s97_alpha import TREE as ALPHA_TREE\n")
        (fake / "__main__.py").write_text(f"import sys\nprint('milestone of the {tree} tree', sys.argv[1:])\n")
    return tmp_path


def clean_env(trees: Path, **settings: str) -> dict[str, str]:
    """The environment without inherited switch settings, pointing at the fake trees."""
    env = {k: v for k, v in os.environ.items() if k not in SWITCH_VARS and k != "PYTHONPATH"}
    env.update(ENGINE_SOLUTIONS_DIR=str(trees / "solutions"), ENGINE_STAGES_DIR=str(trees / "stages"))
    env.update(settings)
    return env


def run_python(code: str, env: dict[str, str], cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True, timeout=120)


def where(trees: Path, **settings: str) -> dict:
    done = run_python(REPORT, clean_env(trees, **settings))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def tree_of(trees: Path, file: str) -> str:
    return Path(file).resolve().relative_to(trees.resolve()).parts[0]


@pytest.mark.parametrize(
    "settings, alpha, fake",
    [
        ({}, "solutions", "solutions"),
        ({"ENGINE_IMPL": "solutions"}, "solutions", "solutions"),
        ({"ENGINE_IMPL": "solutions", "ENGINE_REFERENCE_UPTO": "97"}, "solutions", "solutions"),
        ({"ENGINE_IMPL": "stages"}, "stages", "stages"),
        ({"ENGINE_IMPL": "stages", "ENGINE_REFERENCE_UPTO": ""}, "stages", "stages"),
        ({"ENGINE_IMPL": "stages", "ENGINE_REFERENCE_UPTO": "97"}, "solutions", "stages"),
        ({"ENGINE_IMPL": "stages", "ENGINE_REFERENCE_UPTO": "98"}, "solutions", "solutions"),
    ],
)
def test_each_package_comes_from_the_selected_tree(trees, settings, alpha, fake):
    got = where(trees, **settings)
    assert tree_of(trees, got["alpha"]) == alpha, f"s97_alpha under {settings}: {got['alpha']}"
    assert tree_of(trees, got["fake"]) == fake, f"s98_fake under {settings}: {got['fake']}"
    assert got["fake_sees_alpha_from"] == alpha, (
        "a stage importing an earlier one must get the earlier one's selected tree"
    )


def test_describe_says_what_is_under_test(trees):
    assert where(trees)["describe"].startswith("engine under test: solutions")
    mixed = where(trees, ENGINE_IMPL="stages", ENGINE_REFERENCE_UPTO="3")["describe"]
    assert mixed.startswith("engine under test: stages") and "stages 0-3 from solutions" in mixed
    plain = where(trees, ENGINE_IMPL="stages")["describe"]
    assert "s00_foundation from solutions" in plain


def test_sources_maps_every_package_to_its_tree(trees):
    code = (
        f"import sys, json; sys.path.insert(0, {str(TOOLS)!r}); import impl_switch; "
        "print(json.dumps(impl_switch.Switch.from_env().sources()))"
    )
    done = run_python(code, clean_env(trees, ENGINE_IMPL="stages", ENGINE_REFERENCE_UPTO="97"))
    assert done.returncode == 0, done.stderr
    sources = json.loads(done.stdout)
    assert sources == {
        "s97_alpha": str(trees.resolve() / "solutions" / "s97_alpha"),
        "s98_fake": str(trees.resolve() / "stages" / "s98_fake"),
    }


@pytest.mark.parametrize(
    "settings, expected",
    [
        ({"ENGINE_IMPL": "foo"}, ["ENGINE_IMPL='foo' is not valid", "allowed values", "solutions", "stages"]),
        (
            {"ENGINE_IMPL": "stages", "ENGINE_REFERENCE_UPTO": "two"},
            ["ENGINE_REFERENCE_UPTO='two' is not valid", "K >= 0"],
        ),
        ({"ENGINE_IMPL": "stages", "ENGINE_REFERENCE_UPTO": "-1"}, ["ENGINE_REFERENCE_UPTO='-1' is not valid"]),
        (
            {"ENGINE_IMPL": "stages", "ENGINE_STAGES_DIR": "/no/such/dir"},
            ["ENGINE_STAGES_DIR='/no/such/dir' is not a directory"],
        ),
    ],
)
def test_bad_settings_are_refused_with_a_clear_message(trees, settings, expected):
    done = run_python(REPORT, clean_env(trees, **settings))
    assert done.returncode != 0, f"{settings} should be refused"
    for text in expected:
        assert text in done.stderr, f"the error for {settings} should say {text!r}; got:\n{done.stderr}"


def test_a_package_missing_from_its_tree_does_not_fall_back_to_the_other(trees):
    (trees / "stages" / "s98_fake" / "__init__.py").unlink()
    (trees / "stages" / "s98_fake" / "__main__.py").unlink()
    (trees / "stages" / "s98_fake").rmdir()
    # even with solutions/ on sys.path, the switch must not quietly load the reference
    code = f"import sys; sys.path.insert(0, {str(trees / 'solutions')!r})\n" + REPORT
    done = run_python(code, clean_env(trees, ENGINE_IMPL="stages"))
    assert done.returncode != 0
    assert "No module named 's98_fake' in the stages tree" in done.stderr, done.stderr


def test_install_refuses_when_a_package_was_already_imported_from_the_other_tree(trees):
    code = (
        f"import sys; sys.path.insert(0, {str(trees / 'solutions')!r}); import s97_alpha\n"
        f"sys.path.insert(0, {str(TOOLS)!r}); import impl_switch; impl_switch.install()"
    )
    done = run_python(code, clean_env(trees, ENGINE_IMPL="stages"))
    assert done.returncode != 0 and "already imported from another tree" in done.stderr, done.stderr


def test_child_processes_inherit_the_switch(trees):
    code = f"""
import subprocess, sys, multiprocessing

def spawned(queue):
    import s98_fake  # this process never called install(): tools/switch_site did
    queue.put(s98_fake.__file__)

if __name__ == "__main__":
    sys.path.insert(0, {str(TOOLS)!r})
    import impl_switch
    impl_switch.install()
    subprocess.run([sys.executable, "-c", "import s98_fake; print('child', s98_fake.__file__)"], check=True)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    worker = ctx.Process(target=spawned, args=(queue,))
    worker.start()
    print("spawned", queue.get(timeout=60))
    worker.join()
"""
    script = trees / "parent.py"
    script.write_text(code)
    env = clean_env(trees, ENGINE_IMPL="stages", ENGINE_REFERENCE_UPTO="97")
    done = subprocess.run(
        [sys.executable, str(script)], env=env, cwd=trees, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert tree_of(trees, lines["child"]) == "stages", done.stdout
    assert tree_of(trees, lines["spawned"]) == "stages", done.stdout


@pytest.mark.parametrize("stage", ["98", "s98_fake"])
def test_launcher_runs_the_milestone_of_the_selected_tree(trees, stage):
    command = [sys.executable, str(TOOLS / "impl_switch.py"), "run", stage, "--flag", "x"]
    for impl in ("stages", "solutions"):
        done = subprocess.run(
            command, env=clean_env(trees, ENGINE_IMPL=impl), cwd=trees, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == f"milestone of the {impl} tree ['--flag', 'x']"


def test_launcher_explains_an_unknown_stage(trees):
    command = [sys.executable, str(TOOLS / "impl_switch.py"), "run", "42"]
    done = subprocess.run(
        command, env=clean_env(trees, ENGINE_IMPL="stages"), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and "no package for stage 42" in done.stderr, done.stderr


def test_a_milestone_stopped_by_an_earlier_stages_exercise_says_how_to_run_it_on_the_reference(trees):
    """A learner who graded stage 98 with REFERENCE_UPTO=97 and then ran its milestone without it
    was told only that stage 97 was not written."""
    (trees / "stages" / "s97_alpha" / "__init__.py").write_text(
        "TREE = 'stages'\n\n\ndef unwritten():\n    raise NotImplementedError('Stage 97: write alpha')\n"
    )
    (trees / "stages" / "s98_fake" / "__main__.py").write_text("import s97_alpha\ns97_alpha.unwritten()\n")
    command = [sys.executable, str(TOOLS / "impl_switch.py"), "run", "98"]
    done = subprocess.run(
        command, env=clean_env(trees, ENGINE_IMPL="stages"), cwd=trees, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1, done.stderr
    assert "not written yet -> Stage 97: write alpha" in done.stderr, done.stderr
    assert "make run-98 REFERENCE_UPTO=97" in done.stderr, done.stderr


def test_a_learners_stage_9_milestone_serves_stage_8s_engine_until_told_otherwise(tmp_path):
    """Its server would build stage 11's engine: a learner at stage 9 has no stages 10-11 yet, and
    every request failed with 'not written yet -> Stage 10'."""
    from impl_switch import Switch, stage_9_server_of_your_own

    def switch(impl: str, upto: int) -> Switch:
        return Switch(impl=impl, reference_upto=upto, solutions_dir=tmp_path, stages_dir=tmp_path)

    assert stage_9_server_of_your_own("s09_zmq_serving", switch("stages", 0), ["--port", "8000"])
    assert stage_9_server_of_your_own("s09_zmq_serving", switch("stages", 8), [])
    assert not stage_9_server_of_your_own("s09_zmq_serving", switch("stages", 11), [])  # 10-11 the reference's
    assert not stage_9_server_of_your_own("s09_zmq_serving", switch("solutions", 0), [])  # make serve, make demo
    assert not stage_9_server_of_your_own("s09_zmq_serving", switch("stages", 0), ["--enable-overlap"])
    assert not stage_9_server_of_your_own("s10_overlap_scheduling", switch("stages", 0), [])
