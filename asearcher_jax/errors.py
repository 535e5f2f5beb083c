"""Errors whose message is the whole story, printed by the CLI as one line (no traceback).

Library code raises these for bad *input* (a missing file, a corrupt checkpoint, an unsupported
architecture); programming errors stay ordinary exceptions with tracebacks.
"""


class AsearcherError(Exception):
  """Base class: bad input that the user can fix; the message names what and where."""


class CheckpointError(AsearcherError):
  """A model checkpoint (config.json / safetensors) is missing, corrupt or does not match."""


class UnsupportedModelError(AsearcherError):
  """A config.json describes an architecture or feature this codebase does not implement."""


class TokenizerError(AsearcherError):
  """A tokenizer directory is missing files or holds unreadable ones."""


class ConfigValueError(AsearcherError):
  """A configured value the command refused once it ran (a combination no single type or
  config class can check): a configuration mistake, exit status 2 like those found before."""
