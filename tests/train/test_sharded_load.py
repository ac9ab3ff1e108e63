"""Per-rank FSDP2 loading (gloo, spawned ranks): each rank's shards are bitwise the rows of the
one-process fp32 model, and no rank reads more of a tensor than its rows (a routed expert's
tensor: whole, by the one rank whose rows hold that expert). Two ranks, and three, where shards
are uneven, some ranks hold no expert and FP8 cuts fall inside 128-row scale blocks.
DeepSeek-V3.2 and DeepSeek-V4 checkpoints: V4 in the release's formats (FP8 linears with UE8M0
block scales, packed FP4 experts), in bf16 without an MTP layer (a fresh one is added), as a
fine-tuning run saves it (what ``--resume`` reads) and in transformers' layout (stacked experts)."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors import safe_open
from torch.distributed.tensor import DTensor

from safetensors.torch import load_file, save_file

from flashdsa.models import deepseek_v4_loader, loader
from flashdsa.models.deepseek_v4_tiny import make_tiny_v4_checkpoint
from flashdsa.models.linear import SCALE_SUFFIX
from flashdsa.models.tiny import make_tiny_checkpoint
from flashdsa.runtime.fp4 import quantize_fp4
from flashdsa.train.architecture import load_trainable
from flashdsa.train.checkpoint import save_model
from flashdsa.train.distributed import World, own_rows
from flashdsa.train.sharded_load import load_for_training, load_shards

MTP_SEED = 5  # the bf16 checkpoints have no MTP layer: they get a fresh one, as --add-mtp-layer does
BUFFERS = ("e_score_correction_bias", "tid2eid", "ffn.gate.bias")  # whole on every rank
PER_EXPERT = re.compile(r"\.experts\.\d+\.")  # one routed expert's tensor (or its scales)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded_load")
    return {  # (checkpoint, seed of a fresh MTP layer or None)
        # shrunk widths, 4 experts (3 ranks: 2, 2, 0), no MTP layer
        "bf16": (make_tiny_checkpoint(root / "bf16", seed=1, shrink=True), MTP_SEED),
        # V3.2 widths (576-row kv_a_proj, 256-row q_a_proj: cuts inside scale blocks), 8 experts, an MTP layer, 3 files
        "fp8": (make_tiny_checkpoint(root / "fp8", seed=2, fp8=True, mtp=True, shards=3), None),
        # V4 as released: FP8 linears (256- and 512-row ones: 3 ranks cut inside scale blocks), FP4 experts, 2 files
        "v4_release": (release := make_tiny_v4_checkpoint(root / "v4_release", fp8=True, fp4_experts=True, seed=4,
                                                          shards=2, small=True), None),
        "v4_fresh_mtp": (make_tiny_v4_checkpoint(root / "v4_bf16", seed=6, small=True, mtp=False), MTP_SEED),
        "v4_saved": (save_model(load_trainable(release, "cpu"), root / "v4_saved", release), None),
        "v4_transformers": (_transformers_layout(release, root / "v4_transformers"), None),
    }


def _transformers_layout(path, out):
    """Checkpoint ``path``'s fp32 model under its own (transformers') names, experts stacked."""
    model = load_trainable(path, "cpu")
    out.mkdir()
    save_file({name: t.contiguous() for name, t in model.state_dict().items()}, out / "model.safetensors")
    (out / "config.json").write_text((path / "config.json").read_text())
    return out


class _Slice:
    """A safetensors slice that logs the rows of every read of tensor ``name``."""

    def __init__(self, part, name: str, log: dict[str, list[int]]):
        self.part, self.name, self.log = part, name, log

    def get_shape(self):
        return self.part.get_shape()

    def get_dtype(self):
        return self.part.get_dtype()

    def __getitem__(self, index):
        t = self.part[index]
        self.log.setdefault(self.name, []).append(t.shape[0] if t.dim() else 1)
        return t


class _Recording:
    """``safe_open`` whose reads go through :class:`_Slice` (and nothing else: no ``get_tensor``)."""

    def __init__(self, f, log: dict[str, list[int]]):
        self.f, self.log = f, log

    def __enter__(self):
        self.f.__enter__()
        return self

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)

    def keys(self):
        return self.f.keys()

    def get_slice(self, name: str) -> _Slice:
        return _Slice(self.f.get_slice(name), name, self.log)


def _load_on_rank(rank: int, size: int, store: str, checkpoints: dict, out: str) -> None:
    """One rank: load every checkpoint as shards and save ``{key: (shards, reads)}``, each shard
    as ``(start row, local tensor)`` and reads as checkpoint name -> rows of each read."""
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True, warn_only=True)  # uninitialised memory reads as NaN
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    real, result = loader.safe_open, {}
    try:
        for key, (path, seed) in checkpoints.items():
            reads: dict[str, list[int]] = {}
            loader.safe_open = deepseek_v4_loader.safe_open = lambda *a, **k: _Recording(real(*a, **k), reads)
            model = load_for_training(path, World(rank, size), fresh_mtp_seed=seed)
            shards = {}
            for name, t in [*model.named_parameters(), *model.named_buffers()]:
                assert isinstance(t, DTensor) or name.endswith(BUFFERS), name
                local, start, _ = own_rows(t)
                shards[name] = (start, local.detach().clone())
            result[key] = (shards, reads)
    finally:
        loader.safe_open = deepseek_v4_loader.safe_open = real
    torch.save(result, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def _headers(path) -> dict[str, list[int]]:
    """Checkpoint tensor name -> shape."""
    shapes = {}
    for file in loader.checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            shapes.update((name, f.get_slice(name).get_shape()) for name in f.keys())
    return shapes


def _scaled_weight(name: str, shapes: dict[str, list[int]]) -> str | None:
    """The weight whose block scales checkpoint tensor ``name`` holds (V3.2's ``<weight>_scale_inv``,
    V4's ``<module>.scale``), None if it holds none."""
    for suffix, weight_suffix in ((SCALE_SUFFIX, ""), (".scale", ".weight")):
        weight = name.removesuffix(suffix) + weight_suffix
        if name.endswith(suffix) and weight in shapes:
            return weight
    return None


@pytest.mark.parametrize("size", [2, 3])
def test_each_rank_loads_its_rows_of_the_one_process_model_and_reads_no_more(checkpoints, size, tmp_path):
    mp.spawn(_load_on_rank, args=(size, str(tmp_path / "store"), checkpoints, str(tmp_path)), nprocs=size)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(size)]
    for key, (path, seed) in checkpoints.items():
        single = load_for_training(path, World(), fresh_mtp_seed=seed)
        whole = dict([*single.named_parameters(), *single.named_buffers()])
        for name, full in whole.items():
            parts = [rank[key][0][name] for rank in ranks]
            if name.endswith(BUFFERS):  # a buffer: whole on every rank
                assert all(start == 0 and torch.equal(t, full) for start, t in parts), name
                continue
            assert sum(t.shape[0] for _, t in parts) == full.shape[0], name
            assert max(t.shape[0] for _, t in parts) == math.ceil(full.shape[0] / size), name
            for start, t in parts:
                assert t.dtype == torch.float32 and torch.equal(t, full[start:start + t.shape[0]]), (key, name, start)
        if seed is not None:  # the fresh MTP layer is drawn: not all zeros, not NaN
            fresh = "mtp.0.e_proj.weight" if key.startswith("v4") else "model.mtp.eh_proj.weight"
            assert whole[fresh].abs().sum() > 0
        shapes = _headers(path)
        for name, shape in shapes.items():
            rows = [sum(rank[key][1].get(name, [])) for rank in ranks]
            largest = max(max(rank[key][1].get(name, [0])) for rank in ranks)
            if PER_EXPERT.search(name):  # one rank reads it (and its scales), whole
                assert sorted(rows) == [0] * (size - 1) + [shape[0]], name
            elif weight := _scaled_weight(name, shapes):  # the scale rows over a rank's weight rows
                weight_rows = shapes[weight][0]
                assert largest <= math.ceil(math.ceil(weight_rows / size) / 128) + 1, name
            elif name.endswith(BUFFERS):
                assert rows == [shape[0]] * size, name
            elif name.endswith(("layers.3.embed_tokens.weight", "layers.3.shared_head.head.weight")):
                assert rows == [0] * size, name  # the MTP layer's copies of the embedding and head
            else:
                assert sum(rows) == shape[0] and largest <= math.ceil(shape[0] / size), (name, rows)


