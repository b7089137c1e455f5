"""``generate --offline``: run one prompt through an in-process engine.

    python -m services.engine.cli generate --offline --prompt "def fib(n):" --max-tokens 64 --json

``add_generate_args`` and ``run_generate`` let the ``tandem`` command line mount the same
subcommand over its own engine options.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from services.engine.sampling.params import SamplingParams

if TYPE_CHECKING:
    from services.engine.config import EngineConfig

BUNDLED = Path(__file__).resolve().parents[2] / "models"


def add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--offline", action="store_true", help="run the engine in this process")
    p.add_argument("--prompt", required=True, help="prompt text (encoded by the model's tokenizer)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--no-spec", action="store_true", help="target only, no drafter")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run_generate(args: argparse.Namespace, config: EngineConfig) -> int:
    """Prints the completion (or its JSON record); bad input exits with status 2. Forced
    acceptance (benchmarks only) is announced on stderr first."""
    from services.engine.config import forced_acceptance_banner  # noqa: PLC0415 (torch, as Engine)
    from services.engine.engine import Engine  # noqa: PLC0415 (torch: only this subcommand needs it)

    if not args.offline:
        print("generate: give --offline (an engine in this process) or --endpoint HOST:PORT", file=sys.stderr)
        return 2
    if args.no_spec:
        config = dataclasses.replace(config, drafter=None, num_spec_tokens=0)
    if config.forced_acceptance >= 0:
        print(f"WARNING: {forced_acceptance_banner(config.forced_acceptance)}", file=sys.stderr)
    try:
        sampling = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed
        )
        out = Engine(config).generate([args.prompt], sampling)[0]
    except ValueError as e:
        print(f"generate: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(
            json.dumps(
                {
                    "text": out.text,
                    "token_ids": out.token_ids,
                    "finish_reason": out.finish_reason,
                    "usage": dataclasses.asdict(out.usage),
                }
            )
        )
    else:
        print(out.text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate one completion")
    gen.add_argument("--model", default=str(BUNDLED / "tiny-target"))
    gen.add_argument("--drafter", default=str(BUNDLED / "tiny-drafter"))
    gen.add_argument("-k", "--num-spec-tokens", type=int, default=4)
    gen.add_argument("--device", default="cpu")
    gen.add_argument(
        "--unsafe-forced-acceptance",
        type=int,
        default=-1,
        metavar="N",
        help="BENCHMARKS ONLY: the verifier keeps exactly N drafts per step whatever the target "
        "says, so outputs are NOT lossless (not the target's own); default off",
    )
    add_generate_args(gen)
    return parser


def main(argv: list[str] | None = None) -> int:
    from services.engine.config import EngineConfig  # noqa: PLC0415 (torch, as in run_generate)

    args = build_parser().parse_args(argv)
    try:
        config = EngineConfig(
            model=args.model,
            drafter=args.drafter,
            num_spec_tokens=args.num_spec_tokens,
            device=args.device,
            forced_acceptance=args.unsafe_forced_acceptance,
            unsafe_forced_acceptance=args.unsafe_forced_acceptance >= 0,
        )
    except ValueError as e:
        print(f"generate: {e}", file=sys.stderr)
        return 2
    return run_generate(args, config)


if __name__ == "__main__":
    sys.exit(main())
