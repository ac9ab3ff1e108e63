"""Checkpoints of a sharded run: rank 0 streams the HF-layout weights one tensor at a time (never
more than one file's tensors plus one in flight), every rank writes its optimizer shards, and a
run resumes on another rank count (2 -> 1, 1 -> 2) as if uninterrupted; a checkpoint from before
the sharded optimizer state still resumes."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors import safe_open
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from flashdsa.cli import main
from flashdsa.models.loader import checkpoint_files, load_model
from flashdsa.models.tiny import make_tiny_checkpoint
from flashdsa.train import checkpoint as ckpt
from flashdsa.train import weight_stream
from flashdsa.train.distributed import World
from flashdsa.train.sharded_load import load_for_training
from test_fsdp import STEPS, TOLERANCE, finetune_args, losses, on_two_ranks
from test_loop import make_trainer

MAX_SHARD_BYTES = 40_000  # several files for the tiny models, and experts split over them


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp_checkpoint")
    return {  # shrunk widths and 4 experts (3 ranks: 2, 2, 0); V3.2 widths, FP8, an MTP layer, 3 files
        "bf16": make_tiny_checkpoint(root / "bf16", seed=1, shrink=True),
        "fp8": make_tiny_checkpoint(root / "fp8", seed=2, fp8=True, mtp=True, shards=3),
    }


def _recorded_save(model, out, world: World) -> tuple[list[int], list[int]]:
    """Save ``model`` (fp32) to ``out``, recording on this rank the bytes it holds (gathered, not yet
    written) after every gather, and each gathered piece's bytes."""
    held, peaks, pieces = [0], [], []
    real_gather, real_save = weight_stream.gather, weight_stream.save_file

    def gather(tensor, piece, world):
        t = real_gather(tensor, piece, world)
        if t is not None:
            held[0] += t.numel() * t.element_size()
            peaks.append(held[0])
            pieces.append(piece.nbytes)
        return t

    def save_file(tensors, *args, **kwargs):
        held[0] = 0
        return real_save(tensors, *args, **kwargs)

    weight_stream.gather, weight_stream.save_file = gather, save_file
    try:
        ckpt.save_model(model, out, max_shard_bytes=MAX_SHARD_BYTES, world=world)
    finally:
        weight_stream.gather, weight_stream.save_file = real_gather, real_save
    return peaks, pieces


def _save_on_rank(rank: int, size: int, store: str, sources: dict, out: str) -> None:
    """One rank: load each checkpoint as FSDP2 shards and save it again under ``out/key``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    peaks, pieces = [], []
    for key, path in sources.items():
        world = World(rank, size)
        held = _recorded_save(load_for_training(path, world), f"{out}/{key}", world)
        peaks, pieces = peaks + held[0], pieces + held[1]
    if rank == 0:
        torch.save({"peaks": peaks, "pieces": pieces}, f"{out}/held.pt")
    else:
        assert not peaks  # nothing is gathered to the other ranks
    dist.destroy_process_group()


def _layout(path) -> dict[str, list[str]]:
    """File name -> its tensor names, in order."""
    out = {}
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            out[file.name] = list(f.keys())
    return out


@pytest.mark.parametrize("size", [2, 3])
def test_sharded_save_streams_the_one_process_files_holding_one_file_at_most(sources, size, tmp_path):
    mp.spawn(_save_on_rank, args=(size, str(tmp_path / "store"), sources, str(tmp_path / "sharded")), nprocs=size)
    record = torch.load(tmp_path / "sharded" / "held.pt")
    assert record["peaks"] and max(record["peaks"]) <= MAX_SHARD_BYTES + max(record["pieces"])
    for key, path in sources.items():
        single = load_for_training(path, World())
        ckpt.save_model(single, tmp_path / "single" / key, max_shard_bytes=MAX_SHARD_BYTES)
        layout = _layout(tmp_path / "sharded" / key)
        assert len(layout) > 2 and layout == _layout(tmp_path / "single" / key)
        saved = load_model(tmp_path / "sharded" / key, mode="reference", mtp=key == "fp8").state_dict()
        expected = single.state_dict()
        assert saved.keys() == expected.keys()
        for name, t in expected.items():
            assert torch.equal(saved[name], t), (key, name)


def test_the_held_bytes_bound_fails_when_every_tensor_is_gathered_before_writing(sources, tmp_path, monkeypatch):
    """The measure of the test above sees a save that gathers the whole model before writing."""
    monkeypatch.setattr(weight_stream, "assign_files", lambda pieces, _max: [pieces])
    peaks, pieces = _recorded_save(load_for_training(sources["bf16"], World()), tmp_path, World())
    assert max(peaks) > MAX_SHARD_BYTES + max(pieces)


def _finetune(where: str, args: list[str]) -> None:
    """``flashdsa *args`` in this process ("one") or under torchrun on two ("two")."""
    if where == "one":
        assert main(args) == 0
    else:
        run = on_two_ranks(args)
        assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.parametrize("first, then", [("two", "one"), ("one", "two")])
def test_a_run_resumed_on_another_rank_count_continues_the_uninterrupted_one(first, then, tiny_model_dir, corpus,
                                                                             tmp_path):
    """Stopped after its first step (time limit) on one rank count, resumed on the other: the
    losses and the final weights (--keep-best: the best evaluated, restored per rank) are the
    uninterrupted one-process run's."""
    args = [*finetune_args(tiny_model_dir, corpus, tmp_path / "resumed", 32), "--keep-best", "--save-dtype", "float32"]
    _finetune("one", [*finetune_args(tiny_model_dir, corpus, tmp_path / "straight", 32), "--keep-best",
                      "--save-dtype", "float32"])
    _finetune(first, [*args, "--time-limit", "1e-6"])
    assert ckpt.latest_checkpoint(tmp_path / "resumed").name == "step-000001"
    _finetune(then, [*args, "--resume"])
    straight, resumed = losses(tmp_path / "straight"), losses(tmp_path / "resumed")
    assert len(resumed) == STEPS
    for a, b in zip(straight, resumed):
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=TOLERANCE), key
    expected = load_model(tmp_path / "straight", mode="reference").state_dict()
    for name, t in load_model(tmp_path / "resumed", mode="reference").state_dict().items():
        assert (t - expected[name]).abs().max() <= 1e-4 * expected[name].abs().max() + 1e-7, name


def test_a_checkpoint_with_the_optimizer_inside_its_trainer_state_still_resumes_bit_for_bit(tiny_model_dir, corpus,
                                                                                             tmp_path):
    straight = make_trainer(tiny_model_dir, corpus, tmp_path / "straight", "sparse", 4, save_every=2)
    straight.train()
    old = ckpt.checkpoint_dir(tmp_path / "old", 2)
    shutil.copytree(ckpt.checkpoint_dir(tmp_path / "straight", 2), old)
    loaded = make_trainer(tiny_model_dir, corpus, tmp_path / "old", "sparse", 4)  # the full state by name, as before
    state = torch.load(old / ckpt.TRAINER_STATE, weights_only=False)
    state["optimizer"] = get_optimizer_state_dict(loaded.model, loaded.optimizer,
                                                  options=StateDictOptions(full_state_dict=True))
    torch.save(state, old / ckpt.TRAINER_STATE)
    shutil.rmtree(old / ckpt.OPTIMIZER)
    resumed = make_trainer(tiny_model_dir, corpus, tmp_path / "old", "sparse", 4)
    assert resumed.step == 2
    resumed.train()
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
