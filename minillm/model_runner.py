"""ModelRunner: the only engine part that touches device memory.

It owns the weights and the KV pool (allocated once), turns a SchedulerOutput into input ids,
positions and attention metadata, launches the model and the sampler, and returns an InFlightStep
whose wait() gives the StepOutput. Device work (streams, read-backs, timers, graphs, memory) goes
through the backend's device object (minillm/device.py).
"""
from __future__ import annotations

import dataclasses
import os
import time
from operator import attrgetter, getitem
from types import ModuleType

import numpy as np

from minillm.attention import AttentionMetadata
from minillm.block_tables import BlockTables
from minillm.config import EngineConfig, ModelConfig, available_host_bytes, is_fp8_kv_cache
from minillm.fp8 import kv_cache_storage
from minillm.models.decoder import DecoderModel
from minillm.prompt_logprobs import compute_prompt_logprobs, plan_prompt_logprobs
from minillm.sampler import Sampler
from minillm.stats import MemoryStats
from minillm.step import SchedulerOutput, StepOutput

_seq_id, _token_ids = attrgetter("seq_id"), attrgetter("token_ids")


def kv_bytes_per_block(mc: ModelConfig, block_size: int, itemsize: int) -> int:
    """Bytes one block takes across all layers, K and V."""
    return mc.kv_bytes_per_token * block_size * itemsize


