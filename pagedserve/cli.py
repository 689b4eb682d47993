"""The `pagedserve` command: backends, generate, serve, bench."""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import textwrap

from pagedserve import __version__
from pagedserve.bench import add_bench_parser
from pagedserve.generate import add_generate_parser
from pagedserve.server.cli import add_serve_parser

LOG_LEVELS = ("debug", "info", "warning", "error")


def _cmd_backends(args: argparse.Namespace) -> int:
    import torch

    from pagedserve.attention.registry import AUTO_ORDER, backend_status, get_backend_cls

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    width = shutil.get_terminal_size((100, 24)).columns
    for name, (ok, why) in backend_status().items():
        cls = get_backend_cls(name)
        heads = ",".join(map(str, cls.supported_head_sizes)) or "any"
        dtypes = ",".join(str(d).removeprefix("torch.") for d in cls.supported_dtypes)
        print(f"{name:<11} {'available' if ok else 'not available'}")
        lines = [f"{'runs' if ok else 'why'}: {why}", f"head sizes: {heads}; dtypes: {dtypes}",
                 f"features: {', '.join(cls.features()) or '-'}",
                 f"encoder-only attention: {'yes' if cls.supports_encoder_only else 'no'}"]
        for line in lines:
            print(textwrap.fill(line, width=max(40, width), initial_indent="    ",
                                subsequent_indent="      "))
    print(f"\ndevice: {device}; auto-selection order: "
          f"{' > '.join(AUTO_ORDER.get(device.type, ()))}, then, for a quantized "
          f"--kv-cache-dtype, the backends that store it (quantized-kv)")
    print("speculative decoding (--speculative-config): every backend above verifies a "
          "request's 1+K drafted tokens as a chunked prefill over its cached context; "
          "backends with the verify-cuda-graphs feature replay uniform verify steps (every "
          "request 1+K tokens) from CUDA graphs, and a draft model's or head's one-token "
          "steps (draft_model, eagle, eagle3, mtp) replay graphs of their own where the "
          "backend captures decode steps")
    return 0


def build_parser() -> argparse.ArgumentParser:
    # --log-level works before and after the subcommand.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS,
                        default=argparse.SUPPRESS, help="logging level (default: info)")
    parser = argparse.ArgumentParser(prog="pagedserve", parents=[common],
                                     description="A paged-attention LLM serving engine.")
    parser.add_argument("--version", action="version", version=f"pagedserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("backends", parents=[common],
                       help="list attention backends and whether they run here")
    p.set_defaults(func=_cmd_backends)
    for add in (add_generate_parser, add_serve_parser, add_bench_parser):
        add(sub, parents=[common])
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = getattr(args, "log_level", "info").upper()
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
