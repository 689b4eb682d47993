"""--limit-mm-per-prompt in vLLM's spellings, from the command line and from LLM(...)."""

from __future__ import annotations

import argparse

import pytest

from pagedserve.arg_utils import add_engine_args, engine_config
from pagedserve.config import DEFAULT_MM_LIMIT, EngineConfig


@pytest.mark.parametrize("flag,images", [
    ('{"image": 3}', 3), ("image=0", 0), ("image=4,video=0", 4), ('{"image": {"count": 1}}', 1),
])
def test_flag_spellings(flag: str, images: int) -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config(parser.parse_args(["--limit-mm-per-prompt", flag]))
    assert config.model.mm_limit("image") == images


def test_default_and_dict() -> None:
    assert EngineConfig.from_kwargs().model.mm_limit("image") == DEFAULT_MM_LIMIT
    assert EngineConfig.from_kwargs(limit_mm_per_prompt={"image": 5}).model.mm_limit("image") == 5


@pytest.mark.parametrize("value,words", [
    ("image=-1", "count >= 0, got -1"), ("image=two", "count >= 0, got 'two'"),
    ("image", "not MODALITY=COUNT"), ('{"image": 2', "not valid JSON"),
    ("video=1", "video inputs are not supported"), ("pictures=1", "unknown modality"),
    ({"image": True}, "got True"), ('{"image": {"count": 1, "width": 9}}', "profiling sizes"),
    ("[1, 2]", "not MODALITY=COUNT"),
])
def test_bad_limits_are_named(value, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        EngineConfig.from_kwargs(limit_mm_per_prompt=value)
