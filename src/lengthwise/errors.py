"""The one exception type for a user's mistake.

Anything the user can fix (a wrong flag, a preset that does not exist, a sequence that cannot fit)
raises `UserError` with a one-line message naming what to change. The CLI prints that line and
exits non-zero; programmer errors stay `assert`s and tracebacks.
"""


class UserError(ValueError):
    """A mistake in the user's input; the message says what to change."""
