"""Paths of what ships inside the package."""

from pathlib import Path

# The embedded default model (a ~7M-parameter DSA model trained on Tiny Shakespeare by
# scripts/train_default_model.py): what `flashdsa generate` and `flashdsa serve` load without --model.
DEFAULT_MODEL = Path(__file__).resolve().parent / "assets" / "default_model"
