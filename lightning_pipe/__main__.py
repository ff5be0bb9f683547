"""The ``lightning-pipe`` command line (also ``python -m lightning_pipe``)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from lightning_pipe import worker

    parser = argparse.ArgumentParser(prog="lightning-pipe", description="Pipeline-parallel training for Lightning")
    commands = parser.add_subparsers(dest="command", required=True)
    worker.add_arguments(
        commands.add_parser("worker", help="serve pipeline stages for a coordinator (a training script)")
    )
    consolidating = commands.add_parser(
        "consolidate", help="make one checkpoint file (what a plain Trainer loads) of a sharded checkpoint folder"
    )
    consolidating.add_argument("folder", help="a checkpoint folder written by launched mode")
    consolidating.add_argument("output", help="the file to write (it must not exist)")
    args = parser.parse_args(argv)
    if args.command == "consolidate":
        from lightning_pipe.checkpoint.consolidate import consolidate

        print(f"wrote {consolidate(args.folder, args.output)}")
        return 0
    return worker.run(args)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the stages and RPC are shut down; skip the interpreter's slow teardown of torch
