"""The error every argument check raises: the trainer prints its message alone, without a traceback."""


class ArgumentError(ValueError):
    """A user-facing configuration error; the trainer prints it without a traceback."""
