"""Backend selection: refusals name the layers they are about; a quantized kv_cache_dtype picks
the backend that stores it."""

import logging
import re

import pytest
import torch

from pagedserve.attention import (
    AttentionLayerConfig,
    BackendSelectionError,
    get_backend_cls,
    select_backend,
)
from pagedserve.attention.registry import _layer_problems, requested_backend

CPU = torch.device("cpu")
FULL = AttentionLayerConfig(8, 2, 64, torch.bfloat16)
# gpt-oss alternates windowed and full layers, all with sinks.
SINK_WINDOW = AttentionLayerConfig(8, 2, 64, torch.bfloat16, sliding_window=128, has_sinks=True)
SINK_FULL = AttentionLayerConfig(8, 2, 64, torch.bfloat16, has_sinks=True)


def test_reasons_name_the_layers_they_hold_for():
    layers = [FULL, SINK_WINDOW, FULL, SINK_WINDOW, FULL, SINK_WINDOW]
    problems = _layer_problems(get_backend_cls("ROCM"), layers, 16, CPU)
    assert problems == ["layers 1, 3, 5: attention sinks not supported"]


def test_runs_of_layers_and_every_layer():
    layers = [SINK_FULL] * 4 + [FULL, FULL, SINK_WINDOW, FULL]
    problems = _layer_problems(get_backend_cls("TURBOQUANT"), layers, 16, CPU)
    assert "layers 0-3, 6: attention sinks not supported" in problems
    everything = _layer_problems(get_backend_cls("ROCM"), [SINK_FULL] * 3, 16, CPU)
    assert everything == ["all 3 layers: attention sinks not supported"]
    assert _layer_problems(get_backend_cls("CPU"), layers, 16, CPU) == []


def test_a_named_backend_that_cannot_run_some_layers_says_which():
    if not get_backend_cls("TRITON").is_available()[0]:
        pytest.skip("TRITON is not available here")
    odd = AttentionLayerConfig(8, 2, 72, torch.float32)
    plain = AttentionLayerConfig(8, 2, 64, torch.float32)
    with pytest.raises(BackendSelectionError) as err:
        select_backend("TRITON", CPU, [plain, odd, plain, odd], 16)
    assert "layers 1, 3: head size 72 not in" in str(err.value)


def test_a_slow_fallback_is_chosen_automatically_only_when_nothing_after_it_can_run(
        monkeypatch):
    """FLASH_ATTN without FlashAttention's kernels runs its torch path (pages gathered every
    step, no CUDA graphs): on CUDA the automatic choice goes on to TRITON, and takes the
    fallback only where TRITON cannot run the layers; named, it is taken as asked."""
    from pagedserve.attention import registry
    from pagedserve.attention.backends import flash_attn

    cuda = torch.device("cuda")
    layers = [AttentionLayerConfig(4, 2, 64, torch.bfloat16)]
    status = {name: (name in ("FLASH_ATTN", "TRITON"), "test") for name in registry._REGISTRY}
    monkeypatch.setattr(registry, "backend_status", lambda: status)
    monkeypatch.setattr(flash_attn, "choose_implementation",
                        lambda: flash_attn.ImplChoice("torch", "torch: test"))
    monkeypatch.setattr(registry, "_layer_problems", lambda cls, *a: [])
    flash = registry.get_backend_cls("FLASH_ATTN")
    assert flash.is_fallback()
    assert select_backend(None, cuda, layers, 16).get_name() == "TRITON"
    assert select_backend("FLASH_ATTN", cuda, layers, 16) is flash
    monkeypatch.setattr(registry, "_layer_problems",
                        lambda cls, *a: ["cannot"] if cls.get_name() == "TRITON" else [])
    assert select_backend(None, cuda, layers, 16) is flash
    # With FlashAttention's own kernels it comes before TRITON, as before.
    monkeypatch.setattr(flash_attn, "choose_implementation",
                        lambda: flash_attn.ImplChoice("fa3", "fa3: test"))
    monkeypatch.setattr(registry, "_layer_problems", lambda cls, *a: [])
    assert not flash.is_fallback()
    assert select_backend(None, cuda, layers, 16) is flash


