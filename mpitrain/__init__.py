"""mpitrain: data-parallel training of DNN acoustic models over MPI.

Importing this package is cheap: it never initialises MPI, CuPy or h5py.
Those are imported lazily by the modules that need them.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
