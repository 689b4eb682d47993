"""Every available backend against a float32 reference on random paged data."""

import numpy as np
import pytest
import torch

from pagedserve.attention import (
    AttentionLayerConfig,
    BuilderConfig,
    backend_status,
    get_backend_cls,
    registered_names,
    registry,
)
from pagedserve.attention.forward_context import set_forward_context
from pagedserve.attention.metadata import CommonMetadataBuilder
from pagedserve.attention.state import StateBackend
from tests.utils.conformance import BATCHES, Case, reference_attention, run_case

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Lossy caches (TurboQuant) run their own conformance with preset tolerances.
AVAILABLE = [name for name, (ok, _) in backend_status().items()
             if ok and not getattr(get_backend_cls(name), "lossy_kv_cache", False)]
# Kernels run by the Triton interpreter on the CPU are slow (and FLEX_ATTENTION's eager flex
# little faster): they get a reduced grid there.
INTERPRETED = {name for name in AVAILABLE if name != "CPU" and DEVICE.type == "cpu"}
# Eager flex's tiles do not follow the page size: block size 32 repeats 16 (slow);
# tests/attention/test_flex_attention.py runs block size 1.
EAGER_FLEX = {"FLEX_ATTENTION"} & INTERPRETED


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
                            slow = name in EAGER_FLEX and block_size == 32
                            yield pytest.param(name, batch, block_size, ratio, head_size, window,
                                               marks=(pytest.mark.slow,) if slow else (),
                                               id=f"{name}-{batch}-bs{block_size}-gqa{ratio}"
                                                  f"-d{head_size}-w{window}")


def _supported(name: str, case: Case) -> bool:
    return not get_backend_cls(name).validate_configuration(case.layer(), case.block_size,
                                                            DEVICE)


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


# ---- fp8 KV cache ------------------------------------------------------------------------------

FP8_BACKENDS = [name for name in AVAILABLE
                if "fp8" in get_backend_cls(name).supported_kv_cache_dtypes]


@pytest.mark.parametrize("name", FP8_BACKENDS)
@pytest.mark.parametrize("batch,window,kv_scales", [
    ("mixed", None, (1.0, 1.0)), ("chunked_prefill", 8, (0.5, 2.0)), ("decode", None, (3.0, 0.25))])
def test_backend_with_fp8_kv_cache(name, batch, window, kv_scales):
    # The reference attends over the cache's rounded values times the scales: what is compared
    # is the backend's reading of e4m3 pages and its scales, not the quantisation error.
    dtype = torch.float32 if DEVICE.type == "cpu" else torch.bfloat16
    case = Case(BATCHES[batch], 16, 4, 2, 64, dtype, window, kv_cache_dtype="fp8",
                kv_scales=kv_scales)
    if not _supported(name, case):
        pytest.skip(f"{name} does not support {case}")
    run_case(get_backend_cls(name), case, DEVICE)


# ---- attention sinks (gpt-oss) ---------------------------------------------------------------

SINK_BACKENDS = [name for name in AVAILABLE if get_backend_cls(name).supports_sinks]
# Backends that run attention layers (state backends run state slots, never attention).
ATTENTION_BACKENDS = [name for name in registered_names()
                      if not issubclass(get_backend_cls(name), StateBackend)]


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


# ---- values of another head size (DeepSeek's expanded MLA prefill, MiMo-V2-Flash) -----------

DIFF_KV_BACKENDS = [name for name in AVAILABLE if get_backend_cls(name).supports_diff_kv]
DIFF_KV_REFUSAL = "value head size 128 != head size 192 not supported"


def _diff_kv_params():
    # (D, D_v): MLA's 192/128 (a padded K tile in TRITON) and a smaller pair, 128/64.
    for name in DIFF_KV_BACKENDS:
        for head_size, head_size_v in ((192, 128), (128, 64)):
            for batch in BATCHES:
                for block_size in (16, 32):
                    for ratio in (1, 3, 4):
                        marks = ()
                        if name in INTERPRETED:
                            if ratio == 3:
                                continue
                            if block_size == 32:  # tiles do not follow the page size: redundant
                                marks = (pytest.mark.slow,)
                        yield pytest.param(name, batch, block_size, ratio, head_size,
                                           head_size_v, marks=marks,
                                           id=f"{name}-{batch}-bs{block_size}-gqa{ratio}"
                                              f"-d{head_size}-dv{head_size_v}")


@pytest.mark.parametrize("name,batch,block_size,ratio,head_size,head_size_v",
                         list(_diff_kv_params()))
def test_diff_kv_matches_reference(name, batch, block_size, ratio, head_size, head_size_v):
    dtype = torch.float32 if DEVICE.type == "cpu" else torch.bfloat16
    case = Case(BATCHES[batch], block_size, 2 * ratio, 2, head_size, dtype,
                head_size_v=head_size_v)
    if not _supported(name, case):
        pytest.skip(f"{name} does not support {case}")
    run_case(get_backend_cls(name), case, DEVICE)


