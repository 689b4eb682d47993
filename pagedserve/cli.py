"""The `pagedserve` command: backends, generate, serve, bench."""

from __future__ import annotations

import argparse
import sys

import torch


def _cmd_backends(args: argparse.Namespace) -> int:
    from pagedserve.attention.registry import AUTO_ORDER, backend_status, get_backend_cls

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = [("backend", "available", "head sizes", "dtypes", "features", "details")]
    for name, (ok, why) in backend_status().items():
        try:
            cls = get_backend_cls(name)
            heads = ",".join(map(str, cls.supported_head_sizes)) or "any"
            dtypes = ",".join(str(d).removeprefix("torch.") for d in cls.supported_dtypes)
            features = ",".join(cls.features()) or "-"
        except Exception:  # import failure is already in `why`
            heads = dtypes = features = "?"
        rows.append((name, "yes" if ok else "no", heads, dtypes, features, why))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row[:5], widths, strict=False)),
              row[5], sep="  ")
    order = AUTO_ORDER.get(device.type, ())
    print(f"\ndevice: {device}; auto-selection order: {' > '.join(order)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("backends", help="list attention backends and whether they run here")
    p.set_defaults(func=_cmd_backends)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
