"""megagrpo: GRPO-family RL post-training for Mixture-of-Experts models on megatron-core and SGLang."""

from megagrpo.errors import MegagrpoError

__all__ = ["MegagrpoError"]
__version__ = "0.1.0"
