"""Quantization methods and their kernels; `base` holds the interface."""
