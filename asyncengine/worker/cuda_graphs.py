"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

On a GPU a small model's decode step is a few hundred kernel launches of microseconds each;
run eagerly, the host's Python and launch overhead (about 20 ms a step for Qwen2.5-0.5B through
transformers) dwarfs the GPU's work. A captured graph replays every launch of the step in one
call.

A decode-only step (every scheduled request gets one token, and that token's logits are
sampled) of B requests replays the graph of the smallest bucket P >= B (`capture_sizes`: 1, 2,
4, 8, ... up to the bucket holding `max_num_seqs`, at most MAX_CAPTURE_SIZE rows). The graph
reads its inputs from persistent device buffers that each step overwrites, through pinned host
staging and non-blocking copies:

- rows B..P-1 are padding: token 0 at position 0, slot -1 (the cache write skips it), one key
  (block 0, slot 0: attended, never written), so every padded row stays finite;
- the attention plan is fixed at capture: every row a decode, the grid sized for the longest
  context (`max_model_len`), so the kernels read each row's real length from `seq_lens`;
- the graph's output is the [P, V] logits; the caller samples rows 0..B-1 eagerly.

Prefill and mixed steps stay eager. Graphs are captured with the Triton attention backend only
(its plan has no host-side shapes), on one device (no tensor parallel).

