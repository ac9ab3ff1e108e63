"""Cache blocks for sequences, with prefix caching.

Both caches (MLA latent and indexer keys) share one block table: block id b names the same 64
token slots in both pools, so one allocator serves both. A full block is identified by a hash
chained over its tokens and every token before it; a sequence whose prefix hashes match reuses
those blocks (reference counted) instead of recomputing them. When the last user of a cached
block lets go, the block stays cached but evictable; new allocations take never-cached free
blocks first, then evict cached ones in least-recently-freed order.

Allocator refcounts: one per sequence holding the block; an evictable block keeps exactly one,
held by the cache itself, which is handed over to whoever reuses or evicts it.

Models with per-sequence state besides the paged caches (DeepSeek-V4's sliding window and
compressor states) get ``num_state_slots`` slots: a sequence takes one with its first blocks and
gives it back with them, so a preempted sequence restarts from an empty state. There are as many
slots as running sequences may be, so a running sequence always finds one (slot
``num_state_slots`` is the CUDA graphs' padding slot).

Cached blocks alone cannot resume such a model: the state at the prefix's end is needed too. So
with prefix caching it keeps ``num_snapshot_slots`` state snapshots (slots ``num_state_slots + 1``
on), one per prompt at most, taken where its last full block ends (the scheduler ends a prefill
chunk there) and keyed by that block's chain hash. A prefix hit then ends at the longest cached
chain whose last block has a snapshot; the runner copies the snapshot into the sequence's slot
before its first step. Snapshots are evicted least recently used, and with their block.
"""

from __future__ import annotations

from collections import OrderedDict

from flashdsa.runtime.cache.allocator import BlockAllocator
from flashdsa.runtime.sequence import BLOCK_SIZE, Sequence


def chain_hash(parent: int, tokens: tuple[int, ...]) -> int:
    """Hash of a full block given the hash of the block before it (-1 for the first)."""
    return hash((parent, tokens))


