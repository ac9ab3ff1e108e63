"""A deterministic stand-in for DeepseekV32ForCausalLM, and a tiny byte-level tokenizer.

The fake writes each token id into its own paged "cache" (one int per slot) and computes the
next-token logits of a position from the context it reads back through the block table, so a
wrong slot mapping, block table or prefix-cache hit changes the text.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from flashdsa.runtime.cache.allocator import slot_mapping
from flashdsa.runtime.metadata import BatchMetadata

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def context_logits(context: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The fake's logits [vocab] fp32 after the tokens ``context`` [n] int64."""
    weights = torch.arange(1, context.numel() + 1, dtype=torch.int64)
    key = int(((context + 1) * weights * 1_000_003).sum()) % (2**31)
    return 4 * torch.randn(vocab_size, generator=torch.Generator().manual_seed(key))


class FakeModel(torch.nn.Module):
    def __init__(self, vocab_size: int, max_position_embeddings: int = 1024) -> None:
        super().__init__()
        self.config = SimpleNamespace(vocab_size=vocab_size, max_position_embeddings=max_position_embeddings)
        self.mode = "reference"
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # gives the engine a device to read

    def cache_bytes_per_block(self) -> int:
        return 64 * 8

    def allocate_caches(self, num_blocks: int) -> torch.Tensor:
        return torch.full((num_blocks * 64,), -1, dtype=torch.int64)

    def forward(self, input_ids: torch.Tensor, meta: BatchMetadata, caches: torch.Tensor) -> torch.Tensor:
        caches[meta.slot_mapping] = input_ids
        rows = []
        for t in meta.logits_indices.tolist():
            table = meta.block_tables[int(meta.seq_ids[t])]
            slots = slot_mapping(table[table >= 0], torch.arange(int(meta.positions[t]) + 1))
            rows.append(context_logits(caches[slots], self.config.vocab_size))
        return torch.stack(rows) if rows else torch.empty(0, self.config.vocab_size)


def make_tokenizer():
    """A byte-level BPE tokenizer (~300 tokens) with <bos>/<eos> and a chat template."""
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<bos>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["hello world, the quick brown fox jumps over the lazy dog. é ü 日本語"] * 4, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>")
    hf.chat_template = CHAT_TEMPLATE
    return hf


def reference_greedy(prompt_ids: list[int], vocab_size: int, max_tokens: int, eos: int) -> list[int]:
    """What greedy decoding of the fake must produce, computed without any cache."""
    ids = list(prompt_ids)
    out: list[int] = []
    while len(out) < max_tokens:
        token = int(context_logits(torch.tensor(ids), vocab_size).argmax())
        out.append(token)
        ids.append(token)
        if token == eos:
            break
    return out
