"""ModelParallelStrategy: a 2-D device mesh (data parallel x tensor parallel) that the module parallelises itself."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

from phalanx.accelerators.accelerator import Accelerator
from phalanx.plugins.environments.cluster_environment import ClusterEnvironment
from phalanx.plugins.io.checkpoint_io import CheckpointIO
from phalanx.plugins.precision.precision import Precision
from phalanx.strategies.fsdp._sharded import ShardedStrategyMixin, check_state_dict_type
from phalanx.strategies.fsdp.strategy import is_sharded
from phalanx.strategies.parallel import DEFAULT_TIMEOUT, ParallelStrategy
from phalanx.strategies.parallel_dims import MeshAxis, ParallelDims
from phalanx.strategies.settings import RunSettings
from phalanx.strategies.strategy import Strategy
from phalanx.utilities.checks import is_int_at_least
from phalanx.utilities.dtensor import has_dtensors, has_meta_tensors
from phalanx.utilities.registry import Registry

MESH_DIMENSIONS = (MeshAxis.DATA.value, MeshAxis.TENSOR.value)


def _check_size(name: str, value: Any) -> None:
    if value != "auto" and not is_int_at_least(value, 1):
        raise ValueError(f"{name}={value!r} must be 'auto' or an int >= 1.")


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
        """The sizes of the mesh's axes; 'auto' for both is one node's processes for tensor parallelism, 'auto' for
        one is what the other leaves of the world size."""
        world = self.num_nodes * self.num_processes
        dp, tp = self._data_parallel_size, self._tensor_parallel_size
        if tp == "auto" and dp == "auto":
            dp, tp = self.num_nodes, self.num_processes
        try:
            return ParallelDims(
                world,
                data_shard=-1 if dp == "auto" else int(dp),
                tensor=-1 if tp == "auto" else int(tp),
                axes=(MeshAxis.DATA, MeshAxis.TENSOR),
            )
        except ValueError:
            raise ValueError(
                f"data_parallel_size={self._data_parallel_size!r} x"
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
        if not has_dtensors(module) and self.world_size > 1:
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

    @classmethod
    def register_strategies(cls, registry: Registry[Strategy]) -> None:
        """Register 'model_parallel'."""
        registry.register(
            "model_parallel",
            cls,
            description="Tensor parallelism and FSDP on a 2-D DeviceMesh, applied in configure_model.",
        )
