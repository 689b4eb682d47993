"""LoRA adapters served in one batch through the paged CPU path against each PEFT model
(float32): prefill and decode logits, adapters added at start-up and later, bad adapters."""

from __future__ import annotations

import json

import pytest
import torch

from pagedserve.lora import LoRARequest
from pagedserve.lora.manager import LoRAManager
from pagedserve.models import load_model
from tests.lora.adapters import ADAPTERS, save_adapter, save_base
from tests.utils.paged import PagedHarness

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = save_base(root / "base")
    refs, requests = {}, {}
    for i, (name, (rank, alpha, rslora)) in enumerate(ADAPTERS.items()):
        refs[name] = save_adapter(base, root / name, rank, alpha, rslora, seed=i + 1)
        requests[name] = LoRARequest(name, i + 1, str(root / name))
    return root, base, refs, requests


def _ours(root, max_loras=3):
    loaded = load_model(str(root / "base"), torch.float32, CPU, None)
    return loaded.model, LoRAManager(loaded.model, max_loras=max_loras, max_lora_rank=32,
                                     max_cpu_loras=2)


def _close(ours, ref):
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


def _run_mixed(model, manager, names, requests, prompts, new_tokens):
    """Prefill every prompt in one step, then decode greedily, each request with its adapter
    (None: the base). The logits of every prompt token and every chosen token per request."""
    harness = PagedHarness(model, [len(p) + new_tokens for p in prompts])
    ids = [requests[n].lora_int_id if n else 0 for n in names]
    rows = list(range(len(prompts)))
    seqs = [list(p) for p in prompts]
    logits_out = [[] for _ in prompts]
    tokens, computed = [list(p) for p in prompts], [0] * len(prompts)
    for step in range(new_tokens + 1):
        manager.set_step(ids, [len(t) for t in tokens])
        logits, qsl = harness.step(rows, tokens, computed, len(prompts) if step == 0 else 0)
        for r in rows:
            mine = logits[int(qsl[r]):int(qsl[r + 1])]
            logits_out[r].append(mine)
            computed[r] += len(tokens[r])
            tokens[r] = [int(mine[-1].argmax())]
            seqs[r].append(tokens[r][0])
    return seqs, [torch.cat(chunks) for chunks in logits_out]


@pytest.mark.parametrize("path", ["torch", "kernels",
                                  pytest.param("kernels in graph mode", marks=pytest.mark.slow)])
def test_mixed_batch_matches_peft(setup, path):
    """The torch paths, and Triton's kernels (the interpreter off CUDA) through the layers:
    over the step's blocks, or over every block its rows can have (a graph's mode)."""
    root, base, refs, requests = setup
    if path != "torch":
        pytest.importorskip("triton")
    model, manager = _ours(root)
    manager.batch.use_kernels = path != "torch"
    manager.batch.graph_mode = path == "kernels in graph mode"
    manager.add_adapter(requests["r8"])  # one at start-up, the others as requests arrive
    names = [None, "r8", "r16", "r32", "r16"]
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 17, 9, 20, 3)]
    for n in ("r16", "r32"):
        manager.add_adapter(requests[n])
    seqs, logits = _run_mixed(model, manager, names, requests, prompts, new_tokens=4)
    for name, seq, got in zip(names, seqs, logits, strict=True):
        ref = base if name is None else refs[name]
        with torch.no_grad():
            expected = ref(torch.tensor([seq[:-1]])).logits[0].float()
        _close(got, expected)
    # every adapter changes the logits: the test above could not pass with a dropped term
    with torch.no_grad():
        plain = base(torch.tensor([seqs[1][:-1]])).logits[0]
    assert (logits[1] - plain).abs().max() > 0.1


