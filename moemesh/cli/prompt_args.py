"""The prompt and sampling flags shared by `moemesh run` and `moemesh generate` (same names, same defaults)."""
from __future__ import annotations

import argparse


def add_prompt_and_sampling_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="prompt text (wrapped in the chat template when the model has one)")
    src.add_argument("--prompt-ids", metavar="1,2,3", help="prompt as comma-separated token ids (no tokenizer needed)")
    p.add_argument("--raw-prompt", action="store_true", help="do not apply the chat template to --prompt")
    p.add_argument("--max-new-tokens", type=int, default=128, metavar="N")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="0 = off")
    p.add_argument("--seed", type=int, default=None, metavar="S")
