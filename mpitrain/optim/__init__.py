"""Optimisers and the natural-gradient preconditioners they use."""