# ---- a quantized kv_cache_dtype picks the backend that stores it ----------------------------

CUDA = torch.device("cuda")
TQ_PRESETS = ["tq_4bit", "tq_k8v4", "tq_3bit", "naive_int4", "naive_int3"]
VALID_DTYPES = "valid values: auto, fp8, tq_k8v4, tq_4bit, tq_3bit, naive_int4, naive_int3"


def _layers(kv_cache_dtype: str, dtype: torch.dtype = torch.bfloat16,
            count: int = 2) -> list[AttentionLayerConfig]:
    return [AttentionLayerConfig(8, 2, 64, dtype, kv_cache_dtype=kv_cache_dtype)] * count


def _simulate_gpu(monkeypatch, available: tuple[str, ...], capability=(9, 0)) -> None:
    """A CUDA machine (compute capability `capability`) on which only `available` of the
    registered backends run; each backend still judges the layers itself."""
    from pagedserve.attention import registry

    status = {name: (name in available, f"{name} not here") for name in registry._REGISTRY}
    monkeypatch.setattr(registry, "backend_status", lambda: status)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


def _choice_logged(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "pagedserve.attention.registry" and "kv_cache_dtype" in r.getMessage()]


@pytest.mark.parametrize("preset", TQ_PRESETS)
def test_a_turboquant_preset_picks_turboquant_on_a_gpu_without_flashinfer(
        monkeypatch, caplog, preset):
    """The H200 of issue #47 without FlashInfer: TRITON is the automatic order's backend, and
    does not store the preset; TURBOQUANT, outside the order, does."""
    _simulate_gpu(monkeypatch, ("TRITON", "TURBOQUANT", "CPU"))
    with caplog.at_level(logging.INFO, logger="pagedserve.attention.registry"):
        assert select_backend(None, CUDA, _layers("auto"), 16).get_name() == "TRITON"
        assert select_backend(None, CUDA, _layers(preset), 16).get_name() == "TURBOQUANT"
    assert _choice_logged(caplog) == [
        f"kv_cache_dtype {preset!r}: attention backend TURBOQUANT (the automatic order's "
        f"TRITON does not store it)"]


@pytest.mark.parametrize("preset", TQ_PRESETS)
def test_a_turboquant_preset_picks_turboquant_on_the_cpu(caplog, preset):
    """TURBOQUANT's torch format runs on the CPU for every preset (fp8 codes included)."""
    with caplog.at_level(logging.INFO, logger="pagedserve.attention.registry"):
        assert select_backend(None, CPU, _layers("auto", torch.float32), 16).get_name() == "CPU"
        chosen = select_backend(None, CPU, _layers(preset, torch.float32), 16)
    assert chosen.get_name() == "TURBOQUANT"
    assert _choice_logged(caplog) == [
        f"kv_cache_dtype {preset!r}: attention backend TURBOQUANT (the automatic order's CPU "
        f"does not store it)"]


def test_fp8_picks_flashinfer_where_it_runs(monkeypatch, caplog):
    _simulate_gpu(monkeypatch, ("FLASHINFER", "TRITON", "TURBOQUANT"))
    with caplog.at_level(logging.INFO, logger="pagedserve.attention.registry"):
        assert select_backend(None, CUDA, _layers("fp8"), 16).get_name() == "FLASHINFER"
    assert _choice_logged(caplog) == [
        "kv_cache_dtype 'fp8': attention backend FLASHINFER (the first of the automatic order "
        "that can run the model)"]


def test_fp8_on_a_gpu_without_flashinfer_takes_triton(monkeypatch):
    """TRITON stores fp8 too: a GPU without FlashInfer serves an fp8 cache through it."""
    _simulate_gpu(monkeypatch, ("TRITON", "TURBOQUANT", "CPU"))
    assert select_backend(None, CUDA, _layers("fp8"), 16).get_name() == "TRITON"


