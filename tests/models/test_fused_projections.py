"""Inference-time fusions of the V3.2 attention: the three input projections as one GEMM
(``MLA.fuse_input_projections``) and the absorbed query written in place (``absorbed_query``)."""

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from flashdsa.models.batch import contiguous_block_tables, step_metadata
from flashdsa.models.deepseek_v32 import MLA, absorbed_query
from flashdsa.models.linear import FP8Linear, FusedLinear, fusion_refusal
from flashdsa.models.loader import load_model
from flashdsa.models.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def fp8_full_width(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("fp8"), fp8=True, seed=5)


def _layer_outputs(model, ids):
    """Per-layer attention outputs and the logits of one prefill of ``ids``."""
    outs = []
    handles = [layer.self_attn.register_forward_hook(lambda m, a, o: outs.append(o)) for layer in model.model.layers]
    table = contiguous_block_tables([len(ids)])
    try:
        logits = model(ids, step_metadata([0], [len(ids)], table, all_logits=True), model.allocate_caches(2))
    finally:
        for h in handles:
            h.remove()
    return outs, logits


@pytest.mark.parametrize("checkpoint", ["full_width", "fp8_full_width"])
def test_fused_input_projections_give_the_unfused_outputs(request, random_ids, checkpoint):
    path = request.getfixturevalue(checkpoint)
    ids = random_ids(90, seed=7)
    want = _layer_outputs(load_model(path, mode="production"), ids)
    model = load_model(path, mode="production")
    state = {n: t.clone() for n, t in model.state_dict().items()}
    model.prepare_for_inference()
    model.prepare_for_inference()  # idempotent
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.fused_input, FusedLinear) and attn.fused_input.sizes == [256, 128, 576]
    assert attn.fused_input.fp8 == (checkpoint == "fp8_full_width")
    # the parts are views of the fused weight: no memory added, names and values unchanged
    fused_ptr = attn.fused_input.weight.data_ptr()
    assert attn.q_a_proj.weight.data_ptr() == fused_ptr
    assert attn.kv_a_proj_with_mqa.weight.data_ptr() == fused_ptr + 384 * 256 * attn.fused_input.weight.element_size()
    after = model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[n], t) for n, t in state.items())
    calls = []
    attn.fused_input.register_forward_hook(lambda m, a, o: calls.append(len(o)))
    got = _layer_outputs(model, ids)
    assert calls == [3], "the fused GEMM did not run"
    for layer, (g, w) in enumerate(zip(got[0], want[0])):  # bitwise on the CPU GEMMs used here
        assert torch.equal(g, w), f"layer {layer}: max diff {(g.float() - w.float()).abs().max().item()}"
    assert torch.equal(got[1], want[1])


def test_reference_mode_keeps_the_projections_apart(shrunk):
    model = load_model(shrunk, mode="reference")
    model.prepare_for_inference()
    assert all(m.fused_input is None for m in model.modules() if isinstance(m, MLA))


def test_an_update_of_a_part_shows_in_the_fused_weight():
    parts = [nn.Linear(64, 128, bias=False), nn.Linear(64, 8, bias=False)]
    fused = FusedLinear(parts)
    with torch.no_grad():
        parts[1].weight.fill_(2.0)
    x = torch.randn(3, 64)
    a, b = fused(x)
    assert torch.equal(a, parts[0](x)) and torch.equal(b, parts[1](x))


def test_fusion_refuses_layers_whose_scale_blocks_would_mix():
    assert "out_features % 128" in fusion_refusal([FP8Linear(256, 64), FP8Linear(256, 128)])
    assert fusion_refusal([FP8Linear(256, 128), FP8Linear(256, 64)]) is None  # the last may be ragged
    assert "bias" in fusion_refusal([nn.Linear(8, 8), nn.Linear(8, 8)])
    assert "all nn.Linear or all FP8Linear" in fusion_refusal([nn.Linear(8, 8, bias=False), FP8Linear(8, 8)])
    assert "input widths" in fusion_refusal([nn.Linear(8, 8, bias=False), nn.Linear(16, 8, bias=False)])
    assert "quantize" in fusion_refusal([FP8Linear(256, 128), FP8Linear(256, 128, pow2_scales=True)])
    with pytest.raises(ValueError, match="cannot fuse"):
        FusedLinear([nn.Linear(8, 8)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_absorbed_query_equals_einsum_and_cat(dtype):
    g = torch.Generator().manual_seed(3)
    T, H = 37, 4
    q_nope, q_pe = torch.randn(T, H, 192, generator=g).to(dtype).split([128, 64], -1)  # strided, as in MLA
    w_uk = torch.randn(H, 256, 512, generator=g).to(dtype)[:, :128]
    want = torch.cat([torch.einsum("thd,hdc->thc", q_nope, w_uk), q_pe], -1)
    assert torch.equal(absorbed_query(q_nope, q_pe, w_uk), want)


def test_absorbed_query_writes_the_product_in_place():
    """No copy of the product: the batched GEMM writes into the strided view (fp32 CPU: no copy op at all)."""
    q_nope, q_pe = torch.randn(9, 2, 192).split([128, 64], -1)
    w_uk = torch.randn(2, 128, 512)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        absorbed_query(q_nope, q_pe, w_uk)
    ops = {e.key for e in prof.key_averages()}
    assert "aten::bmm" in ops and not ops & {"aten::cat", "aten::clone", "aten::contiguous"}, ops
    assert sum(e.count for e in prof.key_averages() if e.key == "aten::copy_") == 1  # q_pe into its channels
