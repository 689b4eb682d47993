"""Grammar matchers in worker processes (`guided_decoding_workers`): the same tokens as the
engine's own matchers (async and step by step, n > 1, beside unguided requests, through
preemption), a rollback that spans sent and unsent tokens, released matchers freed in the
workers, a dead worker reported instead of waited for, and the setting's checks. One worker:
the CI machine has two cores, and a worker spins on one while guided requests run."""

from __future__ import annotations

import gc
import json
import os
import platform
import signal
import time

import jsonschema
import numpy as np
import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineConfig
from pagedserve.engine.settings_checks import check_settings
from pagedserve.sampling_params import GuidedDecodingParams
from pagedserve.structured_output.manager import StructuredOutputManager, resolve_workers
from pagedserve.structured_output.workers import RemoteGrammar
from tests.structured_output.schemas import FAST, SCHEMAS
from tests.utils.paged import model_with_tokenizer, tiny_chat_model

PROMPT = "Answer with JSON only.\n"
REGEX = r"[A-Z][a-z]{2,5} [0-9]{1,3}"


def _params(max_tokens: int) -> tuple[list[str], list[SamplingParams]]:
    guided = [GuidedDecodingParams(json=SCHEMAS[name]) for name in FAST[:3]]
    prompts = ["The capital of France is", PROMPT, PROMPT, PROMPT, PROMPT, "Pick one:"]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),  # outlives
              *[SamplingParams(temperature=0.8, seed=i, max_tokens=max_tokens, guided_decoding=g)
                for i, g in enumerate(guided)],
              SamplingParams(n=2, temperature=1.0, seed=9, max_tokens=40,
                             guided_decoding=GuidedDecodingParams(regex=REGEX)),
              SamplingParams(temperature=0.8, seed=3, max_tokens=8,
                             guided_decoding=GuidedDecodingParams(choice=["red", "green"]))]
    return prompts, params


def _run(workers: int, async_scheduling: bool, max_tokens: int = 120, device: str = "cpu",
         model: dict[str, str] | None = None, **engine: object
         ) -> tuple[list[list[list[int]]], int]:
    # On CUDA the cache is sized by gpu_memory_utilization (kv_cache_memory is the CPU's).
    llm = LLM(**(model or model_with_tokenizer()), dtype="float32", device=device,
              kv_cache_memory="64MiB", gpu_memory_utilization=0.2, max_num_seqs=16,
              guided_decoding_workers=workers, async_scheduling=async_scheduling, **engine)
    prompts, params = _params(max_tokens)
    with llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        preemptions = llm.engine.scheduler.num_preemptions
        if workers:
            pool = llm.engine.structured_output._workers
            manager = llm.engine.structured_output
            assert pool is not None and manager.num_fills > 0
            # Decode steps of the same requests, all guided, repeat the last task (once the
            # unguided request has ended), when async.
            assert (manager.num_repeats > 0) == async_scheduling
            gc.collect()
            pool._reuse_released()
            assert sum(pool._live) == 0  # every finished sequence's matcher was dropped
    for name, out in zip(FAST[:3], outs[1:4], strict=True):
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMAS[name])
    assert all(c.text in ("red", "green") for c in outs[5].outputs)
    tokens = [[c.token_ids for c in o.outputs] for o in outs]
    return tokens, preemptions


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_workers_sample_the_same_tokens_as_the_engines_matchers(device: str,
                                                                 tmp_path) -> None:
    # float32: tokens do not depend on the batch; async scheduling advances the matchers by
    # the in-flight step's samples, which the workers receive with the next fill. On CUDA the
    # shared bitmasks are page-locked: the sampler's kernel reads a full batch's in place, a
    # mixed batch's (the greedy request beside guided ones) are copied. On the CPU a tiny
    # random model with the bundled tokenizer (the grammars bound every string, number and
    # array, so its JSON ends): SmolLM2's 30 layers took 18 s of steps for the same path.
    model = ({"model": str(tiny_chat_model(tmp_path / "tiny", init_std=0.2))}
             if device == "cpu" else None)
    reference = _run(0, async_scheduling=False, device=device, model=model)[0]
    assert _run(1 if device == "cpu" else 2, async_scheduling=True, device=device,
                model=model)[0] == reference


# Long (15 s): the workers' rollback is also tested directly below, and guided preemption in
# the engine by test_engine_guided.py::test_guided_through_preemption.
@pytest.mark.slow
def test_workers_through_preemption() -> None:
    # 28 blocks of 4 tokens for 7 sequences growing by up to 100: the scheduler preempts
    # (recompute) and the matchers roll back, in the engine or in the worker alike.
    engine = {"block_size": 4, "num_gpu_blocks_override": 28, "max_tokens": 100}
    reference, preemptions = _run(0, async_scheduling=True, **engine)
    assert preemptions > 0
    assert _run(1, async_scheduling=True, **engine) == (reference, preemptions)


