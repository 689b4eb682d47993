"""TurboQuant paged decode attention in CUDA (csrc/tq_decode.cu), built on first use.

The Triton kernel (turboquant_kernels.py) runs every TurboQuant step; this one takes the decode
steps of the rotated presets at head sizes 64 and 128, where it moves the context through tensor
cores with about half the instructions per key (the kernel's header says how), split-KV
included. It is compiled with nvcc for the device's architecture the first time a process needs
it and cached as a shared library under $PAGEDSERVE_CACHE_DIR (default ~/.cache/pagedserve),
keyed by the source's hash; where nvcc or the build is missing, `unsupported_reason` says so and
the Triton kernel runs. PAGEDSERVE_TQ_DECODE_KERNEL=triton turns it off; =cuda makes a step fail
instead of falling back.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from pagedserve import envs
from pagedserve.attention.ops.turboquant_format import KVPreset, codebook_levels

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "tq_decode.cu"
KERNELS = ("auto", "cuda", "triton")
HEAD_SIZES = (64, 128)
MAX_QUERIES_PER_KV = 16
# (key codec, key bits, value codec, value bits) the kernel is instantiated for
_CODECS = {("fp8", 8, "lloyd_max", 4): (8, 4), ("lloyd_max", 4, "lloyd_max", 4): (4, 4),
           ("lloyd_max", 3, "lloyd_max", 3): (3, 3)}
_DTYPES = {torch.float16: 0, torch.bfloat16: 1}


class _Params(ctypes.Structure):
    """Mirror of `Params` in csrc/tq_decode.cu (checked against its sizeof at load)."""

    _fields_ = [(name, ctypes.c_void_p) for name in (
        "query", "key", "value", "out", "cache", "block_table", "query_start_loc", "seq_lens",
        "qblock_req", "signs", "pair_table", "part_m", "part_l", "part_acc")] + [
            (name, ctypes.c_int64) for name in (
            "q_stride_t", "q_stride_h", "k_stride_t", "k_stride_h", "v_stride_t", "v_stride_h",
            "o_stride_t", "o_stride_h", "cache_stride_block", "cache_stride_head",
            "block_table_stride")] + [(name, ctypes.c_int) for name in (
                "block_size_log2", "v_codes_offset", "k_meta_offset", "v_meta_offset",
                "queries_per_kv", "head_size", "num_splits")] + [("scale", ctypes.c_float)]


def requested_kernel() -> str:
    """PAGEDSERVE_TQ_DECODE_KERNEL: auto (default), cuda or triton."""
    value = envs.PAGEDSERVE_TQ_DECODE_KERNEL
    if value not in KERNELS:
        raise ValueError(f"PAGEDSERVE_TQ_DECODE_KERNEL={value!r}: choose one of "
                         f"{', '.join(KERNELS)}")
    return value


@functools.cache
def _arch(index: int) -> str:
    """nvcc's target for cuda:index (once per device: the decode path asks every layer)."""
    major, minor = torch.cuda.get_device_capability(index)
    # 'a' targets (sm_90a) have Hopper's own instructions; the kernel needs none, but the
    # family-specific build is what the rest of the stack runs there.
    suffix = "a" if (major, minor) == (9, 0) else ""
    return f"{major}{minor}{suffix}"


def nvcc_path() -> str | None:
    """The nvcc that builds the kernel: PATH, then $CUDA_HOME, $CUDA_PATH, /usr/local/cuda."""
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    return None


def _cache_dir() -> Path:
    return envs.cache_root() / "kernels"


