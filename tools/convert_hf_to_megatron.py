#!/usr/bin/env python
"""HF -> megatron-core dist checkpoint; the logic is megagrpo/convert/hf_to_megatron.py.

python tools/convert_hf_to_megatron.py HF_DIR OUT_DIR [--dtype bfloat16]
"""

import sys

from megagrpo.convert.hf_to_megatron import main

if __name__ == "__main__":
    sys.exit(main())
