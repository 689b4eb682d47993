"""LLM: offline batch generation over an LLMEngine."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import numbers
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from pagedserve.config import EngineConfig
from pagedserve.engine.gc_heap import collector_paused, thaw_heap
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.outputs import RequestOutput
from pagedserve.lora.request import LoRARequest, per_prompt
from pagedserve.multimodal.chat import chat_images, render_with_images
from pagedserve.pooling import PoolingParams, PoolingRequestOutput
from pagedserve.pooling.classify import ClassificationRequestOutput, classification_output
from pagedserve.pooling.front import ChunkedTokenizer
from pagedserve.pooling.params import check_params, truncation_length
from pagedserve.pooling.scoring import (
    ScoringRequestOutput,
    pair_list,
    pair_token_ids,
    scoring_output,
)
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler import ScoringTask

Prompt = str | list[int] | dict[str, Any]
Message = dict[str, Any]


class LLM:
    """`LLM(model=None, **engine_args)`: engine arguments are the CLI's flags in snake case
    (dtype, attention_backend, max_model_len, max_num_seqs, max_num_batched_tokens,
    block_size, kv_cache_memory, ...); `config=` loads a YAML preset (a file or a shipped
    preset's name) first, or is a whole EngineConfig."""

    def __init__(self, model: str | None = None, config: str | EngineConfig | None = None,
                 log_stats: bool = False, **engine_args: Any) -> None:
        if isinstance(config, EngineConfig):
            if model is not None or engine_args:
                raise ValueError("give an EngineConfig or engine arguments, not both")
            engine_config = config
        elif config is not None:
            engine_config = EngineConfig.from_yaml(config, model=model, **engine_args)
        else:
            engine_config = EngineConfig.from_kwargs(model=model, **engine_args)
        self.engine = LLMEngine(engine_config, log_stats=log_stats)
        self._ids = itertools.count()

    def close(self) -> None:
        """Shut the engine down and give its memory back (the model, the KV cache, and on CUDA
        the allocator's cached blocks), so that another engine can start in this process. The
        LLM is unusable afterwards; `with LLM(...) as llm:` closes it on leaving."""
        engine = self.__dict__.pop("engine", None)
        if engine is None:
            return
        engine.shutdown()
        del engine
        thaw_heap()  # what start-up froze is this engine's too
        gc.collect()  # the engine's parts refer to each other
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_tokenizer(self) -> Any:
        """The model's tokenizer (None for a model without one), as vLLM's LLM has it."""
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's recommended settings (generation_config.json)."""
        return SamplingParams(**self.engine.default_sampling)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | Sequence[LoRARequest | None]
                 | None = None) -> list[RequestOutput]:
        """Prompts as strings, token-id lists or {"prompt_token_ids": [...]} dicts (or
        {"prompt": text}), a dict with "multi_modal_data": {"image": image or [images]} for a
        vision-language model (one placeholder, e.g. `<image>`, per image in the prompt); one
        SamplingParams for all or one per prompt; one LoRARequest for all or one per prompt
        (None: the base model). Outputs come back in prompt order."""
        prompts = _prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params = _sampling_list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        loras = per_prompt(lora_request, len(prompts))
        inputs = [_prompt_input(prompt, i) for i, prompt in enumerate(prompts)]
        ids = []
        try:
            for prompt, text_or_ids, p, lora in zip(prompts, inputs, params, loras, strict=True):
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, text_or_ids, p, stream=False,
                                        prompt_text=_prompt_text(prompt), lora_request=lora,
                                        multi_modal_data=_multi_modal_data(prompt))
                ids.append(request_id)
            return self.wait_for(ids, use_tqdm)
        except BaseException:
            self.engine.abort_request(ids)
            raise

    def score(self, prompts: Sequence[list[int] | str],
              continuations: Sequence[list[int] | str],
              use_tqdm: bool = False, mode: str = "decode",
              truncate_prompt_tokens: int | None = None) -> list[Any]:
        """Teacher-forced scoring: for each prompt, a float32 CPU tensor [len(continuation),
        vocab] of the next-token log-distributions (row i predicts continuation[i]).

        mode="decode" feeds the continuation token by token (decode steps against the KV
        cache); mode="prefill" computes prompt + continuation as one ordinary prompt (chunked
        prefill allowed, prefix cache bypassed) and keeps the rows of its logits that predict
        the continuation, the same shapes of work as a full-sequence forward.

        A reranker (--runner pooling, a causal cross-encoder) scores pairs instead, as vLLM's
        LLM.score does: `prompts` the query (one, or one per document), `continuations` the
        documents; a ScoringRequestOutput per pair, its `outputs.score` the relevance.
        `truncate_prompt_tokens` (a reranker's): each pair to at most k tokens (-1: the context
        length), its document's end cut first (pooling/scoring.py)."""
        if self.engine.pooler_config is not None:
            return self._score_pairs(prompts, continuations, use_tqdm, truncate_prompt_tokens)
        if truncate_prompt_tokens is not None:
            raise ValueError("truncate_prompt_tokens applies to a reranker's pairs; teacher-"
                             "forced scoring does not truncate")
        if mode not in ScoringTask.MODES:
            raise ValueError(f"mode must be 'decode' or 'prefill', not {mode!r}")
        prompts = [self._score_ids(p, f"prompt {i}") for i, p in enumerate(prompts)]
        continuations = [self._score_ids(c, f"continuation {i}")
                         for i, c in enumerate(continuations)]
        if len(prompts) != len(continuations):
            raise ValueError(f"{len(prompts)} prompts but {len(continuations)} continuations")
        for i, (prompt, continuation) in enumerate(zip(prompts, continuations, strict=True)):
            if not prompt:
                raise ValueError(f"prompt {i} is empty")
            if not continuation:
                raise ValueError(f"continuation {i} is empty: nothing to score")
        ids = []
        try:
            for prompt, continuation in zip(prompts, continuations, strict=True):
                request_id = str(next(self._ids))
                self.engine.add_scoring_request(request_id, prompt, continuation, mode)
                ids.append(request_id)
            outputs = self.wait_for(ids, use_tqdm)
        except BaseException:
            self.engine.abort_request(ids)
            raise
        return [o.outputs[0].forced_logprobs for o in outputs]

    def embed(self, prompts: Prompt | Sequence[Prompt],
              pooling_params: PoolingParams | None = None,
              use_tqdm: bool = False, truncate_prompt_tokens: int | None = None
              ) -> list[PoolingRequestOutput]:
        """Embeddings of a pooling model (--runner pooling): prompts as strings (tokenized
        together, with the tokenizer's special tokens), token-id lists or
        {"prompt_token_ids": [...]} dicts; `outputs.embedding` of each result, in prompt
        order. `truncate_prompt_tokens` (vLLM's keyword) sets pooling_params' own."""
        pooler = self.engine.pooler_config
        if pooler is not None and pooler.task != "embed":
            kind = "reranker" if pooler.task == "score" else "classifier"
            raise ValueError(f"this model is a {kind}: it scores pairs (LLM.score) or "
                             "classifies (LLM.classify), it does not embed")
        if truncate_prompt_tokens is not None:
            pooling_params = dataclasses.replace(pooling_params or PoolingParams(),
                                                 truncate_prompt_tokens=truncate_prompt_tokens)
        return self._pool_prompts(prompts, pooling_params, use_tqdm)

    def _pool_prompts(self, prompts: Prompt | Sequence[Prompt],
                      pooling_params: PoolingParams | None,
                      use_tqdm: bool) -> list[PoolingRequestOutput]:
        with collector_paused():  # gc_heap.py: what a collection would walk here
            return self._pool_prompts_now(prompts, pooling_params, use_tqdm)

    def _pool_prompts_now(self, prompts: Prompt | Sequence[Prompt],
                          pooling_params: PoolingParams | None,
                          use_tqdm: bool) -> list[PoolingRequestOutput]:
        inputs = [_prompt_input(p, i) for i, p in enumerate(_prompt_list(prompts))]
        text_at = [i for i, p in enumerate(inputs) if isinstance(p, str)]
        tokenizing = ChunkedTokenizer(
            self.engine.tokenizer, [inputs[i] for i in text_at],
            truncation_length(pooling_params, self.engine.max_model_len))
        ids = [str(next(self._ids)) for _ in inputs]
        added: list[str] = []
        next_text = iter(text_at)

        def add(i: int, prompt: list[int], text: str | None) -> None:
            self.engine.add_pooling_request(ids[i], prompt, pooling_params, prompt_text=text)
            added.append(ids[i])

        def feed(idle: bool) -> bool:
            """The texts tokenized so far join the engine (waiting for some when it is idle);
            whether more are to come."""
            for prompt in tokenizing.take(wait=idle):
                i = next(next_text)
                add(i, prompt, inputs[i])
            return not tokenizing.exhausted

        try:
            for i, p in enumerate(inputs):
                if not isinstance(p, str):
                    add(i, p, None)
            return self.wait_for(ids, use_tqdm, feed)
        except BaseException:
            self.engine.abort_request(added)
            raise
        finally:
            tokenizing.close()

    def _pool(self, token_ids: list[list[int]], params: PoolingParams | None,
              use_tqdm: bool) -> list[PoolingRequestOutput]:
        ids = []
        try:
            with collector_paused():  # gc_heap.py
                for prompt in token_ids:
                    request_id = str(next(self._ids))
                    self.engine.add_pooling_request(request_id, prompt, params)
                    ids.append(request_id)
                return self.wait_for(ids, use_tqdm)
        except BaseException:
            self.engine.abort_request(ids)
            raise

    def _score_pairs(self, text_1: str | list[str], text_2: str | list[str],
                     use_tqdm: bool, truncate_prompt_tokens: int | None = None
                     ) -> list[ScoringRequestOutput]:
        pooler = self.engine.pooler_config
        if not pooler.scores_pairs:
            does = ("embeds (LLM.embed)" if pooler.task == "embed" else
                    f"classifies into {pooler.num_labels} labels (LLM.classify)")
            raise ValueError(f"this model {does}; scoring pairs needs a reranker (a "
                             "cross-encoder of one label, or a sentence-transformers "
                             "CrossEncoder with a LogitScore module)")
        params = PoolingParams(truncate_prompt_tokens=truncate_prompt_tokens)
        check_params(params, pooler)
        token_ids = pair_token_ids(self.engine.tokenizer, pair_list(text_1, text_2), pooler,
                                   truncation_length(params, self.engine.max_model_len))
        outputs = self._pool(token_ids, params, use_tqdm)
        return [scoring_output(o, pooler) for o in outputs]

    def classify(self, prompts: Prompt | Sequence[Prompt], use_tqdm: bool = False,
                 truncate_prompt_tokens: int | None = None
                 ) -> list[ClassificationRequestOutput]:
        """A classifier's (`*ForSequenceClassification`, --runner pooling) logits and
        probabilities per prompt (`outputs.logits`, `outputs.probs`), in prompt order; prompts
        as for `embed`; `truncate_prompt_tokens` truncates each prompt to k tokens (text by the
        tokenizer, its special tokens kept; token ids to their last k)."""
        pooler = self.engine.pooler_config
        if pooler is None or pooler.task != "classify":
            raise ValueError("this model does not classify: LLM.classify needs a "
                             "*ForSequenceClassification model served with --runner pooling")
        params = PoolingParams(truncate_prompt_tokens=truncate_prompt_tokens)
        check_params(params, pooler)
        outputs = self._pool_prompts(prompts, params, use_tqdm)
        return [classification_output(o) for o in outputs]

    def _score_ids(self, text_or_ids: Any, what: str) -> list[int]:
        """Token ids, tokenizing text (without special tokens, so a prompt and its
        continuation concatenate as one text would)."""
        if isinstance(text_or_ids, str):
            return self.engine.tokenize(text_or_ids)
        if isinstance(text_or_ids, list | tuple) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in text_or_ids):
            return list(text_or_ids)
        raise ValueError(f"{what} must be a string or a list of token ids, got "
                         f"{type(text_or_ids).__name__}")

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, lora_request: LoRARequest | Sequence[LoRARequest | None]
             | None = None, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} messages) or a list of them, rendered
        with the model's chat template. Content may be a string or OpenAI-style parts: text,
        and images as {"type": "image_url", "image_url": {"url": "data:image/...;base64,..."}}
        or {"type": "image_pil", "image_pil": PIL image} (vision-language models).
        `continue_final_message` (with add_generation_prompt=False) continues the last
        (assistant) message instead of starting a new one; `tools` go to the template's tools
        section; `chat_template_kwargs` are the template's own variables (Qwen3's
        enable_thinking). Each output's `prompt` is the rendered text."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        options = template_options(add_generation_prompt, continue_final_message, tools,
                                   chat_template_kwargs)
        prompts = [self._chat_prompt(c, chat_template, options) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def chat_prompt(self, messages: list[Message], add_generation_prompt: bool = True,
                    chat_template: str | None = None, continue_final_message: bool = False,
                    chat_template_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
        """One conversation as `generate` takes it: {"prompt_token_ids"} and, when its content
        parts hold images, {"multi_modal_data": {"image": [...]}} (ValueError for a bad image
        or a text-only model). `apply_chat_template` renders the text only."""
        return self._chat_prompt(messages, chat_template, template_options(
            add_generation_prompt, continue_final_message, None, chat_template_kwargs))

    def _chat_prompt(self, messages: list[Message], chat_template: str | None,
                     options: dict[str, Any]) -> dict[str, Any]:
        messages, images = chat_images(messages)
        tokenizer = self.engine.tokenizer
        if not images:
            ids = self._render(messages, chat_template, options)
            return {"prompt_token_ids": ids,
                    "prompt": tokenizer.decode(ids, skip_special_tokens=False)}
        processor = self.engine.mm_processor
        if processor is None:
            raise ValueError(f"{self.engine.model_name} takes no images: it is a text-only "
                             "model")
        ids = render_with_images(tokenizer, messages, len(images), processor.image_placeholder,
                                 chat_template=chat_template or self.engine.chat_template,
                                 **options)
        return {"prompt_token_ids": ids, "multi_modal_data": {"image": images},
                "prompt": tokenizer.decode(ids, skip_special_tokens=False)}

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True,
                            chat_template: str | None = None) -> list[int]:
        return self._render(messages, chat_template, template_options(add_generation_prompt))

    def _render(self, messages: list[Message], chat_template: str | None,
                options: dict[str, Any]) -> list[int]:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        return render_chat(tokenizer, messages,
                           chat_template=chat_template or self.engine.chat_template, **options)

    def wait_for(self, ids: list[str], use_tqdm: bool = True,
                 feed: Callable[[bool], bool] | None = None) -> list[Any]:
        """Step the engine until the requests `ids` finish: all added already, or added by
        `feed(engine_idle)` before each step as they become ready (it returns whether more are
        to come)."""
        pending = set(ids)
        final: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True,
                   disable=not use_tqdm)
        start = time.perf_counter()
        out_tokens = 0
        more = True
        while pending:
            if feed is not None and more:
                more = feed(not self.engine.has_unfinished_requests())
            for output in self.engine.step():
                if output.finished and output.request_id in pending:
                    pending.discard(output.request_id)
                    final[output.request_id] = output
                    if not use_tqdm:  # no bar to keep (a pooling call's 64 outputs a step)
                        continue
                    if isinstance(output, RequestOutput):  # not an embedding
                        out_tokens += sum(len(o.token_ids) for o in output.outputs)
                    elapsed = time.perf_counter() - start
                    bar.set_postfix_str(f"output {out_tokens / elapsed:.1f} tok/s", refresh=False)
                    bar.update(1)
            if pending and not (feed is not None and more) \
                    and not self.engine.has_unfinished_requests():
                raise RuntimeError(f"requests {sorted(pending)} vanished from the engine")
        bar.close()
        return [final[i] for i in ids]


