"""vLLM's `--config FILE`: a YAML file of a command's options, read into its command line.

Each key is an option's name without its dashes (dashes or underscores: max-model-len, max_model_len; an
unambiguous prefix too, max-model, as vLLM's parser reads one);
true gives a flag, false its --no- form (or nothing where it has none), a list gives an option that
takes several values one value each (any other option gets it as JSON), a mapping gives JSON, and
anything else gives its text. The file's options go where the file is named after MODEL, so an
option written on the command line wins over the file's (vLLM's order: command line, file, defaults).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from minillm.argparse_utils import AmbiguousOption, completed_option_word, option_positions

CONFIG_FLAG = "--config"


class ConfigFileError(ValueError):
    """A --config file that cannot be read into options; the message names the flag and the file."""


@dataclass(frozen=True)
class OptionKind:
    """How a command's option takes its value: the flag to write, and what kind of value."""

    param: str                    # the command's parameter it sets (several spellings share one)
    flag: str                     # the long name written on the command line
    is_flag: bool = False         # a switch: true writes `flag`
    off_flag: str | None = None   # a switch's --no- form, written for false
    is_multiple: bool = False     # takes several values, one flag each


def config_file_args(args: list[str], options: dict[str, OptionKind], aliases: dict[str, str],
                     reasons: dict[str, str] | None = None) -> list[str]:
    """ARGS with `--config FILE` replaced by FILE's options (placed after MODEL, before the rest). OPTIONS
    maps a dashless long name to its OptionKind; ALIASES maps every spelling of an option to its param;
    REASONS says why a flag the command lacks is not taken ({"--quantization": "..."}). Only a word where
    an option may stand is read as one: an option's value (--response-role --config) and the words after a
    bare "--" are kept as they are."""
    counts = value_counts(options, aliases)
    at_option = option_positions(args, counts)
    at = [i for i, arg in enumerate(args) if at_option[i] and (arg == CONFIG_FLAG or arg.startswith(CONFIG_FLAG + "="))]
    if not at:
        return args
    if len(at) > 1:
        raise ConfigFileError(f"{CONFIG_FLAG} is given {len(at)} times; give one file")
    i = at[0]
    if args[i] == CONFIG_FLAG:
        if i + 1 >= len(args) or args[i + 1] == "--" or args[i + 1].startswith("-"):
            raise ConfigFileError(f"{CONFIG_FLAG} needs a YAML file of options")
        path, rest = args[i + 1], args[:i] + args[i + 2:]
    else:
        path, rest = args[i].partition("=")[2], args[:i] + args[i + 1:]
    given = given_params(rest, aliases, counts)
    start = 1 if rest and not rest[0].startswith("-") else 0     # MODEL stays first
    from_file = [word for key, value in read_config_file(path).items()
                 for word in option_words(path, key, value, options, given, reasons or {})]
    return rest[:start] + from_file + rest[start:]


def value_counts(options: dict[str, OptionKind], aliases: dict[str, str]) -> dict[str, int]:
    """{spelling: how many values it takes} for every spelling in ALIASES (0 for a switch), --config's too."""
    switches = {kind.param for kind in options.values() if kind.is_flag}
    return {CONFIG_FLAG: 1, **{name: 0 if param in switches else 1 for name, param in aliases.items()}}


def given_params(args: list[str], aliases: dict[str, str], counts: dict[str, int] | None = None) -> set[str]:
    """The params the command line ARGS sets (MODEL, given as the first argument, as "model"); an option's
    value and the words after a bare "--" set none (COUNTS: how many values each option takes)."""
    given = {"model"} if args and not args[0].startswith("-") else set()
    for arg, at_option in zip(args, option_positions(args, counts or dict.fromkeys(aliases, 1))):
        name = arg.partition("=")[0]
        if at_option and name.startswith("-"):
            param = aliases.get(name) or aliases.get(name.replace("_", "-"))
            if param is not None:
                given.add(param)
    return given


def read_config_file(path: str) -> dict:
    """FILE's top-level mapping; a file that is no YAML mapping is a ConfigFileError naming it."""
    import yaml
    where = f"{CONFIG_FLAG} {path}"
    if os.path.splitext(path)[1].lower() not in (".yaml", ".yml"):
        raise ConfigFileError(f"{where}: must be a YAML file (.yaml or .yml), as vLLM's")
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as f:
            config = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigFileError(f"{where}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigFileError(f"{where}: cannot be read: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigFileError(f"{where}: not valid YAML: {' '.join(str(exc).split())}") from None
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise ConfigFileError(f"{where}: must be a mapping of option names to values (port: 8000), "
                              f"got a {type(config).__name__}")
    return config


def option_words(path: str, key, value, options: dict[str, OptionKind], given: set[str],
                 reasons: dict[str, str]) -> list[str]:
    """The command-line words of the file's KEY: VALUE (none where the command line sets the option too)."""
    where = f"{CONFIG_FLAG} {path}"
    name = str(key).replace("_", "-")
    if isinstance(key, str) and name and "=" not in name and "." not in name:
        try:          # vLLM reads a key as --key, so an unambiguous prefix of an option's name is that option
            name = completed_option_word(f"--{name}", {f"--{n}" for n in options} | set(reasons))[2:]
        except AmbiguousOption as exc:
            raise ConfigFileError(f"{where}: {key}: {exc}") from None
    kind = options.get(name) if isinstance(key, str) else None
    if kind is None and f"--{name}" in reasons:
        raise ConfigFileError(f"{where}: {key} is not taken: {reasons[f'--{name}']}")
    if kind is None:
        raise ConfigFileError(f"{where}: {key!r} is no option of this command (a key is an option's name "
                              "without its dashes, such as max-model-len: 2048)")
    if kind.param in given:
        return []
    if value is None:
        raise ConfigFileError(f"{where}: {key} has no value; give one or leave the key out")
    if kind.is_flag:
        if not isinstance(value, bool):
            raise ConfigFileError(f"{where}: {key} is a switch: give true or false, got {value!r}")
        return [kind.flag] if value else [kind.off_flag] if kind.off_flag else []
    if kind.is_multiple:
        return [word for item in (value if isinstance(value, list) else [value])
                for word in (kind.flag, value_text(item))]
    return [kind.flag, value_text(value)]


def value_text(value) -> str:
    """A YAML value as a command line writes it: a list or mapping as JSON, a bool as JSON's, else its text."""
    if isinstance(value, (list, dict, bool)):
        return json.dumps(value)
    return str(value)
