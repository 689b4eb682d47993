"""An EAGLE-3 head over a tiny Qwen2.5-VL (or Qwen3-VL) whose config declares M-RoPE as heads
trained for them do (`rope_scaling: {type: mrope, mrope_section}`; Qwen3-VL's with
`mrope_interleaved`): its drafts equal a plain-torch float32 reference of the published head
forward over the target's tapped layer inputs (forward pre-hooks on transformers' decoder
layers; Qwen3-VL's include the DeepStack rows added before them), turned by transformers' own
M-RoPE positions (`get_rope_index` over the sequence; past it, index + delta on every row),
over prompts with one and two images split by chunked prefill and with the one-token steps
on the padded draft-graph path; greedy outputs equal those without speculation."""

from __future__ import annotations

import math

import pytest
import torch

from pagedserve import SamplingParams
from tests.multimodal.qwen_vl_fixtures import (
    IMAGE,
    VOCAB,
    image_prompt,
    images,
    save_qwen_tokenizer,
    save_tiny_qwen2_5_vl,
    save_tiny_qwen3_vl,
)
from tests.spec_decode.test_draft_graphs import _install
from tests.spec_decode.test_eagle import _mlp, _record_drafts, _rms, write_eagle3

H, HEADS, KV_HEADS = 64, 4, 2  # the tiny Qwen2.5-VL's decoder: head_dim 16
SECTION = [2, 3, 3]  # of its 8 rotary frequencies: temporal, height, width
TAPS = [1, 0, 1]
ROPE = {"qwen2_5_vl": {"type": "mrope", "mrope_section": SECTION},  # published heads' forms
        "qwen3_vl": {"rope_type": "default", "mrope_section": SECTION,
                     "mrope_interleaved": True}}


def _target(root, family: str):
    import transformers

    save = save_tiny_qwen2_5_vl if family == "qwen2_5_vl" else save_tiny_qwen3_vl
    path = save(root / "target")
    save_qwen_tokenizer(path)
    head = write_eagle3(root / "head", tap_ids=TAPS, h=H, heads=HEADS, kv_heads=KV_HEADS,
                        vocab=VOCAB, rope_scaling=ROPE[family])
    cls = (transformers.Qwen2_5_VLForConditionalGeneration if family == "qwen2_5_vl"
           else transformers.Qwen3VLForConditionalGeneration)
    hf = cls.from_pretrained(path, attn_implementation="eager").eval()
    return str(path), head, hf


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return _target(tmp_path_factory.mktemp("qwen2_5_vl_eagle"), "qwen2_5_vl")


def _requests() -> list[dict]:
    ims = images()
    return [
        {"prompt_token_ids": image_prompt([3, 4], [5, 6, 7]),
         "multi_modal_data": {"image": ims[0]}},
        {"prompt_token_ids": image_prompt([8], [9], [10, 11]),
         "multi_modal_data": {"image": [ims[2], ims[1]]}},
        {"prompt_token_ids": [12, 13, 14, 15, 16]},  # text only
    ]


def _llm(make_llm, path, spec=None, **kwargs):
    return make_llm(model=path, dtype="float32", device="cpu", kv_cache_memory="4MiB",
                    speculative_config=spec, **kwargs)


# ---- the reference: the published head's forward turned by M-RoPE positions ---------------

def _mrope(x, positions, interleaved):
    """x [n, heads, 16] turned by positions [3, n]: frequency j by the row of its section
    (Qwen2.5-VL: three blocks; Qwen3-VL: j % 3 within the first 3 * section[row])."""
    d = x.shape[-1]
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    row = torch.repeat_interleave(torch.arange(3), torch.tensor(SECTION))
    if interleaved:
        j = torch.arange(d // 2)
        row = torch.where((j % 3 > 0) & (j < 3 * torch.tensor(SECTION)[j % 3]), j % 3, 0)
    ang = positions[row].T.float() * inv  # [n, d/2]: each frequency at its row's position
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _attention(w, x, positions, interleaved):
    n, d = x.shape[0], H // HEADS
    q = _mrope((x @ w["midlayer.self_attn.q_proj.weight"].T).view(n, HEADS, d), positions,
               interleaved)
    k = _mrope((x @ w["midlayer.self_attn.k_proj.weight"].T).view(n, KV_HEADS, d), positions,
               interleaved)
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(n, KV_HEADS, d)
    k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, HEADS * d)
    return out @ w["midlayer.self_attn.o_proj.weight"].T


