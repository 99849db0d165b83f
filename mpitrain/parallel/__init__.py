"""Data-parallel strategies: how the ranks combine their models."""
