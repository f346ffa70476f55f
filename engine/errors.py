"""Errors that reach users. Each carries a one-line, actionable message."""


class FimbleError(Exception):
    """Base class: the CLI and the server print ``str(exc)`` and no traceback."""


class ModelLoadError(FimbleError):
    """The model folder is missing, corrupt, or of an architecture we cannot run."""


class PromptError(FimbleError):
    """The request cannot be served: empty prompt, prompt longer than the context, ..."""