def test_more_adapters_than_slots_take_turns(setup):
    """One slot and a host cache of two: each step's adapter replaces the last, and one read
    again from disk after the LRU dropped it still matches."""
    root, base, refs, requests = setup
    model, manager = _ours(root, max_loras=1)
    for req in requests.values():
        manager.add_adapter(req)
    prompt = [[5, 9, 11, 40, 7]]
    for name in ("r8", "r32", "r16", "r8"):
        _, logits = _run_mixed(model, manager, [name], requests, prompt, new_tokens=0)
        with torch.no_grad():
            _close(logits[0], refs[name](torch.tensor(prompt)).logits[0])
    with pytest.raises(ValueError, match="over --max-loras 1"):
        manager.set_step([1, 2], [1, 1])


def _broken(root, name, edit):
    src = root / "r8"
    dst = root / name
    if not dst.exists():
        dst.mkdir()
        for f in src.iterdir():
            (dst / f.name).write_bytes(f.read_bytes())
        edit(dst)
    return LoRARequest(name, 9, str(dst))


def _set_config(key, value):
    def edit(path):
        config = json.loads((path / "adapter_config.json").read_text())
        config[key] = value
        (path / "adapter_config.json").write_text(json.dumps(config))
    return edit


def test_bad_adapters_get_clear_errors(setup, tmp_path):
    root, base, refs, requests = setup
    model, manager = _ours(root)
    cases = [
        (_broken(root, "dora", _set_config("use_dora", True)), "DoRA"),
        (_broken(root, "saved", _set_config("modules_to_save", ["lm_head"])),
         "modules_to_save"),
        (_broken(root, "noweights",
                 lambda p: (p / "adapter_model.safetensors").unlink()),
         "missing adapter_model.safetensors"),
        (LoRARequest("nowhere", 9, str(tmp_path / "nowhere")), "no directory"),
    ]
    for request, message in cases:
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            manager.add_adapter(request)
    small = LoRAManager(load_model(str(root / "base"), torch.float32, CPU, None).model,
                        max_loras=1, max_lora_rank=16)
    with pytest.raises(ValueError, match="rank 32, over --max-lora-rank 16"):
        small.add_adapter(requests["r32"])


def test_adapter_for_another_base_is_refused(setup, tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.lora.adapters import TINY

    root, *_ = setup
    other = AutoModelForCausalLM.from_config(LlamaConfig(**{**TINY, "hidden_size": 32}))
    save_adapter(other, tmp_path / "other", 8, 8, False, seed=7)
    _, manager = _ours(root)
    with pytest.raises(ValueError, match="the adapter was trained for another base model"):
        manager.add_adapter(LoRARequest("other", 5, str(tmp_path / "other")))


def test_phi3_adapter_on_layers_fused_in_the_checkpoint(tmp_path):
    """Phi-3's checkpoint (and so PEFT) names qkv_proj and gate_up_proj whole: one factor pair
    over every fused part."""
    from transformers import AutoModelForCausalLM, Phi3Config

    from tests.lora.adapters import TINY

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(Phi3Config(**TINY), attn_implementation="eager",
                                            dtype=torch.float32)
    with torch.no_grad():
        for name, p in base.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name
                    else 0.15 * torch.randn_like(p))
    base.save_pretrained(tmp_path / "base")
    ref = save_adapter(base.eval(), tmp_path / "a", 8, 16, False, seed=1)
    assert any("gate_up_proj.lora_A" in n for n, _ in ref.named_parameters())
    model = load_model(str(tmp_path / "base"), torch.float32, CPU, None).model
    manager = LoRAManager(model, max_loras=1, max_lora_rank=8)
    manager.add_adapter(LoRARequest("a", 1, str(tmp_path / "a")))
    prompt = [[5, 9, 11, 40, 7, 100]]
    seqs, logits = _run_mixed(model, manager, ["a"], {"a": LoRARequest("a", 1, "")}, prompt, 2)
    seq = seqs[0][:-1]
    with torch.no_grad():
        _close(logits[0], ref(torch.tensor([seq])).logits[0])
        assert (logits[0] - base(torch.tensor([seq])).logits[0]).abs().max() > 0.1
