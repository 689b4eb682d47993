"""Engine and server configuration: dataclasses whose fields are also the command line.

`EngineConfig` = `ModelConfig` + `CacheConfig` + `SchedulerConfig` + the engine's own
settings; `ServerConfig` (server_config.py) holds what only the HTTP server uses. A field's
metadata (`help`, `choices`, `flag=False` for settings that have no flag) is what `arg_utils`
turns into the `--kebab-case` flag, so the flags, `LLM(...)`'s keywords and the YAML presets'
keys are the same names from one place.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from pagedserve.lora.config import LoRAConfig
from pagedserve.multimodal.limits import parse_mm_limits
from pagedserve.multimodal.processing import parse_processor_kwargs
from pagedserve.spec_decode.config import (
    SpeculativeConfig,
    check_model_path,
    check_supported,
    parse_speculative_config,
)

logger = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
# vLLM's other names for them.
DTYPE_ALIASES = {"float": "float32", "half": "float16"}


# Items of one modality a prompt may carry unless limit_mm_per_prompt says otherwise.
DEFAULT_MM_LIMIT = 2


def setting(default: Any = None, help: str = "", **metadata: Any) -> Any:  # noqa: A002
    """A config field with its flag's help text (and `choices`, `flag=False`, `metavar`)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **metadata})
    return field(default=default, metadata={"help": help, **metadata})


