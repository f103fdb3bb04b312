"""The mutation check's catalogue still applies to the current solutions (not graded).

`make mutants` plants each realistic learner bug of tools/mutants.py into a copy of solutions/
and runs its stage's graded tests; that takes about half an hour, so CI only checks that
every mutant still applies: its old text is found once, inside an exercise region, the mutated
file compiles, every stage keeps at least five mutants, and every exercise region has a mutant."""

from __future__ import annotations

import pytest

import mutants


def test_every_mutant_applies_to_the_solutions():
    problems = mutants.check_all(mutants.REPO / "solutions")
    assert not problems, "tools/mutants.py no longer fits solutions/; update the mutants:\n  " + "\n  ".join(problems)


def test_an_edit_outside_an_exercise_region_is_refused():
    text = "def f():\n    x = 1\n    # BEGIN EXERCISE: return two\n    return 2\n    # END EXERCISE\n"
    inside = mutants.Mutant("t", "s01_x/f.py", "idea", mutants.edit("return 2", "return 3"), "two")
    assert "return 3" in mutants.mutate(inside, text)
    for old in ("x = 1", "return"):  # outside the region; found twice
        with pytest.raises(ValueError):
            mutants.mutate(mutants.Mutant("t", "s01_x/f.py", "idea", mutants.edit(old, "pass"), "two"), text)


def test_an_exercise_region_without_a_mutant_is_reported(tmp_path):
    # A stage-1 file with one region no mutant names: the catalogue's check must say where it is.
    (tmp_path / "s01_x").mkdir()
    text = "def f():\n    # BEGIN EXERCISE: return two [#anchor]\n    return 2\n    # END EXERCISE\n"
    (tmp_path / "s01_x" / "f.py").write_text(text)
    assert mutants.unmutated_regions(tmp_path) == [
        "solutions/s01_x/f.py:2: no mutant edits the exercise region 'return two'"
    ]
