"""Check that this machine can run the course; one line per check.

[OK]   a required check passed
[FAIL] a required check failed (the line says how to fix it); exit status 1
[--]   optional or informational (no GPU, say: then everything runs on the CPU)

python tools/check_env.py        (ENGINE_REQUIRE_GPU=1 makes a CUDA GPU required)
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "models" / "SmolLM2-135M-Instruct"
MIN_PYTHON = (3, 10)


def report(status: str, text: str) -> bool:
    print(f"{'[' + status + ']':<7}{text}", flush=True)
    return status != "FAIL"


def check_python() -> bool:
    version = ".".join(map(str, sys.version_info[:3]))
    if sys.version_info < MIN_PYTHON:
        return report("FAIL", f"Python {version}: need >= 3.10 (make setup builds .venv with python3)")
    return report("OK", f"Python {version} ({sys.executable})")


def check_packages() -> bool:
    """Every dependency of pyproject.toml installed, in a version it allows."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        return report("--", "packages: not checked (needs Python >= 3.11 to read pyproject.toml)")
    from packaging.requirements import Requirement

    requirements = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    bad = []
    for line in requirements:
        requirement = Requirement(line)
        try:
            installed = importlib.metadata.version(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            bad.append(f"{requirement.name} missing")
            continue
        if not requirement.specifier.contains(installed.split("+")[0], prereleases=True):
            bad.append(f"{requirement.name} {installed} (want {requirement.specifier})")
    if bad:
        return report("FAIL", f"packages: {'; '.join(bad)} -> run `make setup`")
    return report("OK", f"packages: all {len(requirements)} dependencies of pyproject.toml installed")


def check_torch() -> tuple[bool, object]:
    try:
        import torch
    except ImportError:
        return report("FAIL", "torch is not installed -> run `make setup`"), None
    # Its version is checked with the other packages, against pyproject.toml's pin.
    return report("OK", f"torch {torch.__version__}"), torch


def check_cuda(torch) -> bool:
    required = os.environ.get("ENGINE_REQUIRE_GPU", "") not in ("", "0")
    if torch is not None and torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        return report("OK", f"CUDA {torch.version.cuda}: {torch.cuda.device_count()} GPU(s), {name}")
    if required:
        return report("FAIL", "CUDA: no GPU available, but ENGINE_REQUIRE_GPU=1 asks for one")
    return report("--", "CUDA: not available, CPU only (every stage runs; stage 8's CUDA graphs need a GPU)")


def solutions_importable() -> None:
    """The reference packages (s00_foundation, ...) on the import path, once."""
    if str(REPO / "solutions") not in sys.path:
        sys.path.insert(0, str(REPO / "solutions"))


def check_threads(torch) -> bool:
    """torch's CPU threads and what the engine will use (s00 device.py)."""
    if torch is None:
        return True
    solutions_importable()
    from s00_foundation.device import default_torch_threads, physical_cores

    return report(
        "--",
        f"CPU: {physical_cores()} physical core(s); torch uses {torch.get_num_threads()} thread(s) now, "
        f"the engine {default_torch_threads()} (OMP_NUM_THREADS if set, else one per physical core; "
        "fewer on a busy machine: --torch-threads)",
    )


def check_products(torch) -> bool:
    """How the model's matrix products run on this CPU: the library and from how many rows depend
    on the CPU's vendor (s00 linear.py)."""
    if torch is None:
        return True
    solutions_importable()
    from s00_foundation.device import cpu_vendor
    from s00_foundation.linear import linear_kind

    return report(
        "--", f"matrix products on this CPU ({cpu_vendor() or 'vendor unknown'}): {linear_kind(torch.device('cpu'))}"
    )


def check_flash_attn() -> bool:
    if importlib.util.find_spec("flash_attn") is None:
        return report("--", "flash-attn: not installed (optional, CUDA only; PyTorch SDPA is used instead)")
    try:
        import flash_attn
    except Exception as err:  # a build for another torch or CUDA fails in many ways
        return report("--", f"flash-attn: installed but does not import ({err}); PyTorch SDPA is used instead")
    return report("OK", f"flash-attn {flash_attn.__version__} (optional)")


def check_compiler() -> bool:
    """The C++ compiler the CPU kernels are built with on first use (s00 cpu_extension.py)."""
    import shutil

    compiler = os.environ.get("CXX", "c++")
    found = shutil.which(compiler)
    if found is None:
        return report(
            "--",
            f"C++ compiler: no {compiler} (optional: the CPU kernels then run as PyTorch operators, a little "
            "slower; install g++ or clang, or Xcode's command-line tools on a Mac)",
        )
    return report("OK", f"C++ compiler: {found} (builds the CPU kernels on first use, cached)")


def check_model() -> bool:
    """The default model is there and loads: config, safetensors header, tokenizer."""
    fix = "-> run `make setup` (or: .venv/bin/python tools/setup_model.py)"
    missing = [n for n in ("config.json", "model.safetensors", "tokenizer.json") if not (MODEL / n).is_file()]
    if missing:
        return report("FAIL", f"default model: {MODEL} lacks {', '.join(missing)} {fix}")
    try:
        from safetensors import safe_open
        from tokenizers import Tokenizer

        config = json.loads((MODEL / "config.json").read_text())
        with safe_open(MODEL / "model.safetensors", framework="numpy") as weights:
            count = len(weights.keys())
            embed = weights.get_slice("model.embed_tokens.weight").get_shape()
        if embed != [config["vocab_size"], config["hidden_size"]]:
            raise ValueError(f"embedding shape {embed} does not match config.json")
        tokenizer = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
        eos = tokenizer.id_to_token(config["eos_token_id"])
        if tokenizer.decode(tokenizer.encode("Hello world").ids) != "Hello world":
            raise ValueError("the tokenizer does not round-trip 'Hello world'")
    except Exception as err:
        return report("FAIL", f"default model: {MODEL} does not load ({err}) {fix}")
    return report(
        "OK",
        f"default model: {MODEL.relative_to(REPO)} ({config['model_type']}, "
        f"{config['num_hidden_layers']} layers, {count} tensors, eos {config['eos_token_id']} = {eos})",
    )


def main() -> int:
    ok = check_python()
    ok &= check_packages()
    torch_ok, torch = check_torch()
    ok &= torch_ok
    ok &= check_cuda(torch)
    ok &= check_threads(torch)
    ok &= check_products(torch)
    ok &= check_flash_attn()
    ok &= check_compiler()
    ok &= check_model()
    print("environment ready" if ok else "environment NOT ready: fix the [FAIL] lines above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