def build(arch: str) -> Path:
    """Compile the kernel for `arch` ("90a", "89", ...) unless a build of this source exists;
    returns the shared library's path. Safe against concurrent builds (atomic rename)."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise RuntimeError("nvcc not found (PATH, CUDA_HOME, /usr/local/cuda)")
    flags = ["-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC",
             f"-gencode=arch=compute_{arch},code=sm_{arch}"]
    # The compiler's version is in the key: its static runtime decides which drivers can run
    # the library (a cache shared between machines must not hand one to an older driver).
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True,
                             timeout=60).stdout
    key = SOURCE.read_bytes() + "\0".join([*flags, version]).encode()
    digest = hashlib.sha256(key).hexdigest()[:16]
    target = _cache_dir() / f"tq_decode-{digest}-sm{arch}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
        partial = Path(tmp.name)
    cmd = [nvcc, *flags, "-o", str(partial), str(SOURCE)]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{result.stderr[-4000:]}")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


class _Library:
    def __init__(self, path: Path) -> None:
        self.lib = ctypes.CDLL(str(path))
        self.lib.tq_decode_params_size.restype = ctypes.c_int
        self.lib.tq_decode_params_offset.restype = ctypes.c_int
        self.lib.tq_decode_params_offset.argtypes = [ctypes.c_int]
        self.lib.tq_decode_probe.restype = ctypes.c_int
        self.lib.tq_decode_probe.argtypes = [ctypes.c_int]
        self.lib.tq_decode_launch.restype = ctypes.c_int
        self.lib.tq_decode_launch.argtypes = [ctypes.POINTER(_Params)] + [ctypes.c_int] * 6 + [
            ctypes.c_void_p]
        size = self.lib.tq_decode_params_size()
        if size != ctypes.sizeof(_Params):
            raise RuntimeError(f"{path.name}: Params is {size} bytes, the Python mirror "
                               f"{ctypes.sizeof(_Params)}")
        names = [name for name, _ in _Params._fields_]
        offsets = [self.lib.tq_decode_params_offset(i) for i in range(len(names) + 1)]
        mirror = [getattr(_Params, name).offset for name in names] + [-1]
        if offsets != mirror:
            raise RuntimeError(f"{path.name}: Params field offsets {offsets} differ from the "
                               f"Python mirror's {mirror} (fields {names})")


_lock = threading.Lock()


@functools.cache
def _load(arch: str) -> _Library | str:
    """The library for `arch`, or why there is none (logged once)."""
    with _lock:
        try:
            return _Library(build(arch))
        except Exception as exc:  # any build or load failure means: use the Triton kernel
            reason = f"CUDA TurboQuant decode kernel unavailable for sm_{arch}: {exc}"
            logger.warning("%s; decode steps use the Triton kernel", reason)
            return reason


def prepare(device: torch.device) -> str | None:
    """Build or load the library for this device now (engine start-up, not the first decode
    step) and check that its kernels can run there; None when they can, else why not."""
    index = torch.cuda._get_device_index(device, optional=True)
    return _probe(_arch(index), index)


@functools.cache
def _probe(arch: str, index: int) -> str | None:
    library = _load(arch)
    if isinstance(library, str):
        return library
    err = library.lib.tq_decode_probe(index)
    if err:
        reason = (f"the CUDA TurboQuant decode kernel cannot run on cuda:{index} (cudaError "
                  f"{err}: a driver older than the nvcc that built it?)")
        logger.warning("%s; decode steps use the Triton kernel", reason)
        return reason
    return None


def unsupported_reason(preset: KVPreset, head_size: int, block_size: int, dtype: torch.dtype,
                       num_queries_per_kv: int, sliding_window: int | None,
                       soft_cap: float | None, device: torch.device) -> str | None:
    """None when this kernel can run a decode step of this layer, else why not (cheap checks
    first; the last one builds or loads the library)."""
    codecs = (preset.key.kind, preset.key.bits, preset.value.kind, preset.value.bits)
    if device.type != "cuda" or torch.version.hip:
        return "needs an NVIDIA GPU"
    if not preset.rotated or codecs not in _CODECS:
        return f"{preset.name} is not a rotated preset the kernel is built for"
    if head_size not in HEAD_SIZES:
        return f"head size {head_size} (the kernel takes {' and '.join(map(str, HEAD_SIZES))})"
    if block_size < 16 or block_size & (block_size - 1):
        return f"block size {block_size} (needs a power of two >= 16)"
    if dtype not in _DTYPES:
        return f"{dtype} activations (float16 or bfloat16 only)"
    if num_queries_per_kv > MAX_QUERIES_PER_KV:
        return f"{num_queries_per_kv} query heads per KV head (at most {MAX_QUERIES_PER_KV})"
    if sliding_window is not None or soft_cap is not None:
        return "sliding window and soft cap run on the Triton kernel"
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 0) or (preset.key.kind == "fp8" and capability < (8, 9)):
        return f"compute capability {capability[0]}.{capability[1]} is too old"
    return prepare(device)


@functools.cache
def pair_table(preset_name: str, bits: int, device: str) -> torch.Tensor:
    """int32 [2^(2 bits)]: entry e holds the fp16 levels of the code pair e (first channel in
    the low bits and the low half), as the kernel's lookups return them."""
    from pagedserve.attention.ops.turboquant_format import PRESETS

    levels = codebook_levels(PRESETS[preset_name].value).to(torch.float16)
    halves = levels.view(torch.int16).to(torch.int64) & 0xFFFF
    entries = torch.arange(1 << (2 * bits))
    mask = (1 << bits) - 1
    words = halves[entries & mask] | (halves[entries >> bits] << 16)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)
    return words.to(torch.int32).to(device)


