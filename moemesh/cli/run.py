"""`moemesh run`: generate from a model directory in this process (no services)."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from moemesh.cli.prompt_args import PromptArgs
from moemesh.engine.config import EngineConfig


@dataclass(frozen=True)
class RunConfig:
    """`moemesh run`'s flags: the engine's (under the names the CLI contract fixes), the prompt and
    sampling, the output."""

    engine: EngineConfig = field(metadata={
        "omit": ("kv_cache_tokens", "max_num_seqs", "max_num_batched_tokens"),  # sized to the one prompt
        "defaults": {"num_threads": None},  # torch's thread count unless --threads
        "flags": {"model_dir": "--model", "num_threads": "--threads"},
    })
    prompt: PromptArgs
    json: bool = field(default=False, metadata={"help": "print one JSON object instead of streaming text"})


def register(subparsers) -> None:
    from moemesh.svc_config import add_arguments

    p = subparsers.add_parser("run", help="generate from a model directory in this process (no services)")
    add_arguments(p, RunConfig, None)
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    """Bad flags, files and values raise ValueError/OSError: `moemesh.cli.main` prints them as one
    line naming the flag or file, exit status 2."""
    from moemesh.svc_config import from_sources

    fields = argparse.Namespace(**{k: v for k, v in vars(ns).items() if k not in ("command", "func")})
    return generate(from_sources(RunConfig, None, fields))


def load_tokenizer(model: str, required: bool):
    if not required and not (Path(model) / "tokenizer.json").is_file():
        return None
    from moemesh.tokenizer import Tokenizer

    return Tokenizer.from_model_dir(model)


def prompt_token_ids(args: PromptArgs, tokenizer) -> list[int]:
    if args.token_ids is not None:
        return list(args.token_ids)
    if tokenizer.has_chat_template and not args.raw_prompt:
        text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(args.prompt)


def generate(cfg: RunConfig) -> int:
    from moemesh.engine import LLMEngine

    args = cfg.prompt
    model = cfg.engine.model_dir
    if not Path(model).is_dir():
        raise ValueError(f"--model: directory {model!r} does not exist")
    tokenizer = load_tokenizer(model, required=args.prompt is not None)
    params = args.sampling_params(tuple(tokenizer.eos_token_ids) if tokenizer is not None else (), prompt_logprobs=cfg.json)
    prompt = prompt_token_ids(args, tokenizer)
    engine = LLMEngine(
        replace(cfg.engine, max_num_seqs=1, kv_cache_tokens=len(prompt) + args.max_new_tokens, max_num_batched_tokens=max(len(prompt), 1))
    )
    engine.add_request("run", prompt, params)
    stream = None
    if not cfg.json and tokenizer is not None:
        from moemesh.tokenizer import IncrementalDetokenizer

        stream = IncrementalDetokenizer(tokenizer, prompt)
    tokens: list[int] = []
    logprobs: list[float] = []
    prompt_lps = None
    reason = None
    while reason is None:
        for out in engine.step():
            if out.error is not None:  # the sequence failed (non-finite logits): one line from moemesh.cli.main
                raise out.error
            tokens.append(out.token_id)
            logprobs.append(out.logprob)
            if out.prompt_logprobs is not None:
                prompt_lps = out.prompt_logprobs
            reason = out.finish_reason
            if stream is not None:
                sys.stdout.write(stream.push(out.token_id))
                sys.stdout.flush()
            elif not cfg.json:
                sys.stdout.write(f"{out.token_id} ")
                sys.stdout.flush()
    if not cfg.json:
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
