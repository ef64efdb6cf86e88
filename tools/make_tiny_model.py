#!/usr/bin/env python
"""Write a tiny Hugging Face model directory (random weights, local tokenizer); see megagrpo/tiny_model.py.

python tools/make_tiny_model.py OUT_DIR --arch qwen3_moe|deepseek_v3|glm4_moe [--experts 8 --topk 2 --seed 0]
    [--mtp-layers 1]  (deepseek_v3, glm4_moe: multi-token-prediction layers, as DeepSeek-V3 and GLM-4.5 ship)
"""

import sys

from megagrpo.tiny_model import main

if __name__ == "__main__":
    sys.exit(main())
