"""C++ CPU kernels (see megacomp/kernels/__init__.py)."""
