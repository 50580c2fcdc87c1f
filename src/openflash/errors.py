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


class EngramTableError(OpenflashError):
    """An Engram table file is missing, truncated, mismatched or unreadable."""