def tq_decode(preset: KVPreset, signs: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
              value: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor,
              block_table: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
              qblock_req: torch.Tensor, num_programs: int, scale: float, num_splits: int = 1,
              partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
    """One decode token per request: out [T, H, D] = attention of query [T, H, D] over the
    packed context in kv_cache and the step's own key/value [T, Hkv, D] (full precision).
    Program i takes request qblock_req[i]; call `unsupported_reason` first. num_splits > 1:
    each request's context tiles are cut into that many ranges (CTAs), whose partial results
    go through `partials` (decode_split_kv.allocate_partials) and reduce_split_kv."""
    if num_programs == 0:
        return
    index = torch.cuda._get_device_index(query.device, optional=True)
    library = _load(_arch(index))
    if isinstance(library, str):
        raise RuntimeError(library)
    num_kv_heads, block_size = kv_cache.shape[1], kv_cache.shape[2]
    for name, t in (("query", query), ("key", key), ("value", value), ("out", out)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dimension")
    if num_splits > 1 and partials is None:
        raise ValueError("split-KV decode needs partial buffers")
    part_m, part_l, part_acc = partials if num_splits > 1 else (None, None, None)
    head_size = query.shape[2]
    _, v_codes, k_meta, v_meta = preset.plane_offsets(head_size, block_size)
    tensors = dict(query=query, key=key, value=value, out=out, cache=kv_cache,
                   block_table=block_table, query_start_loc=query_start_loc, seq_lens=seq_lens,
                   qblock_req=qblock_req, signs=signs,
                   pair_table=pair_table(preset.name, preset.value.bits, str(query.device)),
                   part_m=part_m, part_l=part_l, part_acc=part_acc)
    params = _Params(
        **{name: t.data_ptr() if t is not None else None for name, t in tensors.items()},
        q_stride_t=query.stride(0), q_stride_h=query.stride(1), k_stride_t=key.stride(0),
        k_stride_h=key.stride(1), v_stride_t=value.stride(0), v_stride_h=value.stride(1),
        o_stride_t=out.stride(0), o_stride_h=out.stride(1),
        cache_stride_block=kv_cache.stride(0), cache_stride_head=kv_cache.stride(1),
        block_table_stride=block_table.stride(0), block_size_log2=block_size.bit_length() - 1,
        v_codes_offset=v_codes, k_meta_offset=k_meta, v_meta_offset=v_meta,
        queries_per_kv=query.shape[1] // num_kv_heads, head_size=head_size,
        num_splits=num_splits, scale=scale)
    bits = _CODECS[(preset.key.kind, preset.key.bits, preset.value.kind, preset.value.bits)]
    stream = torch.cuda.current_stream(query.device).cuda_stream
    err = library.lib.tq_decode_launch(ctypes.byref(params), _DTYPES[query.dtype], *bits,
                                       num_programs, num_kv_heads, index, stream)
    if err != 0:
        raise RuntimeError(f"tq_decode_launch failed: error {err}")
    if num_splits > 1:
        from pagedserve.attention.ops.decode_split_kv import reduce_split_kv

        reduce_split_kv(partials, out, num_programs, num_splits)
