"""The one exception type for user errors (config, data, paths, checkpoints).

The CLI prints a `MegagrpoError` without a traceback, so its message must name the offending thing
(field, file, key) and say how to fix it. Programming errors stay ordinary exceptions.
"""

import os
from pathlib import Path

# `megagrpo ... --nproc N`: each rank leaves its user error in this folder for the CLI to print once.
ERROR_DIR_ENV = "MEGAGRPO_USER_ERROR_DIR"
ECHO = ".echo"  # suffix of a message that only repeats another rank's failure


def leave_user_error(message: str, *, echo: bool = False) -> bool:
    """In a rank started by the CLI's `--nproc`: store `message` for the CLI and return True; else False.
    `echo`: the message only repeats another rank's failure (`dist.agree.PeerFailed`), so the CLI
    prints it only when no rank left its own (`megagrpo.launch.torchrun.first_user_error`)."""
    where, rank = os.environ.get(ERROR_DIR_ENV), os.environ.get("RANK")
    if not where or rank is None or not Path(where).is_dir():
        return False
    tmp = Path(where) / f".rank{rank}.tmp"
    tmp.write_text(message)
    tmp.rename(Path(where) / f"rank{rank}{ECHO if echo else ''}")  # whole messages only
    return True


class MegagrpoError(Exception):
    """A user-facing error: the message names what is wrong and the fix."""
