"""Quantized weights as a method of each layer (vLLM's design): a `QuantizationConfig`, read
from a checkpoint's `quantization_config` or chosen by `--quantization`, gives each linear a
`LinearMethod` and each `FusedMoE` a `MoEMethod` that create, load, post-process and apply its
weights (base.py). One file per method: unquantized.py, int8_cpu.py (CPU weight-only int8),
fp8.py and fp8_moe.py (FP8 checkpoints and online FP8), compressed_tensors.py (its FP8
schemes), compressed_tensors_w4a16.py / compressed_tensors_int8.py (its packed int4 / int8
and unpacked int8 weights, on compressed_tensors_int.py and packed.py); registry.py maps
names to configs, layers.py attaches methods to a model, and fp8_linear.py with ops/ holds
the CUDA kernels.

This file imports nothing: `models/parallel.py` imports the unquantized method from here, and
the configs import the models lazily."""
