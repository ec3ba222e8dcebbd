"""`LLMEngine`: continuous-batching generation over one model in this process.

One step = schedule (decodes, then prompt chunks, within the token budget; see scheduler.py) -> run
the model (optionally as two interleaved micro-batches) -> commit the chunks (prefix cache keys) ->
sample for the requests whose chunk ended their prompt (or that decoded) and update.

Thread safety: every public method takes one lock, so `add_request`, `abort`, `set_moe_knobs` and
`has_unfinished` may be called from any thread (e.g. an asyncio loop) while another thread runs
`step()`; they wait for the running step to finish and take effect between steps.
"""
from __future__ import annotations

import threading
import uuid
from typing import Sequence

import torch

from moemesh.checkpoint import CheckpointReader
from moemesh.config import ModelConfig
from moemesh.engine.config import EngineConfig
from moemesh.engine.device import DeviceReader, on_device, select_device
from moemesh.engine.kv_cache import KVCache
from moemesh.engine.outputs import GenerationResult, StepFailed, StepOutput
from moemesh.engine.recurrent_state import RecurrentStateStore
from moemesh.engine.request import Request
from moemesh.engine.sampler import sample, target_logprobs, top_logprobs
from moemesh.engine.sampling_params import SamplingParams
from moemesh.engine.scheduler import SchedulerStats, ScheduledChunk, Scheduler
from moemesh.models.batch import BatchMeta, SeqSlice
from moemesh.models.registry import get_architecture, load_model_config
from moemesh.moe.expert_compute import ExpertCompute
from moemesh.contracts.knobs import MoeKnobs
from moemesh.moe.local_experts import LocalExperts
from moemesh.token_ids import check_token_ids


