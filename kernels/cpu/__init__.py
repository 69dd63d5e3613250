"""C++ CPU kernels (see kernels/__init__.py)."""
