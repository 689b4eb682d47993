"""The offline API (`LLM`) as a vLLM user calls it: its inputs' checks and vLLM's keywords,
on one tiny random model with the bundled tokenizer."""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from tests.utils.paged import tiny_chat_model

GREEDY = SamplingParams(temperature=0, max_tokens=2)


ENGINE = dict(device="cpu", dtype="float32", kv_cache_memory="16MiB", max_model_len=128)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"), init_std=0.2))


@pytest.fixture(scope="module")
def llm(model_dir):
    llm = LLM(model=model_dir, **ENGINE)
    yield llm
    engine = llm.engine
    assert not engine.has_unfinished_requests(), "requests left in the engine"
    assert engine.call_utility("stats").all_free, "KV blocks leaked"
    llm.close()


@pytest.mark.parametrize("prompts, named", [
    (5, "int"),
    ([None], "NoneType"),
    ([1, "a"], "'a'"),
    ([[1, 2.5]], "2.5"),
    ([{"prompt_token_ids": [1, None]}], "None"),
    (["ok", 3], "prompt 1"),
])
def test_generate_names_a_bad_prompt(llm, prompts, named) -> None:
    with pytest.raises(TypeError) as exc:
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert named in str(exc.value)
    assert not llm.engine.has_unfinished_requests()


def test_generate_names_bad_sampling_params(llm) -> None:
    with pytest.raises(TypeError, match="sampling_params.*dict"):
        llm.generate("hi", {"temperature": 0}, use_tqdm=False)
    with pytest.raises(TypeError, match="sampling_params.*str"):
        llm.generate(["hi", "ho"], [GREEDY, "x"], use_tqdm=False)


def _text(llm, output) -> str:
    return llm.get_tokenizer().decode(output.prompt_token_ids)


def test_chat_takes_vllms_template_keywords(llm) -> None:
    # A template variable of chat_template_kwargs, as Qwen3's enable_thinking is.
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                "{% if not loop.last or not continue_final_message %}<|im_end|>\n{% endif %}"
                "{% endfor %}{% if greeting %}[{{ greeting }}]{% endif %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    out = llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False,
                   chat_template=template, chat_template_kwargs={"greeting": "hello"})[0]
    assert _text(llm, out).endswith("[hello]<|im_start|>assistant\n")
    # The final assistant message is continued: no end marker and no new assistant turn.
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure,"}]
    out = llm.chat(messages, GREEDY, use_tqdm=False, add_generation_prompt=False,
                   continue_final_message=True)[0]
    assert _text(llm, out).endswith("<|im_start|>assistant\nSure,")
    assert out.prompt == _text(llm, out)  # the rendered prompt, as vLLM reports it


def test_chat_refuses_both_generation_prompt_and_continuation(llm) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure,"}]
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(messages, GREEDY, use_tqdm=False, continue_final_message=True)


def test_truncate_prompt_tokens_keeps_the_prompts_end(llm) -> None:
    ids = list(range(100, 140))
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=2,
                                             truncate_prompt_tokens=5), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-5:]
    alone = llm.generate([ids[-5:]], SamplingParams(temperature=0, max_tokens=2),
                         use_tqdm=False)[0]
    assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    # -1: the context length (a prompt within it is kept whole).
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1,
                                             truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids


def test_allowed_token_ids_bound_every_sample(llm) -> None:
    allowed = [300, 301, 302, 7000]
    for params in (SamplingParams(temperature=0, max_tokens=3, allowed_token_ids=allowed,
                                  logprobs=1),
                   SamplingParams(temperature=1.0, seed=1, max_tokens=3, n=2,
                                  allowed_token_ids=allowed)):
        out = llm.generate(["hello there"], params, use_tqdm=False)[0]
        for completion in out.outputs:
            assert set(completion.token_ids) <= set(allowed), completion.token_ids
    # Logprobs are the model's own, before the mask (as vLLM's by default): the top token of
    # the first position is not an allowed one.
    free = llm.generate(["hello there"], SamplingParams(temperature=0, max_tokens=1),
                        use_tqdm=False)[0].outputs[0].token_ids[0]
    first = llm.generate(["hello there"], SamplingParams(
        temperature=0, max_tokens=1, allowed_token_ids=allowed, logprobs=1),
        use_tqdm=False)[0].outputs[0].logprobs[0]
    assert free not in allowed and free in first and first[free].rank == 1


def test_detokenize_false_gives_token_ids_only(llm) -> None:
    params = SamplingParams(temperature=0, max_tokens=2, logprobs=1, detokenize=False)
    out = llm.generate(["hello there"], params, use_tqdm=False)[0].outputs[0]
    ref = llm.generate(["hello there"], GREEDY, use_tqdm=False)[0].outputs[0]
    assert out.text == "" and out.token_ids == ref.token_ids
    assert all(lp.decoded_token is None for pos in out.logprobs for lp in pos.values())


