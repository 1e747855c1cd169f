"""The chained hash of a full KV block: the prefix cache's key, and the DP router's."""

from __future__ import annotations

import struct
from hashlib import blake2b


def hash_block_tokens(parent_hash: bytes, token_ids: list[int]) -> bytes:
    """Chained block hash: blake2b-128 over the parent hash and the tokens as int64 LE.

    The first block's parent hash is ``b""``; equal hashes mean equal KV contents (the same
    tokens in this block and in every block before it).
    """
    packed = struct.pack(f"<{len(token_ids)}q", *token_ids)
    return blake2b(parent_hash + packed, digest_size=16).digest()


def prompt_block_hashes(
    token_ids: list[int], block_size: int, max_blocks: int, seed: bytes = b""
) -> list[bytes]:
    """The chained hashes of the prompt's leading full blocks (at most `max_blocks`); `seed`
    is the first block's parent (a LoRA adapter's salt: its blocks are other blocks)."""
    hashes: list[bytes] = []
    parent = seed
    for start in range(0, min(len(token_ids) // block_size, max_blocks) * block_size, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
