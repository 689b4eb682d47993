"""Linear-attention state ops (gated delta rule, lightning attention) over a step's packed
tokens: prefills of 1, 5, 17 and 70 tokens (across chunk/block boundaries) then several decodes,
some continuing from a saved state and some starting over a slot that holds NaN garbage.

References: for the gated delta rule, transformers' own `torch_chunk_gated_delta_rule` and
`torch_recurrent_gated_delta_rule` (with `use_qk_l2norm_in_kernel=True`, as Qwen3-Next's layer),
one request at a time; for lightning attention, a float64 per-token recurrence, itself checked
against transformers' `MiniMaxLightningAttention` layer (its block path from zeros and its
cached per-token path from a state). The torch ops are checked against those references, the
Triton kernels (the interpreter on the CPU, small shapes) against the references too, and on
CUDA (the `gpu` tests) the kernels against the torch ops in float32 and bfloat16."""

from __future__ import annotations

import os

import pytest
import torch

from pagedserve.attention.linear import gdn_torch, lightning_torch

PREFILL_LENS = [1, 5, 17, 70]
PREFILL_SLOTS = [4, 0, 2, 6]
PREFILL_INIT = [True, False, True, False]
DECODE_SLOTS = [1, 3, 5, 7, 8]
DECODE_INIT = [True, False, True, True, False]
NUM_SLOTS = 10
HEADS, DK, DV = 2, 12, 24  # not powers of two: the kernels' masks are exercised


def _qsl(lens, device="cpu"):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                        device=device)


def _step(seed, lens=PREFILL_LENS, num_decodes=len(DECODE_SLOTS), dk=DK, dv=DV):
    """Random inputs of one step: prefill tokens then one token per decode, packed."""
    g = torch.Generator().manual_seed(seed)
    t = sum(lens) + num_decodes
    state = torch.randn(NUM_SLOTS, HEADS, dk, dv, generator=g)
    for slot, init in zip(PREFILL_SLOTS + DECODE_SLOTS, PREFILL_INIT + DECODE_INIT, strict=True):
        if not init:
            state[slot] = float("nan")  # a previous owner's leftovers: must not be read
    return dict(
        q=torch.randn(t, HEADS, dk, generator=g), k=torch.randn(t, HEADS, dk, generator=g),
        v=torch.randn(t, HEADS, dv, generator=g),
        g=-torch.rand(t, HEADS, generator=g) * 0.7,
        beta=torch.rand(t, HEADS, generator=g), state=state,
        slope=torch.rand(HEADS, generator=g) * 0.5 + 0.01)


def _initial(state, slot, init):
    return state[slot].double() if init else torch.zeros_like(state[slot], dtype=torch.float64)


def _triton_device():
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        return torch.device("cuda")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    return torch.device("cpu")


def _assert_close(got, ref, tol=1e-5):
    """Close relative to the reference's scale (outputs and states grow with the length)."""
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float().cpu(), ref.float().cpu(), rtol=tol,
                               atol=tol * max(1.0, float(ref.abs().max())))


# ---- gated delta rule ------------------------------------------------------------------------

