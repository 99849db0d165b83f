"""The error that stops training with a message for the user."""

from __future__ import annotations


class TrainingError(RuntimeError):
    """A problem that stops training, with a message for the user.

    ``agreed``: every rank raises it at the same point (a decision taken from
    collective results), so the job can end without an abort and one rank
    alone needs to print it.  ``setting``: a setting of the configuration that
    this job cannot run (with its number of ranks, say); the command line puts
    the configuration file's name in front.
    """

    def __init__(self, message: str, *, agreed: bool = False, setting: bool = False):
        super().__init__(message)
        self.agreed = agreed
        self.setting = setting


def error_record(exc: BaseException) -> dict:
    """The fields of the ``error`` record a run writes as it ends on ``exc``, so that
    ``status`` says how it ended (a failure, or Ctrl-C) rather than that it was cut off.

    Example::

        log.write("error", step=step, **error_record(exc))
    """
    message = "interrupted (SIGINT, Ctrl-C)" if isinstance(exc, KeyboardInterrupt) \
        else str(exc)
    return {"error": type(exc).__name__, "message": " ".join(message.split())[:1000]}
