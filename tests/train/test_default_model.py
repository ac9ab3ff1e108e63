"""The embedded default model: small enough to ship, loads, and knows some Shakespeare."""

from __future__ import annotations

import torch
from transformers import AutoTokenizer

from flashdsa.defaults import DEFAULT_MODEL
from flashdsa.models.loader import load_model
from flashdsa.train.forward import training_forward
from flashdsa.train.losses import lm_loss

VERSE = """ROMEO:
But soft! what light through yonder window breaks?
It is the east, and Juliet is the sun.

JULIET:
O Romeo, Romeo! wherefore art thou Romeo?
"""


def test_default_model_files_fit_the_package_limits():
    sizes = {p.name: p.stat().st_size for p in DEFAULT_MODEL.iterdir()}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= sizes.keys()
    assert "model.safetensors" in sizes or "model.safetensors.index.json" in sizes  # one file, or shards under 16 MB
    assert max(sizes.values()) < 16 << 20 and sum(sizes.values()) <= 50 << 20


def test_default_model_predicts_shakespeare_far_better_than_chance():
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    model = load_model(DEFAULT_MODEL, mode="reference")
    assert model.config.index_topk == 64 and model.config.d_qk == 576 and model.config.index_head_dim == 128
    ids = torch.tensor([tokenizer(VERSE)["input_ids"]])
    with torch.no_grad():
        loss = lm_loss(training_forward(model, ids[:, :-1], "sparse").logits, ids[:, 1:])
    assert loss < 4.5 < torch.log(torch.tensor(float(model.config.vocab_size)))  # chance: ln 2048 = 7.6