@torch.no_grad()
def _reference_drafts(hf, head_path, tokens, extra, k):
    """K greedy drafts after `tokens` (prompt and outputs so far): position i reads the
    target's tapped states at i and token i + 1, turned by transformers' M-RoPE rows of
    position i; drafts past the sequence at index + delta on every row."""
    w = torch.load(f"{head_path}/pytorch_model.bin")
    interleaved = "Qwen3" in type(hf).__name__
    ids = torch.tensor([tokens])
    types = (ids == IMAGE).int()
    states = {}  # [i]: the input of decoder layer i
    hooks = [layer.register_forward_pre_hook(lambda _, args, i=i: states.setdefault(i, args[0]))
             for i, layer in enumerate(hf.model.language_model.layers)]
    hf(input_ids=ids, mm_token_type_ids=types, **extra)
    for hook in hooks:
        hook.remove()
    rows, delta = hf.model.get_rope_index(ids, types, extra.get("image_grid_thw"))
    rows, delta = rows[:, 0], int(delta.reshape(-1)[0])
    n = len(tokens)
    past = torch.arange(n, n + k) + delta  # where drafts go: index + delta, all rows
    positions = torch.cat([rows, past.expand(3, -1)], dim=1)
    hidden = torch.cat([states[i][0] for i in TAPS], -1)[:-1] @ w["fc.weight"].T
    embed = hf.model.language_model.embed_tokens.weight
    inputs, drafts = list(tokens[1:]), []
    for _ in range(k):
        m = len(inputs)
        x = torch.cat([_rms(embed[torch.tensor(inputs)], w["midlayer.input_layernorm.weight"]),
                       _rms(hidden, w["midlayer.hidden_norm.weight"])], -1)
        h = hidden + _attention(w, x, positions[:, :m], interleaved)
        g = h + _mlp(w, "midlayer", _rms(h, w["midlayer.post_attention_layernorm.weight"]))
        last = g[-1]
        d = int((_rms(last, w["norm.weight"]) @ w["lm_head.weight"].T).argmax())
        token = d + int(w["d2t"][d])
        drafts.append(token)
        inputs.append(token)
        hidden = torch.cat([hidden, last[None]], 0)
    return drafts


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_mrope_head_drafts_equal_the_published_forward(target, tmp_path, make_llm, monkeypatch,
                                                       family):
    """Drafts kept at rate 0.5 whatever the target says (synthetic), so the head's pass after
    a step covers prompt chunks (8-token steps split the image spans), kept drafts and single
    tokens past the prompt; its one-token steps go through the padded draft-graph path, which
    reads the proposer's M-RoPE buffer."""
    path, head, hf = target if family == "qwen2_5_vl" else _target(tmp_path, family)
    made = _install(monkeypatch, "eagle3", capture=False)
    seen = _record_drafts(monkeypatch)
    llm = _llm(make_llm, path, {"method": "eagle3", "model": head, "num_speculative_tokens": 3,
                                "rejection_sample_method": "synthetic",
                                "synthetic_acceptance_rate": 0.5},
               max_num_batched_tokens=8, max_num_seqs=4)
    requests = _requests()
    llm.generate(requests, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                 use_tqdm=False)
    assert made[0].replays > 0
    # Each recorded sequence's request: the one whose expanded prompt it starts with.
    prompts = []
    for req in requests:
        imgs = req.get("multi_modal_data", {}).get("image", [])
        imgs = imgs if isinstance(imgs, list) else [imgs]
        processed = llm.engine.mm_processor.process(req["prompt_token_ids"], imgs)
        extra = {}
        if imgs:
            feats = processed.features
            extra = dict(pixel_values=torch.cat([f.data["pixel_values"] for f in feats]),
                         image_grid_thw=torch.stack([f.data["image_grid_thw"] for f in feats]))
        prompts.append((processed.prompt_token_ids, extra))
    checked = set()
    for tokens, drafts in seen:
        (i, (prompt, extra)), = [(i, p) for i, p in enumerate(prompts)
                                 if tokens[:len(p[0])] == p[0]]
        assert drafts == _reference_drafts(hf, head, tokens, extra, len(drafts)), (i, tokens)
        checked.add(i)
    assert checked == {0, 1, 2}


def test_mrope_head_greedy_equals_no_speculation(target, make_llm):
    path, head, _ = target
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in _llm(make_llm, path).generate(
        _requests(), params, use_tqdm=False)]
    llm = _llm(make_llm, path, {"method": "eagle3", "model": head, "num_speculative_tokens": 3})
    got = [o.outputs[0].token_ids for o in llm.generate(_requests(), params, use_tqdm=False)]
    assert got == want
    assert llm.engine.call_utility("stats").spec_decode_num_draft_tokens > 0


@pytest.mark.parametrize("kind, message", [
    ("text-target", r"turns by M-RoPE positions \(mrope_section \[2, 3, 3\]\); the target "
                    "LlamaForCausalLM places its tokens by one position row"),
    ("section", r"mrope_section \[2, 3, 2\] covers 14 rotary dims, the heads turn 16"),
    ("vl-draft-model", r"\(Qwen2_5_VLForConditionalGeneration\) takes images"),
])
def test_what_cannot_draft_right_is_refused(target, tmp_path, kind, message):
    from pagedserve import LLM
    from tests.spec_decode.test_engine import VOCAB as TEXT_VOCAB
    from tests.spec_decode.test_engine import _tiny

    path, _, _ = target
    if kind == "vl-draft-model":
        spec = {"method": "draft_model", "model": path}
    else:
        section = SECTION if kind == "text-target" else [2, 3, 2]
        spec = {"method": "eagle3", "model": write_eagle3(
            tmp_path / "head", tap_ids=TAPS, h=H, heads=HEADS, kv_heads=KV_HEADS,
            vocab=TEXT_VOCAB if kind == "text-target" else VOCAB,
            rope_scaling={"type": "mrope", "mrope_section": section})}
    if kind == "text-target":
        path = _tiny(tmp_path / "text", 0, H, 2)
    with pytest.raises(ValueError, match=message):
        LLM(model=path, dtype="float32", device="cpu", kv_cache_memory="4MiB",
            speculative_config=dict(spec, num_speculative_tokens=2))
