"""The hybrid models' state ops over packed tokens and state slots: Mamba-2's SSD scan
(`attention/mamba/ssd_torch.py`, `attention/ops/ssd_kernels.py`) and the causal conv without an
activation (LFM2's short conv).

References: a per-token float64 recurrence; transformers' own chunked scan and single-step update
(`mamba2_chunk_scan`, `mamba2_selective_state_update`); tiny transformers Mamba2Mixer /
BambaMixer / Lfm2ShortConv modules with random weights run request by request with their cache,
against the same layer composed from our ops over a packed batch. The Triton kernels run in the
interpreter on the CPU (small shapes, float32); the `gpu` tests check them against the torch ops
in float32 and bfloat16 at realistic sizes.

Longer than 500 lines: the SSD, conv and LFM2 cases share the packed-step helpers (`_Step`,
`_conv_step`, the case builders); apart they would be copied."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

from pagedserve.attention.mamba import ssd_torch, torch_ops

LENS = [1, 5, 17, 70]  # with chunk size 16: inside one chunk, across one boundary, across four
SLOTS = [4, 0, 2, 5]
HAS_INIT = [True, False, True, False]
NUM_SLOTS = 6


def _qsl(lens, device="cpu"):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                        device=device)


def _grid_index(lens):
    """The Mamba-1-style torch conv's padded-grid index of each packed token."""
    qsl = _qsl(lens).long()
    req = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    return req * max(lens) + torch.arange(sum(lens)) - qsl[req]


def _needs_triton():
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")


# ---- SSD against a per-token recurrence ------------------------------------------------------

def _ssd_case(lens, heads=4, head_dim=8, groups=2, state_size=8, seed=0, has_init=HAS_INIT,
              slots=SLOTS):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    state = r(NUM_SLOTS, heads, head_dim, state_size)
    for slot, has in zip(slots, has_init, strict=True):
        if not has:
            state[slot] = float("nan")  # a previous owner's leftovers: must never be read
    return dict(x=r(t, heads, head_dim), dt=r(t, heads, scale=0.5),
                A=-torch.exp(torch.rand(heads, generator=g) * 2), B=r(t, groups, state_size),
                C=r(t, groups, state_size), D=r(heads), dt_bias=r(heads, scale=0.3),
                state=state, slots=torch.tensor(slots), has_init=torch.tensor(has_init))


