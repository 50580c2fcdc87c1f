"""User-facing errors.

Anything a user can cause (a bad config key, a missing tensor, a truncated table file, a bad request) raises
`OpenflashError` with a message that names the thing that is wrong. The CLI prints that one line and exits 2;
`--debug` shows the traceback. Internal bugs stay ordinary exceptions.
"""


class OpenflashError(Exception):
    """An error caused by input the user can fix; the message names the file, key, tensor or value."""


class ConfigError(OpenflashError):
    """A config file or field is invalid."""


class CheckpointError(OpenflashError):
    """A checkpoint folder or tensor does not match the expected layout."""


class RequestError(OpenflashError):
    """A generation request that cannot run as given. `param` names the request field at fault (a SamplingParams
    field such as "max_tokens"), or is None when the prompt itself is (empty, ids outside the vocabulary); the
    server turns it into an error body's `param` without parsing the message."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngramTableError(OpenflashError):
    """An Engram table file is missing, truncated, mismatched or unreadable."""
