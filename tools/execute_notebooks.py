"""Execute notebooks in place, so their saved outputs (timings, plots) come from this machine.

    .venv/bin/python tools/execute_notebooks.py notebooks/08_cuda_graph.ipynb    # e.g. on a GPU machine
    .venv/bin/python tools/execute_notebooks.py notebooks/*.ipynb

Each notebook runs in a fresh kernel from the notebooks/ folder (as nbval runs it in make test) and
is saved with its outputs; commit the result. Keep OMP_NUM_THREADS=1 on a busy CPU machine.
`--save-to DIR` saves the executed copies there instead and leaves the notebooks as they are.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--timeout", type=int, default=900, help="seconds one cell may run")
    parser.add_argument("--save-to", type=Path, default=None, help="save the executed notebooks here, not in place")
    args = parser.parse_args()
    for path in args.notebooks:
        start = time.perf_counter()
        notebook = nbformat.read(path, as_version=4)
        NotebookClient(
            notebook, timeout=args.timeout, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
        ).execute()
        saved = path if args.save_to is None else args.save_to / path.name
        nbformat.write(notebook, saved)
        print(f"{path}: executed in {time.perf_counter() - start:.1f} s, outputs saved in {saved}", flush=True)


if __name__ == "__main__":
    main()
