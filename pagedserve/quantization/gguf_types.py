"""The GGUF block types kept quantized on CUDA, shared by the method that keeps them
(`gguf_blocks.py`) and their decoding into integer codes (`gguf_codes.py`)."""

# The block types with a kernel: ggml's type id (gguf.GGMLQuantizationType) -> (values per
# block, bytes per block, name).
Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 8, 12, 13, 14
BLOCKS: dict[int, tuple[int, int, str]] = {
    Q8_0: (32, 34, "Q8_0"), Q4_0: (32, 18, "Q4_0"), Q4_1: (32, 20, "Q4_1"),
    Q4_K: (256, 144, "Q4_K"), Q5_K: (256, 176, "Q5_K"), Q6_K: (256, 210, "Q6_K"),
}
