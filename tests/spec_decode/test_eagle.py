"""EAGLE-1 and EAGLE-3 heads written by the test in their published on-disk format (config.json
and weights named as `yuhuili/EAGLE3-LLaMA3.1-Instruct-8B` and EAGLE-1 heads name them):
their drafts equal a plain-torch float32 reference of the published forward (tap layers, norms,
the fc input order, the d2t map; greedy equality alone holds for any drafts), greedy outputs
equal those without speculation over chunked prefill and preemption, seeded sampling
reproduces, and heads that do not fit the target are refused at start-up."""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from pagedserve import SamplingParams
from tests.spec_decode.test_engine import VOCAB, _assert_same, _prompts, _run, _tiny

H, HEADS, KV_HEADS, INTER = 32, 4, 2, 64
DRAFT_VOCAB = 50


def _head_config(h=H, heads=HEADS, kv_heads=KV_HEADS, **extra) -> dict:
    return dict(hidden_size=h, intermediate_size=INTER, num_attention_heads=heads,
                num_key_value_heads=kv_heads, num_hidden_layers=1, vocab_size=VOCAB,
                rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=256,
                hidden_act="silu", tie_word_embeddings=False, **extra)


def _layer(g: torch.Generator, prefix: str, qkv_in: int, input_norm: bool, h=H, heads=HEADS,
           kv_heads=KV_HEADS) -> dict:
    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.3

    d = h // heads
    out = {f"{prefix}.self_attn.q_proj.weight": w(heads * d, qkv_in),
           f"{prefix}.self_attn.k_proj.weight": w(kv_heads * d, qkv_in),
           f"{prefix}.self_attn.v_proj.weight": w(kv_heads * d, qkv_in),
           f"{prefix}.self_attn.o_proj.weight": w(h, heads * d),
           f"{prefix}.mlp.gate_proj.weight": w(INTER, h),
           f"{prefix}.mlp.up_proj.weight": w(INTER, h),
           f"{prefix}.mlp.down_proj.weight": w(h, INTER),
           f"{prefix}.post_attention_layernorm.weight": 1 + w(h)}
    if input_norm:
        out[f"{prefix}.input_layernorm.weight"] = 1 + w(h)
    return out


def write_eagle3(path, tap_ids=None, seed=5, fc_in=None, max_positions=256, h=H, heads=HEADS,
                 kv_heads=KV_HEADS, vocab=VOCAB, **config_extra) -> str:
    """An EAGLE-3 head (pytorch_model.bin, as the published one): fc, midlayer with its
    hidden_norm, norm, a draft vocabulary of DRAFT_VOCAB ids mapped by d2t; no embedding.
    `config_extra`: more config.json fields (an M-RoPE head's rope_scaling)."""
    g = torch.Generator().manual_seed(seed)
    weights = _layer(g, "midlayer", 2 * h, input_norm=True, h=h, heads=heads,
                     kv_heads=kv_heads)
    weights["midlayer.hidden_norm.weight"] = 1 + torch.randn(h, generator=g) * 0.3
    weights["fc.weight"] = torch.randn(h, fc_in or 3 * h, generator=g) * 0.3
    weights["norm.weight"] = 1 + torch.randn(h, generator=g) * 0.3
    weights["lm_head.weight"] = torch.randn(DRAFT_VOCAB, h, generator=g)
    target_ids = torch.randperm(vocab, generator=g)[:DRAFT_VOCAB].sort().values
    weights["d2t"] = target_ids - torch.arange(DRAFT_VOCAB)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[target_ids] = True
    weights["t2d"] = t2d
    extra = {"draft_vocab_size": DRAFT_VOCAB, "architectures": ["LlamaForCausalLMEagle3"],
             **config_extra}
    if tap_ids is not None:
        extra["eagle_aux_hidden_state_layer_ids"] = tap_ids
    path.mkdir(parents=True, exist_ok=True)
    config = dict(_head_config(h, heads, kv_heads, **extra), max_position_embeddings=max_positions,
                  vocab_size=vocab)
    (path / "config.json").write_text(json.dumps(config))
    torch.save(weights, path / "pytorch_model.bin")
    return str(path)


def write_eagle1(path, seed=6) -> str:
    """An EAGLE-1 head (safetensors): fc with a bias over concat(embedding, hidden), layers.0
    without an input norm, its own embedding."""
    g = torch.Generator().manual_seed(seed)
    weights = _layer(g, "layers.0", H, input_norm=False)
    weights["fc.weight"] = torch.randn(H, 2 * H, generator=g) * 0.3
    weights["fc.bias"] = torch.randn(H, generator=g) * 0.3
    weights["embed_tokens.weight"] = torch.randn(VOCAB, H, generator=g)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(_head_config(architectures=["LlamaForCausalLM"])))
    save_file(weights, str(path / "model.safetensors"))
    return str(path)


