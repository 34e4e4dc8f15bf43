"""User-facing errors: the CLI prints them as one line (no traceback) and exits with status 2."""


class UserError(ValueError):
    """A problem with the user's input (file, parameter, data) that the user can fix.

    The message must name the file or parameter and say what was expected, in one line.
    """
