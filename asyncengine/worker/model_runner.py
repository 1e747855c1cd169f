"""ModelRunner: one packed (varlen) batch per step → model forward → Sampler.

Pipeline: SchedulerOutput → (update request states) → packed inputs + AttentionMetadata →
model forward with logits only at sampling positions → Sampler → ModelRunnerOutput.
"""

from __future__ import annotations

import logging
import math
import mmap
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import numpy as np
import torch

from asyncengine.config import CacheConfig, ModelConfig, SchedulerConfig
from asyncengine.ipc.messages import LogprobsEntry
from asyncengine.ipc.scheduler_output import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    INVALID_TOKEN_ID,
    GrammarBitmask,
    ModelRunnerOutput,
    SchedulerOutput,
)
from asyncengine.kernels.linear_cpu import POOL_MAX_ROWS, openmp_in_caller
from asyncengine.model.attention import AttentionMetadata, get_backend
from asyncengine.model.cpu_forward import CpuForward
from asyncengine.model.interface import ModelForward, TokenChoice
from asyncengine.model.loader import load_model_forward
from asyncengine.model.lora_layers import LoRABatch
from asyncengine.sampling_params import CoreSamplingParams
from asyncengine.worker.cuda_graphs import DecodeGraphs, capture_sizes
from asyncengine.worker.grammar_bitmask import apply_grammar_bitmask
from asyncengine.worker.host_copy import to_device
from asyncengine.worker.lora_manager import LoRAManager
from asyncengine.worker.parallel import TensorParallelGroup
from asyncengine.worker.rejection_sampler import accept_drafts, draft_states
from asyncengine.worker.sampler import Sampler, SamplerOutput
from asyncengine.worker.sampling_metadata import (
    SamplingMetadata,
    SamplingRequestState,
    build_sampling_metadata,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class CachedRequestState:
    """What the runner keeps of a request between steps."""

    token_ids: list[int]  # prompt + generated tokens (the runner appends what it samples)
    block_ids: list[int]
    num_computed_tokens: int
    sampling: SamplingRequestState
    pooling: str | None = None  # an embedding request: how its hidden states are pooled
    pool_acc: torch.Tensor | None = None  # "mean": the rows' fp32 sum so far; "cls": row 0
    lora_name: str | None = None  # its LoRA adapter


@dataclass(slots=True)
class _BatchInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # [S + P] packed positions: sampled ones, then the prompt's
    # Per sampled row: its request (a request with drafts has 1 + len(drafts) rows in a row),
    # and the sampling state of that position.
    sample_req_ids: list[str]
    sample_states: list[SamplingRequestState]
    # Requests whose prompt logprobs this step computes, with logits rows S.. in order:
    # (batch row, the prompt position of its first target token, its target token ids, top-N).
    prompt_rows: list[tuple[int, int, list[int], int]]
    # Embedding requests' packed rows whose hidden states the step wants, in order, and per
    # request (batch row, its first entry in hidden_indices, how many, whether its prompt
    # ends in this step).
    hidden_indices: list[int]
    pool_rows: list[tuple[int, int, int, bool]]


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        device: torch.device,
        tp: TensorParallelGroup | None = None,
        scheduler_config: SchedulerConfig | None = None,
    ) -> None:
        self.model_config = model_config
        # The step limits the CUDA graphs and the profiling forward are sized for.
        self.max_num_seqs = scheduler_config.max_num_seqs if scheduler_config else 256
        self.max_num_batched_tokens = (
            scheduler_config.max_num_batched_tokens if scheduler_config else 2048
        )
        # Tensor parallel: this rank holds H_kv / tp KV heads; only the driver rank samples.
        self.tp = tp
        self.is_driver = tp is None or tp.is_driver
        self.num_local_kv_heads = model_config.num_kv_heads // (tp.world_size if tp else 1)
        self.cache_config = cache_config
        self.device = device
        self.dtype: torch.dtype = getattr(torch, model_config.dtype)
        self.block_size = cache_config.block_size
        self.requests: dict[str, CachedRequestState] = {}
        self.kv_caches: list[torch.Tensor] = []
        self.sampler = Sampler()
        self.model: ModelForward | None = None  # load_model()
        self.decode_graphs: DecodeGraphs | None = None  # initialize_kv_cache(), on CUDA
        self.lora_manager: LoRAManager | None = None  # the first add_lora()
        # Resolve the attention backend now, so a missing triton fails at start-up.
        get_backend(model_config.attention_backend, device)

    def load_model(self) -> None:
        """Load the model `loader.choose_model` picks (this rank's shard under TP)."""
        tp = self.tp
        self.model = load_model_forward(
            self.model_config,
            self.device,
            tp.rank if tp is not None else 0,
            tp.world_size if tp is not None else 1,
            tp.all_reduce if tp is not None else None,
        )

    # ---- LoRA adapters -------------------------------------------------------------------

    def enable_lora(self, max_loaded: int, max_lora_rank: int) -> None:
        """Take LoRA adapters, at most `max_loaded` loaded at once; ValueError where the
        model cannot (it runs through transformers)."""
        if not isinstance(self.model, CpuForward):
            raise ValueError(
                "LoRA adapters run on the lean CPU forward only (device 'cpu', attention "
                "backend 'cpu', no tensor parallel, the native CPU kernels): this model runs "
                "through transformers"
            )
        self.lora_manager = LoRAManager(self.model_config, max_loaded, max_lora_rank, self.dtype)

    def add_lora(self, name: str, path: str) -> None:
        """Register and load a LoRA adapter (the engine core has checked its folder)."""
        assert self.lora_manager is not None, "enable_lora() first"
        self.lora_manager.add(name, path)

    def remove_lora(self, name: str) -> None:
        if self.lora_manager is not None:
            self.lora_manager.remove(name)

    # ---- KV cache ------------------------------------------------------------------------

    def kv_cache_bytes_per_block(self) -> int:
        mc = self.model_config
        elem = torch.empty((), dtype=self.dtype).element_size()
        return mc.num_layers * 2 * self.block_size * self.num_local_kv_heads * mc.head_dim * elem

    def initialize_kv_cache(self, num_blocks: int) -> None:
        mc = self.model_config
        shape = (2, self.num_local_kv_heads, num_blocks, self.block_size, mc.head_dim)
        self.decode_graphs = None  # they point into the cache they were captured with
        self.kv_caches = [_zeroed(shape, self.dtype, self.device) for _ in range(mc.num_layers)]
        if self.uses_cuda_graphs:
            self.capture_decode_graphs()

    @property
    def uses_cuda_graphs(self) -> bool:
        """Decode steps replay CUDA graphs: on CUDA with Triton attention, one device (no
        tensor parallel), unless `enforce_eager`."""
        mc = self.model_config
        return (
            self.device.type == "cuda"
            and mc.attention_backend == "triton"
            and not mc.enforce_eager
            and (self.tp is None or self.tp.world_size == 1)
        )

    @torch.inference_mode()
    def capture_decode_graphs(self) -> None:
        """Capture the decode graphs over the current KV cache (worker/cuda_graphs.py). On a
        CPU (tests, with Triton's interpreter) the same padded steps run uncaptured."""
        assert self.model is not None and self.kv_caches, "load_model() and the KV cache first"
        graphs = DecodeGraphs(
            self.model,
            self.kv_caches,
            block_size=self.block_size,
            max_model_len=self.model_config.max_model_len,
            max_num_seqs=self.max_num_seqs,
            device=self.device,
            capture=self.device.type == "cuda",
        )
        try:
            graphs.capture_all()
        except RuntimeError as exc:  # an op in the model that cannot be captured
            logger.warning("CUDA graphs could not be captured; decode steps run eagerly: %s", exc)
            return
        self.decode_graphs = graphs

    # ---- start-up: profiling and warm-up ------------------------------------------------

    @torch.inference_mode()
    def profile_run(self) -> None:
        """Forwards the engine will meet, on dummy tokens, before any request: the largest
        step (`max_num_batched_tokens` tokens over up to `max_num_seqs` prefills, every
        sequence's logits then through the sampler's widest path: top-k/top-p sorts every
        row), then a 17-token prefill and a one-token step.

        The first sets the peak activation memory the KV cache is sized around
        (worker/gpu_memory.py); together they compile, on a GPU, the Triton kernels'
        specializations (Triton specializes integer arguments that equal 1 or are multiples
        of 16) so that no request waits on a compile. Uses a temporary KV cache of its own."""
        assert self.model is not None, "load_model() first"
        max_len = self.model_config.max_model_len
        num_seqs = min(self.max_num_seqs, self.max_num_batched_tokens)
        num_tokens = min(self.max_num_batched_tokens, num_seqs * max_len)
        lens = [num_tokens // num_seqs] * num_seqs
        for i in range(num_tokens % num_seqs):
            lens[i] += 1
        for step in (lens, [min(17, max_len)], [1]):
            self._dummy_forward(step)
        if self.device.type == "cuda" and self.model_config.attention_backend == "triton":
            from asyncengine.kernels.paged_attention_triton import warm_up_decode

            # The split decodes an eager step with long contexts takes (graphs fix theirs).
            mc = self.model_config
            shape = (2, self.num_local_kv_heads, 1, self.block_size, mc.head_dim)
            local_heads = mc.num_attention_heads * self.num_local_kv_heads // mc.num_kv_heads
            warm_up_decode(torch.zeros(shape, dtype=self.dtype, device=self.device), local_heads)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def decode_graph_memory(self) -> int:
        """About the bytes the decode graphs' memory pool will hold (CUDA): twice the
        activations of a decode step of the largest captured batch, measured on a dummy one
        (every graph keeps its output alive, and the bucket sizes sum to about twice the
        largest)."""
        if not self.uses_cuda_graphs:
            return 0
        rows = capture_sizes(self.max_num_seqs)[-1]
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self._dummy_forward([1] * rows, sample=False)
        torch.cuda.synchronize(self.device)
        return 2 * (torch.cuda.max_memory_allocated(self.device) - before)

    def _dummy_forward(self, lens: list[int], sample: bool = True) -> None:
        """One forward of fresh sequences of `lens` tokens; with `sample`, sampled at
        temperature 1 with top-k and top-p."""
        assert self.model is not None
        mc, bs, dev = self.model_config, self.block_size, self.device
        blocks = [-(-n // bs) for n in lens]
        shape = (2, self.num_local_kv_heads, sum(blocks), bs, mc.head_dim)
        kv_caches = [torch.empty(shape, dtype=self.dtype, device=dev) for _ in range(mc.num_layers)]
        block_table = np.zeros((len(lens), max(blocks)), dtype=np.int64)
        first = np.cumsum([0, *blocks[:-1]])
        for i, n in enumerate(blocks):
            block_table[i, :n] = np.arange(first[i], first[i] + n)
        positions = np.concatenate([np.arange(n, dtype=np.int64) for n in lens])
        query_start_loc = [0, *np.cumsum(lens).tolist()]
        attn = self._attention(kv_caches, block_table, positions, lens, query_start_loc, lens)
        generator = np.random.default_rng(0)
        token_ids = generator.integers(0, mc.vocab_size, len(positions), dtype=np.int64)
        last = np.asarray(query_start_loc[1:], dtype=np.int64) - 1
        keep = _to_device(last, dev) if self.is_driver else _to_device(last[:0], dev)
        logits = self.model(_to_device(token_ids, dev), _to_device(positions, dev), attn, keep)
        if not self.is_driver or not sample:
            return
        params = CoreSamplingParams(temperature=1.0, top_k=50, top_p=0.9)
        states = [SamplingRequestState(params=params, prompt_token_ids=[0]) for _ in lens]
        metadata = build_sampling_metadata(states, mc.vocab_size, dev)
        self.sampler.forward(logits[:, : mc.vocab_size], metadata)

    # ---- one step ------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(
        self,
        scheduler_output: SchedulerOutput,
        grammar_bitmask: Callable[[], GrammarBitmask | None] | None = None,
    ) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        if scheduler_output.is_empty:
            return EMPTY_MODEL_RUNNER_OUTPUT
        assert self.model is not None, "load_model() first"
        decodes = self._graph_decodes(scheduler_output)
        if decodes is not None:
            return self._execute_graph_decode(scheduler_output, decodes, grammar_bitmask)
        batch = self._prepare_inputs(scheduler_output)
        # Only the driver rank samples: the others skip the lm_head entirely.
        keep = batch.logits_indices if self.is_driver else batch.logits_indices[:0]
        metadata = None
        if self.is_driver and batch.sample_req_ids:
            metadata = build_sampling_metadata(
                batch.sample_states, self.model_config.vocab_size, self.device
            )
        choice = None
        if metadata is not None and grammar_bitmask is None and not batch.prompt_rows:
            with self._host_ops(scheduler_output):
                choice = self._token_choice(scheduler_output, metadata)
        hidden: list[torch.Tensor] = []
        hidden_indices = None
        if batch.hidden_indices and self.is_driver:
            hidden_indices = _to_device(
                np.asarray(batch.hidden_indices, dtype=np.int64), self.device
            )
        lora = self._lora_batch(scheduler_output)
        out = self.model(  # [S + P, V] logits, or [S] tokens
            batch.input_ids, batch.positions, batch.attn, keep, token_choice=choice,
            hidden_indices=hidden_indices, hidden_out=hidden, lora=lora,
        )  # fmt: skip
        if grammar_bitmask is not None:  # filled beside the forward pass: wait for it now
            scheduler_output.grammar_bitmask = grammar_bitmask()
        num_sampled = len(batch.sample_req_ids)
        with self._host_ops(scheduler_output):
            output = self._sample(
                scheduler_output, batch.sample_req_ids, out[:num_sampled], metadata
            )
        if batch.prompt_rows and self.is_driver:
            output.prompt_logprobs = self._prompt_logprobs(
                len(output.req_ids), batch.prompt_rows, out[num_sampled:]
            )
        if batch.pool_rows and hidden:
            output.pooled = self._pool(output.req_ids, batch.pool_rows, hidden[0])
        return output

    def _host_ops(self, scheduler_output: SchedulerOutput) -> AbstractContextManager[None]:
        """Where a CPU step's products run on the kernels' work pool (at most POOL_MAX_ROWS
        tokens), its sampling runs in this thread alone (see linear_cpu.openmp_in_caller)."""
        if self.device.type != "cpu" or scheduler_output.total_num_scheduled_tokens > POOL_MAX_ROWS:
            return nullcontext()
        return openmp_in_caller()

    def _lora_batch(self, scheduler_output: SchedulerOutput) -> LoRABatch | None:
        """The step's adapters and their rows (packed in batch order); None: none."""
        if self.lora_manager is None:
            return None
        scheduled = scheduler_output.num_scheduled_tokens
        names = [self.requests[r].lora_name for r in scheduled]
        return self.lora_manager.step_batch(names, list(scheduled.values()))

    def _pool(
        self,
        req_ids: list[str],
        pool_rows: list[tuple[int, int, int, bool]],
        hidden: torch.Tensor,  # [H, hidden]: the rows _prepare_inputs listed, in order
    ) -> list[list[float] | None] | None:
        """Fold this step's rows into each embedding request's pooling; the pooled vector
        (fp32) of each whose prompt ended in this step, by batch row."""
        hidden = hidden.float()
        pooled: list[list[float] | None] = [None] * len(req_ids)
        for row, first, count, final in pool_rows:
            state = self.requests[req_ids[row]]
            rows = hidden[first : first + count]
            if state.pooling == "mean":
                total = rows.sum(dim=0)
                state.pool_acc = total if state.pool_acc is None else state.pool_acc + total
            elif state.pooling == "cls" and count:
                state.pool_acc = rows[0].clone()
            elif count:  # "last": only the final chunk lists a row
                state.pool_acc = rows[-1].clone()
            if final:
                assert state.pool_acc is not None
                vector = state.pool_acc
                if state.pooling == "mean":
                    vector = vector / len(state.sampling.prompt_token_ids)
                pooled[row] = vector.cpu().tolist()
        return pooled if any(v is not None for v in pooled) else None

    def _prompt_logprobs(
        self,
        num_reqs: int,
        prompt_rows: list[tuple[int, int, list[int], int]],
        logits: torch.Tensor,  # [P, V]: every listed request's prompt positions, in order
    ) -> list[tuple[int, list[LogprobsEntry]] | None]:
        """Each listed request's prompt logprobs: per position, its prompt token (first)
        and the top-N tokens, their logprobs (fp32), and the prompt token's rank."""
        logprobs = torch.log_softmax(logits[:, : self.model_config.vocab_size].float(), dim=-1)
        targets = torch.tensor([t for _, _, ts, _ in prompt_rows for t in ts], dtype=torch.int64)
        target_lp = logprobs.gather(1, to_device(targets, self.device)[:, None])  # [P, 1]
        ranks = ((logprobs > target_lp).sum(dim=1) + 1).tolist()
        target_list = target_lp[:, 0].tolist()
        top_n = max(n for _, _, _, n in prompt_rows)
        top_lp, top_ids = logprobs.topk(top_n, dim=1) if top_n else (logprobs[:, :0],) * 2
        top_lps, top_id_list = top_lp.tolist(), top_ids.tolist()
        result: list[tuple[int, list[LogprobsEntry]] | None] = [None] * num_reqs
        row = 0
        for batch_row, first, tokens, n in prompt_rows:
            entries: list[LogprobsEntry] = []
            for token in tokens:
                ids = [token, *top_id_list[row][:n]]
                lps = [target_list[row], *top_lps[row][:n]]
                entries.append((ids, lps, int(ranks[row])))
                row += 1
            result[batch_row] = (first, entries)
        return result

    def _graph_decodes(self, scheduler_output: SchedulerOutput) -> list[str] | None:
        """The step's requests when it can replay a decode graph: every request one token,
        the one whose logits it samples; else None."""
        graphs = self.decode_graphs
        num_reqs = len(scheduler_output.num_scheduled_tokens)
        if (
            graphs is None
            or num_reqs > graphs.max_size
            or scheduler_output.total_num_scheduled_tokens != num_reqs
        ):
            return None
        req_ids = list(scheduler_output.num_scheduled_tokens)
        for req_id in req_ids:
            state = self.requests[req_id]
            if state.num_computed_tokens + 1 != len(state.token_ids):
                return None  # a one-token prefill chunk that does not reach the end
        return req_ids

    def _execute_graph_decode(
        self,
        scheduler_output: SchedulerOutput,
        req_ids: list[str],
        grammar_bitmask: Callable[[], GrammarBitmask | None] | None,
    ) -> ModelRunnerOutput:
        assert self.decode_graphs is not None
        states = [self.requests[r] for r in req_ids]
        positions = [s.num_computed_tokens for s in states]
        metadata = None
        if self.is_driver:  # before the replay: its copies then queue behind nothing
            sampling = [s.sampling for s in states]
            metadata = build_sampling_metadata(sampling, self.model_config.vocab_size, self.device)
        logits = self.decode_graphs.run(
            [s.token_ids[p] for s, p in zip(states, positions, strict=True)],
            positions,
            [s.block_ids for s in states],
        )
        if grammar_bitmask is not None:
            scheduler_output.grammar_bitmask = grammar_bitmask()
        return self._sample(scheduler_output, req_ids, logits, metadata)

    def _token_choice(
        self, scheduler_output: SchedulerOutput, metadata: SamplingMetadata
    ) -> TokenChoice | None:
        """What the model may pick itself (model/interface.py): rows sampled greedily or by
        temperature alone, with no grammar, penalty, min_tokens, logprobs or filter; else
        None (the sampler then needs the logits), and for more rows than the model takes
        (no noise drawn for nothing)."""
        assert self.model is not None
        if (
            metadata.num_rows > self.model.token_choice_rows
            or scheduler_output.grammar_bitmask is not None
            or not metadata.no_penalties
            or metadata.min_tokens_indices is not None
            or metadata.max_num_logprobs is not None
            or metadata.num_filter_candidates
            or metadata.min_p is not None
        ):
            return None
        vocab_size = self.model_config.vocab_size
        if metadata.all_greedy:
            return TokenChoice(vocab_size)
        # The noise the sampler would draw for these rows (the same, for a seeded row).
        assert metadata.temperature is not None
        temperatures = metadata.temperature
        if metadata.greedy_mask is not None:
            temperatures = temperatures.masked_fill(metadata.greedy_mask, 0.0)
        noise = self.sampler.gumbel_noise(metadata, vocab_size)
        return TokenChoice(vocab_size, temperatures, noise)

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            tokens = list(new.token_ids)
            self.requests[new.request_id] = CachedRequestState(
                token_ids=tokens,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                sampling=SamplingRequestState(
                    params=new.sampling_params,
                    prompt_token_ids=tokens[: new.num_prompt_tokens],
                    output_token_ids=tokens[new.num_prompt_tokens :],
                    eos_token_ids=self.model_config.eos_token_ids,
                ),
                pooling=new.pooling,
                lora_name=new.lora_name,
            )
        for cached in scheduler_output.scheduled_cached_reqs:
            state = self.requests[cached.request_id]
            # After speculative decoding's rollback, the scheduler freed the blocks past the
            # computed tokens (sched/spec_decode.py); without drafts this drops nothing.
            del state.block_ids[-(-cached.num_computed_tokens // self.block_size) :]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _prepare_inputs(self, scheduler_output: SchedulerOutput) -> _BatchInputs:
        req_ids = list(scheduler_output.num_scheduled_tokens)
        num_reqs = len(req_ids)
        states = [self.requests[r] for r in req_ids]
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        if not spec_tokens and scheduler_output.total_num_scheduled_tokens == num_reqs:
            decode = self._prepare_decode(req_ids, states)
            if decode is not None:
                return decode
        counts = list(scheduler_output.num_scheduled_tokens.values())
        token_ids: list[int] = []
        positions: list[np.ndarray] = []
        seq_lens: list[int] = []
        sample_indices: list[int] = []
        sample_req_ids: list[str] = []
        sample_states: list[SamplingRequestState] = []
        prompt_rows: list[tuple[int, int, list[int], int]] = []
        prompt_indices: list[int] = []
        hidden_indices: list[int] = []
        pool_rows: list[tuple[int, int, int, bool]] = []
        max_blocks = max(len(s.block_ids) for s in states)
        block_table = np.zeros((num_reqs, max_blocks), dtype=np.int64)  # [B, max_blocks]
        for i, (state, n) in enumerate(zip(states, counts, strict=True)):
            start = state.num_computed_tokens
            drafts = spec_tokens.get(req_ids[i]) if spec_tokens else None
            if drafts:
                # The last token and its drafts: every position's logits are sampled.
                token_ids.append(state.token_ids[start])
                token_ids.extend(drafts)
                positions.append(np.arange(start, start + n, dtype=np.int64))
                seq_lens.append(start + n)
                block_table[i, : len(state.block_ids)] = state.block_ids
                sample_indices.extend(range(len(token_ids) - n, len(token_ids)))
                sample_req_ids.extend([req_ids[i]] * n)
                sample_states.extend(draft_states(state.sampling, drafts))
                continue
            token_ids.extend(state.token_ids[start : start + n])
            positions.append(np.arange(start, start + n, dtype=np.int64))
            seq_lens.append(start + n)
            block_table[i, : len(state.block_ids)] = state.block_ids
            if state.pooling is not None:  # an embedding request: pooled, never sampled
                rows = _pooled_rows(state.pooling, len(token_ids) - n, start, n, state.token_ids)
                pool_rows.append(
                    (i, len(hidden_indices), len(rows), start + n == len(state.token_ids))
                )
                hidden_indices.extend(rows)
                continue
            if start + n == len(state.token_ids):
                sample_indices.append(len(token_ids) - 1)
                sample_req_ids.append(req_ids[i])
                sample_states.append(state.sampling)
            top_n = state.sampling.params.prompt_logprobs
            if top_n is not None and self.is_driver:
                # Position p's logits give token p + 1's logprob, for the prompt's tokens.
                end = min(start + n, len(state.sampling.prompt_token_ids) - 1)
                if end > start:
                    first = len(token_ids) - n  # this request's first packed token
                    prompt_indices.extend(range(first, first + end - start))
                    targets = state.token_ids[start + 1 : end + 1]
                    prompt_rows.append((i, start + 1, targets, top_n))
        pos = np.concatenate(positions)  # [T]
        query_start_loc = [0, *np.cumsum(counts).tolist()]
        dev = self.device
        attn = self._attention(self.kv_caches, block_table, pos, counts, query_start_loc, seq_lens)
        logits_indices = sample_indices + prompt_indices
        return _BatchInputs(
            input_ids=_to_device(np.asarray(token_ids, dtype=np.int64), dev),
            positions=_to_device(pos, dev),
            attn=attn,
            logits_indices=_to_device(np.asarray(logits_indices, dtype=np.int64), dev),
            sample_req_ids=sample_req_ids,
            sample_states=sample_states,
            prompt_rows=prompt_rows,
            hidden_indices=hidden_indices,
            pool_rows=pool_rows,
        )

    def _prepare_decode(
        self, req_ids: list[str], states: list[CachedRequestState]
    ) -> _BatchInputs | None:
        """The inputs of a step that decodes one next token per request (no drafts, no
        embedding request), as `_prepare_inputs` builds them, in a few ops instead of
        per-request arrays: at one stream the general path's host work is a tenth of a
        small model's step. None where a request is not such a decode."""
        positions = [s.num_computed_tokens for s in states]
        for state, p in zip(states, positions, strict=True):
            if p + 1 != len(state.token_ids) or state.pooling is not None:
                return None
        num_reqs = len(states)
        block_table = np.zeros((num_reqs, max(len(s.block_ids) for s in states)), np.int64)
        for i, state in enumerate(states):
            block_table[i, : len(state.block_ids)] = state.block_ids
        pos = np.asarray(positions, dtype=np.int64)  # [B]
        ones = [1] * num_reqs
        attn = self._attention(
            self.kv_caches, block_table, pos, ones, list(range(num_reqs + 1)), (pos + 1).tolist()
        )
        token_ids = [s.token_ids[p] for s, p in zip(states, positions, strict=True)]
        dev = self.device
        return _BatchInputs(
            input_ids=_to_device(np.asarray(token_ids, dtype=np.int64), dev),
            positions=_to_device(pos, dev),
            attn=attn,
            logits_indices=_to_device(np.arange(num_reqs, dtype=np.int64), dev),
            sample_req_ids=req_ids,
            sample_states=[s.sampling for s in states],
            prompt_rows=[],
            hidden_indices=[],
            pool_rows=[],
        )

    def _attention(
        self,
        kv_caches: list[torch.Tensor],
        block_table: np.ndarray,  # [B, max_blocks]
        positions: np.ndarray,  # [T] each packed token's position in its sequence
        counts: list[int],  # [B] packed tokens per sequence
        query_start_loc: list[int],  # [B + 1]
        seq_lens: list[int],  # [B] tokens in the cache after this step
    ) -> AttentionMetadata:
        """The step's attention metadata: each token's cache slot, and the backend's plan."""
        bs = self.block_size
        rows = np.repeat(np.arange(len(counts)), counts)  # [T]
        slots = block_table[rows, positions // bs] * bs + positions % bs  # [T]
        return AttentionMetadata.build(
            kv_caches=kv_caches,
            slot_mapping=_to_device(slots, self.device),
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_table=_to_device(block_table, self.device),
            block_size=bs,
            dtype=self.dtype,
            backend=self.model_config.attention_backend,
        )

    def _sample(
        self,
        scheduler_output: SchedulerOutput,
        sample_req_ids: list[str],
        out: torch.Tensor,  # [S, V] logits, or [S] the sampled tokens themselves
        metadata: SamplingMetadata | None,  # the driver's, where rows are sampled
    ) -> ModelRunnerOutput:
        sampled_by_req: dict[str, list[int]] = {}
        logprobs_by_req: dict[str, list[LogprobsEntry]] = {}
        if sample_req_ids:
            sampler_out: SamplerOutput | None = None
            sampled: list[int] | None = None
            if metadata is not None and out.dim() == 1:
                sampled = out.tolist()
            elif metadata is not None:
                logits = out[:, : self.model_config.vocab_size]  # [S, V]
                if scheduler_output.grammar_bitmask is not None:
                    apply_grammar_bitmask(logits, sample_req_ids, scheduler_output.grammar_bitmask)
                sampler_out = self.sampler.forward(logits, metadata)
                # A NaN logit sampled means a broken row (argmax and the Gumbel-max both
                # pick NaN first): that request fails alone. O(S), and in the same sync.
                picked = logits.gather(1, sampler_out.sampled_token_ids[:, None])[:, 0]  # [S]
                sampled = torch.where(
                    picked.isnan(), INVALID_TOKEN_ID, sampler_out.sampled_token_ids
                ).tolist()
            if self.tp is not None:
                # Every rank appends the driver's tokens, so the next step's inputs agree.
                sampled = self.tp.broadcast_token_ids(sampled, len(sample_req_ids))
            assert sampled is not None
            spec_tokens = scheduler_output.scheduled_spec_decode_tokens
            row = 0
            while row < len(sample_req_ids):
                req_id = sample_req_ids[row]
                state = self.requests[req_id]
                drafts = spec_tokens.get(req_id) if spec_tokens else None
                if drafts:  # its 1 + len(drafts) rows: the accepted drafts, and one more
                    emitted = accept_drafts(drafts, sampled[row : row + len(drafts) + 1])
                    row += len(drafts) + 1
                else:
                    emitted = [sampled[row]]
                    row += 1
                state.token_ids.extend(emitted)
                state.sampling.output_token_ids.extend(emitted)
                sampled_by_req[req_id] = emitted
            if sampler_out is not None and sampler_out.logprobs is not None:
                states = [self.requests[r].sampling for r in sample_req_ids]
                logprobs_by_req = _logprobs_entries(
                    sample_req_ids, states, sampler_out, sampled_by_req
                )
        req_ids = list(scheduler_output.num_scheduled_tokens)
        return ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=[sampled_by_req.get(r, []) for r in req_ids],
            logprobs=[logprobs_by_req.get(r) for r in req_ids] if logprobs_by_req else None,
        )


def _logprobs_entries(
    req_ids: list[str],  # per sampled row: a request with drafts has several rows in a row
    states: list[SamplingRequestState],
    out: SamplerOutput,
    emitted: dict[str, list[int]],  # each request's tokens this step
) -> dict[str, list[LogprobsEntry]]:
    """The logprobs entries of the tokens each request emits, one per token: its rows' first
    ones (a request's emitted tokens are the tokens sampled at its first rows)."""
    assert out.logprob_token_ids is not None and out.logprobs is not None
    assert out.sampled_token_ranks is not None
    ids = out.logprob_token_ids.tolist()
    lps = out.logprobs.tolist()
    ranks = out.sampled_token_ranks.tolist()
    entries: dict[str, list[LogprobsEntry]] = {}
    for row, (req_id, state) in enumerate(zip(req_ids, states, strict=True)):
        n = state.params.logprobs
        if n is None:
            continue
        mine = entries.setdefault(req_id, [])
        if len(mine) < len(emitted[req_id]):
            mine.append((ids[row][: n + 1], lps[row][: n + 1], int(ranks[row])))
    return entries


def _pooled_rows(pooling: str, first: int, start: int, n: int, token_ids: list[int]) -> list[int]:
    """The packed rows of an embedding request's chunk (packed from row `first`, prompt
    positions start..start + n) that its pooling reads: every one ("mean"), position 0's
    ("cls"), or the prompt's last ("last")."""
    if pooling == "mean":
        return list(range(first, first + n))
    if pooling == "cls":
        return [first] if start == 0 else []
    return [first + n - 1] if start + n == len(token_ids) else []


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return to_device(torch.from_numpy(array), device)


def _zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor; on the CPU, of anonymous-mapping pages that become resident only
    when first written (torch.zeros writes, so commits, every page up front).

    The KV cache is sized for the worst case and mostly unused in a quiet service: its
    untouched blocks then cost no memory. The mapping lives as long as the tensor.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    try:
        pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)  # anonymous: zero pages
    except OSError as exc:  # the kernel refuses more than it could ever back
        raise MemoryError(
            f"the KV cache needs {nbytes / 2**20:,.0f} MiB per layer, more than this machine "
            f"can provide ({exc.strerror}): lower kv_cache_memory_bytes or num_kv_blocks"
        ) from None
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)
