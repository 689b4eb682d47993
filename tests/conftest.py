import os

# Triton kernels run on CPU tensors in the interpreter; it must be set before triton is imported.
if not os.environ.get("CUDA_VISIBLE_DEVICES_FORCE_GPU"):
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")

# Engine core processes and tensor-parallel workers fork from one forkserver that imported
# their modules once: about 4 s a process less than a fresh interpreter each, for the suite's
# dozens of them. The product's default, spawn, keeps tests of its own, which ask for it by
# name: the served two ranks, a dropped two-rank engine's exit, the processes under a served
# core, an orphaned core.
os.environ.setdefault("PAGEDSERVE_PROCESS_START_METHOD", "forkserver")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def make_llm():
    """Build LLMs for a test; afterwards every KV block of each must be free again."""
    from pagedserve import LLM

    made = []

    def make(**kwargs):
        llm = LLM(**kwargs)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        engine = llm.engine
        assert not engine.has_unfinished_requests(), "requests left in the engine"
        stats = engine.call_utility("stats")  # also from an engine core process
        assert stats.all_free, f"{stats.num_blocks - stats.num_free_blocks} KV blocks leaked"
        engine.shutdown()
