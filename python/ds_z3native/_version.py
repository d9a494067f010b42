"""ds_z3native's version (a leaf module: the package and its submodules import it from here)."""

__version__ = "0.1.0"
