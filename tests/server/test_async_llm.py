"""AsyncLLM in the test process: a bad request beside a good one, abort, a cancelled
consumer, shutdown."""

from __future__ import annotations

import asyncio
import time

import pytest

from pagedserve import SamplingParams
from pagedserve.engine.async_llm import AsyncLLM, EngineDeadError
from tests.server.openai_server import GREEDY, LONG_PROMPT, PROMPTS, REF_TOKENS


def test_async_llm_abort_bad_request_and_cancel(ref):
    engine = ref.llm.engine
    greedy = SamplingParams(max_tokens=REF_TOKENS, **GREEDY)
    long = SamplingParams(max_tokens=2000, **GREEDY)

    async def collect(agen) -> str:
        text = ""
        async for out in agen:
            text = out.outputs[0].text
        return text

    async def main():
        llm = AsyncLLM(engine)
        try:
            good = asyncio.create_task(collect(llm.generate(PROMPTS[4], greedy, "good")))
            with pytest.raises(ValueError, match="maximum context length"):
                await llm.add_request("bad", LONG_PROMPT, SamplingParams(max_tokens=20))
            assert await good == ref.texts[4][REF_TOKENS]

            # abort(): applied before the next step, the stream ends, the blocks are free.
            stream = await llm.add_request("long", PROMPTS[6], long)
            for _ in range(3):
                await stream.__anext__()
            steps = llm.snapshot.num_steps
            await llm.abort("long")
            assert llm.snapshot.num_steps - steps <= 1
            rest = [out async for out in stream]  # at most the step that ran meanwhile
            assert len(rest) <= 1 and stream.aborted
            assert llm.snapshot.num_free_blocks == llm.snapshot.num_blocks

            # A cancelled consumer (a dropped client) aborts its request too.
            started = asyncio.Event()

            async def consume():
                async for _ in llm.generate(PROMPTS[7], long, "cancelled"):
                    started.set()

            task = asyncio.create_task(consume())
            await started.wait()
            task.cancel()
            deadline = time.monotonic() + 60
            while llm.snapshot.num_aborted < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert llm.snapshot.num_aborted == 2
            assert llm.snapshot.num_free_blocks == llm.snapshot.num_blocks

            # Shutdown ends in-flight streams with EngineDeadError and refuses new requests.
            stream = await llm.add_request("inflight", PROMPTS[8], long)
            await stream.__anext__()
            await asyncio.to_thread(llm.shutdown)
            with pytest.raises(EngineDeadError):
                async for _ in stream:
                    pass
            with pytest.raises(EngineDeadError):
                await llm.add_request("late", PROMPTS[0], greedy)
        finally:
            await asyncio.to_thread(llm.shutdown)
        assert not llm.is_running

    asyncio.run(main())
    assert not engine.has_unfinished_requests()
    assert engine.check_blocks_free()
