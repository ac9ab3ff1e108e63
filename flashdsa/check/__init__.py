"""Layerwise accuracy check of flashdsa against Hugging Face transformers."""
