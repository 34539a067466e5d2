"""Exceptions raised by phalanx."""


class MisconfigurationError(ValueError):
    """A combination of options that cannot work; the message names the valid choices."""


class CheckpointError(ValueError):
    """A file that is not a usable phalanx checkpoint."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint that can only be loaded by unpickling arbitrary objects, which phalanx refuses."""
