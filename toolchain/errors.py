"""User-facing errors.

Library code raises `ToolchainError` for anything a user can fix (bad spec,
missing files, unsupported model). The CLI prints it as one line and exits 2;
`--debug` shows the traceback. Programming errors stay ordinary exceptions.
"""


class ToolchainError(Exception):
    """An error caused by user input, with a hint on how to fix it."""

    exit_code = 2

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


class StageFailed(ToolchainError):
    """A stage ran but did not succeed (server failed to load, SLO missed)."""

    exit_code = 1
