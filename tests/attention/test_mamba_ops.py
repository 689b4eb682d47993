"""Mamba's state ops: the torch ops, and the Triton kernels in the interpreter, against a plain
per-token loop; on CUDA (the `gpu` tests) the Triton kernels against the torch reference ops in
float32 and bfloat16 at realistic widths. Mamba through the model and the engine:
tests/models/test_mamba.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.attention.mamba import torch_ops

# ---- state ops against a plain loop -------------------------------------------------------

def _naive(x, w, bias, conv0, dt, A, B, C, D, z, dt_bias, h0):
    """One request, token by token, float64: returns y [L, d], final conv and SSM states."""
    x, w, bias, conv0, dt, A, B, C, D, z, dt_bias, h0 = (
        t.double() for t in (x, w, bias, conv0, dt, A, B, C, D, z, dt_bias, h0))
    window, h, ys = conv0.clone(), h0.clone(), []
    for t in range(x.shape[0]):
        full = torch.cat([window, x[t, :, None]], dim=1)
        u = F.silu((full * w).sum(-1) + bias)
        window = full[:, 1:]
        step = F.softplus(dt[t] + dt_bias)
        h = torch.exp(step[:, None] * A) * h + step[:, None] * B[t][None, :] * u[:, None]
        ys.append(((h @ C[t]) + D * u) * F.silu(z[t]))
    return torch.stack(ys), window, h


def _random_case(lens, d=24, n=8, k=4, num_slots=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return dict(x=r(t, d), w=r(d, k) * 0.5, bias=r(d) * 0.1, conv=r(num_slots, d, k - 1),
                dt=r(t, d) * 0.5, A=-torch.rand(d, n, generator=g) * 2, B=r(t, n), C=r(t, n),
                D=r(d), z=r(t, d), dt_bias=r(d) * 0.3, ssm=r(num_slots, d, n))


def _grid_index(lens):
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    req = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    return qsl, req * max(lens) + torch.arange(sum(lens)) - qsl[req]


def _expected(c, lens, slots, has_init):
    qsl, _ = _grid_index(lens)
    ys, convs, ssms = [], [], []
    for i, (s, h) in enumerate(zip(slots, has_init, strict=True)):
        a, b = int(qsl[i]), int(qsl[i + 1])
        conv0 = c["conv"][s] if h else torch.zeros_like(c["conv"][s])
        h0 = c["ssm"][s] if h else torch.zeros_like(c["ssm"][s])
        y, conv, ssm = _naive(c["x"][a:b], c["w"], c["bias"], conv0, c["dt"][a:b], c["A"],
                              c["B"][a:b], c["C"][a:b], c["D"], c["z"][a:b], c["dt_bias"], h0)
        ys.append(y)
        convs.append(conv)
        ssms.append(ssm)
    return torch.cat(ys).float(), torch.stack(convs).float(), torch.stack(ssms).float()


LENS, SLOTS, HAS_INIT = [5, 1, 19, 2], [4, 0, 2, 5], [True, False, True, False]


def test_torch_prefill_ops_match_loop():
    c = _random_case(LENS)
    y_ref, conv_ref, ssm_ref = _expected(c, LENS, SLOTS, HAS_INIT)
    idx, has = torch.tensor(SLOTS), torch.tensor(HAS_INIT)
    _, token_index = _grid_index(LENS)
    conv, ssm = c["conv"].clone(), c["ssm"].clone()
    u = torch_ops.causal_conv1d_prefill(c["x"], c["w"], c["bias"], conv, idx, has, token_index,
                                        torch.tensor(LENS), max(LENS))
    y = torch_ops.selective_scan_prefill(u, c["dt"], c["A"], c["B"], c["C"], c["D"], c["z"],
                                         c["dt_bias"], ssm, idx, has, token_index, max(LENS))
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv[idx], conv_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ssm[idx], ssm_ref, rtol=1e-5, atol=1e-5)
    untouched = [s for s in range(6) if s not in SLOTS]
    assert torch.equal(ssm[untouched], c["ssm"][untouched])


def test_torch_decode_ops_match_loop():
    lens = [1, 1, 1, 1]
    c = _random_case(lens, seed=1)
    y_ref, conv_ref, ssm_ref = _expected(c, lens, SLOTS, HAS_INIT)
    idx, has = torch.tensor(SLOTS), torch.tensor(HAS_INIT)
    conv, ssm = c["conv"].clone(), c["ssm"].clone()
    u = torch_ops.causal_conv1d_decode(c["x"], c["w"], c["bias"], conv, idx, has)
    y = torch_ops.selective_state_update(u, c["dt"], c["A"], c["B"], c["C"], c["D"], c["z"],
                                         c["dt_bias"], ssm, idx, has)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv[idx], conv_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ssm[idx], ssm_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lens", [LENS, [1, 1, 1, 1]], ids=["prefill", "decode"])
def test_triton_kernels_match_loop(lens):
    """The Triton kernels (in the interpreter on the CPU; small shapes) against the loop."""
    pytest.importorskip("triton")
    import os

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    from pagedserve.attention.ops import mamba_kernels as kernels

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    c = {k: v.to(device) for k, v in _random_case(lens, seed=2).items()}
    y_ref, conv_ref, ssm_ref = _expected({k: v.cpu() for k, v in c.items()}, lens, SLOTS,
                                         HAS_INIT)
    idx = torch.tensor(SLOTS, device=device)
    has = torch.tensor(HAS_INIT, device=device)
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                       device=device)
    conv, ssm = c["conv"].clone(), c["ssm"].clone()
    u = kernels.causal_conv1d(c["x"], c["w"], c["bias"], conv, qsl, idx, has, max(lens),
                              block_t=8, block_d=16)
    if max(lens) > 1:
        y = kernels.selective_scan(u, c["dt"], c["A"], c["B"], c["C"], c["D"], c["z"],
                                   c["dt_bias"], ssm, qsl, idx, has, chunk=8, block_d=16)
    else:
        y = kernels.selective_state_update(u, c["dt"], c["A"], c["B"], c["C"], c["D"], c["z"],
                                           c["dt_bias"], ssm, idx, has, block_d=16)
    torch.testing.assert_close(y.cpu(), y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv[idx].cpu(), conv_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ssm[idx].cpu(), ssm_ref, rtol=1e-5, atol=1e-5)


# ---- the Triton kernels on CUDA, against the torch ops -------------------------------------

CUDA = torch.device("cuda")
# (context_len, new tokens) per request: prefills (fresh, continued chunks, long), then decodes.
PREFILLS = [(0, 300), (64, 37), (0, 2), (17, 129), (5, 1000)]
DECODES = [(40, 1)] * 48 + [(0, 1)] * 4


def _case(batch, d, n, k, dtype, seed=0):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    lens = [q for _, q in batch]
    t, num_slots = sum(lens), len(batch) + 3

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=CUDA) * scale).to(dtype)

    slots = torch.randperm(num_slots, generator=g, device=CUDA)[:len(batch)]
    xz = r(t, 2 * d)
    return dict(
        x=xz[:, :d], z=xz[:, d:], w=r(d, k, scale=0.5), bias=r(d, scale=0.1),
        conv=r(num_slots, d, k - 1), dt=r(t, d, scale=0.5),
        A=-torch.rand(d, n, generator=g, device=CUDA) * 4, B=r(t, n), C=r(t, n), D=r(d),
        dt_bias=r(d, scale=0.3), ssm=torch.randn(num_slots, d, n, generator=g, device=CUDA),
        slots=slots, has_init=torch.tensor([c > 0 for c, _ in batch], device=CUDA),
        lens=torch.tensor(lens, device=CUDA),
        qsl=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                         device=CUDA))


def _token_index(c):
    lens, qsl = c["lens"], c["qsl"].long()
    req = torch.repeat_interleave(torch.arange(len(lens), device=CUDA), lens)
    return req * int(lens.max()) + torch.arange(int(lens.sum()), device=CUDA) - qsl[req]


def _tol(dtype):
    # bf16: the torch path rounds dt + dt_bias and y to bf16, the kernels keep them in fp32.
    return dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)


def _assert_state_close(got, ref, dtype):
    tol = _tol(dtype)
    torch.testing.assert_close(got, ref, rtol=tol["rtol"],
                               atol=tol["atol"] * max(1.0, float(ref.abs().max())))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,n", [(256, 16), (1536, 16), (128, 8)])
def test_prefill_kernels_match_torch(dtype, d, n):
    from pagedserve.attention.ops import mamba_kernels as kernels

    c = _case(PREFILLS, d, n, 4, dtype)
    conv_ref, ssm_ref = c["conv"].clone(), c["ssm"].clone()
    u_ref = torch_ops.causal_conv1d_prefill(c["x"], c["w"], c["bias"], conv_ref, c["slots"],
                                            c["has_init"], _token_index(c), c["lens"],
                                            int(c["lens"].max()))
    conv, ssm = c["conv"].clone(), c["ssm"].clone()
    u = kernels.causal_conv1d(c["x"], c["w"], c["bias"], conv, c["qsl"], c["slots"],
                              c["has_init"], int(c["lens"].max()))
    torch.testing.assert_close(u.float(), u_ref.float(), **_tol(dtype))
    torch.testing.assert_close(conv, conv_ref, rtol=0, atol=0)  # a copy of inputs: exact

    args = (u_ref, c["dt"], c["A"], c["B"], c["C"], c["D"], c["z"], c["dt_bias"])
    y_ref = torch_ops.selective_scan_prefill(*args, ssm_ref, c["slots"], c["has_init"],
                                             _token_index(c), int(c["lens"].max()))
    y = kernels.selective_scan(*args, ssm, c["qsl"], c["slots"], c["has_init"])
    scale = float(y_ref.float().abs().max())
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=_tol(dtype)["rtol"],
                               atol=_tol(dtype)["atol"] * scale)
    _assert_state_close(ssm, ssm_ref, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,n", [(1536, 16), (128, 8)])
def test_decode_kernels_match_torch(dtype, d, n):
    from pagedserve.attention.ops import mamba_kernels as kernels

    c = _case(DECODES, d, n, 4, dtype, seed=1)
    conv_ref, ssm_ref = c["conv"].clone(), c["ssm"].clone()
    conv, ssm = c["conv"].clone(), c["ssm"].clone()
    u_ref = torch_ops.causal_conv1d_decode(c["x"], c["w"], c["bias"], conv_ref, c["slots"],
                                           c["has_init"])
    u = kernels.causal_conv1d(c["x"], c["w"], c["bias"], conv, c["qsl"], c["slots"],
                              c["has_init"], 1)
    torch.testing.assert_close(u.float(), u_ref.float(), **_tol(dtype))
    torch.testing.assert_close(conv, conv_ref, rtol=0, atol=0)
    args = (u_ref, c["dt"], c["A"], c["B"], c["C"], c["D"], c["z"], c["dt_bias"])
    y_ref = torch_ops.selective_state_update(*args, ssm_ref, c["slots"], c["has_init"])
    y = kernels.selective_state_update(*args, ssm, c["slots"], c["has_init"])
    torch.testing.assert_close(y.float(), y_ref.float(), **_tol(dtype))
    _assert_state_close(ssm, ssm_ref, dtype)
