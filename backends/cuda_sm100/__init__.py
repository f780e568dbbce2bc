"""deepinfer's NVIDIA backend: Triton kernels (and cuBLAS through torch where it is faster) for SM100, also SM90."""
