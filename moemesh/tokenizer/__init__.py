"""Tokenizer (`tokenizers` + jinja2 chat template), incremental detokenizer and stop strings."""
from moemesh.tokenizer.chat_template import ChatTemplate
from moemesh.tokenizer.config import TokenizerConfig
from moemesh.tokenizer.incremental import IncrementalDetokenizer
from moemesh.tokenizer.stop_strings import StopMatch, StopStringMatcher
from moemesh.tokenizer.tokenizer import Tokenizer

__all__ = ["ChatTemplate", "IncrementalDetokenizer", "StopMatch", "StopStringMatcher", "Tokenizer", "TokenizerConfig"]
