"""The one exception type that means "the user's input or environment is wrong".

The CLI prints its message as a single line and exits 1; anything else is a bug
and shows a traceback only with --debug.
"""


class EdgeError(Exception):
    """A problem the user can fix: bad file, bad option, not enough memory."""