`DecodeGraphs(capture=False)` runs the same padded, persistent-buffer forward eagerly: on a CPU
(Triton's interpreter) it tests everything but the capture itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np
import torch

from asyncengine.model.attention import AttentionMetadata, get_backend
from asyncengine.model.interface import ModelForward

logger = logging.getLogger(__name__)

# The largest batch captured: bigger decode batches run eagerly (their launch overhead is
# then a small share of the step), and each graph's memory and capture time grow with it.
MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch-size buckets to capture: powers of two from 1 up to the first that holds
    `max_num_seqs` (or MAX_CAPTURE_SIZE)."""
    sizes = [1]
    while sizes[-1] < min(max_num_seqs, MAX_CAPTURE_SIZE):
        sizes.append(sizes[-1] * 2)
    return sizes


class DecodeGraphs:
    """Persistent decode inputs and, on CUDA, one captured graph per bucket."""

    def __init__(
        self,
        model: ModelForward,
        kv_caches: list[torch.Tensor],
        *,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        device: torch.device,
        capture: bool = True,
    ) -> None:
        from asyncengine.kernels.paged_attention_triton import TritonAttentionPlan

        self._plan_cls = TritonAttentionPlan
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = device
        self.capture = capture
        self.backend = get_backend("triton", device)
        self.sizes = capture_sizes(max_num_seqs)
        rows = self.sizes[-1]
        self.max_blocks = -(-max_model_len // block_size)

        def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        # Step inputs, overwritten before each replay.
        self.input_ids = zeros(rows)
        self.positions = zeros(rows)
        self.slot_mapping = torch.full((rows,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(rows, dtype=torch.int32, device=device)
        self.block_table = zeros(rows, self.max_blocks, dtype=torch.int32)
        # Fixed for every step: row i is decode i, one query token each.
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self.decode_seqs = torch.arange(rows, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(rows, dtype=torch.int64, device=device)
        self.no_tiles = zeros(0, 2, dtype=torch.int32)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def bucket(self, num_rows: int) -> int:
        """The smallest captured size that holds `num_rows` (<= max_size)."""
        for size in self.sizes:
            if size >= num_rows:
                return size
        raise ValueError(f"{num_rows} decode rows: the largest bucket is {self.max_size}")

    # ---- capture ------------------------------------------------------------------------

    def capture_all(self) -> None:
        """Capture every bucket's graph, largest first (they share one memory pool, and the
        smaller ones fit in what the largest left). Each is run eagerly first: Triton compiles
        its kernels there, never during a capture."""
        start = time.perf_counter()
        self._pad_from(0)
        if not self.capture:
            for size in self.sizes:
                self._forward(size)
            return
        free_before = torch.cuda.mem_get_info(self.device)[0]
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                self._forward(size)  # warm-up: compiles, and sets up cuBLAS for this shape
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        for size in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self.outputs[size] = self._forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        logger.info(
            "CUDA graphs: captured %d decode batch sizes (1 to %d) in %.1f s, %.0f MiB",
            len(self.sizes),
            self.max_size,
            self.capture_seconds,
            (free_before - torch.cuda.mem_get_info(self.device)[0]) / 2**20,
        )

    def _forward(self, size: int) -> torch.Tensor:
        plan = self._plan_cls(
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size],
            decode_seqs=self.decode_seqs[:size],
            prefill_tiles=self.no_tiles,
            # The grid (splits of a long decode) is sized for the longest context; each row
            # reads its own length at run time.
            max_decode_seq_len=self.max_model_len,
        )
        attn = AttentionMetadata(
            kv_caches=self.kv_caches,
            slot_mapping=self.slot_mapping[:size],
            plan=plan,
            backend=self.backend,
        )
        return self.model(
            self.input_ids[:size], self.positions[:size], attn, self.logits_indices[:size]
        )

    def _pad_from(self, row: int) -> None:
        """Rows `row`.. become padding (see the module docstring)."""
        self.input_ids[row:].zero_()
        self.positions[row:].zero_()
        self.slot_mapping[row:].fill_(-1)
        self.seq_lens[row:].fill_(1)
        self.block_table[row:, 0].zero_()

    # ---- one step -----------------------------------------------------------------------

    def run(
        self,
        token_ids: Sequence[int],  # [B] each row's input token
        positions: Sequence[int],  # [B] its position (the tokens already cached)
        block_ids: Sequence[Sequence[int]],  # [B] each row's KV blocks, in order
    ) -> torch.Tensor:  # [B, V] logits
        """One decode step of B = len(token_ids) <= max_size rows."""
        num_rows = len(token_ids)
        size = self.bucket(num_rows)
        bs = self.block_size
        width = max(len(b) for b in block_ids)
        # Staged in pinned memory, copied without waiting: the host never blocks on the
        # copies (a pageable copy would wait for the stream to drain first).
        pin = self.device.type == "cuda"
        ints = torch.empty((3, size), dtype=torch.int64, pin_memory=pin)
        lens_and_table = torch.empty((size, 1 + width), dtype=torch.int32, pin_memory=pin)
        host = ints.numpy()
        lt = lens_and_table.numpy()
        lt.fill(0)  # padding rows read block 0; columns past a row's blocks are never read
        pos = np.asarray(positions, dtype=np.int64)
        host[0, :num_rows] = token_ids
        host[1, :num_rows] = pos
        table = lt[:, 1:]
        for i, blocks in enumerate(block_ids):
            table[i, : len(blocks)] = blocks
        rows = np.arange(num_rows)
        host[2, :num_rows] = table[rows, pos // bs].astype(np.int64) * bs + pos % bs
        lt[:num_rows, 0] = pos + 1
        # Padding rows (see the module docstring).
        host[0, num_rows:] = 0
        host[1, num_rows:] = 0
        host[2, num_rows:] = -1
        lt[num_rows:, 0] = 1
        nb = pin
        self.input_ids[:size].copy_(ints[0], non_blocking=nb)
        self.positions[:size].copy_(ints[1], non_blocking=nb)
        self.slot_mapping[:size].copy_(ints[2], non_blocking=nb)
        staged = lens_and_table.to(self.device, non_blocking=nb)
        self.seq_lens[:size].copy_(staged[:, 0])
        self.block_table[:size, :width].copy_(staged[:, 1:])
        if self.capture:
            self.graphs[size].replay()
            out = self.outputs[size]
        else:
            out = self._forward(size)
        return out[:num_rows]
