"""engine/guided.py's one-pass accept-and-rows (a batch that keeps its requests) against the two
passes it replaces, over random batches of live, finished, failed and ended grammars."""

import copy
import random
from types import SimpleNamespace

import numpy as np

from pagedserve.engine import guided


class FakeGrammar:
    def __init__(self, rng: random.Random) -> None:
        self.failed = rng.random() < 0.1
        self.is_terminated = rng.random() < 0.1
        self.log: list[tuple] = []

    def accept(self, token: int, position: int) -> bool:
        self.log.append(("accept", token, position))
        self.is_terminated = token == 0  # token 0 ends this grammar
        return True

    def rollback_to(self, num_tokens: int) -> None:
        self.log.append(("rollback", num_tokens))


def random_batch(rng: random.Random, size: int):
    requests = []
    for i in range(size):
        grammar = FakeGrammar(rng) if rng.random() < 0.8 else None
        requests.append(SimpleNamespace(
            request_id=f"r{i}", grammar=grammar, is_finished=rng.random() < 0.1,
            output_token_ids=[1] * rng.randrange(5), num_output_tokens=0))
    def samples():
        return np.array([rng.random() < 0.85 for _ in range(size)])
    prev = SimpleNamespace(requests=requests, will_sample=samples(), is_new=[False] * size,
                           num_reqs=size)
    batch = SimpleNamespace(requests=requests, will_sample=samples(), is_new=[False] * size,
                            num_reqs=size)
    sampled = np.array([rng.randrange(4) for _ in range(size)])
    return prev, batch, sampled


def test_one_pass_equals_two():
    rng = random.Random(0)
    for _ in range(300):
        prev, batch, sampled = random_batch(rng, rng.randrange(1, 12))
        prev2, batch2 = copy.deepcopy((prev, batch))  # the same requests in both
        rows, grammars = guided._advance_and_rows(batch, prev.will_sample, sampled)
        rows2, grammars2 = guided.rows_to_mask(batch2, guided.advance_by_step(prev2, sampled))
        assert rows == rows2
        assert [g.log for g in grammars] == [g.log for g in grammars2]
        assert ([r.grammar and (r.grammar.log, r.grammar.is_terminated) for r in batch.requests]
                == [r.grammar and (r.grammar.log, r.grammar.is_terminated)
                    for r in batch2.requests])