class BlockManager:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True, num_state_slots: int = 0,
                 num_snapshot_slots: int = 0) -> None:
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.allocator = BlockAllocator(num_blocks)
        self.stateful = num_state_slots > 0
        self.free_state_slots = list(range(num_state_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self.free_snapshot_slots = list(range(num_state_slots + num_snapshot_slots, num_state_slots, -1))
        self.snapshot_of: OrderedDict[int, int] = OrderedDict()  # block hash -> snapshot slot, LRU first
        self.hash_to_block: dict[int, int] = {}
        self.block_to_hash: dict[int, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody holds, LRU first

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence could get now: never-cached free ones plus evictable cached ones."""
        return self.allocator.num_free + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def update_hashes(self, seq: Sequence) -> None:
        """Extend seq.block_hashes to cover every full block of its tokens."""
        for i in range(len(seq.block_hashes), len(seq) // BLOCK_SIZE):
            parent = seq.block_hashes[-1] if seq.block_hashes else -1
            tokens = tuple(seq.token_ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
            seq.block_hashes.append(chain_hash(parent, tokens))

    def acquire_prefix(self, seq: Sequence) -> int:
        """Give a sequence with no blocks the cached blocks of its longest cached prefix.

        At least one token is always left to compute, so the step that finishes the prompt has
        logits to sample from. Returns the number of tokens found (now seq.num_computed_tokens).
        """
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching or seq.wants_prompt_logprobs:
            return 0
        self.update_hashes(seq)
        found = []
        for h in seq.block_hashes[: (len(seq) - 1) // BLOCK_SIZE]:
            if h not in self.hash_to_block:
                break
            found.append(h)
        if self.stateful:  # up to the last block with a snapshot of the state there
            found = found[: max((i + 1 for i, h in enumerate(found) if h in self.snapshot_of), default=0)]
            if found:
                self.snapshot_of.move_to_end(found[-1])
                seq.restore_from = self.snapshot_of[found[-1]]
        for h in found:
            block = self.hash_to_block[h]
            if block in self.evictable:
                del self.evictable[block]  # the cache's reference passes to the sequence
            else:
                self.allocator.incref(block)
            seq.block_table.append(block)
        seq.num_registered_blocks = len(seq.block_table)
        seq.num_computed_tokens = len(seq.block_table) * BLOCK_SIZE
        return seq.num_computed_tokens

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return seq.num_blocks_for(num_tokens) - len(seq.block_table) <= self.num_free_blocks

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Extend seq's block table to hold num_tokens tokens; False (nothing taken) if short."""
        if not self.can_grow(seq, num_tokens):
            return False
        if seq.state_slot < 0 and self.free_state_slots:
            seq.state_slot = self.free_state_slots.pop()
        while len(seq.block_table) < seq.num_blocks_for(num_tokens):
            seq.block_table.append(self._take_block())
        return True

    def _take_block(self) -> int:
        if self.allocator.num_free > 0:
            return self.allocator.allocate()
        block, _ = self.evictable.popitem(last=False)
        h = self.block_to_hash.pop(block)
        del self.hash_to_block[h]
        if h in self.snapshot_of:
            self.free_snapshot_slots.append(self.snapshot_of.pop(h))
        return block  # the cache's reference passes to the new owner

    def snapshot_boundary(self, seq: Sequence) -> int:
        """Tokens after which ``seq``'s state is snapshotted: its prompt's last full block boundary
        (the longest prefix a later hit may take); 0: none."""
        if not (self.stateful and self.enable_prefix_caching) or seq.wants_prompt_logprobs:
            return 0
        return (seq.num_prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE

    def reserve_snapshot(self, seq: Sequence) -> int:
        """A snapshot slot for ``seq``'s state at :meth:`snapshot_boundary` (evicting the least
        recently used snapshot when none is free), or -1 when its prefix has one already or every
        slot is reserved. Committed by :meth:`register_computed` once the step has run."""
        h = seq.block_hashes[self.snapshot_boundary(seq) // BLOCK_SIZE - 1]
        if h in self.snapshot_of or seq.snapshot_to >= 0:
            return -1
        if not self.free_snapshot_slots and self.snapshot_of:
            self.free_snapshot_slots.append(self.snapshot_of.popitem(last=False)[1])
        if self.free_snapshot_slots:
            seq.snapshot_to = self.free_snapshot_slots.pop()
        return seq.snapshot_to

    def register_computed(self, seq: Sequence) -> None:
        """Offer seq's newly completed full blocks (their tokens now in the cache) for reuse."""
        if not self.enable_prefix_caching:
            return
        self.update_hashes(seq)
        num_full = min(seq.num_computed_tokens // BLOCK_SIZE, len(seq.block_hashes))
        for i in range(seq.num_registered_blocks, num_full):
            h, block = seq.block_hashes[i], seq.block_table[i]
            if h not in self.hash_to_block and block not in self.block_to_hash:
                self.hash_to_block[h] = block
                self.block_to_hash[block] = h
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)
        boundary = self.snapshot_boundary(seq)
        if seq.snapshot_to >= 0 and seq.num_computed_tokens >= boundary:  # its snapshot is taken: offer it
            h = seq.block_hashes[boundary // BLOCK_SIZE - 1]
            if h in self.snapshot_of or h not in self.hash_to_block:
                self.free_snapshot_slots.append(seq.snapshot_to)
            else:
                self.snapshot_of[h] = seq.snapshot_to
            seq.snapshot_to = -1

    def free(self, seq: Sequence) -> None:
        """Release all of seq's blocks (finish, abort or preemption).

        Tail blocks are freed first, so they are the first evicted: a later request sharing
        the prefix most likely needs the head.
        """
        for block in reversed(seq.block_table):
            if self.allocator.refcount(block) == 1 and block in self.block_to_hash:
                self.evictable[block] = None
            else:
                self.allocator.free(block)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
        if seq.state_slot >= 0:
            self.free_state_slots.append(seq.state_slot)
            seq.state_slot = -1
        if seq.snapshot_to >= 0:  # reserved, never taken
            self.free_snapshot_slots.append(seq.snapshot_to)
            seq.snapshot_to = -1
        seq.restore_from = -1
