"""Weight quantization: formats (int8, int4 group-wise, FP8 E4M3, NF4), methods (round-to-nearest, GPTQ, AWQ),
fused dequant-matmul modules and kernels, and the export that transformers and vLLM load.

Every format meets the rest of the code as a `formats.QuantizedWeight` (unpacked, canonical); packing is the
business of whoever consumes it (a CPU kernel, a Triton kernel, the compressed-tensors export).
"""
