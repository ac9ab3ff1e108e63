"""Byte layouts of the two caches, decoded field by field from raw bytes, and FP8 round trips.

FP8 bound used throughout (e4m3: 3 mantissa bits, round to nearest): every element satisfies
    |dequant(x) - x| <= 2^-4 * |x| + 2^-10 * scale
i.e. half an ulp relative to the value for normal e4m3 numbers (ulp = 2^-3 of the binade), and
half the subnormal spacing 2^-9 (times the scale) at the bottom. MLA scales are amax / 448, not
powers of two, so the fp32 division and multiplication add a relative 2^-22 of slack.
"""

import pytest
import torch

from flashdsa.runtime.cache import layout, write_indexer_cache
from flashdsa.runtime.cache.pool import indexer_pool
from flashdsa.runtime.indexer import hadamard_transform


@pytest.fixture(autouse=True)
def reference_backend(monkeypatch):
    """These tests pin down the reference ops; GPU backends are tested against them elsewhere."""
    monkeypatch.setenv("FLASHDSA_BACKEND", "reference")


def decode_e4m3(b: torch.Tensor) -> torch.Tensor:
    """Independent e4m3fn decoder from the bits: s.eeee.mmm, bias 7, no infinities."""
    b = b.long()
    sign = torch.where(b >> 7 == 1, -1.0, 1.0).double()
    exp, man = (b >> 3) & 15, (b & 7).double()
    normal = (1 + man / 8) * torch.exp2((exp - 7).double())
    value = torch.where(exp == 0, man * 2.0**-9, normal)
    return torch.where((exp == 15) & (b & 7 == 7), float("nan"), sign * value)


