"""Building the course's C++ CPU kernels: ``torch.utils.cpp_extension`` compiles them with the
machine's own C++ compiler the first time they are needed, and torch registers their operators.

The build takes seconds and is cached under ``~/.cache/torch_extensions`` (or
``TORCH_EXTENSIONS_DIR``), in a folder named by what it is built from: the sources, the shared
header, this Python and this torch. A later process with the same sources finds it and only loads
it, whichever copy of the course they come from (solutions/, stages/, a grader's temporary
skeleton: the sources are copied into that folder and built there), and a changed source gets a
folder and a build of its own. Where there is no compiler, the build fails, or
``ENGINE_CPU_KERNELS=off`` is set, ``build`` says why and the callers keep their plain PyTorch path:
the same results, a little slower. Used by s00 cpu_ops.py (norms, SiLU, RoPE) and s08
decode_kernel.py (attention).

One process at a time builds or loads in a folder, under a lock the operating system drops when its
holder dies: ``cpp_extension``'s own lock is a file it deletes when it is done, so a process killed
in between (a server stopped while it starts) would leave every later one waiting for it forever.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Iterator

OFF = "ENGINE_CPU_KERNELS"  # set to "off" to build and use none of them
INCLUDE, HEADER = Path(__file__).parent, "cpu_kernel.h"  # what every kernel includes: vectors, exp, threads
# First choice: tuned for this CPU's vector units and threaded by OpenMP like torch itself. Without
# OpenMP (Apple's clang, or clang without libomp) at::parallel_for runs a kernel on one thread, and
# the vector units still pay (clang 14 built the decode kernel 1.25-1.36x faster for AVX-512 than
# with -O3 alone); last, flags any C++17 compiler takes.
FLAG_SETS = (["-O3", "-march=native", "-fopenmp"], ["-O3", "-march=native"], ["-O3"])


def switched_off(name: str = OFF) -> str | None:
    """Why the environment variable ``name`` turns kernels off ("off (NAME=off)"), or None."""
    value = os.environ.get(name, "")
    return f"off ({name}={value})" if value.lower() in ("0", "off", "false", "no") else None


def build(name: str, sources: list[Path], extra_flags: tuple[str, ...] = ()) -> tuple[bool, str]:
    """Compile (or find in the cache) and load the library ``name`` from ``sources``; never raises.
    Returns (loaded, how): the flags it was built with, or why it is not there."""
    reason = switched_off()
    if reason is not None:
        return False, reason
    try:
        from torch.utils import cpp_extension
    except ImportError as error:  # a torch build without its C++ tooling
        return False, f"torch.utils.cpp_extension is missing ({error})"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return False, "no C++ compiler (install g++ or clang, or set CXX)"
    where = build_folder(name, [*sources, INCLUDE / HEADER])
    failures = []
    with ninja_on_path(), alone_in(where, name):
        for flags in FLAG_SETS:
            openmp = "-fopenmp" in flags
            try:
                cpp_extension.load(
                    name=name,
                    sources=[str(where / source.name) for source in sources],
                    extra_cflags=[*flags, *extra_flags],
                    extra_ldflags=["-fopenmp"] if openmp else [],
                    build_directory=str(where),
                    is_python_module=False,
                    verbose=False,
                )
                return True, " ".join(flags) + ("" if openmp else " (no OpenMP: one thread)")
            except Exception as error:  # noqa: BLE001 - a build that fails for any reason falls back
                failures.append(f"{' '.join(flags)}: {str(error).strip().splitlines()[-1][:200]}")
    return False, "the build failed (" + "; ".join(failures) + ")"


def build_folder(name: str, files: list[Path]) -> Path:
    """The cache folder for library ``name`` built from ``files`` (copied into it, each written
    whole and then renamed, so that processes building at once never see half a file)."""
    import torch

    # Keyed by the torch installation too, not only its version: the build file cpp_extension
    # writes names torch's include folder, so two checkouts (each its own venv) sharing one folder
    # would rewrite it in turn, and each would rebuild while the other waited on the lock.
    digest = hashlib.sha256(f"{sys.version_info[:2]} {torch.__version__} {Path(torch.__file__).parent}".encode())
    for f in files:
        digest.update(f.name.encode() + b"\0" + f.read_bytes())
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    where = root / f"{name}-{digest.hexdigest()[:16]}"
    where.mkdir(parents=True, exist_ok=True)
    for f in files:
        target = where / f.name
        if not target.exists() or target.read_bytes() != f.read_bytes():
            partial = where / f".{f.name}.{os.getpid()}"
            shutil.copyfile(f, partial)
            os.replace(partial, target)
    return where


@contextlib.contextmanager
def alone_in(where: Path, name: str, note_after_s: float = 5.0) -> Iterator[None]:
    """Be the only process building or loading in ``where``, under an ``flock``: the operating
    system releases it when its holder exits, however it exits. While it is held no other process
    is inside ``cpp_extension`` here, so the file cpp_extension locks with (``where/lock``, deleted
    when its build finishes) can only be one left by a process that was killed mid-build: it is
    removed, where cpp_extension would wait for it to go away forever."""
    try:
        import fcntl
    except ImportError:  # Windows: cpp_extension's own lock file only
        yield
        return
    with open(where / "flock", "w") as handle:
        started, said = time.monotonic(), False
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:  # another process is building (a first build takes seconds)
                if not said and time.monotonic() - started > note_after_s:
                    print(
                        f"[{name}] waiting for another process building or loading it in {where}",
                        file=sys.stderr,
                        flush=True,
                    )
                    said = True
                time.sleep(0.05)
        (where / "lock").unlink(missing_ok=True)
        yield  # the flock goes with the file's closing


@contextlib.contextmanager
def ninja_on_path() -> Iterator[None]:
    """``cpp_extension`` runs the ``ninja`` build tool by name: when it is not on PATH (a venv that
    is not activated), put the pip package's copy there for the build, and take it off again."""
    saved = os.environ.get("PATH", "")
    if shutil.which("ninja") is None:
        try:
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + saved
        except ImportError:
            pass  # then cpp_extension says that ninja is missing, and build() passes that on
    try:
        yield
    finally:
        os.environ["PATH"] = saved
