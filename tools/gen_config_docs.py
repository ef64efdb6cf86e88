#!/usr/bin/env python
"""Generate docs/config.md and configs/reference.yaml from the config schema itself.

    python tools/gen_config_docs.py          # write both files
    python tools/gen_config_docs.py --check  # exit 1 if either is out of date

The rendering is megagrpo/config/docs.py; this script knows where the two files live in the repository.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megagrpo.config.docs import render_markdown, render_reference_yaml

REPO = Path(__file__).resolve().parents[1]
DOC_PATH = REPO / "docs" / "config.md"
REFERENCE_PATH = REPO / "configs" / "reference.yaml"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="only check that the files are up to date")
    a = p.parse_args(argv)
    targets = {DOC_PATH: render_markdown(), REFERENCE_PATH: render_reference_yaml()}
    stale = [path for path, text in targets.items() if not path.is_file() or path.read_text() != text]
    if a.check:
        for path in stale:
            print(
                f"{path.relative_to(REPO)} is out of date; run python tools/gen_config_docs.py",
                file=sys.stderr,
            )
        return 1 if stale else 0
    for path, text in targets.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
