"""Exceptions raised by phalanx."""


class MisconfigurationError(ValueError):
    """A combination of options that cannot work; the message names the valid choices."""


class CheckpointError(ValueError):
    """A file that is not a usable phalanx checkpoint."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint that could only load by running code from it, or by reading files outside it; phalanx refuses."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint that could not be written (disk full, ...); the previous checkpoint of that name is kept as is."""