@pytest.mark.parametrize("name", DIFF_KV_BACKENDS)
@pytest.mark.parametrize("batch", ["mixed", "chunked_prefill"])
def test_diff_kv_with_window_soft_cap_and_sinks(name, batch):
    case = Case(BATCHES[batch], 16, 8, 2, 192, torch.float32, 8, 5.0, sinks=True,
                head_size_v=128)
    if not _supported(name, case):
        pytest.skip(f"{name} does not support {case}")
    run_case(get_backend_cls(name), case, DEVICE)


@pytest.mark.parametrize("name", DIFF_KV_BACKENDS)
def test_diff_kv_half_precision(name):
    case = Case(BATCHES["mixed"], 16, 8, 2, 192, torch.bfloat16, head_size_v=128)
    if not _supported(name, case):
        pytest.skip(f"{name} does not support {case}")
    run_case(get_backend_cls(name), case, DEVICE)


@pytest.mark.parametrize("name", ATTENTION_BACKENDS)
def test_backends_without_diff_kv_refuse_it_by_name(name):
    backend = get_backend_cls(name)
    layer = AttentionLayerConfig(8, 2, 192, torch.bfloat16, head_size_v=128)
    assert backend.impl_cls.supports_diff_kv == backend.supports_diff_kv
    assert ("diff-kv" in backend.features()) == backend.supports_diff_kv
    reasons = backend.validate_configuration(layer, 16, DEVICE)
    if backend.supports_diff_kv:
        assert DIFF_KV_REFUSAL not in reasons
        return
    if DIFF_KV_REFUSAL not in reasons:
        # A backend for another kind of layer altogether (MLA's latent cache) refuses the
        # same layer with V of K's size just as well.
        twin = AttentionLayerConfig(8, 2, 192, torch.bfloat16)
        assert reasons and backend.validate_configuration(twin, 16, DEVICE) == reasons
        return
    # Nor can its impl be built for one, so no path runs V with K's head size.
    with pytest.raises(ValueError, match=DIFF_KV_REFUSAL):
        backend.impl_cls(layer)


def test_diff_kv_refusal_names_the_layers():
    mixed = [AttentionLayerConfig(8, 2, 192, torch.bfloat16, head_size_v=128),
             AttentionLayerConfig(8, 2, 128, torch.bfloat16)] * 2
    problems = registry._layer_problems(get_backend_cls("FLASHINFER"), mixed, 16, DEVICE)
    assert f"layers 0, 2: {DIFF_KV_REFUSAL}" in problems


def test_layer_config_stores_an_equal_value_head_size_as_none():
    same = AttentionLayerConfig(8, 2, 128, torch.float32, head_size_v=128)
    assert same == AttentionLayerConfig(8, 2, 128, torch.float32)
    assert hash(same) == hash(AttentionLayerConfig(8, 2, 128, torch.float32))
    assert same.head_size_v is None and same.value_head_size == 128
    diff = AttentionLayerConfig(8, 2, 192, torch.float32, head_size_v=128)
    assert diff.value_head_size == 128 and diff != AttentionLayerConfig(8, 2, 192, torch.float32)
    assert diff.softmax_scale == 192 ** -0.5  # the scale follows the query/key head size
    with pytest.raises(ValueError, match="head_size_v"):
        AttentionLayerConfig(8, 2, 192, torch.float32, head_size_v=0)


def test_attention_module_takes_and_returns_value_head_size():
    """The model-facing layer: value [T, Hkv * D_v] in, [T, H * D_v] out, through the CPU
    backend's side-by-side cache, against the float32 reference."""
    from pagedserve.attention.layer import Attention

    h, hkv, d, dv, t, bs = 4, 2, 48, 32, 7, 4
    module = Attention(h, d, d ** -0.5, hkv, layer_idx=0, head_size_v=dv)
    config = module.config(torch.float32)
    assert config.head_size_v == dv
    backend = get_backend_cls("CPU")
    module.bind(backend.impl_cls(config), config)
    cache = torch.zeros(backend.get_kv_cache_shape(3, bs, hkv, d, head_size_v=dv))
    table = np.array([[2, 0]], dtype=np.int32)
    common = CommonMetadataBuilder(1, t, 2, bs, torch.device("cpu")).build(
        rows=np.arange(1), num_computed=np.zeros(1, np.int32),
        num_scheduled=np.array([t], np.int32), num_prefills=1, block_table=table)
    builder = backend.builder_cls(BuilderConfig.for_layer(config, bs, 1, t, 2,
                                                          torch.device("cpu")))
    q, k, v = torch.randn(t, h * d), torch.randn(t, hkv * d), torch.randn(t, hkv * dv)
    with set_forward_context({config: builder.build(common)}, [cache]):
        out = module(q, k, v)
    assert out.shape == (t, h * dv)
    ref = reference_attention(q.view(t, h, d), k.view(t, hkv, d), v.view(t, hkv, dv), 0,
                              d ** -0.5, None, None)
    torch.testing.assert_close(out, ref.reshape(t, h * dv), rtol=1e-5, atol=1e-5)
