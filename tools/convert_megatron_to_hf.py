#!/usr/bin/env python
"""megatron-core dist checkpoint -> HF model directory; the logic is megagrpo/convert/megatron_to_hf.py.

python tools/convert_megatron_to_hf.py CKPT_DIR OUT_DIR [--dtype bfloat16] [--max-shard-bytes N]
torchrun --nproc-per-node 4 tools/convert_megatron_to_hf.py CKPT_DIR OUT_DIR --tp 2 --ep 2
"""

import sys

from megagrpo.convert.megatron_to_hf import main

if __name__ == "__main__":
    sys.exit(main())