class ModelRunner:
    """Weights, KV pool and the forward pass for one backend.

    Start-up runs forward: construct (weights), determine_num_blocks() (profiling), then, once the
    engine has fitted max_model_len to the pool, initialize_cache() (pool, rotary table, graphs).
    """

    def __init__(self, model_config: ModelConfig, config: EngineConfig, ops: ModuleType, device,
                 weights: dict[str, np.ndarray], dtype, eos_token_ids: list[int], comm=None):
        self.model_config, self.config, self.ops, self.device, self.dtype = model_config, config, ops, device, dtype
        self.block_size = config.block_size
        # All device work goes on the compute stream, start-up included: the compute stream does
        # not wait for the legacy default stream, so an upload or memset queued there could still
        # be running when a kernel on the compute stream reads the memory.
        with device.compute():
            self.model = DecoderModel(model_config, weights, ops, dtype, comm=comm)   # comm: minillm/parallel/
        arrays = {id(a): a for a in self._device_arrays()}        # a tied head is the embedding: counted once
        self.weights_bytes = sum(int(getattr(a, "nbytes", 0)) for a in arrays.values())
        self.sampler = Sampler(ops, eos_token_ids, device, config.max_num_seqs)
        self.block_tables = BlockTables(2 * config.max_num_seqs)   # the steps' block tables, on the host
        self.verifier = None             # verifies draft tokens (only with speculative decoding)
        if config.speculative_config is not None:
            from minillm.spec_decode.verifier import DraftVerifier
            self.verifier = DraftVerifier(ops, self.sampler)
        self.kv_pool = None              # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        # The pool's element type: the model dtype, or uint8 bytes of FP8 E4M3 (kv_cache_dtype="fp8").
        self.is_fp8_kv_cache = is_fp8_kv_cache(config.kv_cache_dtype)
        self.kv_cache_dtype = kv_cache_storage(config.kv_cache_dtype, dtype)   # what the stats report
        # The first eager forward pass sets the FP8 scales from its keys and values, then never again.
        self._kv_scales_pending = self.is_fp8_kv_cache and config.calculate_kv_scales
        self.graphs = None
        self.verify_graphs = None        # steps of up to 1 + k tokens a sequence (speculative decoding)
        self.piecewise = None            # prefill and mixed steps: graphs between the attention calls
        self.mixed_graphs = None         # small mixed steps: whole graphs, attention at a fixed grid
        self.profile = False             # when set, time forward and sampling on the device
        # (ids on the device [R], the seq_id of each sampled sequence, their rows [S] int32 or None: 0..S-1)
        # of the last launched step
        self._last_sampled = None
        self._deferred = None            # (InFlightStep, logits, grammar_bitmask) of a launch whose sampling waits
        self._prompt_logprobs = None     # what compute_logits queued for the step's prompt log-probabilities
        self.kv_connector = None         # runner side of a KV connector (minillm/kv_connector), when one is on
        self._picked = self._logits = None   # [R, D], [R, V] the sampling rows of a step off the decode graphs

    def _device_arrays(self):
        m = self.model
        yield from (m.embed, m.lm_head, m.final_norm)
        for lw in m.layers:
            yield from (a for a in vars(lw).values() if a is not None)

    def _kv_pool_dtype(self):
        """The backend dtype of a KV pool element (one byte for FP8)."""
        xp = self.ops.xp
        return xp.dtype(xp.uint8) if self.is_fp8_kv_cache else xp.dtype(self.dtype)

    # ---- start-up ----------------------------------------------------------------------------
    def determine_num_blocks(self, max_model_len: int) -> int:
        """KV blocks that fit the memory budget (a profiling forward pass measures activations)."""
        cfg = self.config
        per_block = kv_bytes_per_block(self.model_config, self.block_size, self._kv_pool_dtype().itemsize)
        # Tensor-parallel ranks on the CPU hold their pools (their KV heads) in this host's one memory.
        num_ranks = self.model.comm.world_size if self.model.comm is not None else 1
        if cfg.num_kv_blocks is not None:
            # A host pool past the memory there is would fail in the allocation (or the OOM killer).
            available = None if self.device.kv_pool_fills_memory else available_host_bytes()
            if available is not None and cfg.num_kv_blocks * per_block * num_ranks > available:
                raise ValueError(f"num_kv_blocks {cfg.num_kv_blocks} needs "
                                 f"{cfg.num_kv_blocks * per_block * num_ranks / 2**30:.1f} GiB of KV pool"
                                 f"{f' over {num_ranks} ranks' if num_ranks > 1 else ''}, more than the "
                                 f"{available / 2**30:.1f} GiB of memory available; lower num_kv_blocks")
            return cfg.num_kv_blocks
        # Decode graphs keep their own logits [max_num_seqs, V] fp32 and a batch's activations;
        # verification graphs theirs for up to 1 + k tokens a sequence.
        graph_rows = 0 if cfg.enforce_eager else cfg.max_num_seqs + self._verify_graph_tokens()
        graphs = 2 * graph_rows * self.model_config.vocab_size * 4
        # Piecewise graphs keep a forward pass's intermediates in their own pool, beside the eager ones.
        activation_copies = 2 if self._uses_piecewise_graphs() else 1
        budget = self.device.kv_cache_budget_bytes(
            cfg.kv_cache_memory_bytes, cfg.gpu_memory_utilization,
            lambda: activation_copies * self._profile_activation_bytes(max_model_len), graphs, num_ranks)
        num_blocks = budget // per_block
        if num_blocks < 1:
            source = "kv_cache_memory_bytes" if cfg.kv_cache_memory_bytes else "the KV budget"
            raise ValueError(f"{source} {budget} holds no KV block: a block of "
                             f"{self.block_size} tokens takes {per_block} bytes")
        if not self.device.kv_pool_fills_memory:
            enough = cfg.max_num_seqs * -(-max_model_len // self.block_size)
            num_blocks = min(num_blocks, enough)
        return num_blocks

    def _uses_piecewise_graphs(self) -> bool:
        """Prefill and mixed steps replay piecewise graphs (not with enforce_eager, tensor
        parallelism, or MINILLM_PIECEWISE_GRAPHS=0; the CPU has none)."""
        return (not self.config.enforce_eager and self.model.comm is None
                and os.environ.get("MINILLM_PIECEWISE_GRAPHS", "1") != "0")

    def _verify_graph_tokens(self) -> int:
        """Token rows of the largest verification graph (0 without speculative decoding)."""
        spec = self.config.speculative_config
        if spec is None:
            return 0
        from minillm.cuda_graphs import verify_graph_batch_sizes
        query_len = 1 + spec.num_speculative_tokens
        return verify_graph_batch_sizes(self.config.max_num_seqs, query_len)[-1] * query_len

    def _profile_activation_bytes(self, max_model_len: int) -> int:
        """Device bytes one forward pass at max_num_batched_tokens takes (with logits and sampling
        for max_num_seqs rows), measured on dummy inputs."""
        xp, mc, cfg, bs = self.ops.xp, self.model_config, self.config, self.block_size
        num_tokens = min(cfg.max_num_batched_tokens, max_model_len * cfg.max_num_seqs)
        seq_len = min(num_tokens, max_model_len)
        lens = [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else [])
        blocks = -(-seq_len // bs)
        a = self.ops.asarray

        def forward() -> None:
            # One sequence's worth of blocks that every dummy sequence reads; nothing is written.
            scratch = xp.zeros((mc.num_layers, 2, blocks, bs, mc.num_kv_heads, mc.head_dim), dtype=self._kv_pool_dtype())
            meta = AttentionMetadata(a(np.cumsum([0] + lens).astype(np.int32)), a(np.asarray(lens, np.int32)),
                                     a(np.tile(np.arange(blocks, dtype=np.int32), (len(lens), 1))),
                                     a(np.full(num_tokens, -1, np.int32)), max(lens), max(lens), False)
            positions = np.concatenate([np.arange(n, dtype=np.int32) for n in lens])
            hidden = self.model.forward(a(np.zeros(num_tokens, np.int32)), a(positions), meta, scratch)
            # A step verifying drafts computes logits for every draft as well.
            spec = cfg.speculative_config
            rows = min(cfg.max_num_seqs * (1 + (spec.num_speculative_tokens if spec else 0)), num_tokens)
            logits = self.model.compute_logits(hidden[:rows])
            ones = a(np.ones(rows, np.float32))
            self.ops.log_softmax(logits)
            self.ops.sample(logits, ones, a(np.zeros(rows, np.int32)), ones * 0.9, ones * 0.0, ones * 0.5)

        with self.device.compute():
            self.model.build_rotary(seq_len)
            return self.device.peak_bytes(forward) + (256 << 20)   # cuBLAS workspace and rounding

    def initialize_cache(self, num_blocks: int, max_model_len: int) -> None:
        """Allocate the KV pool and build what depends on max_model_len (rotary table, graphs)."""
        mc = self.model_config
        self.num_blocks = num_blocks
        with self.device.compute():
            self.model.build_rotary(max_model_len)
            # A KV producer's pool is shared: another engine copies a prompt's blocks straight out of it.
            transfer = self.config.kv_transfer_config
            self.kv_pool = self.device.kv_pool_zeros(
                (mc.num_layers, 2, num_blocks, self.block_size, mc.num_kv_heads, mc.head_dim),
                self._kv_pool_dtype(), shared=transfer is not None and transfer.is_kv_producer)
            # A step off the decode graphs writes its sampling rows into these: an allocation that grows
            # with the batch would make the allocator wait for the device in the middle of a step.
            spec = self.config.speculative_config
            rows = self.config.max_num_seqs * (1 + (spec.num_speculative_tokens if spec else 0))
            xp = self.ops.xp
            self._picked = xp.zeros((rows, mc.hidden_size), self.model.embed.dtype)       # [R, D]
            self._logits = xp.empty((rows, self.model.lm_head.shape[0]), np.float32)      # [R, V] (V / N on a rank)
            if xp is not np:
                # The GEMM library picks its kernel by the row count and the driver loads a kernel on
                # its first launch, waiting for the device: each row count a step may sample runs the
                # head once here, not in the middle of serving.
                for m in range(1, rows + 1):
                    self.ops.linear(self._picked[:m], self.model.lm_head, out=self._logits[:m], out_dtype=np.float32)
            if not self.config.enforce_eager:
                self.graphs = self.device.decode_graphs(self.model, self.ops, self.kv_pool,
                                                        self.config.max_num_seqs, max_model_len, self.block_size)
                if spec is not None and self.graphs is not None:
                    self.verify_graphs = self.device.verify_graphs(
                        self.model, self.ops, self.kv_pool, self.config.max_num_seqs, max_model_len,
                        self.block_size, 1 + spec.num_speculative_tokens, self.graphs)
                if self.graphs is not None and self._uses_piecewise_graphs():
                    self.piecewise = self.device.piecewise_graphs(
                        self.model, self.ops, self.kv_pool, self.config.max_num_batched_tokens, self.graphs)
                    if os.environ.get("MINILLM_MIXED_GRAPHS", "1") != "0":
                        self.mixed_graphs = self.device.mixed_graphs(
                            self.model, self.ops, self.kv_pool, self.config.max_num_batched_tokens,
                            self.config.max_num_seqs, max_model_len, self.block_size, self.graphs)
        self.device.synchronize()

    def reset_kv_scales(self) -> None:
        """Undo what dummy steps did to the FP8 scales: 1.0 again (in place: graphs read these
        arrays), and with calculate_kv_scales the next eager forward pass sets them once more."""
        with self.device.compute():
            self.model.kv_scales[...] = 1.0
        self._kv_scales_pending = self.is_fp8_kv_cache and self.config.calculate_kv_scales

    def register_kv_connector(self, worker) -> None:
        """Give a KV connector's runner side the pool; launch() queues its transfers first."""
        worker.register_kv_cache(self.kv_pool, self.device)
        self.kv_connector = worker

    def worker_sentinels(self) -> list[int]:
        """File descriptors that become readable when a worker process of this runner exits (none here)."""
        return []

    def check_workers(self) -> None:
        """Raise if a worker process of this runner has died (none here)."""

    def shutdown(self) -> None:
        """Wait for the device, drop the graphs, pool and weights, and give the memory back."""
        self.device.synchronize()
        if self.mixed_graphs is not None:
            self.mixed_graphs.release()
        if self.piecewise is not None:
            self.piecewise.release()
        if self.verify_graphs is not None:
            self.verify_graphs.release()
        if self.graphs is not None:
            self.graphs.release()
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
        self.graphs = self.verify_graphs = self.piecewise = self.mixed_graphs = None
        self.kv_pool = self.model = self._last_sampled = None
        self.kv_connector = self._deferred = self._picked = self._logits = None
        self.device.release()

    @property
    def max_mixed_graph_tokens(self) -> int | None:
        """The most tokens a mixed step replayed as one captured graph holds (None: no such graphs)."""
        return None if self.mixed_graphs is None else self.mixed_graphs.max_tokens

    def padded_tokens(self, num_tokens: int, is_mixed: bool) -> int:
        """The rows a step of num_tokens tokens runs its GEMMs on: the size of the graph that
        replays it (a decode graph's batch, or a mixed step's token count), else num_tokens."""
        graphs = self.piecewise if is_mixed else self.graphs
        if graphs is None or not graphs.can_run(num_tokens):
            return num_tokens
        return next(s for s in graphs.sizes if s >= num_tokens)

    # ---- one step ----------------------------------------------------------------------------
    def prepare_inputs(self, out: SchedulerOutput):
        """Host-side input ids [T], positions [T], attention metadata, and the token rows whose
        ids are still on the device (the last step's samples): (rows [H] int32, their sequences' ids)."""
        if all(n == 1 for n in out.num_new_tokens):
            return self._prepare_decode(out)
        bs = self.block_size
        spec = out.scheduled_spec_decode_tokens
        ids, hole_rows, hole_ids, row = [], [], [], 0
        for seq, start, n in zip(out.seqs, out.num_computed_tokens, out.num_new_tokens):
            known = seq.token_ids[start:start + n]
            if spec and seq.seq_id in spec:
                known = known + spec[seq.seq_id]      # the drafts follow its last token
            if len(known) < n:
                hole_rows.extend(range(row + len(known), row + n))
                hole_ids.extend([seq.seq_id] * (n - len(known)))
                known = known + [0] * (n - len(known))
            ids.extend(known)
            row += n
        holes = (np.asarray(hole_rows, np.int32), hole_ids)
        # Positions and slots for every token at once: a mixed step holds hundreds of sequences.
        counts = np.asarray(out.num_new_tokens, np.int64)                    # [B]
        starts = np.asarray(out.num_computed_tokens, np.int64)               # [B]
        qsl = np.zeros(len(counts) + 1, np.int64)
        np.cumsum(counts, out=qsl[1:])
        owner = np.repeat(np.arange(len(counts)), counts)                    # [T] sequence of each token
        positions = np.arange(row, dtype=np.int64) - np.repeat(qsl[:-1] - starts, counts)   # [T]
        tables = self.block_tables.table(out.seqs)
        slots = tables[owner, positions // bs].astype(np.int64) * bs + positions % bs
        seq_lens = (starts + counts).astype(np.int32)
        num_decode = next((b for b, n in enumerate(out.num_new_tokens) if n != 1), len(out.seqs))
        meta = AttentionMetadata(
            query_start_loc=qsl.astype(np.int32), seq_lens=seq_lens, block_tables=tables,
            slot_mapping=slots.astype(np.int32), max_query_len=int(counts.max()), max_seq_len=int(seq_lens.max()),
            is_decode_only=False, num_decode_seqs=num_decode,
            prefill_max_seq_len=int(seq_lens[num_decode:].max()) if num_decode < len(out.seqs) else 0)
        return np.asarray(ids, np.int32), positions.astype(np.int32), meta, holes

    def _prepare_decode(self, out: SchedulerOutput):
        """The common step, one token per sequence: the rows' lengths and positions in NumPy, the
        tokens read only for rows whose input is on the host (with async scheduling, none)."""
        bs, seqs = self.block_size, out.seqs
        n = len(seqs)
        pos = np.asarray(out.num_computed_tokens, np.int32)                          # [B]
        lengths = np.fromiter(map(len, map(_token_ids, seqs)), np.int32, n)         # [B] known tokens
        tables = self.block_tables.table(seqs)                                       # [B, W]
        slots = tables[np.arange(n), pos // bs] * bs + pos % bs                      # [B]
        on_device = pos >= lengths                                                   # [B] input still sampled
        if not on_device.any():
            ids = np.fromiter(map(getitem, map(_token_ids, seqs), out.num_computed_tokens), np.int32, n)
            holes = (np.zeros(0, np.int32), [])
        elif on_device.all():
            ids = np.zeros(n, np.int32)
            holes = (np.arange(n, dtype=np.int32), list(map(_seq_id, seqs)))
        else:
            ids = np.fromiter((s.token_ids[p] if p < len(s.token_ids) else 0
                               for s, p in zip(seqs, out.num_computed_tokens)), np.int32, n)
            rows = np.flatnonzero(on_device)
            holes = (rows.astype(np.int32), [seqs[b].seq_id for b in rows.tolist()])
        meta = AttentionMetadata(
            query_start_loc=np.arange(n + 1, dtype=np.int32), seq_lens=pos + 1,
            block_tables=tables, slot_mapping=slots.astype(np.int32),
            max_query_len=1, max_seq_len=int(pos.max()) + 1, is_decode_only=True)
        return ids, pos, meta, holes

    def _to_device(self, meta: AttentionMetadata) -> AttentionMetadata:
        """meta with its arrays on the device: one upload of one int32 array, of which they are
        views (each starting on a 16-byte boundary); a mixed step's host time is mostly launches."""
        parts = [np.asarray(a, np.int32).reshape(-1) for a in
                 (meta.query_start_loc, meta.seq_lens, meta.block_tables, meta.slot_mapping)]
        ends = np.cumsum([0] + [-(-p.size // 4) * 4 for p in parts])          # [5] padded offsets
        flat = np.zeros(int(ends[-1]), np.int32)
        for p, start in zip(parts, ends):
            flat[start:start + p.size] = p
        dev = self.ops.asarray(flat)
        qsl, seq_lens, tables, slots = (dev[s:s + p.size] for p, s in zip(parts, ends))
        return dataclasses.replace(meta, query_start_loc=qsl, seq_lens=seq_lens, slot_mapping=slots,
                                   block_tables=tables.reshape(np.shape(meta.block_tables)))

    def launch(self, out: SchedulerOutput, grammar_bitmask=None, defer_sampling: bool = False) -> "InFlightStep":
        """Queue one forward pass and the sampling of out.sampling_rows; nothing waits for the
        device here, so the host can go on while the step runs.

        grammar_bitmask: structured outputs' callback, called once the forward pass is queued (the
        host fills the masks while the device computes), returning a GrammarBitmask or None.
        defer_sampling: queue the forward pass only (a step without drafts, not profiled); its
        sampling, callback first, is queued by sample_deferred(), which the next launch and the
        step's wait() call first: the masks' host work then overlaps the host's next step."""
        self.sample_deferred()               # its tokens may be this step's inputs
        t0 = time.perf_counter()
        if self.kv_connector is not None:    # before any of the step's work: its forward reads the loads
            self.kv_connector.start_load_kv(out.kv_connector_metadata)
        ids, positions, meta, holes = self.prepare_inputs(out)
        patch = self._placeholder_patch(holes)
        seqs = out.sampling_seqs
        spec = self.verifier.metadata(out, meta.query_start_loc) if out.scheduled_spec_decode_tokens else None
        prompt_plan = plan_prompt_logprobs(out, meta.query_start_loc) if out.num_prefill_tokens else None
        t1 = time.perf_counter()
        with self.device.compute():
            timer = self.device.timer() if self.profile else None
            logits = self.compute_logits(ids, positions, meta, out.sampling_rows, patch,
                                         spec.logits_indices if spec is not None else None, prompt_plan)
            prompt_logprobs, self._prompt_logprobs = self._prompt_logprobs, None
            if timer:
                timer.mark()
            t2 = time.perf_counter()
            if logits is None:
                self._last_sampled = None
                return InFlightStep([], None, None, [], {"prepare": t1 - t0, "forward_host": t2 - t1}, timer,
                                    prompt_logprobs=prompt_logprobs)
            if defer_sampling and spec is None and timer is None:
                self._last_sampled = None
                step = InFlightStep(seqs, None, None, [], {"prepare": t1 - t0, "forward_host": t2 - t1}, None,
                                    prompt_logprobs=prompt_logprobs)
                step.sampled_by = self
                self._deferred = (step, logits, grammar_bitmask)
                return step
            mask = grammar_bitmask() if grammar_bitmask is not None else None
            t3 = time.perf_counter()
            if spec is None:
                sampled = self.sampler.sample_no_sync(logits, seqs, mask)
                self._last_sampled = (sampled.token_ids, list(map(_seq_id, seqs)), None)
            else:
                if mask is not None:        # a mask for each verified position of a constrained sequence
                    self.sampler.apply_grammar_bitmask(logits, mask.at_verify_rows(spec.row_starts))
                sampled = self.verifier.sample_no_sync(logits, spec, seqs)
                # Only a sequence without drafts has its next input among the rows before acceptance.
                plain = [(s.seq_id, int(r)) for s, r, d in zip(seqs, spec.row_starts, spec.num_draft_tokens) if not d]
                self._last_sampled = (sampled.token_ids, [sid for sid, _ in plain],
                                      np.asarray([r for _, r in plain], np.int32))
            if timer:
                timer.mark()
            tokens = self.device.to_host_async(sampled.token_ids)
            logprobs = self.device.to_host_async(sampled.logprobs) if sampled.logprobs is not None else None
        host = {"prepare": t1 - t0, "forward_host": t2 - t1, "sample_host": time.perf_counter() - t3}
        verify = (self.verifier, spec) if spec is not None else None
        return InFlightStep(seqs, tokens, logprobs, sampled.logprob_rows, host, timer, verify, prompt_logprobs)

    def sample_deferred(self) -> None:
        """Queue the sampling of the step launched with defer_sampling (nothing when there is none):
        its grammar_bitmask callback, then the sampler."""
        if self._deferred is None:
            return
        step, logits, grammar_bitmask = self._deferred
        self._deferred = step.sampled_by = None
        with self.device.compute():
            mask = grammar_bitmask() if grammar_bitmask is not None else None
            t0 = time.perf_counter()
            sampled = self.sampler.sample_no_sync(logits, step.seqs, mask)
            self._last_sampled = (sampled.token_ids, list(map(_seq_id, step.seqs)), None)
            step.set_sampled(self.device.to_host_async(sampled.token_ids),
                             self.device.to_host_async(sampled.logprobs) if sampled.logprobs is not None else None,
                             sampled.logprob_rows, time.perf_counter() - t0)

    def _placeholder_patch(self, holes: tuple[np.ndarray, list[int]]):
        """(dst token rows, src rows of the last sampled ids, those ids) for inputs on the device.
        holes: (token rows [H] int32, the seq_id of each)."""
        dst, hole_ids = holes
        if not hole_ids:
            return None
        if self._last_sampled is None:
            raise RuntimeError("an input token is still on the device but no step sampled it")
        last_ids, last_seq_ids, last_rows = self._last_sampled
        if hole_ids == last_seq_ids:          # most steps: the batch the last step sampled, in its order
            src = np.arange(len(hole_ids), dtype=np.int32) if last_rows is None else last_rows
            return dst, src, last_ids
        row_of = dict(zip(last_seq_ids, range(len(last_seq_ids))))
        missing = [sid for sid in hole_ids if sid not in row_of]
        if missing:
            raise RuntimeError(f"input tokens of sequences {missing} were not sampled by the last step")
        src = np.fromiter(map(row_of.__getitem__, hole_ids), np.int32, len(hole_ids))
        return dst, src if last_rows is None else last_rows[src], last_ids

    def _apply_patch(self, ids_dev, patch) -> None:
        if patch is not None:
            dst, src, last_ids = patch
            ids_dev[self.ops.asarray(dst)] = last_ids[self.ops.asarray(src)]

    def compute_logits(self, ids, positions, meta: AttentionMetadata, rows: list[int], patch=None,
                       logits_indices=None, prompt_plan=None):
        """Logits [len(rows), V] of the sampling rows (None when no row samples), or of the token
        rows logits_indices [N] names (a step verifying drafts). With prompt_plan (rows that score
        prompt tokens) their log-probabilities are queued too (taken from _prompt_logprobs)."""
        calibrate = self._kv_scales_pending      # the first step runs eagerly, before anything is stored
        whole = calibrate or prompt_plan is not None   # a path that has every row's hidden state
        if meta.is_decode_only and self.graphs is not None and self.graphs.can_run(len(ids)) and not whole:
            logits = self.graphs.run(ids, meta, lambda ids_dev: self._apply_patch(ids_dev, patch))
            if len(rows) < len(ids):
                logits = logits[self.ops.asarray(np.asarray(rows, np.int32))] if rows else None
            return logits
        if (self.verify_graphs is not None and not whole and rows
                and self.verify_graphs.can_run(meta, len(ids))):
            logits = self.verify_graphs.run(ids, positions, meta, lambda ids_dev: self._apply_patch(ids_dev, patch))
            if logits_indices is None:
                logits_indices = meta.query_start_loc[np.asarray(rows) + 1] - 1
            if len(logits_indices) == len(ids) and np.array_equal(logits_indices, np.arange(len(ids))):
                return logits                                    # a verify step samples every row
            return logits[self.ops.asarray(np.asarray(logits_indices, np.int32))]
        if (self.piecewise is not None and not calibrate and not meta.is_decode_only
                and self.piecewise.can_run(len(ids))):
            fill = lambda ids_dev: self._apply_patch(ids_dev, patch)    # noqa: E731
            if self.mixed_graphs is not None and self.mixed_graphs.can_run(meta, len(ids)):
                hidden = self.mixed_graphs.run(ids, positions, meta, fill)
            else:
                hidden = self.piecewise.run(ids, positions, meta.slot_mapping, self._to_device(meta), fill)
        else:
            ids_dev = self.ops.asarray(ids)
            self._apply_patch(ids_dev, patch)
            self._kv_scales_pending = False
            hidden = self.model.forward(ids_dev, self.ops.asarray(positions), self._to_device(meta), self.kv_pool,
                                        calculate_kv_scales=calibrate)
        if prompt_plan is not None:
            self._prompt_logprobs = compute_prompt_logprobs(prompt_plan, hidden, self.model, self.ops, self.device)
        if not rows:
            return None
        if logits_indices is None:
            logits_indices = meta.query_start_loc[np.asarray(rows) + 1] - 1
        n, index = len(logits_indices), self.ops.asarray(np.asarray(logits_indices, np.int32))
        if self._logits is None or n > len(self._logits):
            return self.model.compute_logits(hidden[index])                              # [N, V]
        picked = self.ops.xp.take(hidden, index, axis=0, out=self._picked[:n])          # [N, D]
        return self.model.compute_logits(picked, out=self._logits[:n])                  # [N, V]

    def memory_stats(self) -> MemoryStats:
        """Weights, KV pool and everything else, in bytes."""
        kv = int(self.kv_pool.nbytes) if self.kv_pool is not None else 0
        total = self.device.used_bytes()
        other = max(total - self.weights_bytes - kv, 0)
        return MemoryStats(self.weights_bytes, kv, other, max(total, self.weights_bytes + kv))


class InFlightStep:
    """A launched step: its sampling sequences and the read-backs of their tokens."""

    def __init__(self, seqs, tokens, logprobs, logprob_rows: list[int], host_timings: dict[str, float], timer,
                 verify=None, prompt_logprobs=None):
        self.seqs, self._tokens, self._logprobs, self._logprob_rows = seqs, tokens, logprobs, logprob_rows
        self._host_timings, self._timer = host_timings, timer
        self._verify = verify            # (DraftVerifier, SpecDecodeMetadata) of a step with drafts
        self._prompt_logprobs = prompt_logprobs   # PendingPromptLogprobs, when a row scores its prompt
        self.sampled_by = None           # the runner that still has to queue its sampling (defer_sampling)

    def set_sampled(self, tokens, logprobs, logprob_rows: list[int], sample_host_s: float) -> None:
        """The read-backs of a deferred sampling, once it is queued."""
        self._tokens, self._logprobs, self._logprob_rows = tokens, logprobs, logprob_rows
        self._host_timings["sample_host"] = sample_host_s

    def wait(self) -> StepOutput:
        """The step's tokens (blocks until the device has produced them; queues a deferred
        sampling first)."""
        if self.sampled_by is not None:
            self.sampled_by.sample_deferred()
        t0 = time.perf_counter()
        timings = dict(self._host_timings)
        sampled, logprobs, accepted = {}, {}, {}
        if self._tokens is not None:
            ids = self._tokens.result()
            host = self._logprobs.result() if self._logprobs is not None else None
            if self._verify is not None:
                verifier, meta = self._verify
                sampled, logprobs, accepted = verifier.accept(ids, host, self._logprob_rows, meta, self.seqs)
            else:
                tokens = ids.tolist()
                dicts = Sampler.logprob_dicts(host, self._logprob_rows, self.seqs, tokens)
                sampled = {s.seq_id: [t] for s, t in zip(self.seqs, tokens)}
                logprobs = {s.seq_id: [lp] for s, lp in zip(self.seqs, dicts) if lp is not None}
        if self._timer is not None:
            for name, seconds in zip(("forward_device", "sample_device"), self._timer.elapsed()):
                timings[name] = seconds
        prompt = self._prompt_logprobs.result() if self._prompt_logprobs is not None else {}
        timings["wait"] = time.perf_counter() - t0
        return StepOutput(sampled=sampled, logprobs=logprobs, timings=timings, num_accepted_tokens=accepted,
                          prompt_logprobs=prompt)