def resolve_dtype(name: str | torch.dtype, device: torch.device) -> torch.dtype:
    """`auto` is float32 on the CPU and bfloat16 on CUDA."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    name = DTYPE_ALIASES.get(name, name)
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def parse_memory(value: int | str) -> int:
    """Bytes from an int or a string such as '2GiB', '512MiB', '1.5GB'."""
    if isinstance(value, int):
        return value
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6,
             "gb": 10**9, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "b": 1}
    text = value.strip().lower()
    for unit in sorted(units, key=len, reverse=True):
        if text.endswith(unit):
            number = text[: -len(unit)].strip()
            try:
                return int(float(number) * units[unit])
            except ValueError:
                break
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"memory size {value!r} is not a number of bytes or e.g. '2GiB'") from None


@dataclass
class ModelConfig:
    model: str | None = setting(
        None, "model directory (config.json, safetensors, tokenizer) or .gguf file; "
              "'random:<preset>' for random weights (default: the bundled SmolLM2-135M)")
    dtype: str = setting("auto", "weights and activations; auto is float32 on the CPU and "
                                 "bfloat16 on CUDA", choices=["auto", *DTYPES, *DTYPE_ALIASES])
    max_model_len: int | None = setting(None, "context length (default: the model's)")
    seed: int = setting(0, "engine seed")
    tokenizer: str | None = setting(None, "tokenizer directory (default: the model's own)")
    chat_template: str | None = setting(
        None, "a Jinja chat template, or a file holding one (default: the tokenizer's)")
    generation_config: str = setting(
        "auto", "'auto': EOS ids and default sampling settings from the model's "
                "generation_config.json; 'vllm': neither; or a directory holding one")
    quantization: str = setting(
        "auto", "int8: weight-only int8 linears on the CPU (bfloat16 products, float32 "
                "activations), which auto picks for a .gguf model when --dtype is left to the "
                "engine; fp8: FP8 weights quantized at load (dequantized on the CPU); gguf: a "
                ".gguf file's Q8_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K linears stay in their blocks for "
                "Triton GEMMs on CUDA (auto does so with PAGEDSERVE_GGUF_KERNEL=1); none. "
                "A checkpoint's own quantization_config (FP8, AWQ, GPTQ, compressed-tensors, "
                "MXFP4) is always read; awq, gptq, compressed-tensors, mxfp4: only check that "
                "it is that format (as vLLM takes them; awq_marlin and gptq_marlin too)",
        choices=["auto", "int8", "fp8", "gguf", "none", "awq", "gptq", "compressed-tensors",
                 "mxfp4", "awq_marlin", "gptq_marlin"])
    runner: str = setting(
        "auto", "generate: sample tokens; pooling: embeddings (LLM.embed, /v1/embeddings); "
                "auto: pooling for a sentence-transformers directory (modules.json) or a bare "
                "checkpoint such as Qwen3Model, else generate",
        choices=["auto", "generate", "pooling"])
    pooling_type: str | None = setting(
        None, "a pooling model's pooling: cls, mean or last (default: the model's "
              "1_Pooling/config.json, else last)", choices=["cls", "mean", "last"])
    pooling_normalize: bool | None = setting(
        None, "L2-normalise a pooling model's embeddings (default: when its modules.json has "
              "a Normalize module; without modules.json, yes)")
    max_logprobs: int = setting(20, "most logprobs a request may ask for (per token or prompt "
                                    "position)")
    # The front searches every stop string in the tail of the text at every token (a window
    # of the new text and the longest stop string), the core looks the stop ids up at every
    # step, and a stream holds back the last (longest stop string - 1) characters. OpenAI
    # takes 4 stop strings; 32 leaves room for clients that list a chat format's markers. At
    # 32 strings of 1,024 characters, built to make the search work hardest, the front spent
    # ~25 us per token of a sequence on a 2-core CPU (~2 us with one short string); an
    # unbounded string is an unbounded search and hold-back per token.
    max_stop_strings: int = setting(32, "most stop strings a request may give")
    max_stop_string_length: int = setting(1024, "most characters in one stop string")
    max_stop_token_ids: int = setting(1024, "most stop token ids a request may give")
    trust_remote_code: bool = setting(
        False, "refused: pagedserve runs only its own model code, never a checkpoint's")
    # Images one prompt may carry, as vLLM's limit_mm_per_prompt (its JSON or image=N
    # spelling, or a dict); a modality left out takes DEFAULT_MM_LIMIT.
    limit_mm_per_prompt: dict[str, int] | str | None = setting(
        None, "most images one prompt may carry, as vLLM spells it: '{\"image\": 4}' or "
              f"'image=4'; 0 takes a vision-language model's text only (default: "
              f"{DEFAULT_MM_LIMIT})", metavar="LIMITS")

    # vLLM's mm_processor_kwargs: settings of the model's image processing over its
    # preprocessor_config.json's (Gemma 3: do_pan_and_scan and the pan_and_scan_* values).
    mm_processor_kwargs: dict[str, Any] | str | None = setting(
        None, "settings of the model's image processing, as vLLM spells them: a JSON object "
              "over its preprocessor_config.json, e.g. '{\"do_pan_and_scan\": true}' for "
              "Gemma 3's pan-and-scan crops", metavar="JSON")

    def mm_limit(self, modality: str) -> int:
        limits = self.limit_mm_per_prompt
        return (limits if isinstance(limits, dict) else {}).get(modality, DEFAULT_MM_LIMIT)

    def __post_init__(self) -> None:
        if self.trust_remote_code:
            raise ValueError("trust_remote_code: pagedserve runs only its own implementation of "
                             "each model family and never code shipped with a checkpoint; drop "
                             "--trust-remote-code")
        for name in ("max_logprobs", "max_stop_strings", "max_stop_string_length",
                     "max_stop_token_ids"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        self.limit_mm_per_prompt = parse_mm_limits(self.limit_mm_per_prompt)
        self.mm_processor_kwargs = parse_processor_kwargs(self.mm_processor_kwargs)


@dataclass
class CacheConfig:
    block_size: int = setting(16, "tokens per KV block")
    kv_cache_memory: int | str = setting("1GiB", "KV cache budget on the CPU, e.g. 2GiB")
    gpu_memory_utilization: float = setting(0.9, "fraction of the GPU's memory the engine may "
                                                 "fill (weights, activations, KV cache)")
    kv_cache_dtype: str = setting("auto", "auto (the model's dtype), fp8, or a TurboQuant "
                                          "preset (tq_k8v4, tq_4bit, tq_3bit)")
    num_gpu_blocks_override: int | None = setting(None, "KV blocks, bypassing the memory "
                                                        "budget (testing)", hidden=True)
    enable_prefix_caching: bool = setting(True, "reuse KV blocks of shared prompt prefixes")

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        self.kv_cache_memory = parse_memory(self.kv_cache_memory)


# A step's token budget unless the model or the user decides otherwise (SchedulerConfig).
DEFAULT_STEP_TOKENS = 2048


@dataclass
class SchedulerConfig:
    # None: 256 on CUDA, 128 on the CPU (EngineConfig decides, knowing the device). vLLM's
    # offline and server default on GPUs is 256 (1,024 on >= 70 GiB ones); 128 halved the
    # bundled 135M model's H200 throughput (two waves of host-bound steps instead of one).
    max_num_seqs: int | None = setting(
        None, "most requests in one step (default: 256 on CUDA, 128 on the CPU)")
    # None: 2048, but a pooling model's on CUDA max(16384, its context): its requests run
    # whole in one step each (never in chunks), and its steps should keep the GPU busy, as
    # vLLM's offline default on large GPUs does (EngineConfig decides, knowing both).
    max_num_batched_tokens: int | None = setting(
        None, "most tokens in one step (longer prompts are prefilled in chunks; default: 2048, "
              "a pooling model's on CUDA max(16384, its context length))")
    # Images: the encoder's output rows kept between steps (a span prefilled in chunks reads
    # them over several steps; a repeated image finds them), and the rows the encoder may
    # produce in one step. None: max(max_num_batched_tokens, the largest image's rows), as
    # vLLM sizes both.
    encoder_cache_size: int | None = setting(
        None, "image embedding rows kept between steps (default: max(max_num_batched_tokens, "
              "the largest image's rows))")
    max_num_encoder_input_tokens: int | None = setting(
        None, "most image embedding rows the encoder computes in one step (default: as "
              "encoder_cache_size)")
    enable_chunked_prefill: bool = setting(
        True, "vLLM's flag; prompts over --max-num-batched-tokens are always prefilled in "
              "chunks")

    def __post_init__(self) -> None:
        if not self.enable_chunked_prefill:
            logger.warning("enable_chunked_prefill=False: long prompts still prefill in chunks")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        for name in ("encoder_cache_size", "max_num_encoder_input_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


SECTIONS = ("model", "cache", "scheduler", "lora")


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    attention_backend: str | None = setting(
        None, "FLASHINFER, FLASH_ATTN, TRITON, CPU, ROCM, TURBOQUANT, FLEX_ATTENTION; MLA "
              "models: FLASHINFER_MLA, TRITON_MLA, CPU_MLA (default: "
              "$PAGEDSERVE_ATTENTION_BACKEND, else the best available)")
    device: str | None = setting(None, "cpu or cuda (default: cuda when available)")
    enforce_eager: bool = setting(False, "never capture CUDA graphs")
    cuda_graph_sizes: list[int] | None = setting(
        None, "decode batch sizes to capture (default: 1, 2, 4, then every multiple of 8)")
    # Not yet run on a GPU: off by default until it has (engine/piecewise_graphs.py).
    piecewise_cuda_graphs: bool = setting(
        False, "replay the model's forward between attention layers from CUDA graphs in "
               "prefill and mixed steps, attention running eagerly in between (experimental)")
    piecewise_graph_sizes: list[int] | None = setting(
        None, "padded token counts of the piecewise graphs (default: multiples of 64 up to "
              "512, of 256 up to 4,096, of 512 up to max_num_batched_tokens, and the max)")
    # Schedule step N+1 and finish step N on the host while N+1 runs. None: on for CUDA (an
    # 8B-shaped model's decode steps kept the H200 busy 96% of the time with it, 65% without),
    # off on the CPU, where nothing runs beside the host.
    async_scheduling: bool | None = setting(
        None, "schedule the next step and finish this one on the host while the GPU runs "
              "(default: on for CUDA, off on the CPU)")
    # The engine core (scheduler, KV cache manager, model runner) in a process of its own, so
    # that HTTP, tokenization and detokenization never hold the step loop's GIL. None: the
    # command line (serve, bench, generate) turns it on for CUDA; LLM(...) in Python and the
    # CPU keep the core in-process (tests start many small engines and look inside them).
    engine_core_process: bool | None = setting(
        None, "run the scheduler, KV cache and model runner in a process of their own, apart "
              "from the server, tokenization and detokenization (default: on for CUDA, off on "
              "the CPU)")
    guided_decoding_backend: str = setting(
        "xgrammar", "grammar library of guided decoding (structured outputs); only guided "
                    "requests need its package, the engine starts without it",
        choices=["xgrammar", "guidance"])
    guided_decoding_workers: int | None = setting(
        None, "processes that hold xgrammar's matchers and fill the token bitmask, each "
              "spinning on a core while guided requests run (default: 2 on x86-64 CUDA hosts "
              "with at least 8 CPUs, else 0: a fill thread in the engine's process; 0 only "
              "with speculative decoding)")
    tensor_parallel_size: int = setting(
        1, "ranks each layer is split over (GPUs on CUDA: ranks use cuda:N, N+1, ...; "
           "processes on the CPU)", aliases=["-tp"])
    data_parallel_size: int = setting(
        1, "engine cores behind one front, each a process with its own copy of the model "
           "(on CUDA its own GPUs, after the previous core's tensor-parallel ranks); a request "
           "goes to the least loaded core", aliases=["-dp"])
    distributed_executor_backend: str | None = setting(
        None, "how the ranks run: uni (in the engine's process, one rank only), mp (a process "
              "per rank beside the engine's) or ray (Ray actors); default: uni at one rank, "
              "mp above", choices=["uni", "mp", "ray"])
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = setting(
        None, "speculative decoding, a JSON object with vLLM's fields: method (ngram, "
              "draft_model, eagle, eagle3 or mtp), "
              "num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, model, "
              "draft_tensor_parallel_size; testing only: rejection_sample_method 'synthetic' "
              "with synthetic_acceptance_rate", metavar="JSON")

    def __post_init__(self) -> None:
        self.speculative_config = parse_speculative_config(self.speculative_config)
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got "
                             f"{self.tensor_parallel_size}")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.data_parallel_size > 1 and self.engine_core_process is False:
            raise ValueError("data_parallel_size > 1 runs each engine core in a process of its "
                             "own: drop --no-engine-core-process")
        if self.distributed_executor_backend not in (None, "uni", "mp", "ray"):
            raise ValueError(f"distributed_executor_backend {self.distributed_executor_backend!r}"
                             " is not uni, mp or ray")
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size > 1:
            raise ValueError("distributed_executor_backend uni runs one rank: use mp or ray "
                             "with tensor_parallel_size > 1")
        if self.speculative is not None:  # before any rank starts
            check_supported(self.speculative, tensor_parallel_size=self.tensor_parallel_size)
            check_model_path(self.speculative)
        if self.device is not None:
            try:
                device = torch.device(self.device)
            except RuntimeError:
                raise ValueError(f"device {self.device!r} is not a device: cpu, cuda or cuda:N"
                                 ) from None
            if device.type not in ("cpu", "cuda"):
                raise ValueError(f"device {self.device!r}: pagedserve runs on cpu or cuda")
        if self.scheduler.max_num_seqs is None:
            self.scheduler.max_num_seqs = 256 if self.torch_device.type == "cuda" else 128
        if self.scheduler.max_num_batched_tokens is None:
            from pagedserve.pooling.config import default_step_tokens

            self.scheduler.max_num_batched_tokens = default_step_tokens(
                self.model, self.torch_device, DEFAULT_STEP_TOKENS)

    def check_device(self) -> None:
        """The device can be used here (the engine asks before it loads anything)."""
        if self.torch_device.type == "cuda" and not torch.cuda.is_available():
            gpu_build = torch.version.cuda is not None or torch.version.hip is not None
            build = "a GPU build" if gpu_build else "a CPU-only build"
            raise ValueError(f"device {self.device!r}: no CUDA device is usable here (torch "
                             f"{torch.__version__} is {build}); use --device cpu")

    @property
    def torch_device(self) -> torch.device:
        if self.device is not None:
            return torch.device(self.device)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The parsed speculative decoding settings (None: off)."""
        spec = self.speculative_config
        return spec if isinstance(spec, SpeculativeConfig) else None

    @property
    def use_async_scheduling(self) -> bool:
        if self.async_scheduling is not None:
            return self.async_scheduling
        return self.torch_device.type == "cuda"

    @property
    def use_engine_core_process(self) -> bool:
        return bool(self.engine_core_process) or self.data_parallel_size > 1

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Flat snake-case keyword arguments (as `LLM(...)` and the CLI take them) -> config.

        Unknown names are an error that names them; None values keep the default.
        """
        sections = section_classes()
        split: dict[str, dict[str, Any]] = {name: {} for name in sections}
        top: dict[str, Any] = {}
        top_names = {f.name for f in fields(cls)} - set(sections)
        for key, value in kwargs.items():
            if value is None:
                continue
            for name, section in sections.items():
                if key in {f.name for f in fields(section)}:
                    split[name][key] = value
                    break
            else:
                if key not in top_names:
                    raise ValueError(f"unknown engine argument {key!r}")
                top[key] = value
        return cls(**{name: sections[name](**split[name]) for name in sections}, **top)

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> EngineConfig:
        """A YAML preset (flat keys, or grouped under model/cache/scheduler), then overrides.
        `path` is a file, or the name of a preset shipped in pagedserve/configs/."""
        import yaml

        path = preset_path(path)
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of engine settings")
        flat: dict[str, Any] = {}
        for key, value in data.items():
            if key in SECTIONS and isinstance(value, dict):
                flat.update(value)
            else:
                flat[key] = value
        flat.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls.from_kwargs(**flat)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


PRESETS_DIR = Path(__file__).parent / "configs"


def presets() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def preset_path(name_or_path: str | Path) -> Path:
    """A YAML file's path, or a shipped preset's by name ("cpu", "llama3-8b-random", ...)."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    shipped = PRESETS_DIR / f"{path.name.removesuffix('.yaml')}.yaml"
    if shipped.is_file() and path.parent in (Path("."), Path("configs")):
        return shipped
    raise ValueError(f"config {str(name_or_path)!r} is neither a file nor a preset "
                     f"({', '.join(presets())})")


def section_classes() -> dict[str, type]:
    return {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
            "lora": LoRAConfig}
