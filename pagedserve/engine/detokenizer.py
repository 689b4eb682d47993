"""Incremental detokenization with stop-string detection for one request."""

from __future__ import annotations

import functools
from collections import deque
from typing import Any

from pagedserve.sampling_params import SamplingParams

# Prompt tokens decoded ahead of the first output token. Tokenizers that drop the leading
# space of a decode's first token (SentencePiece) need some context to render it correctly.
_PROMPT_CONTEXT_TOKENS = 5


@functools.cache
def _can_stream() -> bool:
    """This version of `tokenizers` streams decodes from a primed context."""
    try:
        from tokenizers.decoders import DecodeStream

        DecodeStream(ids=[], skip_special_tokens=False)
    except (ImportError, TypeError):
        return False
    return True


def _rust_tokenizer(tokenizer: Any) -> Any | None:
    """The `tokenizers.Tokenizer` behind a fast transformers tokenizer, if it can stream."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not _can_stream():
        return None
    from tokenizers import Tokenizer

    return backend if isinstance(backend, Tokenizer) else None


class IncrementalDetokenizer:
    """Turns a stream of token ids into text, O(1) decode work per token.

    Keeps two offsets into the id list: text of ``ids[prefix_offset:read_offset]`` has
    already been emitted; each step decodes ``ids[prefix_offset:]`` and emits what it adds
    beyond that prefix. Decoding with the prefix (rather than the new ids alone) keeps
    context-dependent spacing correct, and a decode that ends in U+FFFD is an incomplete
    multi-byte character, so the offsets wait for the bytes that complete it.

    Fast tokenizers run the same algorithm inside `tokenizers`' `DecodeStream` (one call
    per token instead of two decodes through the Python wrapper: about a tenth of the host
    time, which a small model's steps feel).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self._stop: list[str] = list(params.stop or ())
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        # Only the context window of the prompt is kept; earlier ids are never decoded again.
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._num_output_tokens = 0
        self._text = ""
        self._sent = 0  # chars of _text already returned by get_next_delta
        self._stop_reason: str | None = None
        # Output tokens are settled once their text is known to stay in the output (it starts
        # before the held-back tail, or before a stop string's cut), or cut once it lies
        # wholly after the cut: a token's logprobs belong with its text.
        self._num_settled = 0
        self._num_cut = 0
        self._unsettled_starts: deque[int] = deque()  # where later tokens' text starts
        self._backend = _rust_tokenizer(tokenizer)
        self._stream = None
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(ids=context,
                                        skip_special_tokens=params.skip_special_tokens)

    @property
    def output_text(self) -> str:
        return self._text

    @property
    def finished(self) -> bool:
        """True once a stop string matched."""
        return self._stop_reason is not None

    @property
    def stop_reason(self) -> str | None:
        return self._stop_reason

    @property
    def num_settled_tokens(self) -> int:
        """How many output tokens (the first ones) have text that stays in the output: all of
        them without stop strings or once flushed; else those whose text starts before the
        held-back tail, or, after a stop string, before the cut. Tokens with no text of their
        own yet (bytes of an unfinished character) settle with the text that follows."""
        return self._num_settled

    @property
    def num_cut_tokens(self) -> int:
        """How many of the last output tokens a stop string cut off: their text lies wholly
        in the truncated tail (0 unless a stop string matched)."""
        return self._num_cut

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append tokens; return the stop string they completed, if any."""
        if self._stop_reason is not None:
            return None  # the request ended; trailing ids cannot change the text
        if self._stream is not None and not self._stop and len(new_token_ids) == 1:
            # The common step: one token, no stop strings to look for.
            self._num_output_tokens += 1
            self._num_settled += 1
            piece = self._stream_step(new_token_ids[0])
            if piece:
                self._text += piece
            return None
        old_len = len(self._text)
        if self._stream is not None:
            pieces = [self._stream_step(token_id) or "" for token_id in new_token_ids]
        else:
            pieces = []
            for token_id in new_token_ids:
                self._ids.append(token_id)
                pieces.append(self._decode_next())
        self._num_output_tokens += len(new_token_ids)
        if not self._stop:
            self._num_settled += len(new_token_ids)
            self._text += "".join(pieces)
            return None
        for piece in pieces:
            self._unsettled_starts.append(len(self._text))
            self._text += piece
        # Like min_tokens for EOS, stop strings may only end the request after min_tokens.
        if self._num_output_tokens > self.params.min_tokens:
            self._check_stop(old_len)
        if self._stop_reason is None:
            # A later stop string cuts at or after the start of the held-back tail.
            self._settle_before(len(self._text) - (self._max_stop_len - 1))
        return self._stop_reason

    def _stream_step(self, token_id: int) -> str | None:
        """`DecodeStream.step`, which raises on ids whose bytes cannot continue the text it
        has emitted (a byte-fallback piece that completes no character, then one that changes
        the prefix: random or badly trained models sample them). That request's stream then
        starts over from this token, as vLLM's does; its text so far stands."""
        try:
            return self._stream.step(self._backend, token_id)
        except Exception:  # tokenizers raises a bare Exception ("Invalid prefix ...")
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(ids=[], skip_special_tokens=self.params.skip_special_tokens)
            try:
                return self._stream.step(self._backend, token_id)
            except Exception:
                return None

    def get_next_delta(self, finished: bool = False) -> str:
        """Text not returned yet.

        Until the request finishes, the last ``len(longest stop string) - 1`` chars are
        held back: they could be the start of a stop string that later tokens complete.
        Pass ``finished=True`` when the request ended for another reason (EOS, length)
        to flush them.
        """
        end = len(self._text)
        if not (finished or self.finished) and self._max_stop_len > 1:
            end = max(self._sent, end - (self._max_stop_len - 1))
        delta = self._text[self._sent : end]
        self._sent = end
        if finished and not self.finished:  # flushed: every token's text is out
            self._num_settled += len(self._unsettled_starts)
            self._unsettled_starts.clear()
        return delta

    def _settle_before(self, end: int) -> None:
        starts = self._unsettled_starts
        while starts and starts[0] < end:
            starts.popleft()
            self._num_settled += 1

    def _decode_next(self) -> str:
        ids = self._ids
        skip = self.params.skip_special_tokens
        prefix = self._decode(ids[self._prefix_offset : self._read_offset], skip)
        full = self._decode(ids[self._prefix_offset :], skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        # Drop ids before the window so memory stays bounded as well as decode cost.
        del ids[: self._prefix_offset]
        self._read_offset -= self._prefix_offset
        self._prefix_offset = 0
        return full[len(prefix) :]

    def _decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(
            ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def _check_stop(self, old_len: int) -> None:
        # Any match must end in the new text (an older one would have stopped us already),
        # so it starts at most max_stop_len - 1 chars before it: only that tail is searched,
        # and a token's search costs the same however long the text has grown.
        start = max(0, old_len - self._max_stop_len + 1)
        found = earliest_stop(self._text[start:], self._stop)
        if found is None:
            return
        idx, stop = found
        idx += start
        self._stop_reason = stop
        end = idx + len(stop) if self.params.include_stop_str_in_output else idx
        self._text = self._text[:end]
        self._sent = min(self._sent, end)
        self._settle_before(end)
        self._num_cut = len(self._unsettled_starts)
        self._unsettled_starts.clear()


def earliest_stop(window: str, stops: list[str]) -> tuple[int, str] | None:
    """The stop string that starts first in `window`, and where it starts (None: none)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        idx = window.find(stop)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best
