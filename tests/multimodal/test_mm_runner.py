"""The runner's per-step work for images without a model: placeholder rows written over the
token embeddings (partial spans, is_embed masks), and M-RoPE step positions."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from pagedserve.multimodal.inputs import MultiModalFeature, PlaceholderRange
from pagedserve.multimodal.runner import MultiModalRunner


class _Embedder:
    """Token id t embeds as a row of t's; images' rows come from the store."""

    uses_mrope = True

    def embed_input_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids.float()[:, None].repeat(1, 2)


def _batch(requests, computed, scheduled):
    return SimpleNamespace(requests=requests, num_computed_tokens=np.array(computed),
                           num_scheduled_tokens=np.array(scheduled), embeds_images=True,
                           free_encoder_identifiers=[], scheduled_encoder_inputs={})


def test_rows_over_partial_spans_and_masks():
    mm = MultiModalRunner(_Embedder(), torch.device("cpu"), torch.float32)
    mask = np.array([False, True, True, False])  # a marker token at each end keeps its id
    a = SimpleNamespace(request_id="a", mm_features=[
        MultiModalFeature("image", "x", PlaceholderRange(2, 5), {}),
        MultiModalFeature("image", "y", PlaceholderRange(9, 4, mask), {})])
    b = SimpleNamespace(request_id="b", mm_features=[])
    mm.store["x"] = -torch.arange(1, 6).float()[:, None].repeat(1, 2)  # rows -1..-5
    mm.store["y"] = torch.tensor([[100.0, 100.0], [200.0, 200.0]])
    # a computes tokens 4..10 (x's rows 2..4, y's marker and first row), b 3 tokens
    batch = _batch([a, b], [4, 0], [7, 3])
    ids = torch.arange(10)
    out = mm.inputs_embeds(batch, ids, np.array([0, 7, 10]))
    expected = ids.float()
    expected[0:3] = torch.tensor([-3.0, -4.0, -5.0])  # tokens 4, 5, 6 of a
    expected[6] = 100.0  # token 10: y's first embedding row (token 9 is its marker)
    assert torch.equal(out[:, 0], expected)


def test_mrope_positions():
    mm = MultiModalRunner(_Embedder(), torch.device("cpu"), torch.float32, max_num_tokens=8)
    prompt = np.array([[0, 1, 2, 2, 2, 5], [0, 1, 2, 3, 3, 5], [0, 1, 2, 3, 4, 5]])
    a = SimpleNamespace(mrope_positions=prompt, mrope_delta=-2, num_prompt_tokens=6)
    b = SimpleNamespace(mrope_positions=None, mrope_delta=0, num_prompt_tokens=3)
    # a: tokens 4..7 (two prompt tokens, two outputs); b: a decode at position 9
    positions = np.array([4, 5, 6, 7, 9])
    common = SimpleNamespace(num_actual_tokens=5, query_start_loc_cpu=np.array([0, 4, 5]))
    out = mm.step_positions(_batch([a, b], [4, 9], [4, 1]), common, positions)
    expected = np.array([[2, 5, 4, 5, 9], [3, 5, 4, 5, 9], [4, 5, 4, 5, 9]])
    assert out.dtype == torch.int64 and (out.numpy() == expected).all()
    # what a decode graph reads: the same buffer's first columns
    assert (mm.graph_positions(torch.zeros(5)).numpy() == expected).all()


def test_encoder_attention_falls_back_to_a_backend_with_an_encoder_path():
    """A decoder backend without an encoder path: the tower's layers go through the one the
    selector picks for encoder layers, and attend within each packed image only."""
    from torch import nn

    from pagedserve.attention.encoder import EncoderMetadata, torch_varlen_attention
    from pagedserve.multimodal.encoder_attention import EncoderAttention, bind_encoder_attention

    class NoEncoder:
        supports_encoder_only = False

        @staticmethod
        def get_name() -> str:
            return "NO_ENCODER"

        @staticmethod
        def validate_configuration(*args) -> list[str]:
            return ["no encoder path"]

    tower = nn.Module()
    tower.attn = EncoderAttention(2, 8, 8 ** -0.5)
    backend = bind_encoder_attention(tower, NoEncoder, torch.device("cpu"), torch.float32, 64)
    assert backend.get_name() == "CPU"
    q, k, v = (torch.randn(7, 16) for _ in range(3))
    md = tower.attn.binding.metadata([3, 4])
    out = tower.attn(q, k, v, md)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    ref_md = EncoderMetadata(cu, cu.numpy(), 4, 2, 7)
    ref = torch_varlen_attention(q.view(7, 2, 8), k.view(7, 2, 8), v.view(7, 2, 8), ref_md,
                                 8 ** -0.5)
    # and by hand: the first image's rows see only its own 3 keys
    first = torch.softmax(q.view(7, 2, 8)[:3].transpose(0, 1) @ k.view(7, 2, 8)[:3].permute(
        1, 2, 0) * 8 ** -0.5, dim=-1) @ v.view(7, 2, 8)[:3].transpose(0, 1)
    assert torch.allclose(out, ref.reshape(7, 16), atol=1e-6)
    assert torch.allclose(out[:3], first.transpose(0, 1).reshape(3, 16), atol=1e-5)


class _CompletedEvent:
    """A CUDA event that has completed, 2 ms after the one before it."""

    def __init__(self, enable_timing: bool = False) -> None:
        pass

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: object) -> float:
        return 2.0


def test_encoder_timing_events_are_read_as_they_complete(monkeypatch):
    """On CUDA each encoder call's events are read once they have completed, also when no one
    asks for the encoder's time (a server without stats logging kept every call's events)."""
    monkeypatch.setattr(torch.cuda, "Event", _CompletedEvent)
    model = SimpleNamespace(uses_mrope=False, embed_multimodal=lambda features: [])
    mm = MultiModalRunner(model, torch.device("cuda"), torch.float32)
    for _ in range(50):
        mm._timed_encoder([])
    assert len(mm._timing) <= 1
    assert abs(mm.encoder_seconds - 0.1) < 1e-9
