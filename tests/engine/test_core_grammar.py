"""The engine core compiles a grammar it has not seen in a worker thread: the other requests
keep stepping meanwhile, the guided request joins once its grammar is ready (or fails alone
when it cannot compile), and an abort reaches it while it waits. (In the core process the
front's compile, which validates the spec, fills only the front's cache.)"""

from __future__ import annotations

import threading
import time

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.engine.core_messages import CoreRequest
from pagedserve.sampling_params import GuidedDecodingParams
from tests.utils.paged import tiny_chat_model

CHOICES = ["yes", "no", "maybe"]


@pytest.fixture(scope="module")
def core(tmp_path_factory):
    model = str(tiny_chat_model(tmp_path_factory.mktemp("tiny"), init_std=0.2))
    llm = LLM(model=model, dtype="float32", kv_cache_memory="16MiB")
    return llm.engine.client.core


def _request(rid: str, tokens: int, guided: GuidedDecodingParams | None = None) -> CoreRequest:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=guided is None,
                            guided_decoding=guided)
    return CoreRequest(rid, [5, 6, 7, 8], params, time.time())


def _run(core, until) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(400):
        out = core.step()
        if out.tokens is not None:
            for seq_id, token in zip(out.seq_ids, out.tokens.tolist(), strict=True):
                if token >= 0:
                    tokens.setdefault(seq_id, []).append(token)
        if until(tokens, out):
            return tokens
    raise AssertionError("the core never got there")


def test_compile_runs_beside_the_steps(core, monkeypatch):
    manager = core.structured_output
    release = threading.Event()
    real_compile = manager.compile

    def slow_compile(guided):
        assert release.wait(30)
        return real_compile(guided)

    monkeypatch.setattr(manager, "compile", slow_compile)
    guided = GuidedDecodingParams(choice=CHOICES)
    assert not manager.is_compiled(guided)
    core.add_requests([_request("plain", 12)])
    core.add_requests([_request("guided", 8, guided)])
    # The plain request runs to its end while the grammar is held back.
    _run(core, lambda tokens, out: "plain" in out.finished)
    assert core.has_unfinished_requests()
    assert not core.scheduler.has_unfinished_requests()  # not in the scheduler yet
    release.set()
    tokens = _run(core, lambda tokens, out: "guided" in out.finished)
    text = core.loaded.tokenizer.decode(tokens["guided"], skip_special_tokens=True)
    assert text in CHOICES
    assert manager.is_compiled(guided) and not core.has_unfinished_requests()


def test_a_failed_compile_fails_its_request_alone(core, monkeypatch):
    def broken(guided):
        raise ValueError("no grammar today")

    monkeypatch.setattr(core.structured_output, "compile", broken)
    core.add_requests([_request("bad", 4, GuidedDecodingParams(regex="[ab]+x"))])
    core.add_requests([_request("fine", 4)])
    failed: dict[str, str] = {}

    def done(tokens, out):
        failed.update(out.failed)
        return "fine" in out.finished

    _run(core, done)
    assert failed == {"bad": "ValueError: no grammar today"}
    assert not core.has_unfinished_requests()


def test_abort_reaches_a_request_waiting_for_its_grammar(core, monkeypatch):
    release = threading.Event()
    real_compile = core.structured_output.compile
    monkeypatch.setattr(core.structured_output, "compile",
                        lambda guided: release.wait(30) and real_compile(guided))
    core.add_requests([_request("waits", 4, GuidedDecodingParams(regex="[xy]{3}"))])
    assert core.has_unfinished_requests()
    core.abort_requests(["waits"])
    assert not core.has_unfinished_requests()
    release.set()


def test_guided_requests_through_the_core_process(tmp_path):
    """The front validates the spec, the core compiles its own grammar: guided and plain
    requests batched across the process boundary."""
    model = str(tiny_chat_model(tmp_path / "tiny", init_std=0.2))
    llm = LLM(model=model, dtype="float32", kv_cache_memory="16MiB", engine_core_process=True)
    try:
        params = [SamplingParams(temperature=0.8, seed=i, max_tokens=8,
                                 guided_decoding=GuidedDecodingParams(choice=CHOICES))
                  for i in range(3)]
        params.append(SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        outs = llm.generate(["Well?"] * 4, params, use_tqdm=False)
        assert all(o.outputs[0].text in CHOICES for o in outs[:3])
        assert len(outs[3].outputs[0].token_ids) == 8
        assert llm.engine.check_blocks_free()
    finally:
        llm.engine.shutdown()