def _naive_ssd(c, a, b, h0, dt_limit):
    """One request's tokens a..b token by token in float64: y [L, H, P] and the final state."""
    heads, groups = c["x"].shape[1], c["B"].shape[1]
    h, ys = h0.double().clone(), []
    for t in range(a, b):
        step = F.softplus(c["dt"][t].double() + c["dt_bias"].double()).clamp(*dt_limit)
        bh = c["B"][t].double().repeat_interleave(heads // groups, 0)  # [H, N]
        ch = c["C"][t].double().repeat_interleave(heads // groups, 0)
        xt = c["x"][t].double()
        h = (torch.exp(step * c["A"].double())[:, None, None] * h
             + (step[:, None] * xt)[..., None] * bh[:, None, :])
        ys.append(h @ ch[..., None] + (c["D"].double()[:, None] * xt)[..., None])
    return torch.stack(ys)[..., 0].float(), h.float()


def _expected_ssd(c, lens, dt_limit=ssd_torch.DEFAULT_DT_LIMIT):
    qsl = _qsl(lens)
    ys, states = [], []
    for i, (slot, has) in enumerate(zip(c["slots"].tolist(), c["has_init"].tolist(),
                                        strict=True)):
        h0 = c["state"][slot] if has else torch.zeros_like(c["state"][slot])
        y, h = _naive_ssd(c, int(qsl[i]), int(qsl[i + 1]), h0, dt_limit)
        ys.append(y)
        states.append(h)
    return torch.cat(ys), torch.stack(states)


def _run_prefill(ops, c, lens, chunk_size=16, dt_limit=ssd_torch.DEFAULT_DT_LIMIT, **kw):
    state = c["state"].clone()
    y = ops.ssd_chunk_scan(c["x"], c["dt"], c["A"], c["B"], c["C"], c["D"], c["dt_bias"],
                           state, _qsl(lens, c["x"].device), c["slots"], c["has_init"],
                           chunk_size=chunk_size, dt_limit=dt_limit, **kw)
    return y, state


def _run_decode(ops, c, dt_limit=ssd_torch.DEFAULT_DT_LIMIT):
    state = c["state"].clone()
    y = ops.ssd_state_update(c["x"], c["dt"], c["A"], c["B"], c["C"], c["D"], c["dt_bias"],
                             state, c["slots"], c["has_init"], dt_limit=dt_limit)
    return y, state


def _assert_slots(state, c, ref_states, **tol):
    """The requests' slots hold the reference states; every other slot is untouched."""
    torch.testing.assert_close(state[c["slots"]].cpu(), ref_states, **tol)
    others = [s for s in range(NUM_SLOTS) if s not in c["slots"].tolist()]
    assert torch.equal(state[others].cpu(), c["state"][others].cpu())


def _ops(name):
    if name == "triton":
        _needs_triton()
        from pagedserve.attention.ops import ssd_kernels

        return ssd_kernels
    return ssd_torch


OPS = ["torch", "triton"]
LIMITS = [ssd_torch.DEFAULT_DT_LIMIT, (0.05, 0.6)]


@pytest.mark.parametrize("ops", OPS)
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("dt_limit", LIMITS, ids=["no-limit", "limit"])
def test_ssd_prefill_matches_recurrence(ops, groups, dt_limit):
    c = _ssd_case(LENS, groups=groups, seed=groups)
    y_ref, states_ref = _expected_ssd(c, LENS, dt_limit)
    y, state = _run_prefill(_ops(ops), c, LENS, dt_limit=dt_limit)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
    _assert_slots(state, c, states_ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("ops", OPS)
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("dt_limit", LIMITS, ids=["no-limit", "limit"])
def test_ssd_decode_matches_recurrence(ops, groups, dt_limit):
    lens = [1, 1, 1, 1]
    c = _ssd_case(lens, groups=groups, seed=10 + groups)
    y_ref, states_ref = _expected_ssd(c, lens, dt_limit)
    y, state = _run_decode(_ops(ops), c, dt_limit)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    _assert_slots(state, c, states_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ops", OPS)
def test_ssd_chunk_size_does_not_change_the_result(ops):
    c = _ssd_case(LENS, seed=3)
    y_ref, states_ref = _expected_ssd(c, LENS)
    # The kernel steps min(32, chunk_size) tokens (at least 16): 8 and 64 give both.
    for chunk_size in (8, 32, 256) if ops == "torch" else (8, 64):
        y, state = _run_prefill(_ops(ops), c, LENS, chunk_size=chunk_size)
        torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
        _assert_slots(state, c, states_ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("ops", OPS)
def test_ssd_chunked_prefill_continues_from_saved_state(ops):
    """One request of 70 tokens in one step equals 30 tokens, then 40 continuing from the slot
    (a boundary inside a chunk), then 3 decodes; a second request rides along each step."""
    impl = _ops(ops)
    whole = _ssd_case([70, 4], seed=4, has_init=[False, True], slots=[3, 1])
    y_whole, state_whole = _run_prefill(impl, whole, [70, 4])

    state = whole["state"].clone()
    out = []
    for i, (a, b) in enumerate([(0, 30), (30, 70)]):
        part = {k: whole[k] for k in ("A", "D", "dt_bias")}
        rows = torch.cat([torch.arange(a, b), torch.arange(70, 74)])  # + the rider's 4 tokens
        part.update({k: whole[k][rows] for k in ("x", "dt", "B", "C")})
        part.update(state=state, slots=whole["slots"], has_init=torch.tensor([i > 0, True]))
        y, state = _run_prefill(impl, part, [b - a, 4])
        out.append(y[:b - a])
    torch.testing.assert_close(torch.cat(out), y_whole[:70], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state[3], state_whole[3], rtol=1e-4, atol=1e-4)

    # Decodes from the saved state against the recurrence over all 73 tokens.
    extra = _ssd_case([73], seed=5, has_init=[False], slots=[3])
    full = dict(extra, x=torch.cat([whole["x"][:70], extra["x"][70:]]),
                dt=torch.cat([whole["dt"][:70], extra["dt"][70:]]),
                B=torch.cat([whole["B"][:70], extra["B"][70:]]),
                C=torch.cat([whole["C"][:70], extra["C"][70:]]),
                **{k: whole[k] for k in ("A", "D", "dt_bias")})
    y_ref, states_ref = _expected_ssd(full, [73])
    for t in range(70, 73):
        step = dict(full, x=full["x"][t:t + 1], dt=full["dt"][t:t + 1], B=full["B"][t:t + 1],
                    C=full["C"][t:t + 1], state=state, has_init=torch.tensor([True]))
        y, state = _run_decode(impl, step)
        torch.testing.assert_close(y[0], y_ref[t], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state[3], states_ref[0], rtol=1e-4, atol=1e-4)


# ---- SSD against transformers' own functions --------------------------------------------------

@pytest.mark.parametrize("groups", [1, 2])
def test_ssd_torch_matches_transformers_functions(groups):
    from transformers.models.mamba2.modeling_mamba2 import (
        mamba2_chunk_scan,
        mamba2_selective_state_update,
    )

    c = _ssd_case(LENS, groups=groups, seed=20 + groups)
    y, state = _run_prefill(ssd_torch, c, LENS, chunk_size=16)
    qsl = _qsl(LENS)
    for i, (slot, has) in enumerate(zip(SLOTS, HAS_INIT, strict=True)):
        a, b = int(qsl[i]), int(qsl[i + 1])
        y_ref, h_ref = mamba2_chunk_scan(
            c["x"][None, a:b], c["dt"][None, a:b], c["A"], c["B"][None, a:b],
            c["C"][None, a:b], chunk_size=16, D=c["D"], dt_bias=c["dt_bias"],
            initial_states=c["state"][slot][None] if has else None, dt_softplus=True,
            return_final_states=True)
        torch.testing.assert_close(y[a:b], y_ref[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(state[slot], h_ref[0], rtol=1e-4, atol=1e-4)

    # One decode step, with the expansions transformers' mixer makes before its update.
    d = _ssd_case([1] * 4, groups=groups, seed=30 + groups, has_init=[True] * 4)
    y, state = _run_decode(ssd_torch, d)
    p = d["x"].shape[2]
    ref_state = d["state"][d["slots"]].clone()
    y_ref = mamba2_selective_state_update(
        ref_state, d["x"], d["dt"][..., None].expand(-1, -1, p),
        d["A"][:, None, None].expand(-1, p, d["B"].shape[2]), d["B"], d["C"],
        d["D"][:, None].expand(-1, p), dt_bias=d["dt_bias"][:, None].expand(-1, p),
        dt_softplus=True)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state[d["slots"]], ref_state, rtol=1e-5, atol=1e-5)


def _mixer(kind):
    torch.manual_seed(0)
    if kind == "mamba2":
        from transformers import Mamba2Config
        from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer

        config = Mamba2Config(hidden_size=16, num_heads=4, head_dim=8, expand=2, n_groups=2,
                              state_size=8, chunk_size=8, conv_kernel=4, num_hidden_layers=1,
                              vocab_size=32)
        mixer = Mamba2Mixer(config, 0)
    else:
        from transformers import BambaConfig
        from transformers.models.bamba.modeling_bamba import BambaMixer

        config = BambaConfig(hidden_size=16, mamba_n_heads=4, mamba_d_head=8, mamba_expand=2,
                             mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=8,
                             mamba_d_conv=4, num_hidden_layers=1, attn_layer_indices=[],
                             vocab_size=32, num_attention_heads=2, num_key_value_heads=1)
        mixer = BambaMixer(config, 0)
    with torch.no_grad():  # away from the initialisation's special values
        mixer.A_log.uniform_(-1.0, 1.5)
        mixer.D.normal_()
        mixer.dt_bias.normal_(0.0, 0.5)
        mixer.norm.weight.normal_(1.0, 0.2)
    return config, mixer.eval()


class _Step:
    """One engine step over packed tokens: prefills (new token counts > 1 or fresh) first."""

    def __init__(self, lens, num_prefills, slots, has_init):
        self.lens, self.p = lens, num_prefills
        self.tp = sum(lens[:num_prefills])
        self.slots, self.has_init = torch.tensor(slots), torch.tensor(has_init)


def _conv_step(ops, x, weight, bias, conv_state, step, activation):
    """The causal conv over a step's packed tokens, prefills then decodes."""
    p, tp = step.p, step.tp
    if ops == "triton":
        from pagedserve.attention.ops import mamba_kernels

        return mamba_kernels.causal_conv1d(x, weight, bias, conv_state, _qsl(step.lens),
                                           step.slots, step.has_init, max(step.lens),
                                           block_t=8, block_d=16, activation=activation)
    out = torch.empty_like(x)
    if p:
        lens = step.lens[:p]
        out[:tp] = torch_ops.causal_conv1d_prefill(
            x[:tp], weight, bias, conv_state, step.slots[:p], step.has_init[:p],
            _grid_index(lens), torch.tensor(lens), max(lens), activation=activation)
    if len(step.lens) > p:
        out[tp:] = torch_ops.causal_conv1d_decode(x[tp:], weight, bias, conv_state,
                                                  step.slots[p:], step.has_init[p:],
                                                  activation=activation)
    return out


def _ours_mixer(ops, mixer, hidden, conv_state, ssm_state, step):
    """The mixer's forward composed from our ops (the gate and gated norm as the layer does)."""
    impl = _ops(ops)
    h, g, n = mixer.num_heads, mixer.n_groups, mixer.ssm_state_size
    gate, xbc, dt = mixer.in_proj(hidden).split(
        [mixer.intermediate_size, mixer.conv_dim, h], dim=-1)
    xbc = _conv_step(ops, xbc.contiguous(), mixer.conv1d.weight[:, 0], mixer.conv1d.bias,
                     conv_state, step, "silu")
    x, B, C = xbc.split([mixer.intermediate_size, g * n, g * n], dim=-1)
    x, B, C = x.view(-1, h, mixer.head_dim), B.view(-1, g, n), C.view(-1, g, n)
    A = -torch.exp(mixer.A_log.float())
    args = (A, mixer.D, mixer.dt_bias, ssm_state)
    p, tp = step.p, step.tp
    y = torch.empty_like(x)
    if p:
        y[:tp] = impl.ssd_chunk_scan(x[:tp], dt[:tp], A, B[:tp], C[:tp], *args[1:],
                                     _qsl(step.lens[:p]), step.slots[:p], step.has_init[:p],
                                     chunk_size=mixer.chunk_size,
                                     dt_limit=mixer.time_step_limit)
    if len(step.lens) > p:
        y[tp:] = impl.ssd_state_update(x[tp:], dt[tp:], A, B[tp:], C[tp:], *args[1:],
                                       step.slots[p:], step.has_init[p:],
                                       dt_limit=mixer.time_step_limit)
    return mixer.out_proj(mixer.norm(y.reshape(len(hidden), -1), gate))


@pytest.mark.parametrize("ops", OPS)
@pytest.mark.parametrize("kind", ["mamba2", pytest.param("bamba", marks=pytest.mark.slow)])
@torch.no_grad()
def test_mixer_matches_transformers(kind, ops):
    """Three steps of four requests: fresh prefills (1, 5, 17, 30 tokens; slots full of NaN),
    then a continued prefill chunk beside three decodes, then four decodes; every output and
    every final state against transformers' mixer run request by request with its cache."""
    from transformers import DynamicCache

    config, mixer = _mixer(kind)
    slots = [5, 2, 0, 3]
    steps = [([1, 5, 17, 30], 4, [False] * 4), ([6, 1, 1, 1], 1, [True] * 4),
             ([1, 1, 1, 1], 0, [True] * 4)]
    conv_state = torch.full((NUM_SLOTS, mixer.conv_dim, mixer.conv_kernel_size - 1), math.nan)
    ssm_state = torch.full((NUM_SLOTS, mixer.num_heads, mixer.head_dim, mixer.ssm_state_size),
                           math.nan)
    caches = [DynamicCache(config=config) for _ in slots]
    g = torch.Generator().manual_seed(1)
    for lens, num_prefills, has_init in steps:
        hidden = torch.randn(sum(lens), config.hidden_size, generator=g)
        step = _Step(lens, num_prefills, slots, has_init)
        out = _ours_mixer(ops, mixer, hidden, conv_state, ssm_state, step)
        qsl = _qsl(lens)
        for i, cache in enumerate(caches):
            a, b = int(qsl[i]), int(qsl[i + 1])
            ref = mixer(hidden[None, a:b], cache=cache)[0]
            torch.testing.assert_close(out[a:b], ref, rtol=1e-4, atol=1e-4)
            layer = cache.layers[0]
            torch.testing.assert_close(ssm_state[slots[i]], layer.recurrent_states[0][0],
                                       rtol=1e-4, atol=1e-4)
            # Copies of in_proj's outputs, which round differently for a batch than for one
            # request: close, not equal.
            torch.testing.assert_close(conv_state[slots[i]],
                                       layer.conv_states[0][0, :, 1:], rtol=1e-5, atol=1e-6)


# ---- the causal conv without an activation; LFM2's short conv ---------------------------------

def _naive_conv(x, w, bias, window0):
    """One request token by token: out [L, d] (no activation) and the final window."""
    window, out = window0.clone(), []
    for t in range(x.shape[0]):
        full = torch.cat([window, x[t, :, None]], dim=1)
        out.append((full * w).sum(-1) + (bias if bias is not None else 0))
        window = full[:, 1:]
    return torch.stack(out), window


@pytest.mark.parametrize("ops", OPS)
@pytest.mark.parametrize("with_bias", [True, False])
def test_conv_without_activation_matches_loop(ops, with_bias):
    """A mixed step (prefills of 1, 5 and 17 tokens, two decodes) against a plain loop."""
    if ops == "triton":
        _needs_triton()
    lens, num_prefills = [5, 1, 17, 1, 1], 3
    slots, has_init = [4, 0, 2, 5, 1], [True, False, True, True, False]
    g = torch.Generator().manual_seed(7)
    d, k = 24, 3
    x, w = torch.randn(sum(lens), d, generator=g), torch.randn(d, k, generator=g)
    bias = torch.randn(d, generator=g) if with_bias else None
    conv0 = torch.randn(NUM_SLOTS, d, k - 1, generator=g)
    for s, has in zip(slots, has_init, strict=True):
        if not has:
            conv0[s] = math.nan
    conv = conv0.clone()
    out = _conv_step(ops, x, w, bias, conv, _Step(lens, num_prefills, slots, has_init), None)
    qsl = _qsl(lens)
    for i, (s, has) in enumerate(zip(slots, has_init, strict=True)):
        a, b = int(qsl[i]), int(qsl[i + 1])
        ref, window = _naive_conv(x[a:b], w, bias, conv0[s] if has else torch.zeros(d, k - 1))
        torch.testing.assert_close(out[a:b], ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(conv[s], window, rtol=0, atol=0)
    # The SiLU default is unchanged (Mamba-1's callers): the same step with it is silu(out).
    conv = conv0.clone()
    act = _conv_step(ops, x, w, bias, conv, _Step(lens, num_prefills, slots, has_init), "silu")
    torch.testing.assert_close(act, F.silu(out), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ops", OPS)
@pytest.mark.parametrize("conv_bias", [False, True])
@torch.no_grad()
def test_lfm2_short_conv_matches_transformers(ops, conv_bias):
    """LFM2's short conv composed from the conv op (B*x -> conv, no activation -> C*) over
    packed steps (fresh prefills of 1, 2, 9 tokens; a continued chunk beside two decodes; three
    decodes) against transformers' Lfm2ShortConv run request by request with its cache."""
    if ops == "triton":
        _needs_triton()
    from transformers import DynamicCache, Lfm2Config
    from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv

    torch.manual_seed(0)
    config = Lfm2Config(hidden_size=16, conv_L_cache=3, conv_bias=conv_bias,
                        num_hidden_layers=1, layer_types=["conv"], vocab_size=32,
                        num_attention_heads=2, num_key_value_heads=1, intermediate_size=32)
    conv = Lfm2ShortConv(config, 0).eval()
    d, k = config.hidden_size, config.conv_L_cache
    slots = [1, 4, 2]
    steps = [([1, 2, 9], 3, [False] * 3), ([4, 1, 1], 1, [True] * 3), ([1, 1, 1], 0, [True] * 3)]
    conv_state = torch.full((NUM_SLOTS, d, k - 1), math.nan)
    caches = [DynamicCache(config=config) for _ in slots]
    g = torch.Generator().manual_seed(2)
    for lens, num_prefills, has_init in steps:
        hidden = torch.randn(sum(lens), d, generator=g)
        B, C, x = conv.in_proj(hidden).chunk(3, dim=-1)
        step = _Step(lens, num_prefills, slots, has_init)
        mixed = _conv_step(ops, (B * x).contiguous(), conv.conv.weight[:, 0], conv.conv.bias,
                           conv_state, step, None)
        out = conv.out_proj(C * mixed)
        qsl = _qsl(lens)
        for i, cache in enumerate(caches):
            a, b = int(qsl[i]), int(qsl[i + 1])
            ref = conv(hidden[None, a:b], cache=cache)[0]
            torch.testing.assert_close(out[a:b], ref, rtol=1e-5, atol=1e-5)
            # transformers keeps the last L_cache inputs; the conv needs the last L_cache - 1.
            torch.testing.assert_close(conv_state[slots[i]],
                                       cache.layers[0].conv_states[0][0, :, 1:], rtol=1e-5,
                                       atol=1e-6)


# ---- the Triton kernels on CUDA, against the torch ops -----------------------------------------

CUDA = torch.device("cuda")
# (context_len, new tokens) per request: prefills (fresh, continued chunks, long), then decodes.
GPU_PREFILLS = [(0, 300), (64, 37), (0, 2), (17, 129), (5, 1000), (0, 1)]
GPU_DECODES = [(40, 1)] * 48 + [(0, 1)] * 4


def _gpu_case(batch, heads, head_dim, groups, state_size, dtype, seed=0):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    lens = [q for _, q in batch]
    t, num_slots = sum(lens), len(batch) + 3

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=CUDA) * scale).to(dtype)

    def u(*shape, lo, hi):
        return torch.rand(*shape, generator=g, device=CUDA) * (hi - lo) + lo

    # As the models initialise them: A = -exp(log U(1, 16)), softplus(dt_bias) in (1e-3, 0.1).
    dt0 = torch.exp(u(heads, lo=math.log(1e-3), hi=math.log(0.1)))
    xbc = r(t, heads * head_dim + 2 * groups * state_size)  # one projection: strided views
    x, B, C = xbc.split([heads * head_dim, groups * state_size, groups * state_size], dim=-1)
    return dict(
        x=x.view(t, heads, head_dim), B=B.view(t, groups, state_size),
        C=C.view(t, groups, state_size), dt=r(t, heads, scale=0.5),
        A=-torch.exp(u(heads, lo=0.0, hi=math.log(16.0))), D=r(heads),
        dt_bias=(dt0 + torch.log(-torch.expm1(-dt0))).to(dtype),
        state=torch.randn(num_slots, heads, head_dim, state_size, generator=g, device=CUDA),
        slots=torch.randperm(num_slots, generator=g, device=CUDA)[:len(batch)],
        has_init=torch.tensor([c > 0 for c, _ in batch], device=CUDA),
        lens=lens, qsl=_qsl(lens, CUDA))


def _close_scaled(got, ref, tol):
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol,
                               atol=tol * max(1.0, float(ref.float().abs().max())))


GPU_SHAPES = [(16, 64, 1, 128), (24, 64, 8, 64), (8, 32, 2, 16)]  # heads, head_dim, groups, N


def _gpu_tol(dtype):
    # bf16 inputs: the kernel's dots run in tf32, the torch ops in full float32.
    return 1e-4 if dtype == torch.float32 else 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "h{}p{}g{}n{}".format(*s))
def test_ssd_prefill_kernel_matches_torch_on_gpu(dtype, shape):
    from pagedserve.attention.ops import ssd_kernels

    c = _gpu_case(GPU_PREFILLS, *shape, dtype)
    args = (c["x"], c["dt"], c["A"], c["B"], c["C"], c["D"], c["dt_bias"])
    state_ref, state = c["state"].clone(), c["state"].clone()
    y_ref = ssd_torch.ssd_chunk_scan(*args, state_ref, c["qsl"], c["slots"], c["has_init"],
                                     chunk_size=256)
    y = ssd_kernels.ssd_chunk_scan(*args, state, c["qsl"], c["slots"], c["has_init"],
                                   chunk_size=256)
    assert y.dtype == dtype
    _close_scaled(y, y_ref, _gpu_tol(dtype))
    _close_scaled(state, state_ref, _gpu_tol(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "h{}p{}g{}n{}".format(*s))
def test_ssd_decode_kernel_matches_torch_on_gpu(dtype, shape):
    from pagedserve.attention.ops import ssd_kernels

    c = _gpu_case(GPU_DECODES, *shape, dtype, seed=1)
    args = (c["x"], c["dt"], c["A"], c["B"], c["C"], c["D"], c["dt_bias"])
    state_ref, state = c["state"].clone(), c["state"].clone()
    y_ref = ssd_torch.ssd_state_update(*args, state_ref, c["slots"], c["has_init"])
    y = ssd_kernels.ssd_state_update(*args, state, c["slots"], c["has_init"])
    _close_scaled(y, y_ref, 1e-4 if dtype == torch.float32 else 1e-2)
    _close_scaled(state, state_ref, 1e-4 if dtype == torch.float32 else 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_without_activation_kernel_matches_torch_on_gpu(dtype):
    from pagedserve.attention.ops import mamba_kernels

    batch = GPU_PREFILLS + GPU_DECODES
    lens, p = [q for _, q in batch], len(GPU_PREFILLS)
    tp, d, k = sum(lens[:p]), 2048, 3
    g = torch.Generator(device=CUDA).manual_seed(2)
    x = torch.randn(sum(lens), d, generator=g, device=CUDA).to(dtype)
    w = torch.randn(d, k, generator=g, device=CUDA).to(dtype)
    conv0 = torch.randn(len(batch) + 2, d, k - 1, generator=g, device=CUDA).to(dtype)
    slots = torch.randperm(len(batch) + 2, generator=g, device=CUDA)[:len(batch)]
    has_init = torch.tensor([c > 0 for c, _ in batch], device=CUDA)
    conv_ref, conv = conv0.clone(), conv0.clone()
    ref = torch.empty_like(x)
    qsl = _qsl(lens[:p]).long()
    req = torch.repeat_interleave(torch.arange(p), torch.tensor(lens[:p]))
    index = (req * max(lens[:p]) + torch.arange(tp) - qsl[req]).to(CUDA)
    ref[:tp] = torch_ops.causal_conv1d_prefill(x[:tp], w, None, conv_ref, slots[:p],
                                               has_init[:p], index,
                                               torch.tensor(lens[:p], device=CUDA),
                                               max(lens[:p]), activation=None)
    ref[tp:] = torch_ops.causal_conv1d_decode(x[tp:], w, None, conv_ref, slots[p:],
                                              has_init[p:], activation=None)
    out = mamba_kernels.causal_conv1d(x, w, None, conv, _qsl(lens, CUDA), slots, has_init,
                                      max(lens), activation=None)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(conv, conv_ref, rtol=0, atol=0)
