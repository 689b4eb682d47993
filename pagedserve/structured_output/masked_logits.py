"""A float32 copy of a batch's logits with each row's grammar bitmask applied, and divided by
the row's temperature when the sampler asks: one kernel on a GPU where the sampler would
otherwise clone the logits, apply the mask and divide (three launches, and xgrammar's wrapper:
~0.1 ms of the host's time a step on the H200 at batch 64, where a guided decode step is
host-bound). With the division a guided step's sampling launches no more kernels than an
unguided one's.

Kernel `_masked_logits_kernel`
  grid:    (num_rows, cdiv(vocab, BLOCK)); program (r, b) copies logits [r, b*BLOCK, (b+1)*BLOCK)
           and writes -inf where bit (t % 32) of the row's word t // 32 is 0 (xgrammar's
           layout: bit set = token allowed); with SCALE, the kept values divided by
           temperature[r] (correctly rounded, as torch's division: same samples).
  layout:  logits [rows, vocab] float32 with unit column stride; bitmask [rows, >= cdiv(vocab,
           32)] int32, unit column stride; the output contiguous.
  memory:  the bitmask may be page-locked host memory (pinned, or registered with
           cudaHostRegister: the grammar workers' shared block): the kernel reads its
           ~0.4 MB over the bus (at batch 64 on a 49k vocabulary), and the host launches no
           copy. The host must not rewrite it until the kernel has run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _masked_logits_kernel(logits_ptr, bitmask_ptr, temperature_ptr, out_ptr, vocab_size,
                          logits_stride, bitmask_stride, SCALE: tl.constexpr,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < vocab_size
    words = tl.load(bitmask_ptr + row * bitmask_stride + offs // 32, mask=inside, other=0)
    allowed = ((words >> (offs % 32)) & 1) != 0
    values = tl.load(logits_ptr + row * logits_stride + offs, mask=inside)
    if SCALE:
        values = tl.math.div_rn(values, tl.load(temperature_ptr + row))
    tl.store(out_ptr + row * vocab_size + offs, tl.where(allowed, values, float("-inf")),
             mask=inside)


def masked_logits_triton(logits: torch.Tensor, bitmask: torch.Tensor,
                         temperature: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's masked copy of every row, divided by `temperature` [rows] float32 if given
    (CUDA tensors, or CPU ones under TRITON_INTERPRET=1)."""
    rows, vocab = logits.shape
    # The kernel trusts these: a short mask would be read past its end (host memory, maybe).
    assert logits.dtype == torch.float32 and bitmask.dtype == torch.int32
    assert logits.stride(1) == 1 and bitmask.stride(1) == 1
    assert bitmask.shape[0] >= rows and bitmask.shape[1] * 32 >= vocab
    if temperature is not None:
        assert temperature.dtype == torch.float32 and temperature.shape[0] >= rows
        assert temperature.stride(0) == 1
    out = torch.empty((rows, vocab), dtype=torch.float32, device=logits.device)
    _masked_logits_kernel[(rows, triton.cdiv(vocab, BLOCK))](
        logits, bitmask, temperature if temperature is not None else logits, out, vocab,
        logits.stride(0), bitmask.stride(0), SCALE=temperature is not None, BLOCK=BLOCK)
    return out
