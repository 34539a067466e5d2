"""A short fit whose save at step 4 is killed (SIGKILL, by the process itself) at one point of the write.

Usage: python killed_save_job.py DIRPATH IO SAVE_LAST POINT
  IO: sync | async (AsyncCheckpointIO); SAVE_LAST: none | true | link
  POINT: claimed (the name reserved, nothing written) | writing (half the bytes in the temporary) |
         written (the temporary whole and flushed, not renamed) | renamed (in place, its claim not yet released)
Saves every 2 steps up to step 6 (save_top_k=-1); the kill comes at step 4's write of its top-k checkpoint.
"""

from __future__ import annotations

import builtins
import os
import signal
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from phalanx_testing import Regressor, loaders, quiet_trainer  # noqa: E402

import phalanx.trainer.trainer as trainer_module  # noqa: E402
from phalanx.callbacks import ModelCheckpoint  # noqa: E402
from phalanx.plugins.io import AsyncCheckpointIO  # noqa: E402

KILLED = "step=4.ckpt"  # the top-k file of step 4 (last.ckpt's own writes are not killed)


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def inject(point: str) -> None:
    if point == "claimed":
        save = trainer_module.Trainer.save_checkpoint

        def save_or_die(self, filepath, *args, **kwargs):
            if str(filepath).endswith(KILLED):
                die()
            return save(self, filepath, *args, **kwargs)

        trainer_module.Trainer.save_checkpoint = save_or_die
    elif point == "writing":
        real_open = builtins.open

        class HalfWritten:
            def __init__(self, handle):
                self.handle = handle

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.handle.close()

            def write(self, data):
                self.handle.write(bytes(data)[: len(data) // 2])
                self.handle.flush()
                os.fsync(self.handle.fileno())
                die()

        def open_or_die(file, mode="r", *args, **kwargs):
            handle = real_open(file, mode, *args, **kwargs)
            if "w" in mode and KILLED in os.path.basename(str(file)):
                return HalfWritten(handle)
            return handle

        import phalanx.plugins.io.serialization as serialization

        serialization.open = open_or_die  # the module's own name for open: only its writes are affected
    else:
        replace = os.replace

        def replace_or_die(source, target, *args, **kwargs):
            if str(target).endswith(KILLED):
                if point == "written":
                    die()
                replace(source, target, *args, **kwargs)
                die()
            return replace(source, target, *args, **kwargs)

        os.replace = replace_or_die


def main() -> None:
    dirpath, io, save_last, point = sys.argv[1:5]
    warnings.filterwarnings("ignore")
    inject(point)
    callback = ModelCheckpoint(
        dirpath=dirpath,
        every_n_train_steps=2,
        save_top_k=-1,
        save_last={"none": None, "true": True, "link": "link"}[save_last],
    )
    trainer = quiet_trainer(
        max_steps=6,
        callbacks=[callback],
        enable_checkpointing=True,
        plugins=[AsyncCheckpointIO()] if io == "async" else None,
    )
    trainer.fit(Regressor(), loaders()[0])
    print("not killed")  # the parent fails on this
    sys.exit(3)


if __name__ == "__main__":
    main()
