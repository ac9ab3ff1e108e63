"""Model weights written in the Hugging Face layout straight from FSDP2 shards, one tensor at a time.

No host ever holds the whole model: the names, shapes and dtypes of every output tensor, and so
the split into ``model-0000i-of-0000n.safetensors`` files, are worked out on a weightless (meta)
copy of the model, which applies the architecture's own export (per-expert names, MTP copies,
the V4 release names) to meta tensors. Then each output tensor is gathered to rank 0 alone, point
to point from the ranks holding its rows (a routed expert's matrix comes from the one rank whose
rows hold that expert), cast, and kept until its file is full; the file is written under a
temporary name and renamed (``safe_io``). So rank 0 holds at most one output file's tensors
(``max_shard_bytes``, or one tensor past it) plus the tensor in flight; the other ranks hold
nothing beyond their shards and the rows they send. One process runs the same code, where a
"gather" is a view of its own tensor.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from flashdsa.models import mtp
from flashdsa.models.moe import Experts
from flashdsa.train.architecture import export, is_v4, skeleton
from flashdsa.train.distributed import World, own_rows, row_ranges
from flashdsa.train.safe_io import atomic_path, write_text


@dataclass(frozen=True)
class Piece:
    """An output tensor: ``name`` in the file, read from rows ``rows`` of the model tensor
    ``source`` (its module path), or of expert ``expert`` of it when stacked, written as ``like``
    (a meta tensor: shape and dtype)."""

    name: str
    source: str
    expert: Optional[int]
    rows: slice
    like: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.like.numel() * self.like.element_size()


def plan(model, dtype: Optional[torch.dtype]) -> tuple[dict, list[Piece]]:
    """(config.json dict, the output tensors in file order) of ``model`` saved in ``dtype`` (None:
    as trained), read off a weightless copy: no weight is touched."""
    config, tensors = export(model, skeleton(model).state_dict(), dtype)
    source = _v4_source if is_v4(model) else _v32_sources(model)
    return config, [Piece(name, *source(name, like), like=like) for name, like in tensors.items()]


def _v4_source(name: str, like: torch.Tensor) -> tuple:
    """(model tensor, expert, rows) of an official V4 tensor: ``w1`` / ``w3`` are the halves of an
    expert's ``gate_up_proj``."""
    from flashdsa.models.deepseek_v4_loader import model_name

    own, expert, half = model_name(name)
    rows = slice(None) if half is None else slice(half * like.shape[0], (half + 1) * like.shape[0])
    return own, expert, rows


def _v32_sources(model):
    """Checkpoint name -> (model tensor, expert, rows) for a V3.2 model: the MTP layer's names and
    copies (``flashdsa.models.mtp``), the routed experts' per-expert names (``Experts.slices``)."""
    experts = {f"{path}.{suffix}": (f"{path}.{stacked}", e, rows) for path, module in model.named_modules()
               if isinstance(module, Experts) for suffix, (stacked, e, rows) in module.slices.items()}
    copies = {mtp.checkpoint_name("model." + mtp.MTP_PREFIX + copy, model.config): main
              for copy, main in mtp.SHARED_COPY_OF.items()}

    def source(name: str, _like: torch.Tensor) -> tuple:
        own = copies.get(name) or mtp.model_name(name, model.config)
        return experts.get(own, (own, None, slice(None)))

    return source


def assign_files(pieces: list[Piece], max_shard_bytes: int) -> list[list[Piece]]:
    """The pieces split in order into files of at most ``max_shard_bytes`` (a larger piece alone)."""
    files: list[list[Piece]] = [[]]
    size = 0
    for piece in pieces:
        if files[-1] and size + piece.nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(piece)
        size += piece.nbytes
    return files


def gather(tensor: torch.Tensor, piece: Piece, world: World) -> Optional[torch.Tensor]:
    """Rank 0: the piece's rows of ``tensor`` (its expert's when stacked), whole, on this rank's
    device; None elsewhere. Every rank calls it; only the ranks holding some of those rows send
    them, to rank 0 alone. A tensor that is not a DTensor is whole here: a view of it."""
    first = slice(None) if piece.expert is None else slice(piece.expert, piece.expert + 1)
    if not isinstance(tensor, DTensor):
        return _cut(tensor.detach(), first, piece) if world.is_main else None
    local, start, _ = own_rows(tensor)
    want = range(tensor.shape[0])[first]
    spans = [(rank, max(lo, want.start), min(hi, want.stop))
             for rank, (lo, hi) in enumerate(row_ranges(tensor.shape[0], world.size)) if lo < want.stop and want.start < hi]
    if world.is_main:
        parts = []
        for rank, lo, hi in spans:
            if rank == world.rank:
                parts.append(_cut(local.detach(), slice(lo - start, hi - start), piece))
            else:
                shape = (hi - lo, *(tensor.shape[1:] if piece.expert is None else piece.like.shape))
                parts.append(torch.empty(shape, dtype=tensor.dtype, device=local.device))
                dist.recv(parts[-1], rank)
        return parts[0] if len(parts) == 1 else torch.cat(parts)
    for rank, lo, hi in spans:
        if rank == world.rank:
            dist.send(_cut(local.detach(), slice(lo - start, hi - start), piece).contiguous(), 0)
    return None


def _cut(tensor: torch.Tensor, first: slice, piece: Piece) -> torch.Tensor:
    """``tensor[first]`` then, for an expert, its ``piece.rows`` (keeping the leading dim)."""
    t = tensor[first]
    return t if piece.expert is None else t[:, piece.rows]


def write_weights(model, output_dir: Path, dtype: Optional[torch.dtype], max_shard_bytes: int, world: World) -> dict:
    """Write ``model``'s weights to ``output_dir`` (rank 0; every rank must call this) as one
    ``model.safetensors``, or shards + ``model.safetensors.index.json`` past ``max_shard_bytes``;
    weight files of an earlier save that this one does not use are removed once the new ones are
    in place. Returns the config.json dict."""
    config, pieces = plan(model, dtype)
    files = assign_files(pieces, max_shard_bytes)
    names = ["model.safetensors"] if len(files) == 1 else [
        f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    tensors = dict([*model.named_parameters(), *model.named_buffers()])
    stale = set(output_dir.glob("model*.safetensors")) | set(output_dir.glob("model.safetensors.index.json"))
    for name, file in zip(names, files):
        held, addresses = {}, set()
        for piece in file:
            t = gather(tensors[piece.source], piece, world)
            if t is not None:
                t = t.reshape(piece.like.shape).to("cpu", piece.like.dtype).contiguous()
                if t.data_ptr() in addresses:  # a second name for one tensor (the MTP layer's copies): own memory
                    t = t.clone()
                addresses.add(t.data_ptr())
                held[piece.name] = t
        if world.is_main:
            with atomic_path(output_dir / name) as temporary:
                save_file(held, str(temporary), metadata={"format": "pt"})
    if not world.is_main:
        return config
    written = {output_dir / name for name in names}
    if len(files) > 1:
        weight_map = {piece.name: name for name, file in zip(names, files) for piece in file}
        index = {"metadata": {"total_size": sum(p.nbytes for p in pieces)}, "weight_map": weight_map}
        write_text(output_dir / "model.safetensors.index.json", json.dumps(index, indent=2) + "\n")
        written.add(output_dir / "model.safetensors.index.json")
    for path in stale - written:
        path.unlink()
    return config