@pytest.fixture(scope="module")
def managers() -> tuple[StructuredOutputManager, StructuredOutputManager]:
    llm = LLM(model=None, kv_cache_memory="16MiB", max_num_seqs=4)
    args = (llm.get_tokenizer(), llm.engine.runner.vocab_size, torch.device("cpu"), 8)
    local, remote = StructuredOutputManager(*args), StructuredOutputManager(*args, workers=2)
    llm.engine.shutdown()
    yield local, remote
    remote.shutdown()


def _mask(manager: StructuredOutputManager, grammar: object) -> torch.Tensor:
    return manager.finish_fill(manager.start_fill([grammar], [0], 1)).clone()


def test_rollback_over_sent_and_pending_tokens(managers) -> None:
    local, remote = managers
    guided = GuidedDecodingParams(json=SCHEMAS["flat_required"])
    tokens = local.tokenizer.encode('{"name": "Ann", "age": 7}', add_special_tokens=False)
    grammar = remote.new_grammar(guided, frozenset({2}))
    assert isinstance(grammar, RemoteGrammar)
    assert all(grammar.accept(t) for t in tokens[:6])
    _mask(remote, grammar)  # the worker has accepted six tokens
    assert all(grammar.accept(t, 6 + i) for i, t in enumerate(tokens[6:9]))
    grammar.rollback_to(4)  # drops three pending tokens here, two sent ones there
    reference = local.new_grammar(guided, frozenset({2}))
    for n in (4, 9, len(tokens)):
        assert all(reference.accept(t) for t in tokens[reference.num_accepted:n])
        assert all(grammar.accept(t) for t in tokens[grammar.num_accepted:n])
        assert torch.equal(_mask(remote, grammar), _mask(local, reference)), n
    assert grammar.num_accepted == len(tokens) and not grammar.failed


def test_rows_spread_over_two_workers_fill_as_local_matchers(managers) -> None:
    local, remote = managers
    specs = [GuidedDecodingParams(json=SCHEMAS["flat_required"]), GuidedDecodingParams(
        regex=REGEX), GuidedDecodingParams(choice=["red", "green"])] * 2
    text = ['{"name": "Ann", "age"', "Abc 1", "gr", '{"na', "Xyz", ""]
    rows = [0, 2, 3, 5, 6, 7]
    masks = []
    for manager in (local, remote):
        grammars = [manager.new_grammar(spec, frozenset({2})) for spec in specs]
        for grammar, t in zip(grammars, text, strict=True):
            assert all(grammar.accept(tok) for tok in local.tokenizer.encode(
                t, add_special_tokens=False))
        masks.append(manager.finish_fill(manager.start_fill(grammars, rows, 8))[rows].clone())
    assert {g.worker for g in grammars} == {0, 1}
    assert torch.equal(*masks)


def test_a_repeated_task_fills_as_a_new_one(managers) -> None:
    """Decode steps of the same sequences: `repeat_fill` (the last task's rows again, each
    grammar advanced by its row's sample, no per-row accept) against accept + `start_fill`,
    step by step, in a batch whose row 1 has no grammar (its sample, a stop token, is not a
    grammar's); a sample that may end a grammar, a token accepted outside the task, or a task
    between, is the general path's."""
    _, remote = managers
    specs = [GuidedDecodingParams(json=SCHEMAS["flat_required"]),
             GuidedDecodingParams(regex=REGEX), GuidedDecodingParams(json=SCHEMAS["flat_required"])]
    texts = ['{"name": "Ann", "age": 7}', "Abcde 123", '{"name": "Bo", "age": 12}']
    steps = [remote.tokenizer.encode(t, add_special_tokens=False) for t in texts]
    num_steps = min(map(len, steps))
    rows = [0, 2, 3]
    sampled = np.full((num_steps, 4), 2)  # row 1: no grammar
    sampled[:, rows] = [[row[k] for row in steps] for k in range(num_steps)]
    runs = []
    for repeat in (False, True):
        grammars = [remote.new_grammar(spec, frozenset({2})) for spec in specs]
        fill, masks = None, []
        for k in range(num_steps):
            if repeat and fill is not None:
                fill = remote.repeat_fill(fill, sampled[k])
                assert fill is not None, k
            else:
                for grammar, token in zip(grammars, sampled[k, rows], strict=True):
                    assert grammar.accept(int(token))
                fill = remote.start_fill(grammars, rows, 4)
            assert fill.rows == rows  # the CPU's way: the grammars' rows only
            masks.append(remote.finish_fill(fill)[rows].clone())
        assert [g.num_accepted for g in grammars] == [num_steps] * 3
        runs.append(masks)
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
    assert remote.repeat_fill(fill, np.array([5, 5, 2, 5])) is None  # 2 may end a grammar
    grammars[0].accept(int(sampled[0, 0]))  # outside the task
    assert remote.repeat_fill(fill, sampled[0]) is None
    remote.finish_fill(remote.start_fill(grammars, rows, 4))
    assert remote.repeat_fill(fill, sampled[0]) is None  # not the last task