def test_a_v4_checkpoint_missing_unexpected_or_misshaped_tensors_is_refused_naming_them(checkpoints, tmp_path):
    path, _ = checkpoints["v4_fresh_mtp"]
    weights = load_file(path / "model.safetensors")
    del weights["layers.2.ffn.experts.1.w3.weight"]
    weights["layers.0.attn.wq_a.weight"] = weights["layers.0.attn.wq_a.weight"][:5]
    weights["layers.0.attn.bogus"] = torch.zeros(1)
    save_file(weights, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(ValueError) as error:
        load_shards(tmp_path, World())  # one rank: the same walk, every row its own
    for part in ("does not match the DeepSeek-V4 model", "model.layers.2.mlp.experts.gate_up_proj[1]1",
                 "layers.0.attn.bogus", "model.layers.0.self_attn.q_a_proj.weight: expected [32, 64], got [5, 64]"):
        assert part in str(error.value)


def test_stacked_quantized_v4_experts_are_refused_naming_the_tensor(checkpoints, tmp_path):
    """transformers' layout stacks the experts: FP4 (or FP8) stacks cannot be dequantized as 2-D weights."""
    path, _ = checkpoints["v4_transformers"]
    weights = load_file(path / "model.safetensors")
    name = "model.layers.2.mlp.experts.gate_up_proj"
    stack = weights[name]
    packed, scale = quantize_fp4(stack.reshape(-1, stack.shape[-1]))
    weights[name] = packed.view(*stack.shape[:2], -1)
    weights[name + SCALE_SUFFIX] = scale.view(*stack.shape[:2], -1)
    save_file(weights, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(ValueError, match=rf"FP4 tensor {name} is \[4, 64, 32\]: only 2-D quantized weights"):
        load_shards(tmp_path, World())
