"""The validated config schema (YAML plus dotted overrides) and the model architecture description."""

from megagrpo.config.model import ModelArch

__all__ = ["ModelArch"]