# ---- the reference: the published heads' forward in plain torch, float32 -------------------

def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, positions):
    d = x.shape[-1]
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    ang = positions[:, None].float() * inv[None, :]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _attention(w, prefix, x):
    """Causal attention of positions 0..n-1 over themselves (x: [n, in])."""
    n, d = x.shape[0], H // HEADS
    pos = torch.arange(n)
    q = _rope((x @ w[f"{prefix}.self_attn.q_proj.weight"].T).view(n, HEADS, d), pos)
    k = _rope((x @ w[f"{prefix}.self_attn.k_proj.weight"].T).view(n, KV_HEADS, d), pos)
    v = (x @ w[f"{prefix}.self_attn.v_proj.weight"].T).view(n, KV_HEADS, d)
    k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, HEADS * d)
    return out @ w[f"{prefix}.self_attn.o_proj.weight"].T


def _mlp(w, prefix, x):
    gate = x @ w[f"{prefix}.mlp.gate_proj.weight"].T
    up = x @ w[f"{prefix}.mlp.up_proj.weight"].T
    return (torch.nn.functional.silu(gate) * up) @ w[f"{prefix}.mlp.down_proj.weight"].T


def _eagle3_layer(w, embeds, hidden):
    x = torch.cat([_rms(embeds, w["midlayer.input_layernorm.weight"]),
                   _rms(hidden, w["midlayer.hidden_norm.weight"])], -1)
    h = hidden + _attention(w, "midlayer", x)
    return h + _mlp(w, "midlayer", _rms(h, w["midlayer.post_attention_layernorm.weight"]))


def _eagle1_layer(w, embeds, hidden):
    x = torch.cat([embeds, hidden], -1) @ w["fc.weight"].T + w["fc.bias"]
    h = x + _attention(w, "layers.0", x)
    return h + _mlp(w, "layers.0", _rms(h, w["layers.0.post_attention_layernorm.weight"]))


def reference_drafts(method, head_path, target, tokens, k, taps=None):
    """K greedy drafts after `tokens` from the head's published forward: position i reads the
    target's hidden state at i and token i + 1; later drafts feed back its own output."""
    w = (torch.load(f"{head_path}/pytorch_model.bin") if method == "eagle3" else
         load_file(f"{head_path}/model.safetensors"))
    with torch.no_grad():
        out = target(torch.tensor([tokens]), output_hidden_states=True)
        states = out.hidden_states  # [i]: the input of layer i; [-1]: the final normed one
        if method == "eagle3":
            hidden = torch.cat([states[i][0] for i in taps], -1)[:-1] @ w["fc.weight"].T
            embed = target.model.embed_tokens.weight
        else:
            hidden = states[-1][0][:-1]
            embed = w["embed_tokens.weight"]
        inputs, drafts = list(tokens[1:]), []
        layer = _eagle3_layer if method == "eagle3" else _eagle1_layer
        for _ in range(k):
            g = layer(w, embed[torch.tensor(inputs)], hidden)
            last = g[-1]
            if method == "eagle3":
                d = int((_rms(last, w["norm.weight"]) @ w["lm_head.weight"].T).argmax())
                token = d + int(w["d2t"][d])
            else:
                token = int(target.lm_head(last).argmax())
            drafts.append(token)
            inputs.append(token)
            hidden = torch.cat([hidden, last[None]], 0)
    return drafts


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return _tiny(tmp_path_factory.mktemp("tiny_eagle"), 0, H, 2)


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    return {"eagle3": write_eagle3(root / "eagle3", tap_ids=[1, 0, 1]),
            "eagle": write_eagle1(root / "eagle1")}


def _spec(method, heads, k=3, **extra):
    return {"method": method, "model": heads[method], "num_speculative_tokens": k, **extra}


def _record_drafts(monkeypatch):
    """Every (verified tokens, drafts) the proposer gave."""
    from pagedserve.spec_decode.eagle import EagleProposer

    seen = []
    propose = EagleProposer.propose_from

    def spy(self, runner, step):
        drafts = propose(self, runner, step)
        for i in range(len(step.rows)):
            if drafts.counts[i]:
                n = int(step.num_tokens[i])
                seen.append((runner.input_batch.token_ids[step.rows[i], :n].tolist(),
                             drafts.row(i)))
        return drafts

    monkeypatch.setattr(EagleProposer, "propose_from", spy)
    return seen


