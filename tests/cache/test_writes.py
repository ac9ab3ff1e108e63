"""Cache writes scatter each token to exactly its slot: pools are poisoned (0xFF bytes, NaN in
e4m3) first, so a missing write or a stray write fails."""

import pytest
import torch

from flashdsa.runtime import dispatch
from flashdsa.runtime.cache import layout, write_indexer_cache, write_mla_cache
from flashdsa.runtime.cache.pool import indexer_pool, mla_pool
from flashdsa.runtime.checks import trusted_values
from flashdsa.runtime.indexer import hadamard_transform


@pytest.fixture(autouse=True)
def reference_backend(monkeypatch):
    """These tests pin down the reference ops; GPU backends are tested against them elsewhere."""
    monkeypatch.setenv("FLASHDSA_BACKEND", "reference")

POISON = 0xFF


def poisoned_pool(make, num_blocks, block_size):
    return make(num_blocks, "cpu", block_size=block_size).fill_(POISON)


def random_slots(num_tokens, capacity, seed, skipped=0.25):
    """Distinct random slots, about ``skipped`` of them -1 (padding tokens)."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(capacity, generator=g)[:num_tokens]
    slots[torch.rand(num_tokens, generator=g) < skipped] = -1
    return slots


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_tokens, num_blocks, block_size", [(1, 1, 64), (37, 3, 64), (50, 5, 16)])
def test_mla_write_lands_each_token_at_its_slot_and_nowhere_else(dtype, num_tokens, num_blocks, block_size):
    g = torch.Generator().manual_seed(num_tokens)
    kv = torch.randn(num_tokens, 576, generator=g).to(dtype)
    c_kv, k_pe = kv[:, :512], kv[:, 512:]  # row-strided views, as a fused projection gives
    pool = poisoned_pool(mla_pool, num_blocks, block_size)
    slots = random_slots(num_tokens, num_blocks * block_size, seed=num_tokens)
    write_mla_cache(c_kv, k_pe, pool, slots)

    expect = layout.quantize_mla(c_kv, k_pe)
    written = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            block, offset = divmod(slot, block_size)
            assert torch.equal(pool[block, offset, 0], expect[t])
            written[block, offset] = True
    assert (pool[~written] == POISON).all()


@pytest.mark.parametrize("num_tokens, num_blocks, block_size", [(1, 1, 64), (45, 2, 64), (33, 4, 16)])
def test_indexer_write_lands_key_and_scale_at_their_slot_and_nowhere_else(num_tokens, num_blocks, block_size):
    g = torch.Generator().manual_seed(num_tokens)
    k = torch.randn(num_tokens, 128, generator=g).bfloat16()
    pool = poisoned_pool(indexer_pool, num_blocks, block_size)
    slots = random_slots(num_tokens, num_blocks * block_size, seed=num_tokens + 1)
    write_indexer_cache(k, pool, slots)

    q, scale = layout.quantize_indexer_key(hadamard_transform(k))
    raw = pool.view(num_blocks, -1)
    untouched = torch.ones_like(raw, dtype=torch.bool)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            block, offset = divmod(slot, block_size)
            key_bytes = slice(offset * 128, (offset + 1) * 128)
            scale_bytes = slice(block_size * 128 + 4 * offset, block_size * 128 + 4 * (offset + 1))
            assert torch.equal(raw[block, key_bytes], q[t].view(torch.uint8))
            assert torch.equal(raw[block, scale_bytes], scale[t : t + 1].view(torch.uint8))
            untouched[block, key_bytes] = untouched[block, scale_bytes] = False
    assert (raw[untouched] == POISON).all()


def test_all_skipped_and_empty_writes_leave_the_pool_untouched():
    pool, kpool = poisoned_pool(mla_pool, 2, 64), poisoned_pool(indexer_pool, 2, 64)
    write_mla_cache(torch.randn(3, 512), torch.randn(3, 64), pool, torch.full((3,), -1))
    write_indexer_cache(torch.randn(3, 128), kpool, torch.full((3,), -1))
    write_mla_cache(torch.randn(0, 512), torch.randn(0, 64), pool, torch.empty(0, dtype=torch.int64))
    write_indexer_cache(torch.randn(0, 128), kpool, torch.empty(0, dtype=torch.int64))
    assert (pool == POISON).all() and (kpool == POISON).all()


def test_rewriting_a_slot_overwrites_it():
    pool = poisoned_pool(mla_pool, 1, 64)
    first, second = torch.randn(2, 1, 576).unbind(0)
    for kv in (first, second):
        write_mla_cache(kv[:, :512], kv[:, 512:], pool, torch.tensor([5]))
    assert torch.equal(pool[0, 5, 0], layout.quantize_mla(second[:, :512], second[:, 512:])[0])


MLA_OK = dict(c_kv=torch.randn(4, 512), k_pe=torch.randn(4, 64), kv_cache=torch.zeros(2, 64, 1, 656, dtype=torch.uint8),
              slot_mapping=torch.arange(4))


@pytest.mark.parametrize("name, bad", [
    ("c_kv", torch.randn(4, 511)),
    ("c_kv", torch.randint(0, 5, (4, 512))),
    ("k_pe", torch.randn(4, 64).double()),
    ("k_pe", torch.randn(3, 64)),
    ("k_pe", torch.randn(64, 4).T),
    ("kv_cache", torch.zeros(2, 64, 1, 655, dtype=torch.uint8)),
    ("kv_cache", torch.zeros(2, 64, 656, dtype=torch.uint8)),
    ("kv_cache", torch.zeros(2, 64, 1, 164, dtype=torch.int32)),
    ("slot_mapping", torch.arange(4, dtype=torch.int32)),
    ("slot_mapping", torch.arange(5)),
    ("slot_mapping", torch.tensor([0, 1, 2, 128])),
    ("slot_mapping", torch.tensor([0.0, 1.5, 2.0, 3.0])),
    ("slot_mapping", torch.tensor([0, 7, 3, 7])),
])
def test_write_mla_cache_rejects_bad_input_naming_it(name, bad):
    with pytest.raises(ValueError, match=name):
        write_mla_cache(**{**MLA_OK, name: bad})


INDEXER_OK = dict(k=torch.randn(4, 128), k_cache=torch.zeros(1, 64, 1, 132, dtype=torch.uint8),
                  slot_mapping=torch.arange(4))


@pytest.mark.parametrize("name, bad", [
    ("k", torch.randn(4, 64)),
    ("k", torch.randn(4, 128).to(torch.float8_e4m3fn)),
    ("k_cache", torch.zeros(1, 64, 1, 656, dtype=torch.uint8)),
    ("k_cache", torch.zeros(1, 64, 1, 132, dtype=torch.int8)),
    ("slot_mapping", torch.arange(4).float()),
    ("slot_mapping", torch.tensor([0, 64, 1, 2])),
    ("slot_mapping", torch.tensor([5, -1, 5, 2])),
])
def test_write_indexer_cache_rejects_bad_input_naming_it(name, bad):
    with pytest.raises(ValueError, match=name):
        write_indexer_cache(**{**INDEXER_OK, name: bad})


@pytest.mark.parametrize("slots, repeated", [([9, 3, 9], 9), ([0, 0], 0), ([4, 1, 4, 1], 4)])
def test_repeated_slots_are_refused_and_padding_may_repeat(slots, repeated):
    pool = poisoned_pool(indexer_pool, 1, 64)
    with pytest.raises(ValueError, match=f"slot_mapping has slot {repeated} twice"):
        write_indexer_cache(torch.randn(len(slots), 128), pool, torch.tensor(slots))
    assert (pool == POISON).all()
    write_indexer_cache(torch.randn(4, 128), pool, torch.tensor([-1, 3, -1, -1]))  # -1: padding, skipped


def test_trusted_writes_read_nothing_back(monkeypatch):
    """Inside checks.trusted_values (the engine's path) the slot checks stay on the device: no
    value is read back, so a repeated slot passes unseen."""
    reads = []
    for method in ("tolist", "item", "__int__"):
        real = getattr(torch.Tensor, method)
        monkeypatch.setattr(torch.Tensor, method, lambda t, *a, _real=real, **k: reads.append(t) or _real(t, *a, **k))
    pool = poisoned_pool(mla_pool, 1, 64)
    with trusted_values():
        write_mla_cache(torch.randn(2, 512), torch.randn(2, 64), pool, torch.tensor([3, 3]))
    assert reads == []
    write_mla_cache(torch.randn(2, 512), torch.randn(2, 64), pool, torch.tensor([3, 4]))
    assert len(reads) == 1  # the checked path reads once


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="backend"):
        write_indexer_cache(**INDEXER_OK, backend="fastest")


def test_both_writes_have_reference_and_triton_backends_registered():
    assert dispatch.available("write_mla_cache") == dispatch.available("write_indexer_cache") == ["triton", "reference"]


def test_pools_have_the_layout_shapes_and_start_zeroed():
    assert mla_pool(3, "cpu").shape == (3, 64, 1, 656)
    assert indexer_pool(2, "cpu", block_size=16).shape == (2, 16, 1, 132)
    assert not mla_pool(2, "cpu").any() and indexer_pool(1, "cpu").dtype == torch.uint8
    with pytest.raises(ValueError, match="num_blocks"):
        mla_pool(0, "cpu")
    with pytest.raises(ValueError, match="block_size"):
        indexer_pool(1, "cpu", block_size=0)