def _prompt_list(prompts: Any) -> list[Prompt]:
    """One prompt (a string, a dict, or a list of token ids) or a sequence of them, as a
    list."""
    if isinstance(prompts, str | dict) or (
            isinstance(prompts, list | tuple) and prompts and _is_token_id(prompts[0])):
        return [prompts]
    if not isinstance(prompts, list | tuple):
        raise TypeError(f"prompts must be a string, a list of token ids, a dict or a list of "
                        f"them, got {type(prompts).__name__}")
    return list(prompts)


def _sampling_list(params: Any) -> list[SamplingParams]:
    bad = [p for p in params if not isinstance(p, SamplingParams)] if isinstance(
        params, list | tuple) else [params]
    if bad:
        raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got "
                        f"{type(bad[0]).__name__}")
    return list(params)


def _is_token_id(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _token_ids(ids: Any, what: str) -> list[int]:
    """Token ids as ints (numpy's and torch's integer scalars too); anything else named."""
    if not isinstance(ids, list | tuple):
        raise TypeError(f"{what} must be a list of token ids, got {type(ids).__name__}")
    if set(map(type, ids)) <= {int}:  # the usual list: no per-id ABC check (a C loop)
        return list(ids)
    bad = [t for t in ids if not _is_token_id(t)]
    if bad:
        raise TypeError(f"{what} must hold token ids (ints), got {bad[0]!r}")
    return [int(t) for t in ids]


def _prompt_input(prompt: Prompt, index: int = 0) -> str | list[int]:
    what = f"prompt {index}"
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return _token_ids(prompt["prompt_token_ids"], f"{what}'s prompt_token_ids")
        if "prompt" in prompt:
            if not isinstance(prompt["prompt"], str):
                raise TypeError(f"{what}'s 'prompt' must be a string, got "
                                f"{type(prompt['prompt']).__name__}")
            return prompt["prompt"]
        raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list | tuple):
        return _token_ids(prompt, what)
    raise TypeError(f"{what} must be a string, a list of token ids or a dict, got "
                    f"{type(prompt).__name__}")


