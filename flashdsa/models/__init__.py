"""DeepSeek-V3.2 for flashdsa: config, model, loader, tiny checkpoints (import the submodules)."""
