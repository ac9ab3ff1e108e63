"""Byte-level BPE tokenizer training (``tokenizers``), saved in the HF layout ``AutoTokenizer`` loads.

Byte-level means every byte string is encodable (no unknown token) and decoding is lossless.
Ids 0, 1, 2 are the special tokens ``<|bos|>``, ``<|eos|>``, ``<|pad|>`` (the model config's
bos/eos/pad ids). The chat template is DeepSeek-V3.2's (models/chat_template.py); its role and
tool markers are plain text to this tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from flashdsa.models.chat_template import CHAT_TEMPLATE
from flashdsa.models.tiny_tokenizer import byte_level_bpe

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = [BOS, EOS, PAD]  # ids 0, 1, 2


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, output_dir: str | Path) -> Path:
    """Train a byte-level BPE of ``vocab_size`` tokens on ``texts``; write tokenizer files to ``output_dir``."""
    tokenizer = byte_level_bpe(texts, vocab_size, SPECIAL_TOKENS)
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(output_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": 1 << 20,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (output_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return output_dir

