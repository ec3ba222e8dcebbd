"""`moemesh generate` flag handling and errors (its happy path runs in tests/e2e)."""
from __future__ import annotations

from moemesh.cli.main import main


def test_bad_prompt_ids_are_a_usage_error(capsys):
    assert main(["generate", "--addr", "127.0.0.1:1", "--prompt-ids", "1,x"]) == 2
    assert "--prompt-ids must be comma-separated integers" in capsys.readouterr().err


def test_unreachable_router_fails_fast_with_the_status(capsys):
    from moemesh.launcher.ports import free_port

    assert main(["generate", "--addr", f"127.0.0.1:{free_port()}", "--prompt", "hi"]) == 1
    assert "moemesh generate: error: UNAVAILABLE" in capsys.readouterr().err


def test_generate_accepts_the_sampling_flags_of_run():
    from moemesh.cli.generate import prompt_args
    from moemesh.cli.main import build_parser

    sampling = ["--max-new-tokens", "5", "--temperature", "0.5", "--top-p", "0.9", "--top-k", "3", "--seed", "7", "--raw-prompt"]
    for given in ([], sampling):  # the same defaults, the same flags
        run = build_parser().parse_args(["run", "--model", "m", "--prompt", "p", *given])
        gen = build_parser().parse_args(["generate", "--addr", "h:1", "--prompt", "p", *given])
        assert prompt_args(gen) == prompt_args(run)