def _prompt_text(prompt: Prompt) -> str | None:
    """The text of a token-id prompt dict that carries it (LLM.chat's rendered prompt)."""
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        text = prompt.get("prompt")
        return text if isinstance(text, str) else None
    return None


def _multi_modal_data(prompt: Prompt) -> Any:
    return prompt.get("multi_modal_data") if isinstance(prompt, dict) else None


# apply_chat_template's own arguments: not template variables a request may set.
_RESERVED_TEMPLATE_KWARGS = frozenset((
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"))


def template_options(add_generation_prompt: bool = True, continue_final_message: bool = False,
                     tools: list[dict[str, Any]] | None = None,
                     chat_template_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """render_chat's keywords from vLLM's chat arguments, checked."""
    if add_generation_prompt and continue_final_message:
        raise ValueError("continue_final_message continues the last message, "
                         "add_generation_prompt starts a new one: set add_generation_prompt="
                         "False with continue_final_message=True")
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise TypeError(f"chat_template_kwargs must be a dict, got "
                        f"{type(chat_template_kwargs).__name__}")
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(chat_template_kwargs or {}))
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {reserved[0]!r}: it is an argument "
                         "of the chat call itself")
    return {"add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message, "tools": tools,
            "template_kwargs": chat_template_kwargs}


def render_chat(tokenizer: Any, messages: list[Message], add_generation_prompt: bool = True,
                chat_template: str | None = None,
                tools: list[dict[str, Any]] | None = None,
                continue_final_message: bool = False,
                template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Messages -> prompt token ids with the tokenizer's chat template (given `tools`, the
    template's own tools section, if it has one; `template_kwargs`: its variables).
    `continue_final_message`: the last message is left open (no end of turn), for the model
    to go on writing it: a prefill."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model has no chat template")
    extra: dict[str, Any] = {"tools": tools} if tools else {}
    if continue_final_message:
        extra["continue_final_message"] = True
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                        chat_template=chat_template, tokenize=True,
                                        **extra, **(template_kwargs or {}))
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 returns an encoding
        ids = ids["input_ids"]
    return list(ids)
