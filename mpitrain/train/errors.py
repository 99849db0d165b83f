"""The error that stops training with a message for the user."""

from __future__ import annotations


class TrainingError(RuntimeError):
    """A problem that stops training, with a message for the user.

    ``agreed``: every rank raises it at the same point (a decision taken from
    collective results), so the job can end without an abort and one rank
    alone needs to print it.
    """

    def __init__(self, message: str, *, agreed: bool = False):
        super().__init__(message)
        self.agreed = agreed
