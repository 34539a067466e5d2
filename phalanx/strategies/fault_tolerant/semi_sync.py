"""Semi-synchronous replica groups: torchft's LocalSGD and DiLoCo, which synchronise the groups every N steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch.optim import Optimizer

from phalanx.utilities.messages import shown

#: The algorithms ``SemiSync`` offers, both torchft's own (``torchft.local_sgd``).
ALGORITHMS = ("local_sgd", "diloco")

#: Makes DiLoCo's outer optimizer from the module's parameters, e.g. ``lambda p: SGD(p, lr=0.7, momentum=0.9,
#: nesterov=True)`` (the DiLoCo paper's choice).
OuterOptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], Optimizer]


@dataclass(frozen=True)
class SemiSync:
    """Train each replica group on its own for ``sync_every`` optimizer steps, then synchronise the groups.

    ``"local_sgd"`` averages the groups' weights at each synchronisation; ``"diloco"`` averages the groups'
    pseudo-gradients (the weights at the last synchronisation minus the current ones) and steps the outer optimizer
    made by ``outer_optimizer`` with them. A synchronisation that the quorum does not commit is discarded: LocalSGD
    keeps each group's own weights, DiLoCo goes back to the weights of the last synchronisation.
    """

    #: "local_sgd" or "diloco".
    algorithm: str
    #: Optimizer steps between two synchronisations (a quorum forms only then).
    sync_every: int
    #: DiLoCo's outer optimizer, made from the module's parameters (required for "diloco", refused for "local_sgd").
    outer_optimizer: OuterOptimizerFactory | None = None

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"SemiSync(algorithm={shown(self.algorithm)}) is not valid; choose one of {ALGORITHMS}.")
        if isinstance(self.sync_every, bool) or not isinstance(self.sync_every, int) or self.sync_every < 1:
            raise ValueError(
                f"SemiSync(sync_every={shown(self.sync_every)}) must be an int >= 1 (the optimizer steps between two"
                f" synchronisations; 1 synchronises after every step)."
            )
        if self.algorithm == "diloco" and not callable(self.outer_optimizer):
            raise ValueError(
                f"SemiSync(algorithm='diloco') needs outer_optimizer, a function that makes the outer optimizer from"
                f" the parameters (e.g. lambda p: torch.optim.SGD(p, lr=0.7, momentum=0.9, nesterov=True)), got"
                f" {shown(self.outer_optimizer)}."
            )
        if self.algorithm == "local_sgd" and self.outer_optimizer is not None:
            raise ValueError(
                "SemiSync(algorithm='local_sgd') averages weights and has no outer optimizer; drop outer_optimizer or"
                " choose algorithm='diloco'."
            )


class SemiSyncGroup:
    """This replica group's torchft LocalSGD or DiLoCo, hooked on its optimizer while it fits."""

    def __init__(
        self, local_sgd: Any, manager: Any, module: torch.nn.Module, optimizer: Optimizer, options: SemiSync
    ) -> None:
        self.options = options
        if options.algorithm == "local_sgd":
            self.algorithm: Any = local_sgd.LocalSGD(manager, module, optimizer, options.sync_every)
        else:
            assert options.outer_optimizer is not None
            outer = options.outer_optimizer(module.parameters())
            # pin_memory=False: the backup of the weights stays in plain host memory (no accelerator needed).
            self.algorithm = local_sgd.DiLoCo(manager, [module], optimizer, outer, options.sync_every, pin_memory=False)
        self.algorithm.__enter__()
        self._manager = manager
        #: Inside an optimizer step: the loop's position at its start (a peer that joins then starts after the step).
        self.stepping: dict[str, int] | None = None

    def join(self) -> None:
        """After this group's first quorum: commit the quorum when the run starts, else take part in the
        synchronisation that the healthy groups are in (this group has just received their state)."""
        manager, algorithm = self._manager, self.algorithm
        if manager.current_step() == 0:
            # Nothing committed anywhere yet: the quorum gave every group group 0's weights (torchft's init_sync).
            # Committing it means no later quorum heals a group that trained since; the all-reduce before the vote
            # holds group 0 until the others have received its state (it stops serving it once it voted).
            manager.allreduce(torch.zeros(1)).wait()
            manager.should_commit()
        elif self.options.algorithm == "local_sgd":
            # The peers are inside LocalSGD.sync(), past its quorum: the same averaging, without a second quorum.
            algorithm._perform_sync()
        else:
            fragment = algorithm._fragments[algorithm._current_fragment()]
            fragment.prepare_sync()
            fragment.perform_sync()

    def close(self) -> None:
        """Remove the hooks from the optimizer."""
        self.algorithm.__exit__(None, None, None)
