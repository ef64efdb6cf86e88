"""torchrun for `megagrpo {train,sft,eval} --nproc N`, with user errors reported once:

    python -m megagrpo.launch.torchrun [torchrun arguments]   (with MEGAGRPO_USER_ERROR_DIR set)

A rank that stops on a user error (`MegagrpoError`) writes its message into `MEGAGRPO_USER_ERROR_DIR`
(`leave_user_error`) and exits 2, without printing. torchrun then stops the other ranks; this wrapper
keeps torchrun's failure log and its `ChildFailedError` traceback quiet in that case only, and the CLI
that started it prints the first rank's message (`first_user_error`) and exits 2, as a single process
does. Any other failure keeps torchrun's full report and exit status.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from megagrpo.errors import ECHO, ERROR_DIR_ENV, leave_user_error  # noqa: F401 - the relay's API

EXIT_USER_ERROR = 2


def first_user_error(where: str | os.PathLike[str]) -> str | None:
    """The message of the rank that failed first (ties: the lowest rank), or None when none did. A rank's
    own error wins over the echoes of it that the other ranks raise, whichever was written first."""
    found = []
    for f in Path(where).glob("rank*"):
        rank = f.name[4:].removesuffix(ECHO)
        if rank.isdigit():
            found.append((f.name.endswith(ECHO), f.stat().st_mtime_ns, int(rank), f))
    return min(found)[3].read_text() if found else None


class _QuietAfterUserError(logging.Filter):
    """Drops torchrun's failure log lines once a rank has left a user error (the CLI prints that)."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.WARNING or first_user_error(self.where) is None


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    where = os.environ.get(ERROR_DIR_ENV)
    if where:
        # torch's loggers print through handlers of the "torch" logger (installed on import), the root
        # logger's, or logging's last resort: a handler filter sees the records of every child logger.
        quiet = _QuietAfterUserError(where)
        loggers = [logging.getLogger()] + [
            lg
            for name, lg in logging.Logger.manager.loggerDict.items()
            if name.startswith("torch") and isinstance(lg, logging.Logger)
        ]
        for handler in {h for lg in loggers for h in lg.handlers} | {logging.lastResort}:
            if handler is not None:
                handler.addFilter(quiet)
    try:
        run(parse_args(list(sys.argv[1:] if argv is None else argv)))
    except ChildFailedError:
        if where and first_user_error(where) is not None:
            return EXIT_USER_ERROR
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