def decode_le(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Little-endian fp32 ([..., 4n] bytes) or bf16 ([..., 2n] bytes) -> float64, from the bits."""
    width = 4 if dtype == torch.float32 else 2
    b = b.long().unflatten(-1, (-1, width))
    bits = sum(b[..., i] << (8 * i) for i in range(width))
    if width == 2:
        bits = bits << 16  # bf16 is the top half of an fp32
    return bits.int().view(torch.float32).double()


def e4m3_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return 2.0**-4 * x.abs() + 2.0**-10 * scale


def random_rows(*shape, seed=0, dtype=torch.float32):
    """Normal values with per-row magnitudes spread over 1e-3..1e3 (subnormals in every row)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    x *= 10 ** (torch.rand(*shape[:-1], 1, generator=g, dtype=torch.float64) * 6 - 3)
    x[..., ::37] *= 1e-4  # a few tiny values that land in e4m3 subnormals
    return x.to(dtype)


def test_layout_constants_match_design():
    assert (layout.MLA_SCALE_OFFSET, layout.MLA_ROPE_OFFSET, layout.MLA_TOKEN_BYTES) == (512, 528, 656)
    assert (layout.INDEXER_TOKEN_BYTES, layout.BLOCK_SIZE, layout.D_QK) == (132, 64, 576)


def test_e4m3_decoder_agrees_with_torch_on_all_256_codes():
    codes = torch.arange(256, dtype=torch.uint8)
    ours, torchs = decode_e4m3(codes), codes.view(torch.float8_e4m3fn).double()
    assert torch.equal(ours.isnan(), torchs.isnan())
    assert torch.equal(ours.nan_to_num(), torchs.nan_to_num())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_token_bytes_field_by_field(dtype):
    c_kv = random_rows(37, 512, seed=1, dtype=dtype)
    k_pe = random_rows(37, 64, seed=2, dtype=dtype)
    raw = layout.quantize_mla(c_kv, k_pe)
    assert raw.dtype == torch.uint8 and raw.shape == (37, 656)

    tiles = c_kv.double().unflatten(-1, (4, 128))
    scales = decode_le(raw[:, 512:528], torch.float32)  # 4 fp32 little-endian
    assert torch.equal(scales, (tiles.float().abs().amax(-1) / 448).double())

    latent = decode_e4m3(raw[:, :512]).unflatten(-1, (4, 128)) * scales[..., None]
    err = (latent - tiles).abs()
    bound = e4m3_bound(tiles, scales[..., None]) * (1 + 2.0**-22)
    assert (err <= bound).all()
    assert (err / bound).max() > 0.5  # the bound is tight, so a wrong scale would fail

    assert torch.equal(decode_le(raw[:, 528:], torch.bfloat16), k_pe.bfloat16().double())


def test_mla_fields_and_dequantize_read_the_same_bytes():
    c_kv, k_pe = random_rows(5, 512, seed=3), random_rows(5, 64, seed=4)
    raw = layout.quantize_mla(c_kv, k_pe)
    latent, scales, pe = layout.mla_fields(raw)
    assert torch.equal(latent.view(torch.uint8), raw[:, :512])
    assert torch.equal(scales.double(), decode_le(raw[:, 512:528], torch.float32))
    assert torch.equal(pe.double(), decode_le(raw[:, 528:], torch.bfloat16))
    expect = decode_e4m3(raw[:, :512]).unflatten(-1, (4, 128)) * scales.double()[..., None]
    full = layout.dequantize_mla(raw)
    assert full.shape == (5, 576)
    torch.testing.assert_close(full[:, :512].double(), expect.flatten(-2), rtol=2.0**-23, atol=0)
    assert torch.equal(full[:, 512:], k_pe.bfloat16().float())


def test_all_zero_mla_token_dequantizes_to_zero_with_finite_scales():
    raw = layout.quantize_mla(torch.zeros(2, 512), torch.zeros(2, 64))
    assert torch.isfinite(layout.mla_fields(raw)[1]).all()
    assert torch.equal(layout.dequantize_mla(raw), torch.zeros(2, 576))


def test_indexer_key_scales_are_powers_of_two_and_round_trip_within_bound():
    k = random_rows(300, 128, seed=5)
    q, scale = layout.quantize_indexer_key(k)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (300,)
    mantissa, _ = torch.frexp(scale)
    assert (mantissa == 0.5).all()
    amax = k.abs().amax(-1).clamp_min(1e-4).double()
    assert (scale.double() >= amax / 448).all() and (scale.double() / 2 < amax / 448).all()
    back = decode_e4m3(q.view(torch.uint8)) * scale.double()[:, None]
    err, bound = (back - k.double()).abs(), e4m3_bound(k.double(), scale.double()[:, None])
    assert (err <= bound).all() and (err / bound).max() > 0.5


@pytest.mark.parametrize("block_size", [64, 16])
def test_indexer_block_views_address_keys_then_scales(block_size):
    g = torch.Generator().manual_seed(6)
    pool = torch.randint(0, 256, (3, block_size, 1, 132), generator=g, dtype=torch.uint8)
    keys, scales = layout.indexer_block_views(pool)
    assert keys.shape == (3, block_size, 128) and scales.shape == (3, block_size)
    flat = pool.view(3, -1)
    for b in range(3):
        for j in (0, 1, block_size - 1):
            assert torch.equal(keys[b, j].view(torch.uint8), flat[b, j * 128 : (j + 1) * 128])
            at = block_size * 128 + 4 * j
            expect = decode_le(flat[b, at : at + 4], torch.float32)
            assert torch.equal(scales[b, j : j + 1].double().nan_to_num(), expect.nan_to_num())


def test_indexer_cache_block_holds_64_keys_then_64_scales():
    k = random_rows(64, 128, seed=7)
    pool = indexer_pool(2, "cpu")
    write_indexer_cache(k, pool, torch.arange(64, 128))  # fills block 1 in order
    block = pool[1].flatten()
    q, scale = layout.quantize_indexer_key(hadamard_transform(k))
    assert torch.equal(block[: 64 * 128], q.view(torch.uint8).flatten())
    assert torch.equal(decode_le(block[64 * 128 :], torch.float32), scale.double())
    assert torch.equal(pool[0], torch.zeros_like(pool[0]))
