"""The tensor-parallel layers on two CPU ranks (gloo) against the whole layer on one: each rank
loads its part of the same full tensors (`rank_part`, from memory and lazily from a
safetensors file) and every rank's output must equal the one-rank output."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from pagedserve.distributed import destroy_distributed, init_distributed, tp_world_size
from pagedserve.distributed.parallel_state import single_rank
from pagedserve.models.moe import FusedMoE, torch_experts
from pagedserve.models.parallel import (
    LazySlice,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    rank_part,
)

HIDDEN, HEAD_DIM, VOCAB = 16, 4, 11  # a vocabulary the ranks split with padding


def _full_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    return {"q": randn(4 * HEAD_DIM, HIDDEN), "k": randn(2 * HEAD_DIM, HIDDEN),
            "v": randn(2 * HEAD_DIM, HIDDEN), "k1": randn(HEAD_DIM, HIDDEN),
            "v1": randn(HEAD_DIM, HIDDEN), "qb": randn(4 * HEAD_DIM),
            "gate": randn(24, HIDDEN), "up": randn(24, HIDDEN), "down": randn(HIDDEN, 24),
            "down_bias": randn(HIDDEN), "emb": randn(VOCAB, HIDDEN),
            "experts_gate_up": randn(3, 2 * 8, HIDDEN), "experts_down": randn(3, HIDDEN, 8),
            "x": randn(5, HIDDEN)}


def _check(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=what)


def _load(layer: torch.nn.Module, name: str, tensor, shard: str | None = None,
          dst: torch.Tensor | None = None) -> None:
    part = rank_part(layer, tensor, name, shard)
    (getattr(layer, name).data if dst is None else dst).copy_(part)


def _run_rank(rank: int, world: int, init_method: str, path: str) -> None:
    init_distributed(rank, world, init_method, "gloo", timeout_s=60)
    try:
        t = _full_tensors()
        x = t["x"]
        with safe_open(path, framework="pt") as f:
            lazy = {k: LazySlice(f.get_slice(k)) for k in f.keys()}  # noqa: SIM118
            for kv, (k, v) in {2: ("k", "v"), 1: ("k1", "v1")}.items():
                # Two K/V heads over two ranks split; one is replicated on both.
                layer = QKVParallelLinear(HIDDEN, HEAD_DIM, 4, kv, bias=False)
                q, kk, vv = layer.weight.data.split([layer.q_size, layer.kv_size,
                                                     layer.kv_size])
                _load(layer, "weight", lazy["q"], "q", q)
                _load(layer, "weight", lazy[k], "k", kk)
                _load(layer, "weight", lazy[v], "v", vv)
                got_q, got_k, got_v = layer(x).split([layer.q_size, layer.kv_size,
                                                      layer.kv_size], dim=-1)
                heads = 4 // world
                _check(got_q, (x @ t["q"].T)[:, rank * heads * HEAD_DIM:
                                             (rank + 1) * heads * HEAD_DIM], "q heads")
                kv_head = rank * kv // world
                n = max(1, kv // world) * HEAD_DIM
                _check(got_k, (x @ t[k].T)[:, kv_head * HEAD_DIM:kv_head * HEAD_DIM + n],
                       f"k heads of {kv}")
                _check(got_v, (x @ t[v].T)[:, kv_head * HEAD_DIM:kv_head * HEAD_DIM + n],
                       f"v heads of {kv}")

            # gate/up column-parallel, then down row-parallel with a bias: the whole MLP.
            gate_up = MergedColumnParallelLinear(HIDDEN, 24)
            g_, u_ = gate_up.weight.data.chunk(2)
            _load(gate_up, "weight", lazy["gate"], "gate", g_)
            _load(gate_up, "weight", lazy["up"], "up", u_)
            down = RowParallelLinear(24, HIDDEN, bias=True)
            _load(down, "weight", lazy["down"])
            _load(down, "bias", t["down_bias"])
            gate, up = gate_up(x).chunk(2, dim=-1)
            want = F.linear(F.silu(x @ t["gate"].T) * (x @ t["up"].T), t["down"], t["down_bias"])
            _check(down(F.silu(gate) * up), want, "MLP")

            emb = VocabParallelEmbedding(VOCAB, HIDDEN)
            _load(emb, "weight", lazy["emb"])
            ids = torch.tensor([0, 5, 6, 10, 3])
            _check(emb(ids), t["emb"][ids], "embedding")
            head = ParallelLMHead(HIDDEN, VOCAB)
            _load(head, "weight", t["emb"])
            _check(head(x), x @ t["emb"].T, "LM head")

        experts = FusedMoE(3, HIDDEN, 8)
        _load(experts, "gate_up_proj", t["experts_gate_up"])
        for e in range(3):  # one by one, as a checkpoint with a tensor per expert holds them
            experts.load_expert(e, "down", t["experts_down"][e])
        ids = torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1], [2, 0]])
        weights = torch.rand(5, 2, generator=torch.Generator().manual_seed(1))
        want = torch_experts(x, t["experts_gate_up"], t["experts_down"], weights, ids)
        _check(experts(x, weights, ids), want, "experts")
        assert tp_world_size() == world
        with single_rank():
            assert tp_world_size() == 1
    finally:
        destroy_distributed()


def test_parallel_layers_match_one_rank(tmp_path):
    path = str(tmp_path / "full.safetensors")
    save_file({k: v.contiguous() for k, v in _full_tensors().items()}, path)
    init_method = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_run_rank, args=(2, init_method, path), nprocs=2, join=True)


def test_one_rank_layers_are_the_plain_ones():
    """At one rank the layers hold the whole weights and compute what nn.Linear does."""
    t = _full_tensors()
    down = RowParallelLinear(24, HIDDEN, bias=True)
    down.weight.data.copy_(rank_part(down, t["down"], "weight"))
    down.bias.data.copy_(t["down_bias"])
    x = torch.randn(3, 24)
    assert torch.equal(down(x), F.linear(x, t["down"], t["down_bias"]))
    emb = VocabParallelEmbedding(VOCAB, HIDDEN)
    assert emb.weight.shape == (VOCAB, HIDDEN)
