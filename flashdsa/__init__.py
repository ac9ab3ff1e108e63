"""flashdsa: one runtime for DeepSeek Sparse Attention (inference, serving, fine-tuning)."""

__version__ = "0.1.0"
