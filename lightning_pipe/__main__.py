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
    args = parser.parse_args(argv)
    return worker.run(args)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the stages and RPC are shut down; skip the interpreter's slow teardown of torch
