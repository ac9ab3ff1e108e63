"""The model over paged caches: equals transformers in reference mode, and is consistent across
ways of batching the same tokens (prefill vs decode, alone vs batched, mixed steps)."""

import pytest
import torch
import torch.nn.functional as F

from flashdsa.models.batch import contiguous_block_tables, step_metadata
from flashdsa.models.loader import load_model


def _run(model, ids, cached, new, table, caches, all_logits=False):
    """One forward of ``new[b]`` tokens per sequence (ids concatenated) after ``cached[b]`` tokens."""
    return model(ids, step_metadata(cached, new, table, all_logits=all_logits), caches)


def _assert_close(got, want, rel=1e-5):
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err <= rel, f"max relative error {err:.2e} > {rel:.0e}"


@pytest.fixture(scope="module")
def reference(shrunk):
    return load_model(shrunk, mode="reference")


def test_reference_logits_match_transformers(reference, hf_shrunk, random_ids):
    ids = random_ids(150)
    table = contiguous_block_tables([150])
    ours = _run(reference, ids, [0], [150], table, reference.allocate_caches(3), all_logits=True)
    want = hf_shrunk(ids[None]).logits[0]
    _assert_close(ours, want, 1e-5)


def test_decode_after_prefill_equals_recomputing_the_whole_sequence(reference, random_ids):
    ids = random_ids(100)
    table = contiguous_block_tables([100])
    whole = _run(reference, ids, [0], [100], table, reference.allocate_caches(2), all_logits=True)
    caches = reference.allocate_caches(2)
    steps = [_run(reference, ids[:90], [0], [90], table, caches)]
    steps += [_run(reference, ids[p : p + 1], [p], [1], table, caches) for p in range(90, 100)]
    _assert_close(torch.cat(steps), whole[89:])


def test_chunked_prefill_equals_one_prefill(reference, random_ids):
    ids = random_ids(130)
    table = contiguous_block_tables([130])
    whole = _run(reference, ids, [0], [130], table, reference.allocate_caches(3), all_logits=True)
    caches = reference.allocate_caches(3)
    _run(reference, ids[:70], [0], [70], table, caches)
    _assert_close(_run(reference, ids[70:], [70], [60], table, caches, all_logits=True), whole[70:])


def test_batch_of_different_lengths_equals_each_alone(reference, random_ids):
    lengths = [5, 130, 70]
    seqs = [random_ids(n, seed=i) for i, n in enumerate(lengths)]
    alone = []
    for s in seqs:
        table = contiguous_block_tables([len(s)])
        alone.append(_run(reference, s, [0], [len(s)], table, reference.allocate_caches(3)))
    table = contiguous_block_tables(lengths)  # then hand the blocks out in reverse order
    table = torch.where(table >= 0, int(table.max()) - table, -1).to(torch.int32)
    batched = _run(reference, torch.cat(seqs), [0, 0, 0], lengths, table, reference.allocate_caches(8))
    _assert_close(batched, torch.cat(alone))


@pytest.mark.parametrize("checkpoint, mode", [("shrunk", "reference"), ("full_width", "production")])
def test_one_forward_mixes_decode_tokens_and_prefill_chunks(request, random_ids, checkpoint, mode):
    model = load_model(request.getfixturevalue(checkpoint), mode=mode)
    a, b = random_ids(80, seed=3), random_ids(100, seed=4)
    table = contiguous_block_tables([80, 100])
    want = _run(model, torch.cat([a, b]), [0, 0], [80, 100], table, model.allocate_caches(4), all_logits=True)
    caches = model.allocate_caches(4)
    _run(model, torch.cat([a[:79], b[:40]]), [0, 0], [79, 40], table, caches)
    # sequence 0 decodes its last token while sequence 1 prefills the rest
    mixed = _run(model, torch.cat([a[79:], b[40:]]), [79, 40], [1, 60], table, caches, all_logits=True)
    want = torch.cat([want[79:80], want[120:]])
    if mode == "reference":
        _assert_close(mixed, want)
    else:  # FP8 caches read the same bytes either way; only bf16 GEMM shapes differ
        assert F.cosine_similarity(mixed.flatten(), want.flatten(), dim=0).item() > 0.999


def test_production_mode_runs_on_cpu_close_to_reference(full_width, random_ids):
    ids = random_ids(96)
    table = contiguous_block_tables([96])
    out = {}
    for mode in ("reference", "production"):
        model = load_model(full_width, mode=mode)
        out[mode] = _run(model, ids, [0], [96], table, model.allocate_caches(2), all_logits=True)
    cosine = F.cosine_similarity(out["production"].flatten(), out["reference"].flatten(), dim=0).item()
    assert cosine > 0.99, cosine
    assert out["production"].isfinite().all()


def test_production_decode_matches_production_prefill(full_width, random_ids):
    model = load_model(full_width, mode="production")
    ids = random_ids(70)
    table = contiguous_block_tables([70])
    whole = _run(model, ids, [0], [70], table, model.allocate_caches(2), all_logits=True)
    caches = model.allocate_caches(2)
    _run(model, ids[:66], [0], [66], table, caches)
    steps = torch.cat([_run(model, ids[p : p + 1], [p], [1], table, caches) for p in range(66, 70)])
    cosine = F.cosine_similarity(steps.flatten(), whole[66:].flatten(), dim=0).item()
    assert cosine > 0.999, cosine


