"""Per-rank slices (no processes): each rank's tensors are exactly its part of the whole model's,
FP8 weights cut with their block scales, and bad splits fail before any weight is read."""

import json

import pytest
import torch

from flashdsa.models.config import DeepseekV32Config
from flashdsa.models.loader import dequantize_blocks, load_model, read_raw_tensors, read_tensors
from flashdsa.models.synthetic import v32_config
from flashdsa.models.tiny import make_tiny_checkpoint
from flashdsa.runtime.parallel.launcher import check_parallel
from flashdsa.runtime.parallel.plan import memory_plan, plan_problem
from flashdsa.runtime.parallel.shard import ParallelConfig, Shard
from flashdsa.runtime.parallel.sharding import placement


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {fp8: make_tiny_checkpoint(root / str(fp8), fp8=fp8, shards=3) for fp8 in (False, True)}


def _float(t, scale, block=(128, 128)):
    return t.float() if scale is None else dequantize_blocks(t, scale, block)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_rank_slices_are_parts_of_the_whole(checkpoints, fp8, expert_parallel):
    path = checkpoints[fp8]
    config = DeepseekV32Config.from_json(path)
    full = dict(read_tensors(path, config))
    for rank in range(2):
        shard = Shard(rank, 2, expert_parallel)
        seen = 0
        for name, t, scale in read_raw_tensors(path, config, shard):
            source = next(n for n in full if placement(n, full[n].shape, shard, config.n_routed_experts)
                          and placement(n, full[n].shape, shard, config.n_routed_experts).name == name)
            at = placement(source, full[source].shape, shard, config.n_routed_experts)
            want = full[source] if at.dim is None else full[source].narrow(at.dim, at.start, at.stop - at.start)
            assert torch.equal(_float(t, scale), want.float()), name
            seen += 1
        experts = sum(".experts." in n and n.endswith("gate_proj.weight") for n in full)
        assert seen == len(full) - (experts // 2 * 3 if expert_parallel else 0)


def test_tp2_models_concatenate_to_the_tp1_model(checkpoints):
    path = checkpoints[False]
    whole = load_model(path, mode="reference").state_dict()
    parts = [load_model(path, mode="reference", shard=Shard(r, 2)).state_dict() for r in range(2)]
    for name, t in whole.items():
        a, b = parts[0][name], parts[1][name]
        if a.shape == t.shape:
            assert torch.equal(a, t) and torch.equal(b, t), name
        else:
            dim = next(d for d in range(t.dim()) if a.shape[d] != t.shape[d])
            assert torch.equal(torch.cat([a, b], dim), t), name


def test_bad_splits_name_their_cause_before_loading(checkpoints, tmp_path):
    with pytest.raises(ValueError, match="tensor_parallel_size 3 must divide"):
        check_parallel(checkpoints[False], ParallelConfig(3), "cpu", "reference")
    with pytest.raises(ValueError, match=r"shared_experts.*128x128 scale blocks"):
        check_parallel(checkpoints[True], ParallelConfig(2), "cpu", "reference")
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1"):
        ParallelConfig(0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs 2 GPUs, 0 visible"):
            check_parallel(checkpoints[False], ParallelConfig(2), "cuda", "reference")


def test_official_v32_fits_eight_h200_with_expert_parallel():
    config = DeepseekV32Config.from_dict(v32_config(61, num_nextn_predict_layers=1))
    plans = memory_plan(config, ParallelConfig(8, True), int(141e9), quantization="fp8")
    assert len(plans) == 8 and plan_problem(plans, config.max_position_embeddings) is None
    assert 85e9 < plans[0].weight_bytes < 92e9  # ~690 GB of FP8 weights over 8 ranks
    assert plans[0].kv_bytes_per_token == 62 * (656 + 132)
    one = memory_plan(config, ParallelConfig(1), int(141e9), quantization="fp8")
    assert "exceed 90% of 141.0 GB" in plan_problem(one, 4096)


def test_plan_command(tmp_path, capsys):
    from flashdsa.cli import main

    (tmp_path / "config.json").write_text(json.dumps(v32_config(61, num_nextn_predict_layers=1)))
    assert main(["plan", "--model", str(tmp_path), "--tensor-parallel-size", "8", "--enable-expert-parallel"]) == 0
    assert "fits:" in capsys.readouterr().out
    assert main(["plan", "--model", str(tmp_path), "--tensor-parallel-size", "4"]) == 2
    assert "does not fit: rank 0: weights" in capsys.readouterr().out
