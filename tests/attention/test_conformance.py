"""Every available backend against a float32 reference on random paged data."""

import pytest
import torch

from pagedserve.attention import AttentionLayerConfig, backend_status, get_backend_cls
from tests.utils.conformance import BATCHES, Case, run_case

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Lossy caches (TurboQuant) run their own conformance with preset tolerances.
AVAILABLE = [name for name, (ok, _) in backend_status().items()
             if ok and not getattr(get_backend_cls(name), "lossy_kv_cache", False)]
# Kernels run by the Triton interpreter on the CPU are slow: they get a reduced grid there.
INTERPRETED = {name for name in AVAILABLE if name != "CPU" and DEVICE.type == "cpu"}


def _grid_params():
    for name in AVAILABLE:
        for batch in BATCHES:
            for block_size in (1, 16, 32):
                for ratio in (1, 3, 4):
                    for head_size in (64, 128):
                        for window in (None, 8):
                            if name in INTERPRETED and (block_size == 1 or head_size == 128
                                                        or ratio == 3):
                                continue
                            yield pytest.param(name, batch, block_size, ratio, head_size, window,
                                               id=f"{name}-{batch}-bs{block_size}-gqa{ratio}"
                                                  f"-d{head_size}-w{window}")


def _supported(name: str, case: Case) -> bool:
    layer = AttentionLayerConfig(case.num_heads, case.num_kv_heads, case.head_size, case.dtype,
                                 case.sliding_window, case.logits_soft_cap)
    return not get_backend_cls(name).validate_configuration(layer, case.block_size, DEVICE)


@pytest.mark.parametrize("name,batch,block_size,ratio,head_size,window", list(_grid_params()))
def test_backend_matches_reference(name, batch, block_size, ratio, head_size, window):
    # float32 where it runs (tolerance 1e-5); GPU kernels are checked in bf16 (2e-2).
    dtype = torch.float32 if DEVICE.type == "cpu" else torch.bfloat16
    case = Case(BATCHES[batch], block_size, 2 * ratio, 2, head_size, dtype, window)
    if not _supported(name, case):
        pytest.skip(f"{name} does not support {case}")
    run_case(get_backend_cls(name), case, DEVICE)


@pytest.mark.parametrize("name", AVAILABLE)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("batch", ["mixed", "chunked_prefill"])
def test_backend_half_precision(name, dtype, batch):
    case = Case(BATCHES[batch], 16, 8, 2, 64, dtype)
    if not _supported(name, case):
        pytest.skip(f"{name} does not support {dtype}")
    run_case(get_backend_cls(name), case, DEVICE)


@pytest.mark.parametrize("name", AVAILABLE)
def test_backend_soft_cap(name):
    case = Case(BATCHES["mixed"], 16, 4, 2, 64, torch.float32, None, logits_soft_cap=5.0)
    if not _supported(name, case):
        pytest.skip(f"{name} does not support soft-cap")
    run_case(get_backend_cls(name), case, DEVICE)