def test_cache_bytes_per_block_counts_both_caches_over_all_layers(full_width, shrunk):
    production = load_model(full_width, mode="production")
    assert production.cache_bytes_per_block() == 3 * 64 * (656 + 132)
    reference = load_model(shrunk, mode="reference")
    assert reference.cache_bytes_per_block() == 2 * 64 * 4 * (48 + 32)
    caches = reference.allocate_caches(5)
    assert len(caches.mla) == 2 and caches.mla[0].shape == (5, 64, 1, 48) and caches.indexer[0].shape == (5, 64, 1, 32)


@pytest.mark.parametrize("checkpoint, mode", [("shrunk", "reference"), ("full_width", "production")])
def test_a_step_reads_only_the_blocks_of_its_sequences(request, random_ids, checkpoint, mode):
    """Every block outside the step's context is poisoned (NaN keys and scales): the logits equal
    those of a run in a clean pool, block placement aside."""
    model = load_model(request.getfixturevalue(checkpoint), mode=mode)
    ids = random_ids(102)
    outs = []
    scattered = torch.tensor([[6, 2]], dtype=torch.int32)
    for table, poison in ((contiguous_block_tables([102]), False), (scattered, True)):
        caches = model.allocate_caches(8)
        for pool in caches.mla + caches.indexer if poison else []:
            pool.fill_(255 if pool.dtype == torch.uint8 else float("nan"))  # 0xff bytes: e4m3 and fp32 NaN
        steps = [_run(model, ids[:100], [0], [100], table, caches)]
        steps += [_run(model, ids[p : p + 1], [p], [1], table, caches) for p in (100, 101)]
        outs.append(torch.cat(steps))
    assert outs[1].isfinite().all()
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_prefill_over_dequantized_blocks_matches_the_decode_kernel(full_width, random_ids, monkeypatch, device):
    """Prompts attend through ``sparse_mla_fwd`` over bf16 rows of their blocks; each layer's
    attention, run again through the decode kernel over the FP8 cache on the same inputs, agrees to
    bf16 rounding of the keys. Step 1: two prompts of different lengths (the second's rows start
    past the first's padded table row). Step 2 mixes two decode tokens with a third prompt (a decode
    run, then a dequantized one). Layer by layer: the tiny random model amplifies any difference
    through the next layers' top-k choices."""
    import flashdsa.models.caches as caches_module
    from flashdsa.models.deepseek_v32 import MLA

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = load_model(full_width, mode="production", device=device)
    table = contiguous_block_tables([131, 76, 600])
    caches = model.allocate_caches(int(table.max()) + 1)
    calls, errors = [], []
    dequantize, attend = caches_module.dequantize_mla_blocks, MLA._attend
    monkeypatch.setattr(caches_module, "dequantize_mla_blocks", lambda *a: calls.append(1) or dequantize(*a))

    def both_paths(self, q, pool, positions, meta):
        monkeypatch.setattr(caches_module, "DEQUANTIZED_MIN_TOKENS", 10**9)
        over_cache = torch.cat(attend(self, q, pool, positions, meta))
        monkeypatch.setattr(caches_module, "DEQUANTIZED_MIN_TOKENS", 1)
        outs = attend(self, q, pool, positions, meta)
        out = torch.cat(outs)
        errors.append(((out - over_cache).abs().max() / over_cache.abs().max()).item())
        return outs

    monkeypatch.setattr(MLA, "_attend", both_paths)
    for cached, new in (([0, 0, 0], [130, 75, 0]), ([130, 75, 0], [1, 1, 600])):
        ids = random_ids(sum(new), sum(cached)).to(device)
        logits = model(ids, step_metadata(cached, new, table, device=device), caches)
        assert logits.isfinite().all()
    layers = len(model.model.layers)
    assert len(calls) == len(errors) == 2 * layers  # one copy a layer in each step (step 2: the prompt's run)
    assert max(errors) <= 1e-2, errors


def test_attention_runs_group_prompts_apart_from_decodes():
    from flashdsa.models.caches import attention_runs

    def runs(cached, new):
        meta = step_metadata(cached, new, contiguous_block_tables([c + n for c, n in zip(cached, new)]))
        return [(r.first, r.end, r.token_first, r.token_end, r.dequantized) for r in attention_runs(meta)]

    assert runs([0], [600]) == [(0, 1, 0, 600, True)]  # a prompt
    assert runs([7000], [1000]) == [(0, 1, 0, 1000, True)]  # a late chunk: 8000 rows for 1000 queries
    assert runs([0], [100]) == [(0, 1, 0, 100, False)]  # too few rows to fill the GPU without a top-k split
    assert runs([16000] * 600, [1] * 600) == [(0, 600, 0, 600, False)]  # decode: 16K rows per query token
    # chunked prefill: decodes, a prompt's chunk, a decode, two short prompts that together fill the GPU
    assert runs([9000, 5000, 0, 4000, 0, 0], [1, 1, 2000, 1, 300, 300]) == [
        (0, 2, 0, 2, False), (2, 3, 2, 2002, True), (3, 4, 2002, 2003, False), (4, 6, 2003, 2603, True)]
    # a short prompt between decodes stays on the decode kernel with them
    assert runs([9000, 0, 9000, 0], [1, 100, 1, 700]) == [(0, 3, 0, 102, False), (3, 4, 102, 802, True)]