def _gdn_reference(c):
    """transformers' reference functions, per prefill request and for the decodes at once:
    outputs [T, H, Dv] and final states by slot."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    qsl, outs, states = _qsl(PREFILL_LENS), [], {}
    for i, (slot, init) in enumerate(zip(PREFILL_SLOTS, PREFILL_INIT, strict=True)):
        a, b = int(qsl[i]), int(qsl[i + 1])
        o, s = hf.torch_chunk_gated_delta_rule(
            *(c[n][None, a:b].double() for n in ("q", "k", "v", "g", "beta")),
            initial_state=_initial(c["state"], slot, init)[None], output_final_state=True,
            use_qk_l2norm_in_kernel=True)
        outs.append(o[0])
        states[slot] = s[0]
    tp = int(qsl[-1])
    o, s = hf.torch_recurrent_gated_delta_rule(
        *(c[n][tp:, None].double() for n in ("q", "k", "v", "g", "beta")),
        initial_state=torch.stack([_initial(c["state"], slot, init)
                                   for slot, init in zip(DECODE_SLOTS, DECODE_INIT,
                                                         strict=True)]),
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    outs.append(o[:, 0])
    states.update(zip(DECODE_SLOTS, s, strict=True))
    return torch.cat(outs), states


def _run_gdn(ops, c, device, **prefill_kwargs):
    """One step through `ops` (the torch module or the kernels), as a backend calls them."""
    c = {n: x.to(device) for n, x in c.items()}
    tp = sum(PREFILL_LENS)
    state = c["state"].clone()
    args = [c[n] for n in ("q", "k", "v", "g", "beta")]
    o_prefill = ops.chunk_gated_delta_rule(
        *(x[:tp] for x in args), state, _qsl(PREFILL_LENS, device),
        torch.tensor(PREFILL_SLOTS, device=device), torch.tensor(PREFILL_INIT, device=device),
        **prefill_kwargs)
    o_decode = ops.recurrent_gated_delta_rule(
        *(x[tp:] for x in args), state, torch.tensor(DECODE_SLOTS, device=device),
        torch.tensor(DECODE_INIT, device=device))
    return torch.cat([o_prefill, o_decode]), state


def _check_gdn(o, state, c):
    o_ref, states_ref = _gdn_reference(c)
    _assert_close(o, o_ref)
    for slot, s_ref in states_ref.items():
        _assert_close(state[slot], s_ref)
    untouched = [s for s in range(NUM_SLOTS) if s not in states_ref]
    assert torch.equal(state[untouched].cpu(), c["state"][untouched])


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_gdn_torch_matches_transformers(chunk_size):
    c = _step(seed=0)
    o, state = _run_gdn(gdn_torch, c, "cpu", chunk_size=chunk_size)
    _check_gdn(o, state, c)


@pytest.mark.parametrize("form", [dict(chunk_size=16), dict(token_by_token=True)],
                         ids=["chunked", "token_by_token"])
def test_gdn_kernels_match_transformers(form):
    device = _triton_device()
    from pagedserve.attention.ops import gdn_kernels

    c = _step(seed=1)
    o, state = _run_gdn(gdn_kernels, c, device, block_v=16, **form)
    _check_gdn(o, state, c)


def test_gdn_without_l2norm_matches_transformers():
    """use_qk_l2norm=False leaves q and k as given (transformers' flag off), in both paths."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    c = _step(seed=2, lens=[19], num_decodes=0)
    c["q"], c["k"] = c["q"] * 0.3, c["k"] * 0.3  # unnormalised keys: keep the rule stable
    state0 = torch.zeros(HEADS, DK, DV)
    o_ref, s_ref = hf.torch_chunk_gated_delta_rule(
        *(c[n][None].double() for n in ("q", "k", "v", "g", "beta")),
        initial_state=state0[None].double(), output_final_state=True)
    impls = [gdn_torch]
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        from pagedserve.attention.ops import gdn_kernels

        impls.append(gdn_kernels)
    for ops in impls:
        state = torch.zeros(1, HEADS, DK, DV)
        o = ops.chunk_gated_delta_rule(
            c["q"], c["k"], c["v"], c["g"], c["beta"], state, _qsl([19]), torch.tensor([0]),
            torch.tensor([False]), use_qk_l2norm=False)
        _assert_close(o, o_ref[0])
        _assert_close(state[0], s_ref[0])


def _split_prefill(ops, prefill, device, split):
    """One request's 70 tokens in one call, and in two (the second from the saved state)."""
    c = {n: x.to(device) for n, x in _step(seed=3, lens=[70], num_decodes=0).items()}
    gdn = prefill == "chunk_gated_delta_rule"
    per_token = [c[n] for n in (("q", "k", "v", "g", "beta") if gdn else ("q", "k", "v"))]
    per_head = [] if gdn else [c["slope"]]

    def call(lo, hi, state, init):
        xs = [x[lo:hi] for x in per_token] + per_head
        return getattr(ops, prefill)(*xs, state, _qsl([hi - lo], device),
                                     torch.tensor([0], device=device),
                                     torch.tensor([init], device=device))

    whole_state = torch.zeros(1, HEADS, DK, DV, device=device)
    whole = call(0, 70, whole_state, False)
    split_state = torch.full((1, HEADS, DK, DV), float("nan"), device=device)
    parts = torch.cat([call(0, split, split_state, False), call(split, 70, split_state, True)])
    _assert_close(parts, whole)
    _assert_close(split_state, whole_state)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("family", ["gdn", "lightning"])
def test_prefill_continued_from_saved_state_equals_one_prefill(impl, family):
    if impl == "torch":
        ops, device = (gdn_torch if family == "gdn" else lightning_torch), "cpu"
    else:
        device = _triton_device()
        from pagedserve.attention.ops import gdn_kernels, lightning_kernels

        ops = gdn_kernels if family == "gdn" else lightning_kernels
    prefill = "chunk_gated_delta_rule" if family == "gdn" else "lightning_attention_prefill"
    _split_prefill(ops, prefill, device, split=29)


# ---- lightning attention -----------------------------------------------------------------

def _lightning_naive(q, k, v, slope, state):
    """One request, token by token, float64: S = exp(-s) S + k v^T, o = S^T q."""
    s, outs = state.double(), []
    decay = torch.exp(-slope.double())[:, None, None]
    for t in range(q.shape[0]):
        s = decay * s + k[t].double()[:, :, None] * v[t].double()[:, None, :]
        outs.append((q[t].double()[:, None, :] @ s)[:, 0])
    return torch.stack(outs) if outs else q.new_zeros(0, *v.shape[1:]).double(), s


def test_lightning_naive_reference_matches_transformers_layer():
    """The per-token recurrence (with the layer's own slope_rate) equals transformers' layer:
    its block path on a fresh 37-token prompt (block size 16) and its cached per-token path for
    three more tokens; the layer's norm, gate and projection are applied to ours."""
    from transformers import MiniMaxConfig
    from transformers.models.minimax import modeling_minimax as hf

    torch.manual_seed(0)
    config = MiniMaxConfig(hidden_size=32, num_attention_heads=4, head_dim=8, block_size=16,
                           num_hidden_layers=4, layer_types=["linear_attention"] * 4,
                           num_key_value_heads=4, intermediate_size=32, num_local_experts=2)
    layer = hf.MiniMaxLightningAttention(config, layer_idx=1).eval()
    slope = layer.slope_rate.flatten()
    torch.testing.assert_close(lightning_torch.slope_rate(4, 1, 4), slope)

    def ours(x, state):
        qkv = layer.act_fn(layer.qkv_proj(x)).reshape(x.shape[1], 4, 24)
        q, k, v = qkv.split(8, dim=-1)
        o, s = _lightning_naive(q, k, v, slope, state)
        o = layer.norm(o.float().reshape(1, x.shape[1], 32))
        return layer.out_proj(torch.sigmoid(layer.output_gate(x)) * o), s

    with torch.no_grad():
        x = torch.randn(1, 37, 32)
        y_ref, s_ref = layer(x, position_embeddings=None, attention_mask=None)
        y, s = ours(x, torch.zeros(4, 8, 8))
        _assert_close(y, y_ref)
        _assert_close(s, s_ref[0])
        cache = hf.MiniMaxCache()
        cache.set_linear_cache(1, s_ref.clone())
        x = torch.randn(1, 3, 32)
        y_ref, s_ref = layer(x, position_embeddings=None, attention_mask=None, cache=cache)
        y, s = ours(x, s)
        _assert_close(y, y_ref)
        _assert_close(s, s_ref[0])


def _lightning_reference(c):
    qsl, outs, states = _qsl(PREFILL_LENS), [], {}
    tp = int(qsl[-1])
    bounds = [(int(qsl[i]), int(qsl[i + 1])) for i in range(len(PREFILL_LENS))]
    bounds += [(tp + i, tp + i + 1) for i in range(len(DECODE_SLOTS))]
    for (a, b), slot, init in zip(bounds, PREFILL_SLOTS + DECODE_SLOTS,
                                  PREFILL_INIT + DECODE_INIT, strict=True):
        o, s = _lightning_naive(c["q"][a:b], c["k"][a:b], c["v"][a:b], c["slope"],
                                _initial(c["state"], slot, init))
        outs.append(o)
        states[slot] = s
    return torch.cat(outs), states


def _run_lightning(ops, c, device, **prefill_kwargs):
    c = {n: x.to(device) for n, x in c.items()}
    tp = sum(PREFILL_LENS)
    state = c["state"].clone()
    o_prefill = ops.lightning_attention_prefill(
        c["q"][:tp], c["k"][:tp], c["v"][:tp], c["slope"], state, _qsl(PREFILL_LENS, device),
        torch.tensor(PREFILL_SLOTS, device=device), torch.tensor(PREFILL_INIT, device=device),
        **prefill_kwargs)
    o_decode = ops.lightning_attention_decode(
        c["q"][tp:], c["k"][tp:], c["v"][tp:], c["slope"], state,
        torch.tensor(DECODE_SLOTS, device=device), torch.tensor(DECODE_INIT, device=device))
    return torch.cat([o_prefill, o_decode]), state


def _check_lightning(o, state, c):
    o_ref, states_ref = _lightning_reference(c)
    _assert_close(o, o_ref)
    for slot, s_ref in states_ref.items():
        _assert_close(state[slot], s_ref)
    untouched = [s for s in range(NUM_SLOTS) if s not in states_ref]
    assert torch.equal(state[untouched].cpu(), c["state"][untouched])


@pytest.mark.parametrize("block_size", [16, 256])
def test_lightning_torch_matches_reference(block_size):
    c = _step(seed=4)
    o, state = _run_lightning(lightning_torch, c, "cpu", block_size=block_size)
    _check_lightning(o, state, c)


def test_lightning_kernels_match_reference():
    device = _triton_device()
    from pagedserve.attention.ops import lightning_kernels

    c = _step(seed=5)
    o, state = _run_lightning(lightning_kernels, c, device, block_size=16)
    _check_lightning(o, state, c)


# ---- the Triton kernels on CUDA, against the torch ops ---------------------------------------

CUDA = torch.device("cuda")
# New tokens per prefill (fresh, continued, long), then decodes with and without a state.
GPU_PREFILLS = [(False, 300), (True, 37), (False, 2), (True, 129), (True, 1000)]
GPU_DECODES = [True] * 48 + [False] * 4


def _gpu_case(heads, dk, dv, dtype, seed):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    lens = [n for _, n in GPU_PREFILLS]
    t = sum(lens) + len(GPU_DECODES)
    num_reqs = len(GPU_PREFILLS) + len(GPU_DECODES)
    num_slots = num_reqs + 3

    def r(*shape):
        return torch.randn(*shape, generator=g, device=CUDA)

    slots = torch.randperm(num_slots, generator=g, device=CUDA)[:num_reqs]
    has_init = torch.tensor([i for i, _ in GPU_PREFILLS] + GPU_DECODES, device=CUDA)
    state = r(num_slots, heads, dk, dv)
    state[slots[~has_init]] = float("nan")
    # Qwen3-Next's g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b); MiniMax's
    # q, k, v come out of a SiLU and its slopes from its formula (layer 0 of 8).
    base = 2 ** (-8 / heads)
    return dict(
        q=r(t, heads, dk).to(dtype), k=r(t, heads, dk).to(dtype), v=r(t, heads, dv).to(dtype),
        g=-torch.rand(heads, generator=g, device=CUDA) * 4 * torch.nn.functional.softplus(
            r(t, heads)), beta=torch.sigmoid(r(t, heads)),
        slope=base ** torch.arange(1, heads + 1, device=CUDA, dtype=torch.float32),
        state=state, slots=slots, has_init=has_init, lens=lens,
        qsl=_qsl(lens, CUDA), tp=sum(lens), p=len(lens))


def _tol(dtype):
    # bf16: both sides read the same bf16 inputs and work in float32; the difference is the
    # order of float32 sums (tf32 dots in the lightning kernel) and the bf16 rounding of o.
    return 1e-4 if dtype == torch.float32 else 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("token_by_token", [False, True], ids=["chunked", "token_by_token"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,dk,dv", [(8, 128, 128), (4, 64, 96)])
def test_gdn_kernels_match_torch_on_cuda(dtype, heads, dk, dv, token_by_token):
    from pagedserve.attention.ops import gdn_kernels

    c = _gpu_case(heads, dk, dv, dtype, seed=0)
    p, tp = c["p"], c["tp"]
    outs, states = [], []
    for ops, form in ((gdn_torch, {}), (gdn_kernels, dict(token_by_token=token_by_token))):
        state = c["state"].clone()
        args = [c[n] for n in ("q", "k", "v", "g", "beta")]
        o = ops.chunk_gated_delta_rule(*(x[:tp] for x in args), state, c["qsl"],
                                       c["slots"][:p], c["has_init"][:p],
                                       max_query_len=max(c["lens"]), **form)
        o_dec = ops.recurrent_gated_delta_rule(*(x[tp:] for x in args), state,
                                               c["slots"][p:], c["has_init"][p:])
        outs.append(torch.cat([o, o_dec]))
        states.append(state[c["slots"]])
    _assert_close(outs[1], outs[0], _tol(dtype))
    _assert_close(states[1], states[0], _tol(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,d,dv", [(8, 128, 128), (4, 96, 80)])
def test_lightning_kernels_match_torch_on_cuda(dtype, heads, d, dv):
    from pagedserve.attention.ops import lightning_kernels

    c = _gpu_case(heads, d, dv, dtype, seed=1)
    c["q"], c["k"], c["v"] = (torch.nn.functional.silu(c[n]) for n in ("q", "k", "v"))
    p, tp = c["p"], c["tp"]
    outs, states = [], []
    for ops in (lightning_torch, lightning_kernels):
        state = c["state"].clone()
        o = ops.lightning_attention_prefill(c["q"][:tp], c["k"][:tp], c["v"][:tp], c["slope"],
                                            state, c["qsl"], c["slots"][:p], c["has_init"][:p],
                                            max_query_len=max(c["lens"]))
        o_dec = ops.lightning_attention_decode(c["q"][tp:], c["k"][tp:], c["v"][tp:],
                                               c["slope"], state, c["slots"][p:],
                                               c["has_init"][p:])
        outs.append(torch.cat([o, o_dec]))
        states.append(state[c["slots"]])
    _assert_close(outs[1], outs[0], _tol(dtype))
    _assert_close(states[1], states[0], _tol(dtype))
