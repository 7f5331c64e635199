"""The CUDA engine: cuda-python driver API and NVRTC. Only this package imports cuda-python."""
