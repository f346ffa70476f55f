"""Errors that reach users. Each carries a one-line, actionable message."""


class FimbleError(Exception):
    """Base class: the CLI and the server print ``str(exc)`` and no traceback."""


class ModelLoadError(FimbleError):
    """The model folder is missing, corrupt, or of an architecture we cannot run."""


class EngineLost(FimbleError):
    """The engine process ended (killed, crashed) or hung without saying why: another start may well work,
    unlike a start the engine itself reported failing (a bad model folder), which would fail the same way."""


class PromptError(FimbleError):
    """The request cannot be served: empty prompt, prompt longer than the context, ..."""


def error_from_name(name: str | None, message: str) -> FimbleError:
    """Rebuild an error that crossed the stream (or a process boundary) by its class name."""
    kinds = {cls.__name__: cls for cls in (FimbleError, ModelLoadError, PromptError)}
    return kinds.get(name or "", FimbleError)(message)
