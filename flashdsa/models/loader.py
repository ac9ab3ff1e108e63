"""Load a Hugging Face DeepSeek-V3.2 checkpoint (config.json + safetensors) into flashdsa.

Single files (``model.safetensors``) and shards (``model.safetensors.index.json``) are read one
file at a time. Tensor names are the checkpoint's own. FP8 e4m3 weights come with a
``<name>_scale_inv`` fp32 tensor holding one scale per 128x128 block; they stay e4m3 in memory
(w = e4m3 * scale per GEMM), except the few layers ``FP8_EXEMPT`` keeps in floating point. The
multi-token-prediction layer stored after the main stack is loaded with ``mtp=True`` (as
``model.mtp``, see ``models/mtp.py``) and skipped otherwise.

Under tensor/expert parallelism each rank reads only its own slices (``safe_open(...).get_slice``,
see ``flashdsa.runtime.parallel.sharding``), an FP8 weight together with the rows/columns of its
block scales, so no rank ever holds the whole model.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from flashdsa.models.config import DeepseekV32Config
from flashdsa.models.deepseek_v32 import DeepseekV32ForCausalLM
from flashdsa.models.linear import SCALE_SUFFIX
from flashdsa.models.mtp import add_mtp_layer, model_name
from flashdsa.runtime.fp8 import E4M3
from flashdsa.runtime.gemm import quantize_weight
from flashdsa.runtime.parallel.shard import Shard
from flashdsa.runtime.parallel.sharding import Placement, placement

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of the checkpoint directory ``path``."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise ValueError(f"{index} lists shards that do not exist: {missing}")
        return [path / n for n in names]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    raise ValueError(f"no model.safetensors or model.safetensors.index.json in {path}")


def dequantize_blocks(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                      start: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """``w: [m, n]`` e4m3, the part of a weight whose first element is at row/column ``start``, with
    ``scale_inv``, the fp32 128x128 block scales covering it (``[ceil(m/bm), ceil(n/bn)]`` from
    ``start`` 0) -> fp32 ``[m, n]``: element (r, c) of the weight is scaled by block (r // bm, c // bn),
    so a part equals the same rows/columns of the whole weight dequantized, bit for bit."""
    m, n = w.shape
    bm, bn = block
    r0, c0 = start[0] % bm, start[1] % bn  # where the part starts inside its first block
    expected = (-(-(r0 + m) // bm), -(-(c0 + n) // bn))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"scale_inv for a {list(w.shape)} weight at {list(start)} must be {list(expected)}, got "
                         f"{list(scale_inv.shape)}")
    scale = scale_inv.float().repeat_interleave(bm, 0)[r0:r0 + m].repeat_interleave(bn, 1)[:, c0:c0 + n]
    return w.float() * scale


def _along(dim: int, rows: slice) -> tuple[slice, ...]:
    """The index of ``rows`` along dimension ``dim`` (the dimensions before it whole)."""
    return (slice(None),) * dim + (rows,)


def _read_slice(f, name: str, at: Placement, scale_of=None, block: tuple[int, int] = (128, 128)):
    """``(tensor, scale or None)``: the part ``at`` of tensor ``name`` of the open file ``f``, and no
    other element of it. An e4m3 weight (``scale_of(index)`` reads its scale blocks) cut on whole
    blocks comes with the scales of its blocks; cut inside a block it comes dequantized (float, no
    scale), each element by its own block's scale."""
    part = f.get_slice(name)
    if at.dim is None:
        return part[:], None if scale_of is None else scale_of((slice(None), slice(None)))
    t = part[_along(at.dim, slice(at.start, at.stop))]
    if scale_of is None:
        return t, None
    b = block[at.dim]
    scale = scale_of(_along(at.dim, slice(at.start // b, -(-at.stop // b))))
    if at.start % b == 0 and (at.stop % b == 0 or at.stop == part.get_shape()[at.dim]):
        return t, scale
    return dequantize_blocks(t, scale, block, (at.start, 0) if at.dim == 0 else (0, at.start)), None


class Checkpoint:
    """The safetensors files of a DeepSeek-V3.2 checkpoint directory and where each tensor lies:
    what every loader walks (whole, per tensor-parallel rank or per FSDP shard), one file at a time."""

    def __init__(self, path: str | Path, config: DeepseekV32Config):
        self.path, self.config = Path(path), config
        self.files = checkpoint_files(self.path)
        self.block = config.weight_block_size or (128, 128)
        self.where: dict[str, Path] = {}  # tensor name -> file holding it
        for file in self.files:
            with safe_open(file, framework="pt") as f:
                self.where.update((name, file) for name in f.keys())

    def weights(self, mtp: bool = False, progress: bool = True):
        """Yield ``(open file, checkpoint name, model's name)`` for every main-model weight (the
        scales go with their weights); with ``mtp`` also the first MTP layer's (``model.mtp.*``).
        Skipped tensors are logged once."""
        config, skipped = self.config, 0
        for file in tqdm(self.files, desc="loading shards", unit="file", leave=False, disable=not progress):
            with safe_open(file, framework="pt") as f:
                for name in sorted(f.keys()):
                    layer = _LAYER.match(name)
                    own = model_name(name, config) if mtp else name
                    if own is None or (layer and int(layer.group(1)) >= config.num_hidden_layers and not mtp):
                        skipped += 1
                        continue
                    if name.endswith(SCALE_SUFFIX):
                        if name[: -len(SCALE_SUFFIX)] not in self.where:
                            raise ValueError(f"{file.name}: {name} has no weight {name[: -len(SCALE_SUFFIX)]}")
                        continue
                    yield f, name, own
        if skipped:
            logger.info("skipped %d tensors of the multi-token-prediction layer(s)%s", skipped,
                        " (copies of the embedding and lm_head, deeper MTP layers)" if mtp else " (not loaded)")

    def read(self, f, name: str, at: Placement) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(tensor, scale or None)``: the part ``at`` of weight ``name`` of the open file ``f``, an
        e4m3 weight with the rows/columns of its block scales (see :func:`_read_slice`)."""
        scale_of = None
        if f.get_slice(name).get_dtype() == "F8_E4M3":
            if name + SCALE_SUFFIX not in self.where:
                raise ValueError(f"{self.where[name].name}: FP8 tensor {name} has no {name + SCALE_SUFFIX}")
            scale_of = _scale_reader(self.where[name + SCALE_SUFFIX], name + SCALE_SUFFIX)
        return _read_slice(f, name, at, scale_of, self.block)


def read_raw_tensors(path: str | Path, config: DeepseekV32Config, shard: Shard = Shard(), mtp: bool = False):
    """Yield ``(name, tensor, scale_inv or None)`` for every main-model weight of the checkpoint, as
    stored (an e4m3 weight's scale may sit in another shard); with ``mtp`` also the first MTP
    layer's, under the model's names (``model.mtp.*``).
    With a ``shard``, only this rank's part of each tensor is read, under the model's name for it."""
    checkpoint = Checkpoint(path, config)
    for f, name, own in checkpoint.weights(mtp, progress=shard.rank == 0):
        at = placement(own, f.get_slice(name).get_shape(), shard, config.n_routed_experts)
        if at is not None:  # None: another rank's expert
            yield (at.name, *checkpoint.read(f, name, at))


def _scale_reader(file: Path, name: str):
    """A function reading ``index`` (a pair of slices) of the scale tensor ``name`` in ``file``."""
    def read(index: tuple[slice, slice]) -> torch.Tensor:
        with safe_open(file, framework="pt") as g:
            return g.get_slice(name)[index]
    return read


def read_tensors(path: str | Path, config: DeepseekV32Config | None = None, mtp: bool = False):
    """Yield ``(name, tensor)`` for every main-model tensor (with ``mtp`` the MTP layer's too, as in
    :func:`read_raw_tensors`), FP8 weights dequantized to fp32."""
    config = config or DeepseekV32Config.from_json(path)
    block = config.weight_block_size or (128, 128)
    for name, t, scale in read_raw_tensors(path, config, mtp=mtp):
        yield name, (t if scale is None else dequantize_blocks(t, scale, block))


def checkpoint_is_fp8(path: Path) -> bool:
    """Whether the checkpoint holds block-scaled e4m3 weights (any ``*_scale_inv`` tensor)."""
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            if any(name.endswith(SCALE_SUFFIX) for name in f.keys()):
                return True
    return False


@torch.no_grad()
def copy_weight(dest: torch.Tensor, dest_scale: torch.Tensor | None, t: torch.Tensor, scale: torch.Tensor | None,
                 block: tuple[int, int]) -> None:
    """Write checkpoint tensor ``t`` (e4m3 with ``scale``, or float) into ``dest`` in its precision:
    e4m3 copied as is, a float weight quantized into an e4m3 destination, e4m3 dequantized into a
    float one (kv_b_proj, or a model built without FP8)."""
    t = t.to(dest.device)
    if dest.dtype == E4M3:
        if t.dtype != E4M3:
            t, scale = quantize_weight(t)
        dest.copy_(t)
        dest_scale.copy_(scale)
        return
    if t.dtype == E4M3:
        t = dequantize_blocks(t, scale.to(dest.device), block)
    dest.copy_(t)


def load_model(
    path: str | Path, device: str | torch.device = "cpu", mode: str = "production", quantization: str | None = None,
    shard: Shard = Shard(), mtp: bool = False, keep_fp8: bool = True,
) -> DeepseekV32ForCausalLM:
    """Build a :class:`DeepseekV32ForCausalLM` from the checkpoint directory ``path``; with ``mtp``
    also its multi-token-prediction layer (ValueError if the checkpoint has none).

    FP8 checkpoints keep their e4m3 weights and scales (one byte a weight in memory) unless
    ``keep_fp8`` is False (training: every weight dequantized to the mode's float); a bf16
    checkpoint is quantized to them at load with ``quantization="fp8"``. The weights stream one
    tensor at a time into the model's own storage on ``device``, so no second copy is ever held.
    With a ``shard`` (tensor/expert parallelism) only this rank's part is built and read.
    Raises ValueError naming every missing, unexpected or mis-shaped tensor.
    """
    path = Path(path)
    config = DeepseekV32Config.from_json(path)
    if mtp and config.num_nextn_predict_layers < 1:
        raise ValueError(f"checkpoint {path} has no multi-token-prediction layer (num_nextn_predict_layers 0): "
                         "train one with `flashdsa finetune --add-mtp-layer`")
    if quantization is None and keep_fp8 and checkpoint_is_fp8(path):
        quantization = "fp8"
    with torch.device("meta"):
        model = DeepseekV32ForCausalLM(config, mode, quantization, shard)
        if mtp:
            add_mtp_layer(model)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        t.data = t.data.to(model.param_dtype(name, t.dtype))
    model.to_empty(device=device)
    block = config.weight_block_size or (128, 128)
    dests = model.state_dict(keep_vars=True)  # checkpoint names -> views of the model's storage
    expected = {n for n in dests if not n.endswith(SCALE_SUFFIX)}
    loaded, unexpected, misshaped = set(), [], []
    for name, t, scale in read_raw_tensors(path, config, shard, mtp):
        if name not in expected:
            unexpected.append(name)
        elif t.shape != dests[name].shape:
            misshaped.append(f"{name}: expected {list(dests[name].shape)}, got {list(t.shape)}")
        else:
            copy_weight(dests[name].data, _data(dests.get(name + SCALE_SUFFIX)), t, scale, block)
            loaded.add(name)
    check_complete(path, expected, loaded, unexpected, misshaped)
    return model.eval()


def check_complete(path: Path, expected: set[str], loaded: set[str], unexpected: list[str],
                   misshaped: list[str], model: str = "DeepSeek-V3.2") -> None:
    """ValueError naming every tensor of ``expected`` not ``loaded``, every ``unexpected`` one and
    the ``misshaped`` ones (``"name: expected ..., got ..."``), and the ``model`` the checkpoint
    does not match; nothing when all is well."""
    missing = sorted(expected - loaded - {m.split(":")[0] for m in misshaped})
    problems = [
        f"{label} ({len(names)}): {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}"
        for label, names in (("missing", missing), ("unexpected", sorted(unexpected)), ("mis-shaped", misshaped))
        if names
    ]
    if problems:
        raise ValueError(f"checkpoint {path} does not match the {model} model: " + "; ".join(problems))


def _data(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.data
