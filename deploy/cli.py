"""The ``tandem`` command line."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Tandem: disaggregated LLM serving "
                                     "with speculative decoding over a unified target+draft KV cache")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start a local cluster (router, prefill, decode) on 127.0.0.1")
    up.add_argument("--device", default="cpu", help="torch device of the workers (default: cpu)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "up":
        print("tandem up: the local cluster needs the router, prefill and decode services, "
              "which are not built yet.", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
