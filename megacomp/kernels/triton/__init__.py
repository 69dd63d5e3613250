"""Triton GPU kernels (see codec_triton.py); this package imports cleanly without triton."""
