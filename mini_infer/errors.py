"""InvalidRequestError: a request the engine refuses, with the input field at fault."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A ValueError that names its field (a SamplingParams field, "prompt" or "request_id"), so an API layer
    can point at the offending input; the message already names it for everyone else."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class WorkerDiedError(RuntimeError):
    """A process of a multi-process engine (a tensor/pipeline-parallel rank or a data-parallel replica) died or
    failed; the engine has stopped and shut its other processes down."""
