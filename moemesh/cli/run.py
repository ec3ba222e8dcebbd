"""`moemesh run`: generate from a model directory in this process (no services)."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from moemesh.cli.prompt_args import add_prompt_and_sampling_args

EXPERT_DTYPES = ("bf16", "fp8", "mxfp4", "nvfp4")


@dataclass(frozen=True)
class RunArgs:
    """The validated flags of one `moemesh run`."""

    model: str
    prompt: str | None
    prompt_ids: tuple[int, ...] | None
    raw_prompt: bool
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    experts_dtype: str | None
    moe_top_k: int | None
    capacity_factor: float
    dtype: str
    micro_batches: int
    threads: int | None
    json: bool
    device: str = "cpu"


def register(subparsers) -> None:
    p = subparsers.add_parser("run", help="generate from a model directory in this process (no services)")
    p.add_argument("--model", required=True, metavar="DIR", help="Hugging Face model directory")
    add_prompt_and_sampling_args(p)
    p.add_argument("--experts-dtype", choices=EXPERT_DTYPES, default=None, help="expert weight format (default: as stored)")
    p.add_argument("--moe-top-k", type=int, default=None, metavar="K", help="experts per token (default: the model's)")
    p.add_argument("--capacity-factor", type=float, default=0.0, metavar="CF", help=">0 capped, 0 dropless, <0 dropless up to |CF|")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto", help="compute dtype (auto = checkpoint's)")
    p.add_argument("--micro-batches", type=int, choices=(1, 2), default=1, help="interleave two micro-batches per layer")
    p.add_argument("--threads", type=int, default=None, metavar="N", help="torch threads (default: torch's)")
    p.add_argument("--device", default="cpu", metavar="DEV", help="cpu (default), cuda or cuda:N")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.set_defaults(func=run)


def parse_prompt_ids(text: str) -> tuple[int, ...]:
    try:
        ids = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise ValueError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise ValueError("--prompt-ids must name at least one token id")
    return ids


def to_run_args(ns: argparse.Namespace) -> RunArgs:
    return RunArgs(
        model=ns.model,
        prompt=ns.prompt,
        prompt_ids=parse_prompt_ids(ns.prompt_ids) if ns.prompt_ids is not None else None,
        raw_prompt=ns.raw_prompt,
        max_new_tokens=ns.max_new_tokens,
        temperature=ns.temperature,
        top_p=ns.top_p,
        top_k=ns.top_k,
        seed=ns.seed,
        experts_dtype=ns.experts_dtype,
        moe_top_k=ns.moe_top_k,
        capacity_factor=ns.capacity_factor,
        dtype=ns.dtype,
        micro_batches=ns.micro_batches,
        threads=ns.threads,
        json=ns.json,
        device=ns.device,
    )


def run(ns: argparse.Namespace) -> int:
    from moemesh.checkpoint import CheckpointError

    try:
        return generate(to_run_args(ns))
    except (ValueError, CheckpointError, FileNotFoundError, OSError) as e:
        print(f"moemesh run: error: {e}", file=sys.stderr)
        return 2


def load_tokenizer(model: str, required: bool):
    if not required and not (Path(model) / "tokenizer.json").is_file():
        return None
    from moemesh.tokenizer import Tokenizer

    return Tokenizer.from_model_dir(model)


def prompt_token_ids(args: RunArgs, tokenizer) -> list[int]:
    if args.prompt_ids is not None:
        return list(args.prompt_ids)
    if tokenizer.has_chat_template and not args.raw_prompt:
        text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(args.prompt)


def generate(args: RunArgs) -> int:
    from moemesh.engine import EngineConfig, LLMEngine, SamplingParams

    if not Path(args.model).is_dir():
        raise ValueError(f"--model: directory {args.model!r} does not exist")
    tokenizer = load_tokenizer(args.model, required=args.prompt is not None)
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop_token_ids=tuple(tokenizer.eos_token_ids) if tokenizer is not None else (),
        prompt_logprobs=args.json,
    )
    prompt = prompt_token_ids(args, tokenizer)
    engine = LLMEngine(
        EngineConfig(
            model_dir=args.model,
            dtype=args.dtype,
            experts_dtype=args.experts_dtype,
            moe_top_k=args.moe_top_k,
            capacity_factor=args.capacity_factor,
            micro_batches=args.micro_batches,
            num_threads=args.threads,
            device=args.device,
            max_num_seqs=1,
            kv_cache_tokens=len(prompt) + args.max_new_tokens,
            max_num_batched_tokens=max(len(prompt), 1),
        )
    )
    engine.add_request("run", prompt, params)
    stream = None
    if not args.json and tokenizer is not None:
        from moemesh.tokenizer import IncrementalDetokenizer

        stream = IncrementalDetokenizer(tokenizer, prompt)
    tokens: list[int] = []
    logprobs: list[float] = []
    prompt_lps = None
    reason = None
    while reason is None:
        for out in engine.step():
            tokens.append(out.token_id)
            logprobs.append(out.logprob)
            if out.prompt_logprobs is not None:
                prompt_lps = out.prompt_logprobs
            reason = out.finish_reason
            if stream is not None:
                sys.stdout.write(stream.push(out.token_id))
                sys.stdout.flush()
            elif not args.json:
                sys.stdout.write(f"{out.token_id} ")
                sys.stdout.flush()
    if not args.json:
        sys.stdout.write((stream.flush() or "") + "\n" if stream is not None else "\n")
        return 0
    text = tokenizer.decode(tokens, skip_special_tokens=True) if tokenizer is not None else ""
    print(
        json.dumps(
            {
                "prompt_token_ids": prompt,
                "token_ids": tokens,
                "text": text,
                "finish_reason": reason,
                "logprobs": logprobs,
                "prompt_logprobs": prompt_lps,
            }
        )
    )
    return 0