@pytest.mark.parametrize("method, layers", [("eagle3", 7), ("eagle", 2)])
def test_drafts_equal_the_published_forward(tmp_path, make_llm, monkeypatch, method, layers):
    """EAGLE-3 over a 7-layer target with the default taps (2, 3, 4), EAGLE-1 with its own
    embedding; a small step budget splits prompts into chunks. Drafts are kept at rate 0.5
    whatever the target says (synthetic), so that the head's pass after a step covers kept
    drafts as well as single tokens (a random head's drafts are hardly ever the target's)."""
    target_path = _tiny(tmp_path / "target", 0, H, layers)
    # (The EAGLE-3 head ships a shorter context than its target's: its rope covers the
    # target's.)
    head = (write_eagle3(tmp_path / "head", max_positions=16) if method == "eagle3"
            else write_eagle1(tmp_path / "head"))
    seen = _record_drafts(monkeypatch)
    prompts = _prompts()[:4]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    _, stats = _run(make_llm, target_path, prompts, params,
                    {"method": method, "model": head, "num_speculative_tokens": 3,
                     "rejection_sample_method": "synthetic", "synthetic_acceptance_rate": 0.5},
                    max_num_batched_tokens=16)
    assert len(seen) > 10
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    target = transformers.AutoModelForCausalLM.from_pretrained(
        target_path, attn_implementation="eager", torch_dtype=torch.float32)
    default_taps = (2, layers // 2, layers - 3)
    for tokens, drafts in seen:
        assert drafts == reference_drafts(method, head, target, tokens, len(drafts),
                                          default_taps)[:len(drafts)]


CASES = {
    "plain": dict(),
    "chunked": dict(max_num_batched_tokens=16),
    "preempting": dict(num_gpu_blocks_override=20, block_size=4, kv_cache_memory=None),
    "prefix-caching": dict(enable_prefix_caching=True, block_size=4),
    "async": dict(async_scheduling=True),
    "flex": dict(attention_backend="FLEX_ATTENTION", block_size=4),
    # Steps overlap without drafts while 4 or more requests run: the head's pass after each
    # step then runs after the next step's launch, and drafting resumes on its K/V.
    "overlap": dict(async_scheduling=True),
    "context-limit": dict(max_model_len=40),  # the head's pass and drafts cut at the end
}
# Paths the draft model's fast tests run already.
SLOW = ("prefix-caching", "async", "flex", "overlap", "context-limit")


@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.slow] if c in SLOW else [])
                                  for c in CASES])
@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_greedy_equals_no_speculation(tiny_path, heads, make_llm, case, method):
    prompts, params = _prompts(), [
        SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=2)
        for m in (1, 2, 5, 16, 21, 28)] + [
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[11, 12, 13]),
        SamplingParams(temperature=0, n=2, max_tokens=14, ignore_eos=True)]
    if case in ("chunked", "flex"):
        prompts, params = prompts[5:], params[5:]
    if case == "context-limit":  # every request runs to max_model_len
        params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True, logprobs=1)
    want, _ = _run(make_llm, tiny_path, prompts, params, None, **CASES[case])
    spec = _spec(method, heads, **({"disable_by_batch_size": 4} if case == "overlap" else {}))
    got, stats = _run(make_llm, tiny_path, prompts, params, spec, **CASES[case])
    _assert_same(got, want)
    assert stats.spec_decode_num_drafts > 0
    if case == "preempting":
        assert stats.num_preemptions > 0
    if case == "prefix-caching":
        assert stats.prefix_cache_hits > 0


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_seeded_sampling_reproduces(tiny_path, heads, make_llm, method):
    prompts = _prompts()
    params = [SamplingParams(temperature=t, top_k=k, top_p=0.9, seed=s, max_tokens=25,
                             ignore_eos=True, logprobs=1)
              for s, (t, k) in enumerate([(0.5, 5), (1.0, 0), (0.3, 20)] * 3)][:len(prompts)]
    spec = _spec(method, heads)
    first, stats = _run(make_llm, tiny_path, prompts, params, spec)
    second, _ = _run(make_llm, tiny_path, prompts[::-1], params[::-1], spec)
    _assert_same(second[::-1], first)
    assert stats.spec_decode_num_draft_tokens > 0


