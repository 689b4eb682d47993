"""Mamba on CUDA (skipped without it): the Triton kernels against the torch reference ops in
float32 and bfloat16 at realistic widths, and greedy tokens through the engine against
transformers on the GPU in float32."""

from __future__ import annotations

import pytest
import torch

from pagedserve.attention.mamba import torch_ops

pytestmark = pytest.mark.gpu

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


@pytest.mark.parametrize("variant", [{}, {"max_num_batched_tokens": 16}])
def test_engine_greedy_matches_transformers_on_gpu(tmp_path, make_llm, variant):
    """float32 on the GPU, the Triton path, against transformers' Mamba on the same GPU."""
    from pagedserve import SamplingParams
    from pagedserve.attention.backends.mamba import use_triton_kernels
    from tests.models.test_mamba import NUM_NEW, _config, _prompts, _save
    from tests.utils.paged import hf_greedy

    hf = _save(_config(tie=False), tmp_path, seed=0).to(CUDA)
    prompts = _prompts(211, seed=100)
    expected = [hf_greedy(hf, p, NUM_NEW) for p in prompts]  # on the GPU
    assert expected[0] == hf_greedy(hf.cpu(), prompts[0], NUM_NEW)  # the GPU reference is sane
    llm = make_llm(model=str(tmp_path), dtype="float32", device="cuda", **variant)
    assert use_triton_kernels(CUDA)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
