"""LoRA branch: batch metadata, weight slots, the torch reference op and (on CUDA) Triton kernels."""
