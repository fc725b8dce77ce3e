"""vLLM's FlexibleArgumentParser: argparse's parser that reads underscores in an option's name as dashes
(--max_model_len 512 is --max-model-len 512), for EngineArgs.add_cli_args(FlexibleArgumentParser())."""
from __future__ import annotations

import argparse
import re
import sys

_OPTION_NAME = re.compile(r"--[^.=]*")      # "--" and the name, up to a JSON option's ".key" or an "=value"


def dashed_option_word(arg: str) -> str:
    """ARG with the underscores of its option's name read as dashes, as vLLM's parser reads a command
    line (--max_model_len=512: --max-model-len=512; --speculative_config.num_speculative_tokens:
    --speculative-config.num_speculative_tokens); what follows the name, and any other word, as it is."""
    if not arg.startswith("--"):
        return arg
    name = _OPTION_NAME.match(arg)[0]
    return name.replace("_", "-") + arg[len(name):]


class FlexibleArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser that takes an option's name with underscores as its name with dashes (vLLM's),
    up to a bare "--" (what follows it is no option)."""

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        end = args.index("--") if "--" in args else len(args)
        return super().parse_known_args([dashed_option_word(arg) for arg in args[:end]] + args[end:], namespace)
