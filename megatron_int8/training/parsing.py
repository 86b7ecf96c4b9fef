"""From argv to arguments: `--config FILE.yaml` sets the parser's defaults, flags given on the command line
override them, and the result records which values the YAML set, so that an error about one names the file.

YAML keys are the flags' names (dashes or underscores); unknown keys fail with the closest names, and values
are converted and checked as argparse would the flag's (a boolean or a fraction for an integer flag fails). An
on/off flag takes true (the flag given) or false (the opposite setting, whatever the built-in default). A path's
leading ~ is expanded, also where the shell leaves it (a YAML value, --save=~/run).
"""
from __future__ import annotations

import argparse
import difflib
import os
import sys
from typing import Dict, Optional, Sequence

import yaml

from .errors import ArgumentError
from .flags import build_parser


NOT_SETTINGS = ("config", "help")  # options that are no setting a YAML key could take
# settings that name files: a leading ~ is expanded where the shell leaves it (a YAML value, --save=~/run), which
# made a folder named '~' in the working directory
PATH_SETTINGS = ("data_path", "data_cache_path", "tokenizer_model", "tensorboard_dir", "log_jsonl", "profile_dir",
                 "save", "load")


class _DuplicateKey(Exception):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader, except that a key written twice in one mapping is an error (PyYAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise _DuplicateKey(f"key '{key}' is given twice (line {key_node.start_mark.line + 1})")
            seen.add(key)
        return super().construct_mapping(node, deep)


def _option_actions(parser: argparse.ArgumentParser) -> Dict[str, argparse.Action]:
    """Every long option name without its dashes, underscored ('num_layers'), mapped to its action."""
    actions = {}
    for action in parser._actions:
        for option in action.option_strings:
            if option.startswith("--"):
                actions[option[2:].replace("-", "_")] = action
    return actions


def _yaml_value(key: str, value, action: argparse.Action):
    """A YAML value converted to what argparse would have stored for the equivalent flag."""
    if isinstance(action, argparse._StoreConstAction) and isinstance(action.const, bool):  # on/off flags
        if not isinstance(value, bool):
            raise ArgumentError(f"config key '{key}': expected true or false, got {value!r}")
        # `key: true` gives the flag (its `const`), `key: false` the opposite setting: `fused_adam: false` turns
        # the fused Adam off (not back to its automatic default), `disable_bias_linear: false` keeps the biases.
        return action.const if value else not action.const
    if value is None:
        return None
    if action.nargs in ("*", "+"):
        values = value if isinstance(value, list) else str(value).split()
        return [_convert(key, v, action) for v in values]
    if isinstance(value, (list, dict)):
        raise ArgumentError(f"config key '{key}': expected a single value, got {value!r}")
    return _convert(key, value, action)


def _convert(key: str, value, action: argparse.Action):
    if action.type in (int, float) and isinstance(value, bool):
        raise ArgumentError(f"config key '{key}': expected a number, got {value!r}")
    if action.type is int and isinstance(value, float) and not value.is_integer():
        raise ArgumentError(f"config key '{key}': expected an integer, got {value!r}")
    if action.type is not None:
        try:
            value = action.type(value)
        except (TypeError, ValueError):
            raise ArgumentError(f"config key '{key}': cannot convert {value!r} with {action.type.__name__}") from None
    elif not isinstance(value, str):
        value = str(value)
    if action.choices is not None and value not in action.choices:
        raise ArgumentError(f"config key '{key}': {value!r} is not one of {list(action.choices)}")
    return value


def load_yaml_defaults(path: str, parser: argparse.ArgumentParser) -> Dict[str, object]:
    """Parser defaults (dest -> value) from a YAML file; unknown keys fail with the closest names."""
    if not os.path.isfile(path):
        raise ArgumentError(f"--config {path}: no such file")
    with open(path, encoding="utf-8") as f:
        try:
            content = yaml.load(f, Loader=_UniqueKeyLoader) or {}
        except yaml.YAMLError as err:
            raise ArgumentError(f"--config {path}: not valid YAML: {err}") from None
        except _DuplicateKey as err:
            raise ArgumentError(f"--config {path}: {err}") from None
    if not isinstance(content, dict):
        raise ArgumentError(f"--config {path}: expected a mapping of flag names to values")
    actions = _option_actions(parser)
    defaults, errors, key_of = {}, [], {}
    for raw_key, value in content.items():
        key = str(raw_key).lstrip("-").replace("-", "_")
        action = actions.get(key)
        if action is not None and key not in NOT_SETTINGS and action.dest in key_of:
            # two keys of one setting (swiglu and no_swiglu, lr and --lr): the last one silently won
            errors.append(f"'{raw_key}' and '{key_of[action.dest]}' both set {action.dest}")
            continue
        if action is None or key in NOT_SETTINGS:
            close = difflib.get_close_matches(key, [k for k in actions if k not in NOT_SETTINGS], n=3,
                                              cutoff=0.6)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            errors.append(f"unknown key '{raw_key}'{hint}")
            continue
        key_of[action.dest] = raw_key
        defaults[action.dest] = _yaml_value(str(raw_key), value, action)
    if errors:
        raise ArgumentError(f"--config {path}: " + "; ".join(errors))
    return defaults


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse YAML (--config) then the command line over it; does not validate (see validate_args)."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", action="append", default=[])
    known, _ = pre.parse_known_args(argv)
    if len(known.config) > 1:  # the last one counts, as for any repeated flag: said, as the others are not read
        print(f"note: --config is given {len(known.config)} times: only the last one, {known.config[-1]}, is read "
              f"(not {', '.join(known.config[:-1])})", flush=True)
    known.config = os.path.expanduser(known.config[-1]) if known.config else None
    from_yaml = load_yaml_defaults(known.config, parser) if known.config else {}
    parser.set_defaults(**from_yaml)
    args = parser.parse_args(argv)
    for dest in PATH_SETTINGS:
        value = getattr(args, dest)
        if value is not None:
            setattr(args, dest, [os.path.expanduser(v) for v in value] if isinstance(value, list)
                    else os.path.expanduser(value))
    # which values the YAML set (not the command line), so that an error about one can say where it came from
    given = {arg.split("=", 1)[0] for arg in argv if arg.startswith("--")}
    on_command_line = {action.dest for action in parser._actions if given & set(action.option_strings)}
    args.from_config = {dest: known.config for dest in from_yaml if dest not in on_command_line}
    return args


def origin(args, dest: str) -> str:
    """' (from --config FILE)' where the YAML set this value, else ''."""
    path = getattr(args, "from_config", {}).get(dest)
    return f" (from --config {path})" if path else ""