def test_synthetic_acceptance_times_a_random_head(tmp_path, make_llm):
    """The timing path (benchmarks/spec_decode.py --random-eagle3-head): a random head of the
    target's shape with the default taps, its drafts kept at rate 1 (not the target's
    output): every step after the prompt's verifies K = 3 drafts, so 13 tokens take the
    prompt's step and 3 verify steps of 4 tokens each."""
    from pagedserve.spec_decode.random_head import write_random_eagle3_head

    target = _tiny(tmp_path / "target", 0, H, 4)
    head = write_random_eagle3_head(tmp_path / "head",
                                    transformers.AutoConfig.from_pretrained(target), 40,
                                    dtype=torch.float32)
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 3,
            "rejection_sample_method": "synthetic", "synthetic_acceptance_rate": 1.0}
    _, stats = _run(make_llm, target, _prompts()[:4], SamplingParams(
        temperature=0, max_tokens=13, ignore_eos=True), spec)
    assert stats.spec_decode_num_drafts == 4 * 3
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens == 36


@pytest.mark.parametrize("kind, message", [
    ("default-taps", r"taps the target's layers \[2, 1, -1\]; the target has 2 layers"),
    ("fc", r"fc of shape \(32, 48\); over a target of hidden size 32 it needs \(32, 96\)"),
    ("eagle1-as-eagle3", "is no EAGLE-3 head"),
    ("eagle3-as-eagle1", "is no EAGLE-1 head"),
    ("not-a-directory", "does not exist as a local model directory"),
    ("hidden-size", "the EAGLE-1 head .* has hidden size 32, the target 48"),
])
def test_heads_that_do_not_fit_are_refused(tiny_path, heads, tmp_path, kind, message):
    from pagedserve import LLM

    if kind == "hidden-size":  # a target of another width
        tiny_path = _tiny(tmp_path / "wide", 0, 48, 2)

    if kind == "default-taps":
        spec = {"method": "eagle3", "model": write_eagle3(tmp_path / "h")}
    elif kind == "fc":
        spec = {"method": "eagle3", "model": write_eagle3(tmp_path / "h", [0, 1, 1],
                                                          fc_in=48)}
    elif kind == "eagle1-as-eagle3":
        spec = {"method": "eagle3", "model": heads["eagle"]}
    elif kind == "hidden-size":
        spec = {"method": "eagle", "model": heads["eagle"]}
    elif kind == "eagle3-as-eagle1":
        spec = {"method": "eagle", "model": heads["eagle3"]}
    else:
        spec = {"method": "eagle3", "model": str(tmp_path / "nothing")}
    with pytest.raises(ValueError, match=message):
        LLM(model=tiny_path, dtype="float32", device="cpu", kv_cache_memory="8MiB",
            speculative_config=dict(spec, num_speculative_tokens=2))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["TRITON", "FLEX_ATTENTION"])
def test_cuda_greedy_equals_no_speculation(tmp_path, make_llm, backend):
    """On CUDA in float32: an EAGLE-3 head's pass and draft steps run eagerly beside the
    target's verify steps (head sizes of 64 for TRITON)."""
    from pagedserve.spec_decode.random_head import write_random_eagle3_head

    path = _tiny(tmp_path / "target", 0, 128, 4, heads=2)
    head = write_random_eagle3_head(tmp_path / "head",
                                    transformers.AutoConfig.from_pretrained(path), 60,
                                    dtype=torch.float32)
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 3}
    kwargs = dict(device="cuda", attention_backend=backend, engine_core_process=False)
    prompts = _prompts()
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1)
    want, _ = _run(make_llm, path, prompts, params, None, gpu_memory_utilization=0.05,
                   **kwargs)
    got, stats = _run(make_llm, path, prompts, params, spec, gpu_memory_utilization=0.05,
                      **kwargs)
    _assert_same(got, want)
    assert stats.spec_decode_num_draft_tokens > 0


@pytest.mark.slow
def test_triton_backend_in_the_interpreter(tmp_path, make_llm):
    """TRITON's kernels (Triton's interpreter on the CPU) over the head's pass after each step
    and its draft steps; head sizes of 64."""
    pytest.importorskip("triton")
    from pagedserve.spec_decode.random_head import write_random_eagle3_head

    path = _tiny(tmp_path / "target", 0, 128, 4, heads=2)
    head = write_random_eagle3_head(tmp_path / "head",
                                    transformers.AutoConfig.from_pretrained(path), 60,
                                    dtype=torch.float32)
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 2}
    prompts, params = _prompts()[:3], SamplingParams(temperature=0, max_tokens=8,
                                                     ignore_eos=True)
    want, _ = _run(make_llm, path, prompts, params, None, attention_backend="TRITON")
    got, stats = _run(make_llm, path, prompts, params, spec, attention_backend="TRITON")
    _assert_same(got, want)
    assert stats.spec_decode_num_draft_tokens > 0
