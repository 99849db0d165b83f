"""Layers on one flat parameter buffer, the network, and model files.

Example::

    from mpitrain.nn import build_network, save_model, load_model
"""

from .network import Network, build_network
from .model_file import load_model, save_model

__all__ = ["Network", "build_network", "load_model", "save_model"]
