"""Side-by-side benchmarks: ``python -m benchmarks NAME|all [--quick]``.

Each ``bench_NAME.py`` has ``main(argv) -> int``; it prints a table with
ratios against a baseline measured in the same run and writes JSON to
``benchmarks/results/NAME.json``.
"""
