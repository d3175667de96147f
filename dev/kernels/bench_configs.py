"""``linmem bench ops`` with some of the Triton kernels' launch configs changed, to time one before editing the
launch table. The arguments after ``--`` are those of ``linmem bench ops``; on a CUDA machine::

    python dev/kernels/bench_configs.py --launch grads_vector=8x2,output_vector=8x3 -- --ops gla --shapes 8x2048

``--launch`` takes ``NAME=WARPSxSTAGES`` pairs, NAME an entry of the launch table. To time a config beside the
current one in one process, take ``kernel_ab.py --try`` instead.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Optional, Sequence

from linmem.ops.recurrence.triton import configs


def parse_launch(text: str, known) -> dict[str, tuple[int, int]]:
    """'name=WxS,name=WxS' -> {name: (warps, stages)}; a name outside ``known`` or a malformed pair is refused,
    with the names it takes."""
    configs = {}
    for item in text.split(","):
        name, _, config = item.partition("=")
        if name not in known or not re.fullmatch(r"\d+x\d+", config.lower()):
            raise SystemExit(f"--launch {item!r}: expected NAME=WARPSxSTAGES with NAME one of {', '.join(known)}")
        configs[name] = tuple(int(x) for x in config.lower().split("x"))
    return configs


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launch", required=True, help="e.g. grads_key=8x2,output=8x2 (warps x stages)")
    parser.add_argument("bench", nargs=argparse.REMAINDER, help="-- and the arguments of linmem bench ops")
    args = parser.parse_args(argv)
    from linmem.cli import main as cli

    with configs.override(LAUNCH=parse_launch(args.launch, configs.LAUNCH)):
        return cli(["bench", "ops", *[a for a in args.bench if a != "--"]])


if __name__ == "__main__":
    sys.exit(main())
