"""vLLM's FlexibleArgumentParser: argparse's parser that reads underscores in an option's name as dashes
(--max_model_len 512 is --max-model-len 512), for EngineArgs.add_cli_args(FlexibleArgumentParser()); and
where on a command line a word stands where an option may, so that only option names are rewritten."""
from __future__ import annotations

import argparse
import re
import sys

_OPTION_NAME = re.compile(r"--[^.=]*")      # "--" and the name, up to a JSON option's ".key" or an "=value"

# How many words after an option are its values, beside a count: as many as follow up to the next word
# that reads as an option (argparse's nargs "?", "*", "+"), or every word after it (argparse.REMAINDER).
UP_TO_NEXT_OPTION = -1
ALL_THE_REST = -2


def option_name(word: str) -> str:
    """The option name of WORD, a word starting with "--": up to a JSON option's ".key" or an "=value"."""
    return _OPTION_NAME.match(word)[0]


def dashed_option_word(arg: str) -> str:
    """ARG with the underscores of its option's name read as dashes, as vLLM's parser reads a command
    line (--max_model_len=512: --max-model-len=512; --speculative_config.num_speculative_tokens:
    --speculative-config.num_speculative_tokens); what follows the name, and any other word, as it is."""
    if not arg.startswith("--"):
        return arg
    name = option_name(arg)
    return name.replace("_", "-") + arg[len(name):]


def num_values_taken(word: str, value_counts: dict[str, int]) -> int:
    """How many of the words after WORD, an option word where an option may stand, are its values.
    VALUE_COUNTS maps each declared spelling of an option (--max-model-len, -p) to the number of values it
    takes (0 for a switch). A long name is read with dashes, a JSON option's dotted key (--x.key, --x_y.key)
    takes one value, and "=value" or a short option's attached value (-p5) takes none; an unknown option
    none."""
    if word.startswith("--"):
        if "=" in word:
            return 0
        name = option_name(word)
        count = value_counts.get(name, value_counts.get(name.replace("_", "-"), 0))
        if name == word:
            return count
        return 1 if count else 0            # a JSON option's dotted key: one value
    if word in value_counts:
        return value_counts[word]
    if "=" in word:
        return 0
    for at, letter in enumerate(word[1:], start=2):     # click's cluster of short options: -xp VALUE, -p5
        count = value_counts.get(f"-{letter}")
        if count is None:
            return 0
        if count:
            return 0 if at < len(word) else count
    return 0


def option_positions(args: list[str], value_counts: dict[str, int]) -> list[bool]:
    """For each word of ARGS, whether it stands where an option may: False for the values of the option
    before it (-p --max_model_len: the prompt "--max_model_len") and for every word after a bare "--"."""
    at_option, i = [True] * len(args), 0
    while i < len(args):
        word = args[i]
        i += 1
        if word == "--":
            at_option[i:] = [False] * (len(args) - i)
            break
        if not word.startswith("-") or word == "-":
            continue
        count = num_values_taken(word, value_counts)
        if count == ALL_THE_REST:
            count = len(args) - i
        elif count == UP_TO_NEXT_OPTION:
            count = next((j for j in range(i, len(args)) if reads_as_option(args[j])), len(args)) - i
        at_option[i:i + count] = [False] * len(at_option[i:i + count])
        i += count
    return at_option


def reads_as_option(word: str) -> bool:
    """Whether argparse reads WORD as an option, not a value: a dash and more, no space, not a number."""
    return word.startswith("-") and word != "-" and " " not in word and not _is_number(word)


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


class AmbiguousOption(ValueError):
    """An abbreviated option name that more than one option begins with (argparse's "ambiguous option")."""


def completed_option_word(word: str, names: set[str]) -> str:
    """WORD, a long option word where an option may stand, with its name (read with dashes, up to a JSON
    option's ".key" or an "=value") completed to the one of NAMES it begins, as argparse takes an unambiguous
    prefix (vLLM's parsers keep allow_abbrev on): --max-model=512 is --max-model-len=512. A name of NAMES, or
    one no name begins with, stays as written; AmbiguousOption where several names begin with it."""
    if not word.startswith("--") or word == "--":
        return word
    name = option_name(word)
    dashed = name.replace("_", "-")
    if name in names or dashed in names:
        return word
    matches = sorted(n for n in names if n.startswith(dashed))
    if len(matches) > 1:
        raise AmbiguousOption(f"ambiguous option: {name} could match {', '.join(matches)}")
    return matches[0] + word[len(name):] if matches else word


def completed_option_words(args: list[str], names: set[str], value_counts: dict[str, int]) -> list[str]:
    """ARGS with each abbreviated long option completed (completed_option_word) where an option may stand;
    an option's values, abbreviated flags or not (-p --temp: the prompt "--temp"), and the words after a
    bare "--" stay as written. VALUE_COUNTS: how many values each option of NAMES takes."""
    out = list(args)
    at_option = option_positions(out, value_counts)
    for i, word in enumerate(args):
        if at_option[i]:
            out[i] = completed_option_word(word, names)
            if out[i] != word:              # the completed option's own values follow it
                at_option = option_positions(out, value_counts)
    return out


def parser_value_counts(parser: argparse.ArgumentParser) -> dict[str, int]:
    """{option string: how many values it takes} for every option of an argparse PARSER."""
    counts = {}
    for option, action in parser._option_string_actions.items():
        nargs = action.nargs
        counts[option] = (1 if nargs is None else nargs if isinstance(nargs, int) else
                          ALL_THE_REST if nargs in (argparse.REMAINDER, argparse.PARSER) else UP_TO_NEXT_OPTION)
    return counts


def dashed_option_words(args: list[str], value_counts: dict[str, int], dashed=dashed_option_word) -> list[str]:
    """ARGS with DASHED applied to each word that stands where an option may (values kept as they are)."""
    return [dashed(arg) if at else arg for arg, at in zip(args, option_positions(args, value_counts))]


class FlexibleArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser that takes an option's name with underscores as its name with dashes (vLLM's):
    a word where an option may stand, neither an option's value nor after a bare "--"."""

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args(dashed_option_words(args, parser_value_counts(self)), namespace)