class LLMEngine:
    def __init__(self, config: EngineConfig, expert_compute: ExpertCompute | None = None) -> None:
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.device = select_device(config.device)  # the current CUDA device is set before any allocation
        self.model_config = load_model_config(config.model_dir)
        cfg = self.model_config
        reader = CheckpointReader(config.model_dir)
        self.dtype = config.compute_dtype(cfg.dtype)
        if config.moe_top_k is not None and config.moe_top_k > cfg.num_experts:
            raise ValueError(f"moe_top_k must be <= num_experts ({cfg.num_experts}), got {config.moe_top_k}")
        self.model, self.experts = build_model(
            cfg, reader, self.dtype, self.device, config.experts_dtype, expert_compute, config.pack_experts,
            config.all_experts_path, config.dense_dtype,
        )
        self.max_model_len = min(cfg.max_position_embeddings, config.max_model_len or cfg.max_position_embeddings)
        kv_tokens = min(config.kv_cache_tokens, config.max_num_seqs * self.max_model_len)
        num_blocks = -(-kv_tokens // config.block_size)
        # A model holding per-sequence state beside the KV cache (recurrent layers) sets
        # `supports_prefix_cache = False`: its cache hits would skip the state the skipped tokens make.
        self.prefix_caching = config.prefix_cache and getattr(self.model, "supports_prefix_cache", True)
        # ... and declares that state: one slot per running sequence, its layers need no KV blocks.
        self.state = None
        if hasattr(self.model, "recurrent_state_spec"):
            self.state = RecurrentStateStore(self.model.recurrent_state_spec(), config.max_num_seqs, self.dtype, self.device)
        stateful = self.state.layers if self.state is not None else {}
        self.kv = KVCache(
            cfg.num_layers, num_blocks, config.block_size, cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device,
            prefix_caching=self.prefix_caching, skip_layers=stateful.keys(),
        )
        self.caches = [stateful.get(i, kv) for i, kv in enumerate(self.kv.layers)]  # what each layer reads and writes
        self.scheduler = Scheduler(
            self.kv.allocator, config.block_size, config.max_num_seqs, config.max_num_batched_tokens,
            self.state.slots if self.state is not None else None,
        )
        self.knobs = MoeKnobs(top_k=config.moe_top_k, capacity_factor=config.capacity_factor)
        self._lock = threading.RLock()
        self._pending: list[StepOutput] = []  # abort outputs handed out by the next step()

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        params.check_fits(len(prompt_token_ids), self.max_model_len)  # the length first: no work on an oversized prompt
        ids = check_token_ids(prompt_token_ids, self.model_config.vocab_size, "prompt_token_ids")
        media = self.model_config.media_token_ids
        at = next((i for i, t in enumerate(ids) if t in media), None) if media else None
        if at is not None:
            raise ValueError(
                f"prompt_token_ids[{at}]: {ids[at]} is an image/video placeholder of {self.model_config.architecture}; "
                "this server runs its language model only and takes no image or video input"
            )
        total_blocks = self.kv.allocator.num_blocks
        if self.kv.blocks_for(len(ids) + params.max_new_tokens) > total_blocks:
            raise ValueError(
                f"max_new_tokens: prompt + max_new_tokens needs more KV cache than the engine has "
                f"({total_blocks * self.config.block_size} tokens)"
            )
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop |= set(self.model_config.eos_token_ids)
        gen = None
        if not params.greedy:
            gen = torch.Generator(device=self.device)
            if params.seed is None:
                gen.seed()
            else:
                gen.manual_seed(params.seed)
        req = Request(request_id, ids, params, gen, frozenset(stop), prompt_logprobs=[None] if params.prompt_logprobs else None)
        with self._lock:
            if self.scheduler.find(request_id) is not None:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self.scheduler.add(req)

    def abort(self, request_id: str) -> bool:
        """Stops a request and frees its KV blocks at once; the next step() reports it with finish_reason
        "abort". Returns False when no such request is unfinished."""
        with self._lock:
            req = self.scheduler.find(request_id)
            if req is None:
                return False
            self.scheduler.remove(req)
            self._pending.append(StepOutput(request_id, None, None, True, "abort"))
            return True

    def has_unfinished(self) -> bool:
        with self._lock:
            return self.scheduler.has_unfinished() or bool(self._pending)

    def set_moe_knobs(self, top_k: int | None = None, capacity_factor: float | None = None, layer: int | None = None) -> None:
        """Changes top-k and/or capacity factor (for all MoE layers, or one); applies from the next step."""
        cfg = self.model_config
        if top_k is not None and not 1 <= top_k <= cfg.num_experts:
            raise ValueError(f"top_k must be in [1, {cfg.num_experts}], got {top_k}")
        if layer is not None and not cfg.is_moe_layer(layer):
            raise ValueError(f"layer {layer} is not a MoE layer (MoE layers: {list(cfg.moe_layers)})")
        with self._lock:
            self.knobs = self.knobs.updated(top_k=top_k, capacity_factor=capacity_factor, layer=layer)

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new sequence can get (free, or cached and held by no sequence)."""
        return self.kv.allocator.num_free

    @property
    def stats(self) -> SchedulerStats:
        """The scheduler's counters since start: prefix cache lookups and hits, preemptions (read only)."""
        return self.scheduler.stats

    # ---- the step -------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """One step -> an output per sequence that produced a token, finished or failed in it.

        A sequence whose logits or sampling fail gets an output with finish_reason "error" and its
        `error`, alone. When the model run itself fails (e.g. an expert server is gone), the
        sequences in the batch are removed and `StepFailed` names them; the others stay."""
        with self._lock, torch.inference_mode(), on_device(self.device):
            outputs, self._pending = self._pending, []
            batch = self.scheduler.schedule()
            if batch.empty:
                return outputs
            try:
                return outputs + self._run_batch(batch)
            except Exception as exc:
                for chunk in batch.chunks:
                    self.scheduler.remove(chunk.request)
                self._pending = outputs + self._pending  # aborts reported before the failure still go out
                raise StepFailed(tuple(dict.fromkeys(c.request.request_id for c in batch.chunks)), exc) from exc

    def _run_batch(self, batch) -> list[StepOutput]:
        logits = self._run([self._slice(c) for c in batch.chunks])  # one [rows, V] tensor per chunk
        done: list[tuple[Request, torch.Tensor]] = []
        for chunk, rows in zip(batch.chunks, logits):
            if chunk.request.prompt_logprobs_pending:
                add_prompt_logprobs(chunk.request, chunk.start, rows)
            self.scheduler.commit(chunk)
            if chunk.completes:
                done.append((chunk.request, rows[-1]))
        if not done:  # only prompt chunks that do not end their prompt
            return []
        reqs = [r for r, _ in done]
        last = done[0][1][None] if len(done) == 1 else torch.stack([row for _, row in done])  # [B, V]
        sampled = sample(last, [r.params for r in reqs], [r.generator for r in reqs])
        tops = top_logprobs(last, [r.params.top_logprobs for r in reqs])
        return [self._fail(req, res) if isinstance(res, Exception) else self._update(req, *res, top)
                for req, res, top in zip(reqs, sampled, tops)]

    def _slice(self, chunk: ScheduledChunk) -> SeqSlice:
        req = chunk.request
        logits = "last" if chunk.completes else "none"
        if req.prompt_logprobs_pending and chunk.start < len(req.prompt_token_ids) - 1:
            logits = "all"
        return SeqSlice(chunk.token_ids, chunk.start, req.block_table, logits=logits, state_slot=req.state_slot)

    def _run(self, slices: list[SeqSlice]) -> list[torch.Tensor]:
        """Runs the model; returns each slice's logits rows [n, V] (float32)."""
        cfg, bs = self.model_config, self.config.block_size
        groups = split_micro_batches(slices, self.config.micro_batches)
        metas = [BatchMeta.build(g, bs, cfg.sliding_window) for g in groups]
        stages = [self.model.forward_stages(m, self.caches, self.experts, self.knobs) for m in metas]
        results = run_interleaved(stages)
        by_slice: dict[int, torch.Tensor] = {}
        for group, meta, logits in zip(groups, metas, results):
            for s, (first, n) in zip(group, meta.logits_rows):
                by_slice[id(s)] = logits[first : first + n]
        return [by_slice[id(s)] for s in slices]

    def _fail(self, req: Request, error: Exception) -> StepOutput:
        """`req` failed alone (its logits or sampling): it leaves the batch and frees its blocks."""
        req.finish_reason = "error"
        self.scheduler.remove(req)
        return StepOutput(req.request_id, None, None, True, "error", error=error)

    def _update(self, req: Request, token: int, logprob: float, top: list[tuple[int, float]] | None = None) -> StepOutput:
        first = not req.output_token_ids
        plp = None
        if req.prompt_logprobs_pending:
            plp, req.prompt_logprobs = req.prompt_logprobs, None
        req.output_token_ids.append(token)
        req.logprobs.append(logprob)
        if token in req.stop_ids:
            req.finish_reason = "stop"
        elif len(req.output_token_ids) >= req.params.max_new_tokens:
            req.finish_reason = "length"
        if req.finish_reason is not None:
            self.scheduler.remove(req)
        return StepOutput(
            req.request_id, token, logprob, req.finish_reason is not None, req.finish_reason, plp,
            cached_tokens=req.cached_tokens if first else None, top_logprobs=top,
        )

    # ---- convenience ----------------------------------------------------------------------------
    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[GenerationResult]:
        """Runs every prompt to completion (continuous batching); results in the order of `prompts`."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise ValueError(f"params: got {len(plist)} SamplingParams for {len(prompts)} prompts")
        ids = [f"generate-{uuid.uuid4().hex}" for _ in prompts]
        state = {rid: {"tokens": [], "logprobs": [], "prompt_logprobs": None, "reason": None, "cached": 0} for rid in ids}
        added: list[str] = []
        try:
            for rid, prompt, p in zip(ids, prompts, plist):
                self.add_request(rid, prompt, p)
                added.append(rid)
        except ValueError:
            for rid in added:  # all or nothing: do not leave earlier prompts running
                self.abort(rid)
            with self._lock:
                self._pending = [o for o in self._pending if o.request_id not in added]
            raise
        remaining = set(ids)
        while remaining:
            for out in self.step():
                s = state.get(out.request_id)
                if s is None:
                    continue
                if out.error is not None:  # one failed: stop the others, report it
                    for rid in remaining - {out.request_id}:
                        self.abort(rid)
                    with self._lock:
                        self._pending = [o for o in self._pending if o.request_id not in remaining]
                    raise out.error
                if out.token_id is not None:
                    s["tokens"].append(out.token_id)
                    s["logprobs"].append(out.logprob)
                if out.prompt_logprobs is not None:
                    s["prompt_logprobs"] = out.prompt_logprobs
                if out.cached_tokens is not None:
                    s["cached"] = out.cached_tokens
                if out.finished:
                    s["reason"] = out.finish_reason
                    remaining.discard(out.request_id)
        return [
            GenerationResult(rid, list(p), s["tokens"], s["logprobs"], s["reason"], s["prompt_logprobs"], s["cached"])
            for rid, p, s in ((rid, p, state[rid]) for rid, p in zip(ids, prompts))
        ]


def build_model(
    cfg: ModelConfig, reader: CheckpointReader, dtype: torch.dtype, device: torch.device,
    experts_dtype: str | None = None, expert_compute: ExpertCompute | None = None, pack_experts: bool | None = None,
    all_experts_path: bool = True, dense_dtype: str | None = None,
) -> tuple[object, ExpertCompute]:
    """The model (and, without `expert_compute`, its in-process experts) with every weight and table on
    `device`: checkpoint tensors are moved there as they are read, factory calls allocate there.
    dense_dtype: the format of the model's dense linears (`EngineConfig.dense_dtype`)."""
    if device.type != "cpu":
        reader = DeviceReader(reader, device)
    with torch.inference_mode(), on_device(device):
        model = get_architecture(cfg.architecture).model_class(cfg, reader, dtype, dense_dtype=dense_dtype)
        experts = expert_compute or LocalExperts.from_checkpoint(reader, cfg, dtype, experts_dtype, pack_experts, all_experts_path)
    return model, experts


def add_prompt_logprobs(req: Request, start: int, rows: torch.Tensor) -> None:
    """rows [n, V]: the logits of positions start.. of a chunk of `req`'s prompt -> the log-probabilities
    of the prompt tokens they predict, stored by position in req.prompt_logprobs (a chunk computed
    again after a preemption overwrites its earlier values)."""
    prompt = req.prompt_token_ids
    m = min(rows.shape[0], len(prompt) - 1 - start)  # rows whose next token is still in the prompt
    del req.prompt_logprobs[start + 1 :]
    if m > 0:
        req.prompt_logprobs += target_logprobs(rows[:m], prompt[start + 1 : start + 1 + m])


def split_micro_batches(slices: list[SeqSlice], n: int) -> list[list[SeqSlice]]:
    """Split into up to n non-empty groups, alternating so each gets a share of decodes and prefills
    (decodes stay first within each group)."""
    if n <= 1 or len(slices) < 2:
        return [slices]
    groups: list[list[SeqSlice]] = [[] for _ in range(n)]
    for i, s in enumerate(slices):
        groups[i % n].append(s)
    return [g for g in groups if g]


def run_interleaved(stages: list) -> list[torch.Tensor]:
    """Drive forward_stages generators round-robin, one MoE layer at a time: while one micro-batch's
    experts compute (a future in flight), the next micro-batch runs its attention. Returns each result."""
    results: list[torch.Tensor | None] = [None] * len(stages)
    live = list(range(len(stages)))
    while live:
        for i in list(live):
            try:
                next(stages[i])
            except StopIteration as done:
                results[i] = done.value
                live.remove(i)
    return results
