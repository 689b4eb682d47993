"""What an EngineCore and its fronts exchange: the loaded model's facts (`CoreInfo`, once),
a sequence to run (`CoreRequest`), a completed step (`StepOutput`) and the counters
(`CoreStats`). They are msgspec structs so that they cross a socket as msgpack, numpy arrays as
raw bytes, when the core runs in a process of its own (`core_process.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from pagedserve.lora import LoRARequest
from pagedserve.multimodal.inputs import MultiModalFeature, PlaceholderRange
from pagedserve.pooling.params import PoolingParams
from pagedserve.sampling_params import SamplingParams


@dataclass
class CoreInfo:
    """What the front needs of the loaded model; sent once when the core is ready."""

    model_name: str
    tokenizer: Any
    chat_template: str | None
    generation_config: dict[str, Any] | None
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    num_blocks: int
    kv_cache_bytes_per_token: int


class CoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """One sequence to run: `request_id` is the sequence's id (`rid#i` for n > 1)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    cache_salt: str | None = None
    scoring_mode: str | None = None  # ScoringTask.mode of a scoring request
    continuation: list[int] | None = None
    pooling: PoolingParams | None = None  # a pooling request's (pooling/)
    lora: LoRARequest | None = None  # the adapter (None: the base model)
    mm_features: list[CoreFeature] | None = None  # the prompt's images, in order
    mrope_positions: Any = None  # M-RoPE models: int64 numpy [3, P]
    mrope_delta: int = 0


class CoreFeature(msgspec.Struct, array_like=True, omit_defaults=True):
    """One image of a CoreRequest (multimodal.MultiModalFeature): its tensors cross the
    socket as raw bytes with dtype and shape (core_process's tensor extension). The sequences
    of one request (n > 1) share their prompt's images: only the first carries the tensors,
    the others `data=None` (`sequence_features`, `share_feature_data`)."""

    modality: str
    identifier: str
    offset: int
    length: int
    data: dict[str, Any] | None  # name -> torch.Tensor on the CPU; None: the first sequence's
    is_embed: Any = None  # numpy bool [length], or None: every token takes a row

    @classmethod
    def of(cls, feature: MultiModalFeature, with_data: bool = True) -> CoreFeature:
        p = feature.placeholder
        return cls(feature.modality, feature.identifier, p.offset, p.length,
                   feature.data if with_data else None, p.is_embed)

    def feature(self) -> MultiModalFeature:
        return MultiModalFeature(self.modality, self.identifier,
                                 PlaceholderRange(self.offset, self.length, self.is_embed),
                                 self.data)


def sequence_features(features: list[MultiModalFeature] | None, n: int
                      ) -> list[list[CoreFeature] | None]:
    """Each of a request's n sequences' CoreFeatures: the first with the images' tensors, the
    others without (a group crosses the socket with each image once)."""
    if not features:
        return [None] * n
    return [[CoreFeature.of(f, with_data=i == 0) for f in features] for i in range(n)]


def share_feature_data(requests: list[CoreRequest]) -> None:
    """Give the features sent without tensors (`data=None`) those of the group's first
    sequence with the same image, in place."""
    data: dict[str, dict[str, Any]] = {}
    for request in requests:
        for feature in request.mm_features or ():
            if feature.data is None:
                feature.data = data[feature.identifier]
            else:
                data.setdefault(feature.identifier, feature.data)


class CoreStats(msgspec.Struct, array_like=True):
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prompt_tokens: int
    generation_tokens: int
    num_blocks: int
    num_free_blocks: int  # free or cached-evictable: not held by any request
    all_free: bool  # no request holds a block or a state slot
    num_steps: int
    step_seconds: float  # host wall time inside step() over all steps
    # Of step_seconds: waiting for the device (a step's samples, the inputs' copies); the
    # rest is the host's own work.
    wait_seconds: float = 0.0
    device_seconds: float = 0.0  # the GPU's busy time (0 unless PAGEDSERVE_DEVICE_TIMING)
    # Speculative decoding under vLLM's names (spec_decode/metrics.py says what each counts).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = msgspec.field(default_factory=list)
    spec_decode_propose_seconds: float = 0.0  # of step_seconds: the proposer's
    # Images (multimodal/): images encoded, and the encoder's calls (one per step that
    # encoded any); an image whose rows were stored already is not encoded again.
    mm_images_encoded: int = 0
    mm_encoder_calls: int = 0
    mm_encoder_seconds: float = 0.0  # the encoder's (device) time over those calls


class StepOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """One completed step, compact. Rows follow `seq_ids` (the sequences the step touched,
    batch order); arrays are numpy (bytes on the wire)."""

    seq_ids: list[str] = msgspec.field(default_factory=list)
    # int64 [N]: each sequence's new token; -1 when it kept none (a partial prompt chunk).
    tokens: Any = None
    # seq id -> (finish reason, the stop token id that ended it or None, whether its last token
    # is an end token (EOS or a stop id), whose text is not shown): ended by the core.
    finished: dict[str, tuple[str, int | None, bool]] = msgspec.field(default_factory=dict)
    # Sampled-token logprobs, rows of seq_ids: float32 [N, K+1], int64 ids [N, K+1], ranks [N].
    logprobs: tuple[Any, Any, Any] | None = None
    # seq id -> (first prompt position predicted, logprobs, ids, ranks) of this chunk.
    prompt_logprobs: dict[str, tuple[int, Any, Any, Any]] = msgspec.field(default_factory=dict)
    # seq id -> new rows of a scoring request's next-token log-distributions, float32 [r, V].
    scores: dict[str, Any] = msgspec.field(default_factory=dict)
    # seq id -> a pooling sequence's embedding, float32 [dimensions] (pooling/).
    embeddings: dict[str, Any] = msgspec.field(default_factory=dict)
    num_preemptions: dict[str, int] = msgspec.field(default_factory=dict)  # nonzero only
    # seq id -> (first scheduled time, prompt tokens found in the prefix cache), once.
    scheduled: dict[str, tuple[float, int]] = msgspec.field(default_factory=dict)
    time: float = 0.0  # time.monotonic() when the step completed (one clock for both processes)
    utility: list[tuple[int, bool, Any]] = msgspec.field(default_factory=list)  # id, ok, result
    failed: dict[str, str] = msgspec.field(default_factory=dict)  # seq id -> why its add failed

    @property
    def is_empty(self) -> bool:
        return not (self.seq_ids or self.scheduled or self.utility or self.failed)
