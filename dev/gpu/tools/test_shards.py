"""Run a test file's tests as parallel pytest processes (shards) and print one summary: for the GPU machine,
where compiling the kernels of each test, not running them, takes the time, and one process leaves most
CPU cores idle (``tests/ops/test_recurrence_triton.py`` on an H200 host: 10 shards take about 5 minutes, their
own times summing to about 40)::

    python dev/gpu/tools/test_shards.py tests/ops/test_recurrence_triton.py --shards 10 --log-dir $OUT
    python dev/gpu/tools/test_shards.py tests/ops/test_recurrence_triton.py -k "vector and delta"
    python dev/gpu/tools/test_shards.py tests -m gpu --shards 12 --log-dir $OUT   # every GPU test

Run it from the repository root (the node ids are relative to it). The tests are collected once and dealt
round-robin, so tests of one parametrisation spread over the shards. Exits 1 if any shard failed; each shard's
output goes to ``--log-dir`` (shard-N.log).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path


def collect(path: str, keyword: str, marker: str) -> list[str]:
    """Node ids of the tests of ``path`` (matching ``keyword`` and ``marker`` if given)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", path]
    if keyword:
        cmd += ["-k", keyword]
    if marker:
        cmd += ["-m", marker]
    out = subprocess.run(cmd, capture_output=True, text=True).stdout
    return [line.strip() for line in out.splitlines() if "::" in line]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="a test file or folder")
    parser.add_argument("-k", dest="keyword", default="", help="pytest -k expression")
    parser.add_argument("-m", dest="marker", default="", help="pytest -m expression")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--log-dir", default=".", help="folder of the shards' logs")
    args = parser.parse_args()
    ids = collect(args.path, args.keyword, args.marker)
    if not ids:
        print("no tests collected", file=sys.stderr)
        return 1
    shards = [ids[i::args.shards] for i in range(args.shards) if ids[i::args.shards]]
    logs = Path(args.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    print(f"{len(ids)} tests in {len(shards)} shards", flush=True)
    procs = []
    for i, shard in enumerate(shards):
        log = open(logs / f"shard-{i}.log", "w")
        procs.append((i, log, subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                                *shard], stdout=log, stderr=subprocess.STDOUT)))
    failed = 0
    for i, log, proc in procs:
        code = proc.wait()
        log.close()
        lines = (logs / f"shard-{i}.log").read_text().splitlines()
        summary = next((line for line in reversed(lines) if " in " in line and ("passed" in line or
                                                                                "failed" in line or
                                                                                "error" in line)), "no summary")
        print(f"shard {i}: exit {code}: {summary}")
        for line in lines:
            if line.startswith(("FAILED", "ERROR")):
                print(f"    {line}")
        failed += code != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
