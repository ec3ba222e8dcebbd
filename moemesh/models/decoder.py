"""The Llama-family MoE decoder (Mixtral, Qwen3-MoE): weights, and a forward split at each MoE layer.

Shape legend: T tokens, H hidden, E experts, K top-k, R logits rows, V vocab.

`forward_stages` is a generator: it runs up to a MoE layer's expert submit (attention, gate, dispatch
plan, `ExpertCompute.submit`), yields, and on resumption adds the experts' combined output.
Driving two such generators alternately overlaps one micro-batch's attention with the other's experts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Generator, Sequence

import torch
from torch import Tensor

from moemesh.checkpoint import CheckpointReader
from moemesh.checkpoint.fp8_dequant import weights_reader
from moemesh.checkpoint.progress import load_layers
from moemesh.config import ModelConfig
from moemesh.models.attention import AttentionWeights, attention
from moemesh.models.batch import BatchMeta
from moemesh.models.layers import (
    RotaryTable, add_rms_norm, as_tensor, cat_rows, held_bytes, linear, matmul_layout, packed_for_linear, rms_norm,
    rope_for_step, silu_mlp,
)
from kernels.cpu.linear_cpu import holds_plain
from kernels.cpu.step_ops import DecodeExperts, DecodeLayer, decode_layer, decode_layer_weights, decode_layers_experts
from kernels.prepare import check_dense_dtype
from moemesh.moe.dispatch import DispatchPlan, route
from moemesh.moe.expert_compute import ExpertCompute, expert_output
from moemesh.moe.local_experts import LocalExperts
from moemesh.contracts.knobs import MoeKnobs
from moemesh.models.stages import run_to_end


@dataclass(frozen=True)
class WeightNames:
    """Checkpoint names of one family ({layer} is filled in)."""

    router: str  # MoE gate weight [E, H]
    dense_mlp: str  # prefix of gate_proj/up_proj/down_proj for dense layers
    qk_norm: bool


@dataclass(frozen=True)
class DecoderLayer:
    input_norm: Tensor  # [H]
    attn: AttentionWeights
    post_norm: Tensor  # [H]
    router: Tensor | None  # [E, H] for MoE layers
    mlp_gate_up: Tensor | None  # [2I, H] for dense layers (or as `matmul_layout` holds it)
    mlp_down: Tensor | None  # [H, I] for dense layers (or as `matmul_layout` holds it)
    # the same weights handed to the compiled kernels' one-call attention half of a decode step
    # (`kernels.cpu.step_ops.decode_layer`), where they read them all
    fused: DecodeLayer | None = None


@dataclass
class OneCallRun:
    """Consecutive MoE layers of a decode step in one compiled call: each layer's experts as the
    kernels hold them and its top-k, in layer order."""

    held: list[DecodeExperts]
    top_ks: list[int]


class MoeDecoderLM:
    """Non-expert weights of a Llama-family MoE model; experts are reached through an ExpertCompute.
    dense_dtype (`EngineConfig.dense_dtype`): the format the attention projections, dense MLPs and LM
    head are held in (None: the compute dtype; "fp8": BlockwiseFP8, see `matmul_layout`); the
    embedding, router and norms stay in the compute dtype."""

    names: WeightNames  # set by each architecture's subclass

    def __init__(self, cfg: ModelConfig, reader: CheckpointReader, dtype: torch.dtype, dense_dtype: str | None = None) -> None:
        check_dense_dtype(dense_dtype)
        if cfg.rope_scaling is not None:
            raise ValueError(
                f"rope_scaling: {cfg.architecture} supports the default rope only, got {cfg.rope_scaling.get('rope_type', cfg.rope_scaling)!r}"
            )
        self.cfg = cfg
        self.dtype = dtype
        self.dense_dtype = dense_dtype
        # BlockwiseFP8 non-expert weights are dequantized at load, or kept as stored for dense_dtype "fp8"
        reader = weights_reader(reader, cfg.raw, dense_dtype)
        h, v = cfg.hidden_size, cfg.vocab_size
        embed = as_tensor(reader.get("model.embed_tokens.weight", shape=(v, h), dtype=dtype), dtype)  # [V, H]
        self.layers: list[DecoderLayer] = load_layers(cfg.num_layers, lambda layer: self._load_layer(reader, layer))
        self.norm = reader.get("model.norm.weight", shape=(h,), dtype=dtype)
        if dense_dtype is not None:
            # The LM head in its own quantized copy (tied: the embedding stays in the compute dtype, it is indexed).
            tied = cfg.tie_word_embeddings or not reader.has("lm_head.weight")
            self.embed = embed
            self.lm_head = matmul_layout(embed if tied else reader.get("lm_head.weight", shape=(v, h), dtype=dtype), dense_dtype=dense_dtype)
        elif cfg.tie_word_embeddings or not reader.has("lm_head.weight"):
            # Tied: the LM head is the step's largest matrix (the demo's 49152 x 576 is a fifth of its
            # weights); where the matmul layout is a oneDNN-packed one it is faster from 1 to 16 rows,
            # worth a second copy. Else one copy serves both, in the matmul layout (plain where the
            # compiled kernels read it faster: `holds_plain`).
            cpu = embed.device.type == "cpu"
            packed = packed_for_linear(embed) if cpu and not holds_plain(embed.dtype, embed.device) else None
            if packed is not None:
                self.embed, self.lm_head = embed, packed
            else:
                self.lm_head = self.embed = matmul_layout(embed, pack=False)  # one copy, also indexed
        else:
            self.embed = embed
            self.lm_head = matmul_layout(reader.get("lm_head.weight", shape=(v, h), dtype=dtype))  # [V, H]
        self.rope = RotaryTable.build(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)

    def _load_layer(self, reader: CheckpointReader, layer: int) -> DecoderLayer:
        cfg, dt, fmt = self.cfg, self.dtype, self.dense_dtype
        h, d, nh, kvh = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        p = f"model.layers.{layer}"
        a = f"{p}.self_attn"
        qkv = cat_rows(
            [
                reader.get(f"{a}.q_proj.weight", shape=(nh * d, h), dtype=dt),
                reader.get(f"{a}.k_proj.weight", shape=(kvh * d, h), dtype=dt),
                reader.get(f"{a}.v_proj.weight", shape=(kvh * d, h), dtype=dt),
            ]
        )
        bias = None
        if reader.has(f"{a}.q_proj.bias"):
            bias = torch.cat([reader.get(f"{a}.{n}_proj.bias", dtype=dt) for n in ("q", "k", "v")])
        attn = AttentionWeights(
            qkv=matmul_layout(qkv, dense_dtype=fmt),
            o=matmul_layout(reader.get(f"{a}.o_proj.weight", shape=(h, nh * d), dtype=dt), dense_dtype=fmt),
            num_heads=nh,
            num_kv_heads=kvh,
            head_dim=d,
            qkv_bias=bias,
            q_norm=reader.get(f"{a}.q_norm.weight", shape=(d,), dtype=dt) if self.names.qk_norm else None,
            k_norm=reader.get(f"{a}.k_norm.weight", shape=(d,), dtype=dt) if self.names.qk_norm else None,
            norm_eps=cfg.rms_norm_eps,
        )
        router = gate_up = down = None
        if cfg.is_moe_layer(layer):
            router = as_tensor(reader.get(self.names.router.format(layer=layer), shape=(cfg.num_experts, h), dtype=dt), dt)
        else:
            m, i = self.names.dense_mlp.format(layer=layer), cfg.intermediate_size
            gate_up = cat_rows(
                [reader.get(f"{m}.gate_proj.weight", shape=(i, h), dtype=dt), reader.get(f"{m}.up_proj.weight", shape=(i, h), dtype=dt)]
            )
            gate_up = matmul_layout(gate_up, dense_dtype=fmt)
            down = matmul_layout(reader.get(f"{m}.down_proj.weight", shape=(h, i), dtype=dt), dense_dtype=fmt)
        input_norm = reader.get(f"{p}.input_layernorm.weight", shape=(h,), dtype=dt)
        post_norm = reader.get(f"{p}.post_attention_layernorm.weight", shape=(h,), dtype=dt)
        fused = decode_layer_weights(
            input_norm, post_norm, attn.qkv, attn.o, router, attn.qkv_bias, attn.qk_norm, nh, kvh, d, cfg.rms_norm_eps, attn.norm_eps,
        )
        return DecoderLayer(input_norm, attn, post_norm, router, gate_up, down, fused)

    def weight_bytes(self) -> int:
        """Bytes of non-expert weights read per decode step (embedding rows excluded, LM head included)."""
        total = held_bytes(self.lm_head) + held_bytes(self.norm)
        for lyr in self.layers:
            for t in (lyr.input_norm, lyr.post_norm, lyr.attn.qkv, lyr.attn.o, lyr.router, lyr.mlp_gate_up, lyr.mlp_down):
                total += held_bytes(t)
        return total

    def forward_stages(
        self,
        meta: BatchMeta,
        kv_caches: Sequence[tuple[Tensor, Tensor]],
        experts: ExpertCompute,
        knobs: MoeKnobs,
    ) -> Generator[None, None, Tensor]:
        """Yields once per MoE layer (after submitting to the experts; after a one-call run of MoE
        layers, once for each layer it ran); returns logits [R, V] float32 for the rows meta.logits_idx."""
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        x = self.embed[meta.input_ids]  # [T, H]
        rope_cs = rope_for_step(self.rope, meta.positions, self.dtype)  # shared by every layer
        mlp_out = None  # [T, H] the previous layer's MLP output, added to x together with the next norm
        decoding = 0 < meta.num_decode == meta.num_tokens and not meta.chunks  # one token per sequence, each after its cache
        runs = self._one_call_runs(experts, knobs) if decoding else {}
        done = 0  # layers before this one ran in a one-call run
        for idx, lyr in enumerate(self.layers):
            if idx < done:
                continue
            run = runs.get(idx)
            if run is not None:  # consecutive MoE layers' whole decode step in one call: attention, plan, experts
                layers = range(idx, idx + len(run.held))
                both = decode_layers_experts(
                    [self.layers[i].fused for i in layers], run.held, x, mlp_out, *rope_cs, [kv_caches[i][0] for i in layers],
                    [kv_caches[i][1] for i in layers], meta.slot_mapping, meta.decode_block_tables, meta.decode_mask,
                    run.top_ks, cfg.norm_topk_prob,
                )
                if both is not None:
                    x, mlp_out = both
                    for _ in layers:
                        yield
                    done = layers.stop
                    continue
                runs = {}  # not taken (the rows, dtype or variant): every layer runs as below
            k_cache, v_cache = kv_caches[idx]
            lk = knobs.for_layer(idx) if lyr.router is not None else None
            top_k = (lk.top_k or cfg.top_k) if lk is not None else 0
            routes_here = lk is not None and lk.capacity_factor == 0 and top_k < cfg.num_experts  # route's compiled plan
            fused = None
            if decoding and lyr.fused is not None:
                fused = decode_layer(
                    lyr.fused, x, mlp_out, *rope_cs, k_cache, v_cache, meta.slot_mapping, meta.decode_block_tables,
                    meta.decode_mask, top_k if routes_here else 0, cfg.norm_topk_prob,
                )
            if fused is not None:
                x, h, made = fused
            else:
                x, h = self._attention_half(lyr, x, mlp_out, meta, k_cache, v_cache, rope_cs)
                made = None
            if lyr.router is None:
                mlp_out = silu_mlp(h, lyr.mlp_gate_up, lyr.mlp_down)
                continue
            if made is not None:
                plan = DispatchPlan(*made, capacity=None, dropped=0)
            else:
                plan = route(linear(h, lyr.router), top_k, cfg.norm_topk_prob, cfg.num_experts, lk.capacity_factor)
            submitted = experts.submit(idx, h, plan)
            yield
            mlp_out = expert_output(submitted)  # [T, H]
        if mlp_out is None:
            h = rms_norm(meta.logits_rows_of(x), self.norm, eps)  # [R, H]
        elif meta.logits_every_row:  # a decode step: the last residual add and the final norm in one op
            h = add_rms_norm(x, mlp_out, self.norm, eps)[1]  # [T, H]
        else:
            h = rms_norm((x + mlp_out)[meta.logits_idx], self.norm, eps)  # [R, H]
        return linear(h, self.lm_head).float()  # [R, V]

    def _one_call_runs(self, experts: ExpertCompute, knobs: MoeKnobs) -> dict[int, "OneCallRun"]:
        """For a decode step: the runs of consecutive MoE layers that go in one compiled call
        (`decode_layers_experts`), by their first layer: layers held for the one-call attention half
        whose experts this process holds where the compiled kernels read them, routed by the dropless
        top-k plan (no capacity factor, top-k below the number of experts)."""
        if not isinstance(experts, LocalExperts):
            return {}
        runs: dict[int, OneCallRun] = {}
        current = None
        for idx, lyr in enumerate(self.layers):
            lk = knobs.for_layer(idx) if lyr.router is not None and lyr.fused is not None else None
            top_k = (lk.top_k or self.cfg.top_k) if lk is not None else 0
            held = experts.decode_kernels(idx) if lk is not None and lk.capacity_factor == 0 and top_k < self.cfg.num_experts else None
            if held is None:
                current = None
                continue
            if current is None:
                current = runs[idx] = OneCallRun([], [])
            current.held.append(held)
            current.top_ks.append(top_k)
        return runs

    def _attention_half(
        self, lyr: DecoderLayer, x: Tensor, mlp_out: Tensor | None, meta: BatchMeta, k_cache: Tensor, v_cache: Tensor,
        rope_cs: tuple[Tensor, Tensor],
    ) -> tuple[Tensor, Tensor]:
        """x [T, H] the residual stream, mlp_out [T, H] the previous layer's MLP output (None for the first
        layer) -> (x + mlp_out + attention [T, H], its post-attention norm h [T, H]), op by op
        (`kernels.cpu.step_ops.decode_layer` computes the same in one call on a decode step)."""
        eps = self.cfg.rms_norm_eps
        if mlp_out is None:
            h = rms_norm(x, lyr.input_norm, eps)
        else:
            x, h = add_rms_norm(x, mlp_out, lyr.input_norm, eps)
        return add_rms_norm(x, attention(h, lyr.attn, meta, self.rope, k_cache, v_cache, rope_cs), lyr.post_norm, eps)

    def forward(self, meta: BatchMeta, kv_caches, experts: ExpertCompute, knobs: MoeKnobs) -> Tensor:
        """Runs forward_stages to the end (one micro-batch); returns logits [R, V]."""
        return run_to_end(self.forward_stages(meta, kv_caches, experts, knobs))
