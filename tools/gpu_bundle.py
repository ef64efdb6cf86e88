#!/usr/bin/env python
"""Offline GPU bundles: record symbol tables from wheels, select versions by them; see megagrpo/bundle/cli.py.

python tools/gpu_bundle.py record WHEEL -o TABLE.json [--member 'nvidia/cu13/lib/libcublas*']
python tools/gpu_bundle.py select TARGET.json [--manifest OUT.json]
"""

import sys

from megagrpo.bundle.cli import main

if __name__ == "__main__":
    sys.exit(main())