def test_a_row_without_a_grammar_allows_every_token_after_a_repeat(managers, monkeypatch):
    """CUDA's way (forced here): a mixed step's mask covers every row, the rows without a
    grammar allowing every token. A buffer's rows written by a repeated task are a grammar's
    again: a later mixed step on that buffer must not take them for all-allowed rows; a
    repeated mixed step's other rows allow every token."""
    _, remote = managers
    monkeypatch.setattr(StructuredOutputManager, "_masks_every_row", property(lambda self: True))
    spec = GuidedDecodingParams(json=SCHEMAS["flat_required"])
    g0, g1 = (remote.new_grammar(spec, frozenset({2})) for _ in range(2))
    token = remote.tokenizer.encode("{", add_special_tokens=False)[0]

    def step(fill):
        mask = remote.finish_fill(fill)
        assert fill.rows is None  # every row's mask applies
        return mask.clone()

    assert (step(remote.start_fill([g0], [0], 2))[1] == -1).all()  # buffer a: row 1 mixed
    both = remote.start_fill([g0, g1], [0, 1], 2)  # buffer b: every row guided
    step(both)
    repeated = remote.repeat_fill(both, np.array([token, token]))  # buffer a, every row
    assert repeated is not None
    assert not (step(repeated)[1] == -1).all()  # g1's mask after "{"
    step(remote.start_fill([g0, g1], [0, 1], 2))  # buffer b
    assert (step(remote.start_fill([g0], [0], 2))[1] == -1).all()  # buffer a: mixed again
    # A mixed step repeated, onto buffer b, whose row 1 held g1's mask.
    letters = remote.new_grammar(GuidedDecodingParams(regex="[a-z]+"), frozenset({2}))
    a = remote.tokenizer.encode("a", add_special_tokens=False)[0]
    assert letters.accept(a)
    mixed = remote.start_fill([letters], [0], 2)
    step(mixed)
    repeated = remote.repeat_fill(mixed, np.array([a, 5]))
    assert repeated is not None and (step(repeated)[1] == -1).all()
    assert letters.num_accepted == 2


def test_a_refused_token_fails_the_grammar(managers) -> None:
    _, remote = managers
    grammar = remote.new_grammar(GuidedDecodingParams(choice=["yes", "no"]), frozenset({2}))
    bad = remote.tokenizer.encode("{", add_special_tokens=False)[0]
    assert grammar.accept(bad)  # known only once the worker has tried it
    mask = _mask(remote, grammar)
    assert grammar.failed and bool((mask == -1).all())  # its row allows anything: it ends


def test_a_dead_worker_is_an_error_not_a_hang(managers) -> None:
    manager = StructuredOutputManager(managers[0].tokenizer, managers[0].vocab_size,
                                      torch.device("cpu"), 4, workers=1)
    try:
        grammar = manager.new_grammar(GuidedDecodingParams(regex="[a-z]+"), frozenset({2}))
        _mask(manager, grammar)
        os.kill(manager._workers._procs[0].pid, signal.SIGKILL)
        manager._workers._procs[0].wait()
        t0 = time.perf_counter()
        with pytest.raises(RuntimeError, match="grammar worker 0 died"):
            _mask(manager, grammar)
        assert time.perf_counter() - t0 < 5
    finally:
        manager.shutdown()


def test_workers_setting() -> None:
    assert resolve_workers(2, torch.device("cpu")) == 2
    assert resolve_workers(None, torch.device("cpu")) == 0
    cuda_default = resolve_workers(None, torch.device("cuda"))
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    assert cuda_default == (2 if x86 and (os.cpu_count() or 1) >= 8 else 0)
    with pytest.raises(ValueError, match="guided_decoding_workers must be >= 0, got -1"):
        check_settings(EngineConfig.from_kwargs(device="cpu", guided_decoding_workers=-1))
