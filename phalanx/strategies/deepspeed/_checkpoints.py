"""DeepSpeedStrategy's checkpoints: full weights gathered from ZeRO-3 partitions, and the checkpoint directories in
which every rank writes its own partitions (see :mod:`phalanx.plugins.io.formats.deepspeed` for the format)."""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from phalanx.plugins.io.checkpoint_files import entry_inside
from phalanx.plugins.io.formats.deepspeed import (
    ENGINE_STEPS,
    STATE_FILE,
    TAG,
    load_deepspeed_checkpoint_as_full,
)
from phalanx.plugins.io.formats.deepspeed_files import (
    check_tag_files,
    refuse_unsafe_engine_reads,
    safe_engine_reads,
    tag_directory,
)
from phalanx.plugins.io.formats.layout import checkpoint_layout
from phalanx.plugins.io.serialization import is_url
from phalanx.strategies.deepspeed._engine import partitioned_parameters
from phalanx.utilities.exceptions import CheckpointError

if TYPE_CHECKING:
    from phalanx.strategies.deepspeed.strategy import DeepSpeedStrategy


class _DeepSpeedCheckpoints:
    """Reads and writes ``DeepSpeedStrategy``'s checkpoints; the strategy owns one per run and forwards its checkpoint
    methods to it (the strategy supplies the engine, the ranks, the CheckpointIO and ``_deepspeed()``)."""

    def __init__(self, strategy: DeepSpeedStrategy) -> None:
        self._strategy = strategy
        self.resume_path: Any = None  # what load_checkpoint read, for a conversion that needs the source's name
        self.optimizer_restored = False  # set when the weights were loaded together with the optimizer state

    # ------------------------------------------------------------------ module state
    def module_state_dict(self) -> dict[str, Any]:
        """The module's full state dict on every rank (ZeRO-3 gathers the partitioned parameters for it)."""
        module = self._strategy._module
        assert module is not None
        partitioned = partitioned_parameters(module)
        if not partitioned:
            return module.state_dict()
        deepspeed = self._strategy._deepspeed()
        with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
            return {name: value.detach().clone() for name, value in module.state_dict().items()}

    def load_model_state(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        """Fitting: the engine loads weights and optimizer (converted when the checkpoint has another layout).
        Otherwise: full weights."""
        meta = checkpoint.get("deepspeed")
        fitting = self._strategy._engine is not None and self._strategy._engine_trains
        from_directory = isinstance(meta, dict) and "directory" in meta
        if fitting:
            if from_directory and self._same_layout(meta):
                self._load_engine_checkpoint(meta, strict)
            else:
                self._load_converted(checkpoint, meta if from_directory else None, strict)
            return
        if from_directory:
            weights = load_deepspeed_checkpoint_as_full(
                meta["directory"], read=self._strategy.checkpoint_io.load_checkpoint
            )
            weights = weights["state_dict"]
        else:
            weights = checkpoint["state_dict"]
        self._load_full_weights(weights, strict)

    def _same_layout(self, meta: dict[str, Any]) -> bool:
        # A directory of this world size and stage is read by the engine itself (each rank its own partition files).
        world_size, stage = meta.get("world_size"), meta.get("zero_stage")
        return (world_size is None or world_size == self._strategy.world_size) and (
            stage is None or stage == self._strategy.zero_stage
        )

    def _load_converted(self, checkpoint: dict[str, Any], meta: dict[str, Any] | None, strict: bool) -> None:
        """Another layout: read it whole, load the weights into the module and the optimizer state into the engine."""
        # Lazy for import time: only a resume from another layout converts; `from phalanx import Trainer` skips it.
        from phalanx.strategies.deepspeed._conversion import (
            conversion_error,
            deepspeed_layout,
            load_into_zero_optimizer,
            single_optimizer_state,
            source_layout,
        )

        engine = self._strategy._require_training_engine()
        path = meta["directory"] if meta is not None else self.resume_path
        source = source_layout(path, meta)
        target = f"DeepSpeed ZeRO stage {self._strategy.zero_stage} on {self._strategy.world_size} processes"
        read = self._strategy.checkpoint_io.load_checkpoint
        full = load_deepspeed_checkpoint_as_full(meta["directory"], read=read) if meta is not None else checkpoint
        saved = single_optimizer_state(
            full.get("optimizer_states"),
            source=source,
            path=path,
            target=target,
            optimizers=len(self._strategy.optimizers),
        )
        weights = full["state_dict"]
        self._load_full_weights(weights, strict)
        if self._strategy.zero_stage == 0:
            engine.optimizer.load_state_dict(saved)
        elif self._strategy.zero_stage in (1, 2, 3):
            names = {id(parameter): name for name, parameter in self._strategy._module.named_parameters()}
            load_into_zero_optimizer(
                engine.optimizer,
                self._strategy.zero_stage,
                weights,
                names,
                saved,
                source=source,
                path=path,
                target=target,
            )
        else:
            raise conversion_error(
                source, path, target, f"ZeRO stage {self._strategy.zero_stage} is not one phalanx converts into",
                f"Resume it as {deepspeed_layout(self._strategy.zero_stage, self._strategy.world_size)} only",
            )  # fmt: skip
        self._continue_engine_counters(engine, full)
        self.optimizer_restored = True

    @staticmethod
    def _continue_engine_counters(engine: Any, full: dict[str, Any]) -> None:
        """DeepSpeed's own counts of updates and samples (its schedules, logs and monitors read them) go on from the
        checkpoint, as ``engine.load_checkpoint`` would set them."""
        saved = full.get(ENGINE_STEPS)
        if isinstance(saved, dict) and isinstance(saved.get("global_steps"), int):
            engine.global_steps = saved["global_steps"]
            engine.global_samples = int(saved.get("global_samples") or 0)
            return
        # Written by another strategy, whose global_step counts optimizer updates; samples as DeepSpeed counts them
        # when its own checkpoint lacks them.
        engine.global_steps = int(full.get("global_step", 0))
        engine.global_samples = engine.global_steps * engine.train_batch_size()

    def _load_engine_checkpoint(self, meta: dict[str, Any], strict: bool) -> None:
        engine = self._strategy._require_training_engine()
        saved_world_size = meta.get("world_size")
        world_size = self._strategy.world_size
        if saved_world_size is not None and saved_world_size != world_size:
            raise CheckpointError(
                f"{meta['directory']} was written by {saved_world_size} processes, "
                f"and DeepSpeed resumes ZeRO checkpoints only with the same number (now {world_size}). "
                f"Consolidate it (phalanx checkpoint consolidate) to get its weights."
            )
        saved_stage = meta.get("zero_stage")
        if saved_stage is not None and saved_stage != self._strategy.zero_stage:
            raise CheckpointError(
                f"{meta['directory']} was written with ZeRO stage {saved_stage}; resume it with the same stage (now"
                f" {self._strategy.zero_stage})."
            )
        # The tag comes from the checkpoint (its state file, else 'latest'): a plain name inside it, every file
        # DeepSpeed needs present. DeepSpeed is given the checked tag, so it never reads 'latest' itself.
        directory = Path(meta["directory"])
        tag, folder = tag_directory(directory, meta.get("tag"))
        check_tag_files(folder, world_size=saved_world_size, zero_stage=saved_stage)
        reads: AbstractContextManager = nullcontext()
        if not self._strategy._allow_unsafe_checkpoint_load:
            refuse_unsafe_engine_reads(engine, directory)
            reads = safe_engine_reads(engine, directory, folder, io=self._strategy.checkpoint_io)
        with reads:
            load_path, _ = engine.load_checkpoint(
                str(directory),
                tag=tag,
                load_module_strict=strict,
                load_optimizer_states=True,
                load_lr_scheduler_states=False,
            )
        if load_path is None:
            raise CheckpointError(f"DeepSpeed found no checkpoint in {directory} (tag {tag!r}).")
        self.optimizer_restored = True

    def load_full_weights(self, weights: dict[str, Any], strict: bool = True) -> None:
        """Whole weights (a plain state dict, as ``Cohort.load_raw`` reads) into the module and, once the engine
        trains, into the optimizer's full-precision partitions too: its next step writes those back into the module."""
        self._load_full_weights(weights, strict)
        engine = self._strategy._engine
        if engine is None or not self._strategy._engine_trains:
            return
        optimizer = engine.optimizer
        # ZeRO keeps an fp32 partition beside the module's; refreshed from the module's (now loaded) partitions, as
        # DeepSpeed does when it loads a checkpoint without fp32 weights. (Its per-parameter setter fails on a
        # parameter smaller than the world size under stage 3.)
        restore = getattr(optimizer, "_restore_from_bit16_weights", None)
        if callable(restore):
            restore()
            return
        import torch
        from deepspeed.utils import safe_set_full_fp32_param

        module = self._strategy._module
        assert module is not None
        for name, parameter in module.named_parameters():
            if name in weights:
                safe_set_full_fp32_param(parameter, weights[name].to(parameter.device, torch.float32))

    def _load_full_weights(self, weights: dict[str, Any], strict: bool) -> None:
        module = self._strategy._module
        assert module is not None
        partitioned = partitioned_parameters(module)
        if not partitioned:
            module.load_state_dict(weights, strict=strict)
            return
        deepspeed = self._strategy._deepspeed()
        # Every rank reads the same weights; rank 0's copy is what GatheredParameters partitions again on exit.
        with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=0):
            module.load_state_dict(weights, strict=strict)

    def check_optimizer_restored(self, checkpoint: dict[str, Any]) -> None:
        """Nothing left to read: the engine restored its optimizer partitions with the weights
        (``load_model_state_dict``)."""
        states = checkpoint["optimizer_states"]
        driven = len(self._strategy.optimizers)
        if len(states) != driven:
            raise ValueError(
                f"The checkpoint holds {len(states)} optimizer state(s) but DeepSpeed drives {driven};"
                " resume with the same optimizer configuration."
            )
        if not self.optimizer_restored:
            # load_model_state_dict restores the optimizer with the weights (from any layout); never resume without it.
            raise CheckpointError(
                "DeepSpeed's optimizer state was not restored with the weights: the checkpoint was read without"
                " load_model_state_dict. Resume through Trainer.fit(ckpt_path=...)."
            )

    # ------------------------------------------------------------------ checkpoint directories
    def save(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Every rank writes its partitions through the CheckpointIO into a staging directory; rank 0 adds the
        Trainer's state; the IO publishes it with ``.complete`` (see ``deepspeed._io``)."""
        # Lazy for import time: the DeepSpeed directory writer (_io) loads on the first save.
        from phalanx.plugins.io.collectives import Collectives
        from phalanx.strategies.deepspeed._io import save_deepspeed_directory

        engine = self._strategy._require_training_engine()
        if storage_options is not None:
            raise TypeError(
                f"DeepSpeedStrategy.save_checkpoint takes no storage_options (got {storage_options!r} for"
                f" {str(filepath)!r}); configure the file system through the CheckpointIO."
            )
        state = None
        if self._strategy.is_global_zero:
            state = {key: value for key, value in checkpoint.items() if key != "state_dict"}
            state["deepspeed"] = {
                "tag": TAG,
                "zero_stage": self._strategy.zero_stage,
                "world_size": self._strategy.world_size,
                "precision": self._strategy.precision_plugin.precision,
            }
        target = filepath if is_url(filepath) else Path(filepath).absolute()
        save_deepspeed_directory(
            engine,
            self._strategy.checkpoint_io,
            state,
            target,
            tag=TAG,
            state_file=STATE_FILE,
            collectives=Collectives.of(self._strategy),
            exclude_frozen_parameters=self._strategy._exclude_frozen_parameters,
        )

    def load(self, checkpoint_path: Any) -> dict[str, Any] | None:
        """A DeepSpeed directory: the Trainer's state, read through the CheckpointIO (its weights stay in DeepSpeed's
        files, see ``load_model_state_dict``)."""
        self.resume_path = checkpoint_path
        if isinstance(checkpoint_path, (str, os.PathLike)) and checkpoint_layout(checkpoint_path) == "deepspeed":
            if is_url(checkpoint_path):  # DeepSpeed's engine reads local files: a local copy, kept while resuming
                # Lazy for import time: only a resume from a URL copies; `from phalanx import Trainer` skips it.
                from phalanx.strategies.deepspeed._io import local_copy_for_resume

                checkpoint_path = local_copy_for_resume(checkpoint_path, self._strategy)
            directory = Path(checkpoint_path)
            state_file = entry_inside(directory, STATE_FILE, root=directory, what="phalanx's state file")
            state = self._strategy.checkpoint_io.load_checkpoint(state_file)  # weights_only=True with TorchCheckpointIO
            meta = dict(state.get("deepspeed") or {})
            meta["directory"] = str(directory.absolute())
            state["deepspeed"] = meta
            state.setdefault("state_dict", {})  # DeepSpeed's files hold the weights
            return state
        return None


__all__ = ["_DeepSpeedCheckpoints"]
