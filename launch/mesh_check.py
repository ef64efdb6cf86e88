#!/usr/bin/env python
"""Distributed bring-up check: `python launch/mesh_check.py --out R.json [--tp N --ep N --pp N --model HF]`.

The same as `python -m megagrpo.launch.mesh_check ...`; the logic (and what is checked) is
megagrpo/launch/mesh_check.py.
"""

import sys

from megagrpo.launch.mesh_check import main

if __name__ == "__main__":
    sys.exit(main())
