"""Fine-tuning DSA models: sparse attention under autograd, the indexer KL losses, the training loop.

``forward.training_forward`` runs the DeepSeek-V3.2 model's modules over whole sequences with dense
or sparse (indexer top-k) attention, ``forward_v4.training_forward_v4`` the DeepSeek-V4 model's
(``architecture`` picks by model); ``loop.Trainer`` runs the dense warm-up and sparse stages;
``finetune`` is the ``flashdsa finetune`` command.
"""
