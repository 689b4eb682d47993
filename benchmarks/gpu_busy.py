"""The GPU's busy share over a timed run, from nvidia-smi's utilization samples.

nvidia-smi's `utilization.gpu` is the share of its sample period in which a kernel ran, which
is what "busy" means here. Sample while a benchmark runs:

    nvidia-smi --query-gpu=timestamp,utilization.gpu --format=csv,noheader,nounits -lms 100 >u.csv
    pagedserve bench throughput ... --output-json run.json
    python benchmarks/gpu_busy.py u.csv run.json

Only the samples of the last `elapsed_s` seconds before the last sample count: start-up, weight
loading and warm-up come before the timed run and would pull the mean down.
"""
from __future__ import annotations

import argparse
import json
from datetime import datetime


def read_samples(path: str) -> list[tuple[float, float]]:
    samples = []
    with open(path) as f:
        for line in f:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) != 2 or not parts[1].isdigit():
                continue
            stamp = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            samples.append((stamp, float(parts[1])))
    return samples


def busy_share(samples: list[tuple[float, float]], elapsed_s: float,
               tail_s: float = 0.0) -> tuple[float, int]:
    """Mean utilization (%) over the window [end - tail_s - elapsed_s, end - tail_s]."""
    if not samples:
        raise SystemExit("no utilization samples")
    # The run ended before the sampler was stopped: the last busy sample marks its end.
    end = max(t for t, u in samples if u > 0) if any(u > 0 for _, u in samples) else samples[-1][0]
    end -= tail_s
    window = [u for t, u in samples if end - elapsed_s <= t <= end]
    return (sum(window) / len(window) if window else 0.0), len(window)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("samples", help="nvidia-smi CSV: timestamp, utilization.gpu")
    parser.add_argument("run_json", help="bench throughput --output-json file")
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    with open(args.run_json) as f:
        run = json.load(f)
    mean, n = busy_share(read_samples(args.samples), run["elapsed_s"])
    print(f"{args.label}: {run['output_tokens_per_s']:.0f} output tok/s in "
          f"{run['elapsed_s']:.2f} s, GPU busy {mean:.0f}% ({n} samples)")


if __name__ == "__main__":
    main()
