"""FP8 kernels (Triton): per-token-group activation quantization and the block-scaled GEMM;
the W4A16 GEMM that dequantizes 4-bit weights in registers (w4a16_gemm.py).
Importing a module here imports triton; the linear method imports them on its first CUDA
forward."""
