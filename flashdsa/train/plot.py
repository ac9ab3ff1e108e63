"""Loss curves as a PNG without a plotting library: a tiny rasteriser and a stdlib PNG encoder.

The canvas is a uint8 tensor ``[H, W, 3]``; lines are drawn by dense sampling, labels with a
3x5 bitmap font (digits, a few letters and signs), and the PNG is written with ``zlib`` + ``struct``.
"""

from __future__ import annotations

import math
import struct
import zlib
from pathlib import Path
from typing import Sequence

import torch

Series = tuple[str, Sequence[tuple[float, float]], tuple[int, int, int]]  # label, (x, y) points, RGB

# 3x5 glyphs, one string of 15 bits per character (rows top to bottom, 3 columns each).
_FONT = {
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
    "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001010010010",
    "8": "111101111101111", "9": "111101111001111", ".": "000000000000010", "-": "000000111000000",
    "e": "000111111100111", "a": "000111011101111", "i": "010000010010010", "l": "110010010010111",
    "n": "000110101101101", "r": "000111100100100", "s": "000011010001110", "t": "010111010010011",
    "v": "000101101101010", "o": "000111101101111", "p": "000111101111100", "x": "000101010101101",
    "d": "001001111101111", "g": "000111101011110", "m": "000111111101101", "u": "000101101101111",
    "k": "100101110101101", " ": "000000000000000", ":": "000010000010000", "=": "000111000111000",
    "w": "000101101111111", "c": "000111100100111", "h": "100100111101101", "y": "000101011001110",
    "b": "100100111101111", "f": "011100110100100",
}

WIDTH, HEIGHT, MARGIN = 640, 400, 40
BACKGROUND, AXES, GRID = (255, 255, 255), (0, 0, 0), (225, 225, 225)


def _text(canvas: torch.Tensor, x: int, y: int, text: str, color, scale: int = 2) -> None:
    for i, ch in enumerate(text.lower()):
        bits = _FONT.get(ch, _FONT[" "])
        for k, bit in enumerate(bits):
            if bit == "1":
                px, py = x + (i * 4 + k % 3) * scale, y + (k // 3) * scale
                canvas[py : py + scale, px : px + scale] = torch.tensor(color, dtype=torch.uint8)


def _line(canvas: torch.Tensor, x0: float, y0: float, x1: float, y1: float, color) -> None:
    steps = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
    t = torch.linspace(0, 1, steps + 1)
    xs = (x0 + (x1 - x0) * t).round().long().clamp(0, canvas.shape[1] - 2)
    ys = (y0 + (y1 - y0) * t).round().long().clamp(0, canvas.shape[0] - 2)
    rgb = torch.tensor(color, dtype=torch.uint8)
    for dx in (0, 1):  # two pixels thick
        canvas[ys, xs + dx] = rgb


def render(series: Sequence[Series], width: int = WIDTH, height: int = HEIGHT) -> torch.Tensor:
    """Draw each series as a polyline on shared axes; returns ``[height, width, 3]`` uint8."""
    canvas = torch.tensor(BACKGROUND, dtype=torch.uint8).expand(height, width, 3).clone()
    points = [p for _, pts, _ in series for p in pts if math.isfinite(p[1])]
    if not points:
        return canvas
    x_lo, x_hi = min(p[0] for p in points), max(p[0] for p in points)
    y_lo, y_hi = min(p[1] for p in points), max(p[1] for p in points)
    x_hi, y_hi = max(x_hi, x_lo + 1e-9), max(y_hi, y_lo + 1e-9)
    left, right, top, bottom = MARGIN + 20, width - 10, 10, height - MARGIN

    def to_px(x: float, y: float) -> tuple[float, float]:
        px = left + (x - x_lo) / (x_hi - x_lo) * (right - left)
        return px, bottom - (y - y_lo) / (y_hi - y_lo) * (bottom - top)

    for k in range(5):  # horizontal grid lines with their y values
        y = y_lo + (y_hi - y_lo) * k / 4
        _, py = to_px(x_lo, y)
        _line(canvas, left, py, right, py, GRID)
        _text(canvas, 2, int(py) - 5, f"{y:.2f}"[:6], AXES)
    _line(canvas, left, top, left, bottom, AXES)
    _line(canvas, left, bottom, right, bottom, AXES)
    _text(canvas, left, bottom + 8, f"{x_lo:g}", AXES)
    _text(canvas, right - 40, bottom + 8, f"{x_hi:g}"[:6], AXES)
    legend_x = left + 10
    for label, pts, color in series:
        finite = [p for p in pts if math.isfinite(p[1])]
        for (xa, ya), (xb, yb) in zip(finite, finite[1:]):
            _line(canvas, *to_px(xa, ya), *to_px(xb, yb), color)
        if len(finite) == 1:
            _text(canvas, *map(int, to_px(*finite[0])), "x", color)
        _text(canvas, legend_x, height - 14, label, color)
        legend_x += 8 * len(label) + 24
    return canvas


def encode_png(image: torch.Tensor) -> bytes:
    """PNG bytes of an RGB ``[H, W, 3]`` uint8 image (filter type 0 on every row)."""
    height, width, _ = image.shape
    rows = torch.cat([torch.zeros(height, 1, dtype=torch.uint8), image.reshape(height, width * 3)], dim=1)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    body = zlib.compress(bytes(rows.flatten().tolist()), 9)  # no numpy needed
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", body) + chunk(b"IEND", b"")


def save_loss_png(path: str | Path, series: Sequence[Series]) -> None:
    """Render ``series`` and write the PNG to ``path``."""
    Path(path).write_bytes(encode_png(render(series)))
