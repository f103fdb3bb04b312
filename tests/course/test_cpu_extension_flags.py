"""How s00 cpu_extension.py falls back when a compiler refuses a flag (not graded: provided code).

``cpp_extension.load`` is replaced by a stand-in that plays a compiler, so nothing is compiled:
a compiler without OpenMP (Apple's clang, clang without libomp) must still get ``-march=native``
and be told it runs on one thread; one that takes no tuning flags gets plain ``-O3``; one that
builds nothing is reported with every attempt's reason, and the caller gets no exception."""

from __future__ import annotations

import pytest
from torch.utils import cpp_extension

from s00_foundation import cpu_extension


@pytest.fixture
def compiler(monkeypatch, tmp_path):
    """Install a stand-in compiler that refuses the flags in ``refused``; returns (refused, attempts)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv(cpu_extension.OFF, raising=False)
    monkeypatch.setattr(cpu_extension.shutil, "which", lambda name: f"/usr/bin/{name}")
    refused: set[str] = set()
    attempts: list[list[str]] = []

    def load(**kwargs):
        flags = kwargs["extra_cflags"]
        attempts.append(flags)
        bad = refused.intersection(flags)
        if bad:
            raise RuntimeError(f"Error building extension: unsupported option {sorted(bad)[0]}")
        assert kwargs["extra_ldflags"] == [f for f in flags if f == "-fopenmp"], "links OpenMP only when built with it"

    monkeypatch.setattr(cpp_extension, "load", load)
    return refused, attempts


def source(tmp_path):
    path = tmp_path / "kernel.cpp"
    path.write_text("// a kernel\n")
    return [path]


def test_a_compiler_with_everything_gets_openmp_and_the_cpu_s_vector_units(compiler, tmp_path):
    refused, attempts = compiler
    assert cpu_extension.build("k", source(tmp_path)) == (True, "-O3 -march=native -fopenmp")
    assert len(attempts) == 1


def test_without_openmp_the_vector_units_stay_and_the_one_thread_is_said(compiler, tmp_path):
    refused, attempts = compiler
    refused.add("-fopenmp")
    loaded, how = cpu_extension.build("k", source(tmp_path))
    assert loaded and how == "-O3 -march=native (no OpenMP: one thread)"
    assert attempts[-1] == ["-O3", "-march=native"]


def test_a_compiler_that_knows_no_native_tuning_gets_plain_o3(compiler, tmp_path):
    refused, attempts = compiler
    refused.add("-march=native")
    assert cpu_extension.build("k", source(tmp_path)) == (True, "-O3 (no OpenMP: one thread)")
    assert attempts == list(map(list, cpu_extension.FLAG_SETS))


def test_a_compiler_that_builds_nothing_is_reported_not_raised(compiler, tmp_path):
    refused, attempts = compiler
    refused.add("-O3")
    loaded, how = cpu_extension.build("k", source(tmp_path))
    assert not loaded
    assert how.startswith("the build failed (") and how.count("unsupported option") == len(cpu_extension.FLAG_SETS)
