"""megacomp: compressed communication for tensor-, pipeline- and data-parallel training."""
__version__ = "0.1.0"
