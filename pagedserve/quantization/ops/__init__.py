"""FP8 kernels (Triton): per-token-group activation quantization and the block-scaled GEMM.
Importing a module here imports triton; the linear method imports them on its first CUDA
forward."""
