"""Runtime: kernels, indexer and cache ops (public functions + dispatch), engine and scheduler."""
