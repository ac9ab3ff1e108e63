"""positions_to_slots: both backends against a per-position restatement (the Triton kernel in the
interpreter on CPU and on the GPU), on positions that are -1, past the table or on -1 blocks."""

import pytest
import torch

from flashdsa.runtime.cache import positions_to_slots
from flashdsa.testing import kernel_test_main, run_under_interpreter

# (tokens, sequences, positions a token, max blocks, block size)
CASES = [(1, 1, 2048, 40, 64), (6, 3, 2048, 5, 64), (5, 2, 100, 3, 16), (3, 3, 7, 1, 4), (0, 1, 64, 2, 64)]


def restated(positions, seq_ids, tables, block_size):
    out = torch.full(positions.shape, -1, dtype=torch.int32)
    for t, row in enumerate(positions.tolist()):
        table = tables[seq_ids[t]].tolist()
        for j, p in enumerate(row):
            if p >= 0 and p // block_size < len(table) and table[p // block_size] >= 0:
                out[t, j] = table[p // block_size] * block_size + p % block_size
    return out


def random_case(tokens, seqs, width, max_blocks, block_size, g):
    """Positions from -1 to past the table, tables with -1 holes, positions a strided view."""
    tables = torch.randint(-1, 1000, (seqs, max_blocks), generator=g, dtype=torch.int32)
    seq_ids = torch.randint(0, seqs, (tokens,), generator=g).sort().values
    positions = torch.randint(-1, (max_blocks + 1) * block_size, (tokens, width + 3), generator=g)[:, 3:]
    return positions, seq_ids, tables


def check_backend(device: str, backend: str) -> None:
    g = torch.Generator().manual_seed(0)
    for case in CASES:
        for dtype in (torch.int32, torch.int64):
            positions, seq_ids, tables = random_case(*case, g)
            want = restated(positions, seq_ids, tables, case[-1])
            got = positions_to_slots(positions.to(device, dtype), seq_ids.to(device), tables.to(device), case[-1],
                                     backend=backend)
            assert got.dtype == torch.int32 and torch.equal(got.cpu(), want), (case, dtype, backend)


def test_reference_matches_the_restatement():
    check_backend("cpu", "reference")


@pytest.mark.parametrize("bad, message", [
    (dict(positions=torch.zeros(2, 4)), "positions must be"),
    (dict(seq_ids=torch.zeros(3, dtype=torch.int64)), "seq_ids must be"),
    (dict(seq_ids=torch.tensor([0, 2])), "seq_ids must lie in"),
    (dict(block_tables=torch.zeros(2, 3)), "block_tables must be"), (dict(block_size=0), "block_size must be"),
    (dict(positions=torch.zeros(4, 2, dtype=torch.int32).T), "contiguous last dim")])
def test_bad_arguments_name_themselves(bad, message):
    args = dict(positions=torch.zeros(2, 4, dtype=torch.int32), seq_ids=torch.zeros(2, dtype=torch.int64),
                block_tables=torch.zeros(2, 3, dtype=torch.int32), block_size=64) | bad
    with pytest.raises(ValueError, match=message):
        positions_to_slots(**args)


def test_triton_kernel_matches_in_the_interpreter():
    run_under_interpreter(__file__, 0)


@pytest.mark.gpu
def test_triton_kernel_matches_on_gpu():
    check_backend("cuda", "triton")


if __name__ == "__main__":
    kernel_test_main(lambda: check_backend("cpu", "triton"), lambda: check_backend("cuda", "triton"))
