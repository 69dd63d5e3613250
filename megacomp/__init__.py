"""megacomp: compressed communication for tensor-, pipeline- and data-parallel training."""
__version__ = "0.1.0"


def _register_kernels_from_checkout() -> None:
    """``kernels/`` lives beside this package and is installed as ``megacomp.kernels`` (setup.py's
    package_dir). From a plain checkout on PYTHONPATH (no install) nothing maps that name, so register the
    folder under it here; an installed package is left alone."""
    import importlib.util
    import os
    import sys

    if "megacomp.kernels" in sys.modules or importlib.util.find_spec("megacomp.kernels") is not None:
        return
    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels")
    init = os.path.join(folder, "__init__.py")
    if not os.path.isfile(init):
        return  # an install without the kernels: megacomp.kernels' importers say how to install
    spec = importlib.util.spec_from_file_location("megacomp.kernels", init, submodule_search_locations=[folder])
    module = importlib.util.module_from_spec(spec)
    sys.modules["megacomp.kernels"] = module
    spec.loader.exec_module(module)
    globals()["kernels"] = module  # as the import system binds a submodule on its package


_register_kernels_from_checkout()
