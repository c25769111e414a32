"""``python -m benchmarks NAME|all [--quick] [...]``: run ``benchmarks/bench_NAME.py:main(argv)``."""

from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def available() -> list[str]:
    return sorted(p.stem.removeprefix("bench_") for p in HERE.glob("bench_*.py"))


def run(name: str, argv: list[str]) -> int:
    module = importlib.import_module(f"benchmarks.bench_{name}")
    return int(module.main(argv) or 0)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    names = available()
    if not args or args[0] in ("-h", "--help"):
        print(f"usage: python -m benchmarks NAME|all [--quick] [options]\nbenchmarks: {', '.join(names)}")
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name != "all":
        if name not in names:
            print(f"unknown benchmark {name!r}; have: {', '.join(names)}", file=sys.stderr)
            return 2
        return run(name, rest)
    failed = []
    for n in names:
        print(f"\n=== {n} ===", flush=True)
        start = time.monotonic()
        rc = run(n, rest)
        print(f"=== {n}: exit {rc} after {time.monotonic() - start:.0f} s ===", flush=True)
        if rc:
            failed.append(n)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
