"""Run every benchmark (``benchmarks/bench_*.py``); exit 1 if any bar is missed.

python -m benchmarks.run [NAME ...]     # e.g. python -m benchmarks.run inspect_70b
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path


def main(names: list[str]) -> int:
    here = Path(__file__).resolve().parent
    found = sorted(p.stem.removeprefix("bench_") for p in here.glob("bench_*.py"))
    chosen = names or found
    failed = []
    for name in chosen:
        if name not in found:
            print(f"no benchmark {name!r}; have {', '.join(found)}")
            return 2
        print(f"== {name}")
        module = importlib.import_module(f"benchmarks.bench_{name}")
        if not module.main():
            failed.append(name)
    print("all bars met" if not failed else f"bars missed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
