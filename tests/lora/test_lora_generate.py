"""`pagedserve generate` through adapters of --lora-modules: `--lora NAME` for every request,
an --input line's `lora` field for its own; an unknown name is reported before the model
loads (the flags were accepted, but no request could use an adapter)."""

from __future__ import annotations

import json

import pytest
import torch

from pagedserve.cli import main
from tests.lora.adapters import save_adapter, save_base

PROMPT = [5, 17, 33, 80, 9, 41, 2, 77]


def _greedy(model, n=4):
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


def test_lines_pick_their_adapter(tmp_path, capsys):
    base = save_base(tmp_path / "base")
    ref = save_adapter(base, tmp_path / "r8", 8, 16, False, seed=1)
    lines = [{"prompt": PROMPT, "lora": "r8"}, {"prompt": PROMPT}, {"prompt": PROMPT, "lora": "x"}]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    flags = ["--model", str(tmp_path / "base"), "--dtype", "float32", "--device", "cpu",
             "--kv-cache-memory", "8MiB", "--enable-lora", "--lora-modules",
             f"r8={tmp_path / 'r8'}", "--max-tokens", "4", "--temperature", "0", "--ignore-eos"]
    assert main(["generate", *flags, "--input", str(src), "--output",
                 str(tmp_path / "out.jsonl")]) == 1
    assert "in.jsonl:3: lora 'x' is no adapter of --lora-modules (they are: r8)" in \
        capsys.readouterr().err
    out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [(r["line"], r["token_ids"]) for r in out] == [(1, _greedy(ref)), (2, _greedy(base))]
    # --lora: the default of every line
    assert _greedy(ref) != _greedy(base)
    assert main(["generate", *flags, "--lora", "r8", "--input", str(src), "--output",
                 str(tmp_path / "out.jsonl")]) == 1
    out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["token_ids"] for r in out] == [_greedy(ref), _greedy(ref)]
    with pytest.raises(SystemExit, match="--lora 'y' is no adapter of --lora-modules"):
        main(["generate", *flags, "--lora", "y", "--input", str(src)])