@pytest.mark.parametrize("field, value", [
    ("truncate_prompt_tokens", 0), ("truncate_prompt_tokens", -2),
    ("truncate_prompt_tokens", 2.0), ("allowed_token_ids", []),
    ("allowed_token_ids", [1, -1]), ("allowed_token_ids", 5), ("detokenize", "no"),
])
def test_vllm_fields_refuse_bad_values(field, value) -> None:
    with pytest.raises(ValueError) as exc:
        SamplingParams(**{field: value})
    assert field in str(exc.value) and repr(value) in str(exc.value)


def test_stop_strings_need_detokenize() -> None:
    with pytest.raises(ValueError, match="stop strings need detokenize=True"):
        SamplingParams(stop=["x"], detokenize=False)


def test_allowed_token_ids_beyond_the_vocabulary_are_refused(llm) -> None:
    with pytest.raises(ValueError, match="allowed_token_ids.*vocabulary.*10000000"):
        llm.generate("hi", SamplingParams(allowed_token_ids=[3, 10_000_000]), use_tqdm=False)


def test_text_prompts_get_the_tokenizers_special_tokens(llm, monkeypatch) -> None:
    """As vLLM tokenizes them: a Llama or Gemma tokenizer's BOS starts a text prompt (the
    models were trained with it); token-id prompts are taken as given."""
    tokenizer = llm.get_tokenizer()
    bos = tokenizer.convert_tokens_to_ids("<|im_start|>")

    class WithBos:  # the bundled tokenizer adds no special tokens of its own
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def encode(self, text, add_special_tokens=True):
            ids = tokenizer.encode(text, add_special_tokens=False)
            return [bos, *ids] if add_special_tokens else ids

    monkeypatch.setattr(llm.engine, "tokenizer", WithBos())
    text = tokenizer.encode("hello there", add_special_tokens=False)
    out = llm.generate(["hello there", text], GREEDY, use_tqdm=False)
    assert out[0].prompt_token_ids == [bos, *text] and out[1].prompt_token_ids == text


def test_bad_words_are_never_generated(llm) -> None:
    tokenizer = llm.get_tokenizer()

    def greedy(prompt: str, **kwargs) -> list[int]:
        return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, **kwargs),
                            use_tqdm=False)[0].outputs[0].token_ids

    # A word of two tokens (one whose text encodes back to them): its second is banned right
    # after its first, and only there; a word of one token at every step.
    for prompt in ("hello there", "a b", "the end", "once upon"):
        free = greedy(prompt)
        word = tokenizer.decode(free[:2])
        if tokenizer.encode(word, add_special_tokens=False) == free[:2]:
            break
    ids = greedy(prompt, bad_words=[word])
    assert ids[0] == free[0] and ids[1] != free[1]
    assert free[0] not in greedy(prompt, bad_words=[tokenizer.decode(free[:1])])


def test_bad_words_refusals() -> None:
    with pytest.raises(ValueError, match="bad_words.*'x'"):
        SamplingParams(bad_words="x")
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=["a", ""])


def test_bad_words_token_ids_are_checked(llm) -> None:
    # The engine's tokenization of bad_words, but a field a caller could set: never an index
    # error in the sampler.
    with pytest.raises(ValueError, match="bad_words_token_ids"):
        SamplingParams(bad_words_token_ids=[[]])
    with pytest.raises(ValueError, match="bad_words_token_ids.*vocabulary.*10000000"):
        llm.generate("hi", SamplingParams(bad_words_token_ids=[[3, 10_000_000]]),
                     use_tqdm=False)


def test_the_engine_seed_makes_unseeded_sampling_repeat(model_dir) -> None:
    """LLM(seed=...) seeds the sampling of requests without a seed of their own, as vLLM's
    does: the same run samples the same tokens (it was left to torch's global state)."""
    import torch

    params = SamplingParams(temperature=1.0, max_tokens=3)
    torch.manual_seed(1)  # whatever the caller did before
    with LLM(model=model_dir, seed=7, **ENGINE) as llm:
        first = llm.generate(["hi", "there"], params, use_tqdm=False)
        torch.manual_seed(7)  # the state the engine started its first step from
        again = llm.generate(["hi", "there"], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]


def test_a_started_engine_freezes_its_heap_and_a_closed_one_thaws_it(model_dir):
    """Start-up's objects leave the collector's sight (engine/gc_heap.py); closing thaws them,
    so the closed engine's reference cycles are freed, not kept frozen."""
    import gc
    import weakref

    with LLM(model=model_dir, **ENGINE) as llm:
        assert gc.get_freeze_count() > 0
        core = weakref.ref(llm.engine.core)
    assert gc.get_freeze_count() == 0 and core() is None
