"""mpitrain: data-parallel training of DNN acoustic models over MPI.

Importing this package is cheap: it never initialises MPI, CuPy or h5py.
Those are imported lazily by the modules that need them.
"""

__version__ = "0.1.0"

__all__ = ["__version__", "load_model"]


def load_model(path):
    """A trained model with ``.predict(feats)`` and ``.log_likelihoods(feats)``.

    Example::

        model = mpitrain.load_model("runs/quickstart/final.h5")
        posteriors = model.predict(feats)       # feats: (frames, feat_dim)
    """
    from .inference import load_model as load   # here, so importing mpitrain stays cheap
    return load(path)
