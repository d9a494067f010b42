"""ds_z3native's version, written only here (a leaf module: the package and its submodules
import it from here; setup.py reads this file as text)."""

__version__ = "0.1.0"
