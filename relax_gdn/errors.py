"""The one exception type for problems the user fixes (configuration, data, checkpoints, files).

``train.py`` and the command-line tools print its message (no traceback) and exit with
:data:`USER_ERROR_EXIT_CODE`; anything else is a bug and keeps its traceback. Raise it (or a
subclass) with a message that names the key, file or value and says what to change.
"""

from __future__ import annotations

USER_ERROR_EXIT_CODE = 2  # the exit code of every RecipeError (argparse uses 2 for usage errors too)


class RecipeError(Exception):
    """A problem in what the user gave the recipe; the message names it and the fix."""