def test_fp8_without_a_backend_that_runs_it_says_who_stores_it(monkeypatch):
    """On a CPU without the Triton interpreter nothing runs an fp8 cache: the error names the
    dtype, the device and each backend that stores it, with why it cannot run here."""
    _simulate_gpu(monkeypatch, ("TRITON", "TURBOQUANT", "CPU"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(BackendSelectionError) as err:
        select_backend(None, CPU, _layers("fp8", torch.float32), 16)
    message = str(err.value)
    assert message.startswith(f"no attention backend can run this model on {CPU} with "
                              "kv_cache_dtype 'fp8' (stored by FLASHINFER, TRITON, ROCM only")
    assert "FlashInfer runs on CUDA devices, not cpu" in message
    assert "CPU tensors need TRITON_INTERPRET=1" in message


def test_a_preset_turboquant_cannot_run_on_this_gpu_is_an_error_saying_why(monkeypatch):
    """tq_k8v4 keeps fp8 keys, which TurboQuant's kernels convert only from sm_89 on."""
    _simulate_gpu(monkeypatch, ("TRITON", "TURBOQUANT"), capability=(8, 0))
    with pytest.raises(BackendSelectionError) as err:
        select_backend(None, CUDA, _layers("tq_k8v4"), 16)
    assert "kv_cache_dtype 'tq_k8v4' (stored by TURBOQUANT only" in str(err.value)
    assert "compute capability 8.9 or newer; choose tq_4bit or tq_3bit" in str(err.value)
    assert select_backend(None, CUDA, _layers("tq_4bit"), 16).get_name() == "TURBOQUANT"


def test_an_unknown_kv_cache_dtype_lists_the_valid_values():
    for name in (None, "CPU"):
        with pytest.raises(BackendSelectionError, match=VALID_DTYPES) as err:
            select_backend(name, CPU, _layers("int8", torch.float32), 16)
        assert str(err.value).startswith("unknown kv_cache_dtype 'int8'")
    with pytest.raises(BackendSelectionError, match=VALID_DTYPES):
        requested_backend(None, "fp8_e5m2")  # checked before the model loads


@pytest.mark.parametrize("backend,kv_cache_dtype,stores", [
    ("TRITON", "tq_4bit", "TURBOQUANT"), ("triton_attn", "tq_3bit", "TURBOQUANT"),
    ("CPU", "fp8", "FLASHINFER, TRITON, ROCM"), ("FLASHINFER", "tq_k8v4", "TURBOQUANT")])
def test_a_backend_that_does_not_store_the_kv_cache_dtype_is_a_one_line_error(
        monkeypatch, backend, kv_cache_dtype, stores):
    """Whether or not the named backend runs here: the two settings contradict each other."""
    _simulate_gpu(monkeypatch, ("TRITON", "CPU", "TURBOQUANT"))
    expected = (f"does not store kv_cache_dtype {kv_cache_dtype!r}; the backends that do: "
                f"{stores} (name one of them")
    for check in (lambda: requested_backend(backend, kv_cache_dtype),
                  lambda: select_backend(backend, CUDA, _layers(kv_cache_dtype), 16)):
        with pytest.raises(BackendSelectionError, match=re.escape(expected)) as err:
            check()
        assert "\n" not in str(err.value)
    monkeypatch.setenv("PAGEDSERVE_ATTENTION_BACKEND", backend)
    with pytest.raises(BackendSelectionError, match=re.escape("(from $PAGEDSERVE_ATTENTION")):
        requested_backend(None, kv_cache_dtype)


def test_mla_layers_with_a_turboquant_preset_are_refused_by_name():
    """TURBOQUANT stores the preset but has no latent-attention path: the error says both."""
    from pagedserve.attention.mla import MLALayerConfig

    mla = MLALayerConfig(16, 1, 576, torch.float32, kv_cache_dtype="tq_4bit", kv_lora_rank=512,
                         qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    with pytest.raises(BackendSelectionError) as err:
        select_backend(None, CPU, [mla], 16)
    assert "TURBOQUANT: layer 0: multi-head latent attention not supported" in str(err.value)
