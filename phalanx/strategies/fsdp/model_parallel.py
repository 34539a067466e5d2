"""ModelParallelStrategy: a device mesh (pipeline x data parallel x tensor parallel) that the module parallelises
itself."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable

import torch
from torch import Tensor
from torch.optim import Optimizer

from phalanx.accelerators.accelerator import Accelerator
from phalanx.plugins.environments.cluster_environment import ClusterEnvironment
from phalanx.plugins.io.checkpoint_io import CheckpointIO
from phalanx.plugins.io.formats.dcp import ELSEWHERE
from phalanx.plugins.precision.precision import Precision
from phalanx.strategies.fsdp._sharded import ShardedStrategyMixin, check_state_dict_type
from phalanx.strategies.fsdp.strategy import is_sharded
from phalanx.strategies.parallel import DEFAULT_TIMEOUT, ParallelStrategy
from phalanx.strategies.parallel_dims import MeshAxis, ParallelDims
from phalanx.strategies.pipeline import SCHEDULES, PipelineRunner, check_pipeline_options, slice_batch, stages_of_rank
from phalanx.strategies.pipeline_split import stage_views
from phalanx.strategies.settings import RunSettings
from phalanx.strategies.strategy import Strategy
from phalanx.utilities.apply import move_to_device
from phalanx.utilities.checks import is_int_at_least
from phalanx.utilities.dtensor import has_dtensors, has_meta_tensors, is_dtensor
from phalanx.utilities.optimizer_names import (
    check_state_shapes,
    groups_in_order,
    is_keyed_by_name,
    name_positions,
    order_keys,
    state_by_name,
)
from phalanx.utilities.registry import Registry

MESH_DIMENSIONS = (MeshAxis.DATA.value, MeshAxis.TENSOR.value)


def _check_size(name: str, value: Any) -> None:
    if value != "auto" and not is_int_at_least(value, 1):
        raise ValueError(f"{name}={value!r} must be 'auto' or an int >= 1.")


def _by_mesh(params: list[Tensor]) -> list[list[Tensor]]:
    """``params`` grouped by the mesh they are DTensors on (plain tensors in one group): torch's norm and clipping
    refuse plain tensors beside DTensors, or DTensors of several meshes, in one call."""
    groups: dict[Any, list[Tensor]] = {}
    for param in params:
        groups.setdefault(param.device_mesh if is_dtensor(param) else None, []).append(param)  # type: ignore[attr-defined]
    return list(groups.values())


def _local_norm(groups: list[list[Tensor]]) -> Tensor:
    """The 2-norm of this stage's gradients as a plain tensor; DTensors' norms are reduced over their own mesh (the
    tensor or data parallel ranks of the stage)."""
    norms = []
    for params in groups:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])  # type: ignore[misc]
        norms.append((norm.full_tensor() if is_dtensor(norm) else norm).float())  # type: ignore[attr-defined]
    return torch.linalg.vector_norm(torch.stack(norms))


def _refuse_loss_scaling(plugin: Precision | None, pipeline_size: int) -> None:
    if pipeline_size > 1 and getattr(plugin, "scaler", None) is not None:
        raise ValueError(
            f"A precision plugin with a GradScaler ('16-mixed') cannot run with pipeline_parallel_size={pipeline_size}:"
            " the schedule runs the backward itself, outside the scaler, and each stage would decide alone whether to"
            " skip a step. Use precision='bf16-mixed' or '32-true'."
        )


class ModelParallelStrategy(ShardedStrategyMixin, ParallelStrategy):
    """Tensor and data parallelism on a DeviceMesh named ("data_parallel", "tensor_parallel").

    The module parallelises itself in ``configure_model`` using ``self.device_mesh`` (``parallelize_module`` on
    ``device_mesh["tensor_parallel"]``, ``fully_shard`` on ``device_mesh["data_parallel"]``). Checkpoints are sharded
    directories by default (``save_distributed_checkpoint=False`` writes one whole file).
    """

    # Each block: configure_model's fully_shard and tensor-parallel hooks sit at block boundaries (as for FSDPStrategy).
    default_compile_unit = "blocks"
    step_collectives = {
        "forward": "tensor-parallel and FSDP collectives (forward)",
        "backward": "tensor-parallel and FSDP collectives (backward)",
        "optimizer_step": "optimizer step (tensor-parallel and FSDP collectives)",
    }

    def __init__(
        self,
        data_parallel_size: int | str = "auto",
        tensor_parallel_size: int | str = "auto",
        save_distributed_checkpoint: bool = True,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = DEFAULT_TIMEOUT,
        *,
        pipeline_parallel_size: int = 1,
        pipeline_schedule: str = "1F1B",
        microbatches: int | None = None,
        pipeline_stages_per_rank: int | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        _check_size("data_parallel_size", data_parallel_size)
        _check_size("tensor_parallel_size", tensor_parallel_size)
        self._data_parallel_size = data_parallel_size
        self._tensor_parallel_size = tensor_parallel_size
        self._state_dict_type = check_state_dict_type("sharded" if save_distributed_checkpoint else "full")
        self._device_mesh: Any = None
        if not is_int_at_least(pipeline_parallel_size, 1):
            raise ValueError(f"pipeline_parallel_size={pipeline_parallel_size!r} must be an int >= 1.")
        check_pipeline_options(pipeline_schedule, microbatches, pipeline_stages_per_rank)
        if pipeline_parallel_size > 1 and not save_distributed_checkpoint:
            # Rank 0 alone writes a whole file, and holds only its own stages: the file would lack the others.
            raise ValueError(
                f"pipeline_parallel_size={pipeline_parallel_size} needs save_distributed_checkpoint=True: each stage"
                " writes its own parameters into the sharded directory."
                " `phalanx checkpoint consolidate` makes one file of that directory."
            )
        self._pipeline_size: int = pipeline_parallel_size
        _refuse_loss_scaling(self._precision_plugin, pipeline_parallel_size)
        self._pipeline_schedule = pipeline_schedule
        several = SCHEDULES[pipeline_schedule][1]
        self._stages_per_rank: int = pipeline_stages_per_rank or (2 if several else 1)
        self._microbatches: int = microbatches or pipeline_parallel_size * self._stages_per_rank
        if pipeline_schedule == "DualPipeV" and self._microbatches < (stages := self.num_pipeline_stages):
            raise ValueError(
                f"pipeline_schedule='DualPipeV' needs microbatches >= its {stages} stages, got {microbatches}."
                f" Use microbatches >= {stages}, or 'ZBVZeroBubble' (the same V placement)."
            )
        self._pipeline: PipelineRunner | None = None

    @property
    def precision_plugin(self) -> Precision:
        """The precision plugin (FSDPPrecision); with a pipeline, one that scales the loss (a GradScaler) is refused
        when it is set (by the Trainer at its construction)."""
        return Strategy.precision_plugin.fget(self)  # type: ignore[attr-defined]

    @precision_plugin.setter
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        _refuse_loss_scaling(precision_plugin, getattr(self, "_pipeline_size", 1))  # the base's __init__ sets it first
        Strategy.precision_plugin.fset(self, precision_plugin)  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ the mesh
    @property
    def device_mesh(self) -> Any:
        """The 2-D DeviceMesh (dims "data_parallel", "tensor_parallel"), built when the processes join their group."""
        if self._device_mesh is None:
            raise RuntimeError(
                "ModelParallelStrategy.device_mesh is built when the processes join their group (setup_environment,"
                " at the start of fit/validate/test/predict); read it from there on, e.g. as self.device_mesh in"
                " configure_model."
            )
        return self._device_mesh

    @device_mesh.setter
    def device_mesh(self, mesh: Any) -> None:
        self._device_mesh = mesh

    def parallel_dims(self) -> ParallelDims:
        """The sizes of the mesh's axes; 'auto' for both data and tensor sizes is one node's processes for tensor
        parallelism without a pipeline (the rest of the world size for data parallelism with one), 'auto' for one is
        what the others leave of the world size."""
        world = self.num_nodes * self.num_processes
        dp, tp, pp = self._data_parallel_size, self._tensor_parallel_size, self._pipeline_size
        if tp == "auto" and dp == "auto":
            dp, tp = (self.num_nodes, self.num_processes) if pp == 1 else ("auto", 1)
        axes = (MeshAxis.DATA, MeshAxis.TENSOR) if pp == 1 else (MeshAxis.PIPELINE, MeshAxis.DATA, MeshAxis.TENSOR)
        try:
            return ParallelDims(
                world,
                pipeline=pp,
                data_shard=-1 if dp == "auto" else int(dp),
                tensor=-1 if tp == "auto" else int(tp),
                axes=axes,
            )
        except ValueError:
            raise ValueError(
                f"pipeline_parallel_size={pp!r} x data_parallel_size={self._data_parallel_size!r} x"
                f" tensor_parallel_size={self._tensor_parallel_size!r} must equal the"
                f" number of processes ({world} = devices {self.num_processes} x num_nodes {self.num_nodes})."
            ) from None

    def mesh_shape(self) -> tuple[int, int]:
        """(data parallel size, tensor parallel size)."""
        dims = self.parallel_dims()
        return dims.data_parallel_size, dims.tensor

    def setup_environment(self) -> None:
        """Join the process group and build the 2-D device mesh."""
        dims = self.parallel_dims()  # checked before any process group exists
        super().setup_environment()
        self.device_mesh = dims.build_mesh(self.root_device.type)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any] | None:
        """Only data-parallel ranks read different data; a tensor-parallel group reads the same batches."""
        return dict(self.parallel_dims().sampler_kwargs(self.global_rank))

    # ------------------------------------------------------------------ set-up
    def connect(self, model: Any) -> None:
        """Take the module, which must parallelise itself in ``configure_model``."""
        # Lazy for import time: `import phalanx.strategies` (and the Cohort) does not load the TrainingModule.
        from phalanx.module import TrainingModule

        configure_model = getattr(type(model), "configure_model", None)
        if self._pipeline_size > 1 and not callable(getattr(model, "pipeline_loss", None)):
            raise TypeError(
                f"ModelParallelStrategy(pipeline_parallel_size={self._pipeline_size}) needs"
                f" {type(model).__name__}.pipeline_loss(output, batch): the loss of the last stage's output for a"
                " micro-batch (docs/pipeline.md)."
            )
        if configure_model is None or configure_model is TrainingModule.configure_model:
            raise TypeError(
                f"ModelParallelStrategy needs a TrainingModule whose {type(model).__name__}.configure_model()"
                " parallelises the model with"
                " self.device_mesh (parallelize_module on device_mesh['tensor_parallel'], fully_shard on"
                " device_mesh['data_parallel'])."
            )
        super().connect(model)

    def prepare_module(self, module: torch.nn.Module, settings: RunSettings) -> torch.nn.Module:
        """Convert the module and check that configure_model parallelised it."""
        module = self.precision_plugin.convert_module(module)
        self._module = module  # type: ignore[assignment]  # the connected TrainingModule, converted in place
        dp, _ = self.mesh_shape()
        if dp > 1 and not is_sharded(module):
            raise ValueError(
                f"data_parallel_size={dp}: gradients must be reduced across the data-parallel ranks. Apply"
                " fully_shard(module, mesh=self.device_mesh['data_parallel']) in configure_model."
            )
        if not has_dtensors(module) and self.world_size // self._pipeline_size > 1:
            raise ValueError(
                "configure_model did not parallelise any parameter with self.device_mesh; the model would be"
                " replicated without synchronisation."
            )
        return module

    def place_module(self, settings: RunSettings) -> None:
        """Materialise meta tensors on the device, or move the module there."""
        assert self._module is not None
        if has_meta_tensors(self._module):
            self._materialize(self._module)
        else:
            self.model_to_device()

    # ------------------------------------------------------------------ the pipeline
    @property
    def pipeline_parallel_size(self) -> int:
        """How many ranks the pipeline's stages are spread over (1: no pipeline)."""
        return self._pipeline_size

    @property
    def num_pipeline_stages(self) -> int:
        """How many stages the model is split into (``pipeline_parallel_size`` x stages per rank)."""
        return self._pipeline_size * self._stages_per_rank

    @property
    def pipeline_stages(self) -> tuple[int, ...]:
        """The stage indices this rank holds (one, or several for virtual-stage schedules); (0,) without a pipeline."""
        if self._pipeline_size == 1:
            return (0,)
        rank = self.parallel_dims().coordinates(self.global_rank)[MeshAxis.PIPELINE]
        return stages_of_rank(self._pipeline_schedule, rank, self._pipeline_size, self._stages_per_rank)

    def check_setup(self, settings: RunSettings) -> None:
        """Refuse what a pipeline cannot run: manual optimization."""
        if self._pipeline_size == 1:
            return
        if settings.fitting and not getattr(self._module, "automatic_optimization", True):
            raise ValueError(
                "A pipeline runs forward and backward in its schedule: manual optimization is not supported with"
                " pipeline_parallel_size > 1; use automatic optimization."
            )

    def _runner(self) -> PipelineRunner:
        if self._pipeline is None:
            assert self._module is not None
            # Several stages per rank: one view of the module per stage (configure_model kept them with keep_stages).
            modules = stage_views(self._module) if self._stages_per_rank > 1 else [self._module]
            self._pipeline = PipelineRunner(
                modules,
                self.pipeline_stages,
                self.num_pipeline_stages,
                self.root_device,
                self._pipeline_group(),
                self._pipeline_schedule,
                self._microbatches,
            )
        return self._pipeline

    def _pipeline_group(self) -> Any:
        return self.device_mesh[MeshAxis.PIPELINE.value].get_group()

    def _last_stage_rank(self) -> int:
        """The global rank in this rank's pipeline group that holds the last stage (the loss and the output)."""
        ranks = torch.distributed.get_process_group_ranks(self._pipeline_group())
        last, schedule, per_rank = self.num_pipeline_stages - 1, self._pipeline_schedule, self._stages_per_rank
        return next(r for i, r in enumerate(ranks) if last in stages_of_rank(schedule, i, len(ranks), per_rank))

    def _pipeline_inputs(self, batch: Any) -> tuple[tuple[Tensor, ...], int]:
        module = self._module
        hook = getattr(module, "pipeline_input", None)
        inputs = hook(batch) if hook is not None else batch[0] if isinstance(batch, (list, tuple)) else batch
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        size = inputs[0].shape[0]
        if size % self._microbatches:
            raise ValueError(
                f"microbatches={self._microbatches} does not divide the batch of {size} samples; use a batch size that"
                f" is a multiple of {self._microbatches} (drop_last=True drops a smaller last batch)."
            )
        return inputs, size

    def forward_backward(
        self, batch: Any, batch_idx: int, between: Callable[[Any], Tensor | None], optimizer: Optimizer | None
    ) -> tuple[Tensor | None, Any]:
        """The base class's step without a pipeline; with one, the schedule's (below)."""
        if self._pipeline_size == 1:
            return super().forward_backward(batch, batch_idx, between, optimizer)
        return self._pipelined_forward_backward(batch, batch_idx, between, optimizer)

    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """The base class's backward; refused with a pipeline, whose schedule runs every backward itself."""
        if self._pipeline_size > 1:
            raise RuntimeError(
                f"ModelParallelStrategy(pipeline_parallel_size={self._pipeline_size}) runs backward inside its pipeline"
                " schedule, so a loss computed outside it cannot be backpropagated."
                " Run each step through the strategy's forward_backward with a TrainingModule that defines"
                " pipeline_loss, by calling cohort.forward_backward(batch, batch_idx) in a Cohort loop;"
                " the Trainer does so itself."
            )
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def _run_step(self, method: str, context: Any, *args: Any, **kwargs: Any) -> Any:
        """The base class's call of a step method; with a pipeline, evaluation steps run it forward only (below)."""
        if self._pipeline_size == 1 or method == "training_step":
            return super()._run_step(method, context, *args, **kwargs)
        return self._pipelined_run_step(method, context, *args, **kwargs)

    def clip_gradients(
        self,
        module: torch.nn.Module | None,
        optimizer: Optimizer,
        *,
        max_norm: float | None = None,
        clip_val: float | None = None,
    ) -> Tensor | None:
        """The base class's clipping, except by norm with a pipeline: one norm over every stage's gradients."""
        by_norm = clip_val is None and isinstance(max_norm, (int, float)) and not isinstance(max_norm, bool)
        if self._pipeline_size == 1 or not by_norm or max_norm is None or max_norm < 0:
            # Without a pipeline, or clipping by value (local), or bad arguments (the base refuses them).
            return super().clip_gradients(module, optimizer, max_norm=max_norm, clip_val=clip_val)
        optimizer = getattr(optimizer, "optimizer", optimizer)
        groups = _by_mesh([p for group in optimizer.param_groups for p in group["params"] if p.grad is not None])
        local = _local_norm(groups) if groups else torch.zeros((), device=self.root_device)
        squared = local.double() ** 2
        torch.distributed.all_reduce(squared, group=self._pipeline_group())
        total = squared.sqrt().to(local.dtype)
        for params in groups if max_norm > 0 else ():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The mixin's; with a pipeline (sharded checkpoints), keyed by parameter name and listing every stage's
        parameters, so that it loads under any other split of the model (see ``_pipelined_optimizer_state``)."""
        if self._pipeline_size == 1 or self._state_dict_type != "sharded":
            return super().optimizer_state(optimizer)
        return self._pipelined_optimizer_state(optimizer)

    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        """The mixin's; with a pipeline, each rank takes its stages' tensors from a checkpoint of the whole model (its
        own stages' tensors must all be there when ``strict``)."""
        if self._pipeline_size > 1:
            live = self._module.state_dict()  # type: ignore[union-attr]
            checkpoint = {**checkpoint, "state_dict": {k: v for k, v in checkpoint["state_dict"].items() if k in live}}
        super().load_model_state_dict(checkpoint, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        """The mixin's; with a pipeline, a state keyed by position (written without a pipeline, for the whole model)
        is keyed by name first, the stages naming their parameters together (see ``_name_positions``)."""
        states = checkpoint.get("optimizer_states")
        if self._pipeline_size > 1 and isinstance(states, list) and len(states) == len(self.optimizers):
            named = [
                state if is_keyed_by_name(state) else self._name_positions(optimizer, state)
                for optimizer, state in zip(self.optimizers, states)
            ]
            checkpoint = {**checkpoint, "optimizer_states": named}
        super().load_optimizer_state_dict(checkpoint)

    def _name_positions(self, optimizer: Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        """``state``'s positions named: every rank lists its groups' parameters with their place in the whole model
        (``order_keys``), and each group's names, sorted by that place, are the positions in order."""
        module = self._module
        assert module is not None
        keys = order_keys(module)
        names = {id(parameter): name for name, parameter in module.named_parameters()}
        local = [[(names[id(p)], keys[names[id(p)]]) for p in group["params"]] for group in optimizer.param_groups]
        named = name_positions(state, groups_in_order(self.all_gather_object(local)))
        check_state_shapes(optimizer, module, named)
        return named

    def _pipelined_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """This rank's state keyed by name, its tensors written by this rank; rank 0 writes the rest of the checkpoint,
        so every rank learns what the others hold: their parameters' names, plain entries and tensor entries."""
        local = state_by_name(optimizer, self._module)  # type: ignore[arg-type]
        outline: dict[str, Any] = {
            "state": {
                pid: (
                    [key for key, value in entries.items() if isinstance(value, Tensor)],
                    {key: value for key, value in entries.items() if not isinstance(value, Tensor)},
                )
                for pid, entries in local["state"].items()
            },
            "params": [group["params"] for group in local["param_groups"]],
        }
        state, elsewhere = dict(local["state"]), dict[tuple[str, str], None]()
        params: list[list[str]] = [[] for _ in local["param_groups"]]
        for part in self.all_gather_object(outline):  # in rank order: the stages' order for the groups' names
            for pid, (tensors, plain) in part["state"].items():
                if pid not in local["state"]:
                    state.setdefault(pid, dict(plain))
                    elsewhere.update(dict.fromkeys((pid, key) for key in tensors))
            for names, more in zip(params, part["params"]):
                names.extend(name for name in more if name not in names)
        groups = [{**group, "params": names} for group, names in zip(local["param_groups"], params)]
        return {"state": state, "param_groups": groups, ELSEWHERE: [list(entry) for entry in elsewhere]}

    def _pipelined_forward_backward(
        self, batch: Any, batch_idx: int, between: Callable[[Any], Tensor | None], optimizer: Optimizer | None
    ) -> tuple[Tensor | None, Any]:
        """With a pipeline: the schedule runs forward and backward over the micro-batches; the loss (their mean)
        goes from the last stage to every rank of the pipeline, then through ``between``."""
        inputs, size = self._pipeline_inputs(batch)
        pipeline_loss: Callable[[Any, Any], Tensor] = self._module.pipeline_loss  # type: ignore[union-attr,assignment]
        divisor = self._run_settings.accumulate_grad_batches if self._run_settings is not None else 1
        step = size // self._microbatches

        def loss_fn(output: Any, indices: Tensor) -> Tensor:
            start = int(indices[0])  # a CPU tensor: no device read
            # The batch's loss is the micro-batches' mean; the driver's loss divisor (accumulation) applies to it.
            return pipeline_loss(output, slice_batch(batch, start, start + step, size)) / scale

        scale = self._microbatches * divisor
        with self.naming_collectives("backward"), self.precision_plugin.train_step_context():
            loss = self._runner().train(inputs, size, loss_fn) * divisor
            torch.distributed.broadcast(loss, src=self._last_stage_rank(), group=self._pipeline_group())
        # The gradients exist already: what ``between`` makes of the loss (the loss divisor, non-finite checks, the
        # on_before_backward hooks) is applied to a leaf that stands for the loss the schedule backpropagated.
        output = loss.requires_grad_(True)
        return between(output), output.detach()

    def _pipelined_run_step(self, method: str, context: Any, *args: Any, **kwargs: Any) -> Any:
        """Evaluation steps with a pipeline: calling the module runs the pipeline forward only, and every rank of the
        pipeline gets the last stage's output."""
        module = self._module
        assert module is not None
        module.__dict__["forward"] = self._pipelined_forward
        try:
            return super()._run_step(method, context, *args, **kwargs)
        finally:
            del module.__dict__["forward"]

    def _pipelined_forward(self, *args: Any) -> Any:
        module = self._module
        if self.__dict__.get("_in_stage"):
            return type(module).forward(module, *args)  # type: ignore[union-attr,arg-type]  # the stage's own layers
        inputs = tuple(args)
        self._in_stage = True
        try:
            output = self._runner().forward(inputs, inputs[0].shape[0])
        finally:
            self._in_stage = False
        box = [output]
        torch.distributed.broadcast_object_list(box, src=self._last_stage_rank(), group=self._pipeline_group())
        return move_to_device(box[0], self.root_device)

    @classmethod
    def register_strategies(cls, registry: Registry[Strategy]) -> None:
        """Register 'model_parallel'."""
        registry.register(
            "model_parallel",
            cls,
            description="Pipeline, data (FSDP) and tensor parallelism on one DeviceMesh, applied in configure_model.",
        )
