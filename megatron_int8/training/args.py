"""Command line and YAML arguments, named as Megatron-LM's, plus their validation: the public names.

flags.py defines the parser (Megatron-LM's flag names and defaults), parsing.py reads `--config FILE.yaml`
under the command line, validation.py fills the derived defaults and rejects inconsistent settings before
anything expensive, and megatron_config.py turns the result into megatron-core's TransformerConfig; all of
them raise errors.ArgumentError, which the trainer prints without a traceback.
"""
from .errors import ArgumentError
from .flags import LR_DECAY_STYLES, STATE_DTYPE_CHOICES, TOKENIZER_TYPES, build_parser
from .megatron_config import pad_vocab_size, transformer_config_from_args
from .parsing import load_yaml_defaults, origin, parse_args
from .validation import OPTIMIZER_STATE_DTYPES, validate_args

__all__ = ["ArgumentError", "LR_DECAY_STYLES", "OPTIMIZER_STATE_DTYPES", "STATE_DTYPE_CHOICES", "TOKENIZER_TYPES",
           "build_parser", "load_yaml_defaults", "origin", "pad_vocab_size", "parse_args",
           "transformer_config_from_args", "validate_args"]
