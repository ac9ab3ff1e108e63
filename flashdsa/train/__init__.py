"""Fine-tuning DSA models: sparse attention under autograd, the indexer KL losses, the training loop.

``forward.training_forward`` runs the inference model's modules over whole sequences with dense
or sparse (indexer top-k) attention; ``loop.Trainer`` runs the dense warm-up and sparse stages;
``finetune`` is the ``flashdsa finetune`` command.
"""
