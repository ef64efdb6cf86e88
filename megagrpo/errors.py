"""The one exception type for user errors (config, data, paths, checkpoints).

The CLI prints a `MegagrpoError` without a traceback, so its message must name the offending thing
(field, file, key) and say how to fix it. Programming errors stay ordinary exceptions.
"""


class MegagrpoError(Exception):
    """A user-facing error: the message names what is wrong and the fix."""
