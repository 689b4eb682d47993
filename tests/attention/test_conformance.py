"""Every available backend against a float32 reference on random paged data."""

import pytest
import torch

from pagedserve.attention import (
    AttentionLayerConfig,
    backend_status,
    get_backend_cls,
    registered_names,
)
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


# ---- attention sinks (gpt-oss) ---------------------------------------------------------------

SINK_BACKENDS = [name for name in AVAILABLE if get_backend_cls(name).supports_sinks]
# Backends that run attention layers (MAMBA runs state slots, never attention).
ATTENTION_BACKENDS = [name for name in registered_names() if name != "MAMBA"]


def _sink_params():
    # gpt-oss alternates window-128 and full layers, 8 query heads per KV head: windows and
    # GQA 8 here, and GQA 3 (a padded row tile in TRITON). With these few heads the seeded
    # sinks matter in every request at bf16 tolerance too (run_case checks it).
    for name in SINK_BACKENDS:
        for batch in BATCHES:
            for ratio in (3, 8):
                for window in (None, 8):
                    yield pytest.param(name, batch, ratio, window,
                                       id=f"{name}-{batch}-gqa{ratio}-w{window}")


@pytest.mark.parametrize("name,batch,ratio,window", list(_sink_params()))
def test_backend_with_sinks_matches_reference(name, batch, ratio, window):
    dtype = torch.float32 if DEVICE.type == "cpu" else torch.bfloat16
    case = Case(BATCHES[batch], 16, 2 * ratio, 2, 64, dtype, window, sinks=True)
    if not _supported(name, case):
        pytest.skip(f"{name} does not support {case}")
    run_case(get_backend_cls(name), case, DEVICE)


@pytest.mark.parametrize("name", SINK_BACKENDS)
def test_sinks_with_soft_cap(name):
    case = Case(BATCHES["mixed"], 16, 4, 2, 64, torch.float32, 8, 5.0, sinks=True)
    if not _supported(name, case):
        pytest.skip(f"{name} does not support sinks with soft-cap")
    run_case(get_backend_cls(name), case, DEVICE)


@pytest.mark.parametrize("name", ATTENTION_BACKENDS)
def test_backends_without_sinks_refuse_a_sink_layer(name):
    backend = get_backend_cls(name)
    layer = AttentionLayerConfig(8, 2, 64, torch.bfloat16, has_sinks=True)
    assert backend.impl_cls.supports_sinks == backend.supports_sinks
    assert ("sinks" in backend.features()) == backend.supports_sinks
    reasons = backend.validate_configuration(layer, 16, DEVICE)
    if backend.supports_sinks:
        assert "attention sinks not supported" not in reasons
        return
    assert "attention sinks not supported" in reasons
    # Nor can its impl be built for one, so no path runs a sink layer without its sinks.
    with pytest.raises(ValueError, match="attention sinks not supported"):
        backend.impl_cls(layer)


def test_a_sink_impl_refuses_to_run_unbound_or_misshapen_sinks():
    impl = get_backend_cls("CPU").impl_cls(
        AttentionLayerConfig(8, 2, 64, torch.float32, has_sinks=True))
    with pytest.raises(RuntimeError, match="before bind_sinks"):
        impl.bound_sinks()
    with pytest.raises(ValueError, match="shape"):
        impl.bind_sinks(torch.zeros(2))
    plain = get_backend_cls("CPU").impl_cls(AttentionLayerConfig(8, 2, 64, torch.float32))
    with pytest.raises(ValueError, match="has_sinks=False"):
        plain.bind_sinks(torch.zeros(8))


def test_attention_module_owns_and_binds_its_sinks():
    from pagedserve.attention.layer import Attention

    layer = Attention(8, 64, 0.125, 2, layer_idx=0, has_sinks=True)
    assert layer.sinks is not None and layer.sinks.shape == (8,)
    assert "sinks" in dict(layer.named_parameters())
    config = layer.config(torch.float32)
    assert config.has_sinks and hash(config) != hash(layer.config(torch.float16))
    impl = get_backend_cls("CPU").impl_cls(config)
    layer.bind(impl, config)
    assert impl.sinks is layer.sinks  # loading weights into the parameter reaches the impl
    plain = Attention(8, 64, 0.125, 2, layer_idx=1)
    assert plain.sinks is None and not plain.config(torch.float32).has_sinks
    with pytest.raises(ValueError, match="attention sinks not supported"):
        layer.bind(get_backend_cls("ROCM").impl_cls(config), config)
