"""LoRA's low-rank term on the CPU, each token through its own adapter, against the dense
product it replaced (every slot's A and B for every token, other slots' columns zeroed): the
grouped path (`ops.lora_torch`, tokens grouped by slot) and the masked one
(`ops.lora_torch_masked`, every token through every slot with B transposed), of which
`add_lora` takes the one `ops.masked_pays` names ("ours"). One fused QKV layer of the bundled
model's shape (576 -> 576 + 192 + 192), rank 16, 8 slots; a step of `tokens` tokens is cut
into requests of 16 tokens whose adapters go round-robin over `adapters` of them. Also the
base layer's matmul, for scale, and the host's routing work (`LoRABatch.set`, once a step,
not once a layer). Milliseconds, median of `--repeats`.

    OMP_NUM_THREADS=1 python benchmarks/lora_cpu.py
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

from pagedserve.lora.batch import LoRABatch
from pagedserve.lora.ops import lora_torch, lora_torch_masked, masked_pays

IN, PARTS, RANK, SLOTS = 576, [576, 192, 192], 16, 8


def dense_term(x, y, a_dense, b_dense, token_slots):
    """The product this replaced: x through every slot's A, each token's other slots zeroed,
    then through every slot's B ([slots + 1] with the last slot zero: the base)."""
    slots, width, _ = a_dense.shape
    shrunk = x @ a_dense.view(slots * width, -1).t()
    own = F.one_hot(token_slots, slots).to(shrunk.dtype).unsqueeze(-1)
    shrunk = (shrunk.view(-1, slots, width) * own).view(-1, slots * width)
    y += shrunk @ b_dense.view(slots * width, -1)


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 256, 1024, 2048])
    parser.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    out = sum(PARTS)
    bounds = [sum(PARTS[:i]) for i in range(len(PARTS) + 1)]
    weight = torch.randn(out, IN)
    a = torch.randn(SLOTS, len(PARTS) * RANK, IN)
    b = torch.randn(SLOTS, out, RANK)
    b_t = b.transpose(1, 2).contiguous()
    a_dense = torch.cat([a, torch.zeros(1, *a.shape[1:])])
    b_dense = torch.zeros(SLOTS + 1, len(PARTS) * RANK, out)
    for p in range(len(PARTS)):
        b_dense[:SLOTS, p * RANK:(p + 1) * RANK, bounds[p]:bounds[p + 1]] = \
            b[:, bounds[p]:bounds[p + 1]].transpose(1, 2)
    print(f"threads {torch.get_num_threads()}; ms per layer call")
    print("tokens adapters   base   dense  grouped  masked  dense/ours  set(step)")
    for tokens in args.tokens:
        x = torch.randn(tokens, IN)
        y = torch.zeros(tokens, out)
        for n in args.adapters:
            per_req = max(1, min(16, tokens // n))
            num_reqs = -(-tokens // per_req)
            counts = np.full(num_reqs, per_req)
            counts[-1] = tokens - per_req * (num_reqs - 1)
            slots = np.arange(num_reqs) % n
            batch = LoRABatch(tokens, SLOTS, torch.device("cpu"))
            batch.set(slots, counts)
            dense_slots = torch.from_numpy(np.repeat(slots, counts)).long()
            base = _median_ms(lambda x=x: F.linear(x, weight), args.repeats)
            dense = _median_ms(lambda x=x, y=y, s=dense_slots: dense_term(x, y, a_dense,
                                                                          b_dense, s),
                               args.repeats)
            grouped = _median_ms(lambda x=x, y=y, g=batch.groups: lora_torch(x, y, a, b, bounds,
                                                                              g),
                                 args.repeats)
            masked = _median_ms(lambda x=x, y=y, t=batch.token_slots: lora_torch_masked(
                x, y, a, b_t, bounds, t), args.repeats)
            host = _median_ms(lambda s=slots, c=counts, bt=batch: bt.set(s, c), args.repeats)
            ours = masked if masked_pays(tokens, len(batch.groups), SLOTS) else grouped
            print(f"{tokens:6d} {n:8d} {base:6.3f} {dense:7.3f} {grouped:8.3f} {masked:7.3f} "
                  f"{dense / ours:11.2f} {host:10.3f}")


if __name__ == "__main__":
    main()
