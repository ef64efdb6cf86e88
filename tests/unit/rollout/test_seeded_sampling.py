"""The CPU stand-in for SGLang's seeded-sampling hash, and seeded Gumbel-max sampling built on it."""

from __future__ import annotations

import struct

import torch

from megagrpo.compat.sglang_cpu import murmur_hash32_torch


def murmur3_x86_32(data: bytes, seed: int = 0) -> int:
    """Scalar MurmurHash3 x86_32 (Appleby), the reference the vectorised stand-in must reproduce."""
    m = 0xFFFFFFFF
    h = seed
    n = len(data) // 4
    for i in range(n):
        (k,) = struct.unpack_from("<I", data, 4 * i)
        k = (k * 0xCC9E2D51) & m
        k = ((k << 15) | (k >> 17)) & m
        k = (k * 0x1B873593) & m
        h ^= k
        h = ((h << 13) | (h >> 19)) & m
        h = (h * 5 + 0xE6546B64) & m
    tail = data[4 * n :]
    k = 0
    for j, b in enumerate(tail):
        k |= b << (8 * j)
    if tail:
        k = (k * 0xCC9E2D51) & m
        k = ((k << 15) | (k >> 17)) & m
        k = (k * 0x1B873593) & m
        h ^= k
    h ^= len(data)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & m
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & m
    return h ^ (h >> 16)


def test_reference_matches_published_vectors():
    assert murmur3_x86_32(b"", 0) == 0
    assert murmur3_x86_32(b"", 1) == 0x514E28B7
    assert murmur3_x86_32(b"", 0xFFFFFFFF) == 0x81F16F39
    assert murmur3_x86_32(b"\0\0\0\0", 0) == 0x2362F9DE
    assert murmur3_x86_32(b"aaaa", 0x9747B28C) == 0x5A97808A
    assert murmur3_x86_32(b"Hello, world!", 0x9747B28C) == 0x24884CBA


def test_stand_in_hashes_seed_position_column_like_the_reference():
    seeds = torch.tensor([0, 1, 42, 2**32 + 7, 2**47 - 3], dtype=torch.int64)
    positions = torch.tensor([0, 5, 17, 1023, 4], dtype=torch.int64)
    cols = torch.arange(0, 300, 7)
    got = murmur_hash32_torch(seeds.to(torch.uint64), positions, cols)
    assert got.shape == (5, cols.numel()) and got.dtype == torch.int64
    for i, (s, p) in enumerate(zip(seeds.tolist(), positions.tolist())):
        for j, c in enumerate(cols.tolist()):
            key = struct.pack("<IIII", s & 0xFFFFFFFF, s >> 32, p, c)
            assert int(got[i, j]) == murmur3_x86_32(key), (s, p, c)


def test_seeded_gumbel_max_samples_the_distribution_and_repeats_per_seed():
    """Gumbel-max with the hash as the uniform source (what SGLang's multinomial_with_seed does): one draw
    per (seed, position); over many seeds the frequencies follow the probabilities."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    n = 20000
    seeds = torch.arange(n, dtype=torch.int64) * 7919 + 11
    positions = torch.full((n,), 3, dtype=torch.int64)

    def draw(seeds):
        u = murmur_hash32_torch(seeds, positions[: seeds.numel()], torch.arange(4)).to(torch.float64)
        u = (u / 0xFFFFFFFF).clamp(1e-300, 1 - 2**-32)
        return torch.argmax(probs.log() - (-u.log()).log(), dim=1)

    first = draw(seeds)
    freq = torch.bincount(first, minlength=4).double() / n
    assert torch.allclose(freq, probs, atol=0.015), freq
    assert torch.equal(draw(seeds[:100]), first[:100])  # same seed and position: same token
