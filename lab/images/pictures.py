"""The test site's pictures: deterministic PNGs from a small encoder (no imaging library), so the
site in every image is the same byte for byte, whatever machine built it."""

from __future__ import annotations

import random
import struct
import zlib


def png(width: int, height: int, seed: int) -> bytes:
    """A deterministic RGB PNG: a gradient, a few bars and mild noise (compresses like a picture)."""
    rng = random.Random(seed)
    base = [rng.randrange(40, 200) for _ in range(3)]
    bars = [
        (
            rng.randrange(width),
            rng.randrange(8, max(9, width // 8)),
            rng.randrange(height),
            [rng.randrange(256) for _ in range(3)],
        )
        for _ in range(6)
    ]
    noise = rng.randbytes(width * height)
    rows = bytearray()
    for y in range(height):
        rows.append(0)
        for x in range(width):
            n = noise[y * width + x] & 15
            r = (base[0] + x * 90 // width + n) & 255
            g = (base[1] + y * 90 // height + n) & 255
            b = (base[2] + (x + y) * 40 // (width + height) + n) & 255
            for bx, bw, top, col in bars:
                if bx <= x < bx + bw and y >= top:
                    r, g, b = col[0] ^ n, col[1] ^ n, col[2] ^ n
                    break
            rows += bytes((r, g, b))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(bytes(rows), 9))
        + chunk(b"IEND", b"")
    )
