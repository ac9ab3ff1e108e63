"""A small byte-level BPE tokenizer with DeepSeek-V3.2's special tokens and chat template, built offline.

Trained on a few KB of built-in text, so tiny checkpoints need no download.
"""

from __future__ import annotations

from pathlib import Path

from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from flashdsa.models.chat_template import CHAT_TEMPLATE, DSML, THINK_END, THINK_START

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
# ids 0..6: bos 0, eos 1 as in DeepSeek's config. DSML (the tool-call markup) is a special token
# in DeepSeek-V3.2's tokenizer too, so tests see tool calls that only parse with special tokens kept.
SPECIAL_TOKENS = [BOS, EOS, USER, ASSISTANT, THINK_START, THINK_END, DSML]

TRAINING_TEXT = """\
DeepSeek Sparse Attention lets every query token attend to a small set of earlier tokens chosen
by a lightning indexer. The indexer scores each cached key with a few cheap heads, keeps the top
two thousand positions, and the attention reads only those from a paged cache of latent vectors.
Multi-head latent attention stores one compressed latent per token instead of a key and a value
for every head, so the cache is small and decoding is fast even for very long contexts.
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with one step.
Once upon a time there was a small model that learned to count: one, two, three, four, five, six,
seven, eight, nine, ten. It liked numbers such as 0 1 2 3 4 5 6 7 8 9 and 42 and 1024 and 65536.
Hello! How are you today? I am fine, thank you. What is the capital of France? Paris is the
capital of France. Where is the library? The library is next to the old station on Main Street.
Please write a short poem about the sea. The sea is wide and the sea is deep; it sings the
sailors gently to sleep. Rain falls on the roofs of the town while the lamps come on one by one.
def add(a, b):
    return a + b
for i in range(10):
    print(i * i)
The scheduler admits waiting requests, allocates blocks of sixty-four tokens, and runs prefill
chunks and decode steps in one batch. Each step writes new tokens into the cache, then the model
selects, attends and samples the next token. Tests compare every layer against the reference.
"""


def byte_level_bpe(texts: Iterable[str], vocab_size: int, special_tokens: list[str]) -> Tokenizer:
    """A byte-level BPE (every byte string encodable, lossless decoding) trained on ``texts``;
    ``special_tokens`` take ids 0, 1, ... in order."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def build_tokenizer(vocab_size: int = 512) -> Tokenizer:
    tok = byte_level_bpe(TRAINING_TEXT.splitlines(), vocab_size, SPECIAL_TOKENS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, 0)])
    return tok


def save_tokenizer(path: Path, vocab_size: int = 512) -> int:
    """Write tokenizer files (loadable by ``transformers.AutoTokenizer``) into ``path``; returns the vocab size."""
    from transformers import PreTrainedTokenizerFast

    tok = build_tokenizer(vocab_size)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=EOS)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return tok.get_vocab_size()
