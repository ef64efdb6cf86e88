#!/usr/bin/env python
"""Parallelism-mismatch probe (sampler vs learner log-probabilities); the logic is megagrpo/probe.py.

python tools/mismatch_probe.py MODEL_DIR --prompts 8 --layouts 1,tp2,ep2 [--inject none,fp8] [--out DIR]
"""

import sys

from megagrpo.probe import main

if __name__ == "__main__":
    sys.exit(main())
