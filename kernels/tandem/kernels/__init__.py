"""Triton kernels, each with a PyTorch reference twin."""
