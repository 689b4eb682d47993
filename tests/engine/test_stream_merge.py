"""A RequestStream whose consumer falls behind hands over one merged output for the several
waiting: deltas joined in order (text, token ids, logprobs), cumulative fields the latest, and
nothing lost or repeated against a consumer that keeps up."""

from __future__ import annotations

import asyncio

from pagedserve import SamplingParams
from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.engine.llm_engine import LLMEngine
from tests.utils.paged import tiny_chat_model


def test_a_slow_consumer_gets_merged_outputs(tmp_path):
    model = str(tiny_chat_model(tmp_path, init_std=0.2))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1, n=2,
                            seed=1)

    async def run(delay: float) -> list:
        llm = AsyncLLM(LLMEngine.from_kwargs(model=model, dtype="float32",
                                             kv_cache_memory="16MiB"))
        try:
            stream = await llm.add_request("r", "Once upon a time", params)
            outputs = []
            async for output in stream:
                outputs.append(output)
                await asyncio.sleep(delay)  # a slow client: the engine's outputs queue up
            return outputs
        finally:
            await asyncio.to_thread(llm.shutdown)

    fast, slow = asyncio.run(run(0.0)), asyncio.run(run(0.05))
    assert len(slow) < len(fast)  # merged
    for outputs in (fast, slow):
        final = outputs[-1]
        assert final.finished and sum(o.finished for o in outputs) == 1
        for c in final.outputs:
            parts = [d for o in outputs for d in o.outputs if d.index == c.index]
            assert "".join(d.delta_text for d in parts) == c.text
            assert [t for d in parts for t in d.delta_token_ids] == c.token_ids
            assert [lp for d in parts for lp in d.delta_logprobs or []] == c.logprobs
            assert len(c.token_ids) == 24
    assert [c.token_ids for c in fast[-1].outputs] == [c.token_ids for c in slow[-1].outputs]
