"""The one exception type users see as a one-line message (no traceback unless --debug)."""


class SpecconvError(Exception):
    """A problem with the user's input or environment, described in one line."""
