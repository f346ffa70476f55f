"""Runtimes: the forward pass of a model and its KV cache.

`compact` (fimble's own torch transformer, the reference and the GPU path), `quant` (int8 weights on
CPU), `cuda_graphs` (captured steps on CUDA), `ggml_runtime`/`ggml_lib` (llama.cpp's kernels), and
`hf_backend` (any other transformers architecture). `gguf_loader`/`gguf_export` read and write GGUF;
`weights_check` refuses corrupt weights. engine/loader.py picks one.
"""
