"""One peer of a test swarm: trains a small regression with HivemindStrategy and records every swarm step.

Run by test_hivemind_strategy.py as a subprocess (one per peer). It writes, line by line (so that a peer killed
mid-run leaves what it recorded), to ``<out>/<name>.jsonl``: its addresses once the DHT runs, then one record per
swarm step it reaches: the step, the parameters right after it, the number of peers and the mean loss of the batches
it trained since the previous record. It stops at the first batch after ``--stop-file`` appears, at swarm step
``--swarm-steps``, ``--more-steps`` after its first, or after ``--max-seconds``. ``--poison`` makes it an attacker
(test_hivemind_trust.py): every gradient one value, its parameters one value after each batch, or the state it serves
to joiners tampered with. ``--peers-from`` joins the peer whose record file it names once that file holds its
addresses: a second peer started beside the first then imports and builds while the first does.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from phalanx_hivemind import HivemindStrategy
from torch.utils.data import DataLoader, TensorDataset

import phalanx


class Regressor(phalanx.TrainingModule):
    """A small MLP fitting a fixed linear map; every peer builds it from the same seed."""

    def __init__(self, step_sleep: float, lr: float, scheduler: bool = True) -> None:
        super().__init__()
        self.lr, self.scheduler = lr, scheduler
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.step_sleep = step_sleep

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.step_sleep:
            time.sleep(self.step_sleep)  # a real peer computes for a while; keeps 3 peers from saturating 2 cores
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.5)
        if not self.scheduler:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.99)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Recorder(phalanx.Callback):
    """Writes the peer's addresses and each swarm step it reaches; stops the run after ``swarm_steps``."""

    def __init__(self, path: Path, swarm_steps: int, deadline: float, stop_file: Path | None, go_file: Path | None):
        self.path, self.swarm_steps, self.deadline = path, swarm_steps, deadline
        self.more_steps: int | None = None  # stop this many steps after the first one recorded
        self.first_epoch: int | None = None
        self.stop_file, self.go_file = stop_file, go_file
        self.last_epoch = -1
        self.losses: list[float] = []

    def _write(self, record: dict) -> None:
        with self.path.open("a") as file:
            file.write(json.dumps(record) + "\n")
            file.flush()

    def setup(self, trainer, module, stage):
        self._write({"addresses": trainer.strategy.visible_addresses, "pid": os.getpid()})

    def on_train_start(self, trainer, module):
        # Building a peer takes seconds here: the test starts late joiners early, and lets each join by creating its
        # go file. The peer says it is ready, then waits (its first step then finds the swarm ahead and downloads).
        self._write({"ready": True})
        while self.go_file is not None and not self.go_file.exists():
            if time.time() > self.deadline:
                raise TimeoutError(f"{self.go_file} did not appear before the deadline")
            time.sleep(0.1)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss.detach()))
        progress = trainer.strategy.swarm_progress
        if progress.epoch != self.last_epoch:
            self.last_epoch = progress.epoch
            params = torch.cat([p.detach().reshape(-1) for p in module.parameters()]).tolist()
            lr = trainer.strategy.hivemind_optimizer.param_groups[0]["lr"]
            mean_loss = sum(self.losses) / len(self.losses)
            self.losses = []
            record = {"epoch": progress.epoch, "params": params, "peers": progress.num_peers, "loss": mean_loss}
            self._write({**record, "lr": lr, "time": time.time()})
        stop_file = self.stop_file is not None and self.stop_file.exists()
        if self.first_epoch is None:
            self.first_epoch = progress.epoch
        more = self.more_steps is not None and progress.epoch >= self.first_epoch + self.more_steps
        if progress.epoch >= self.swarm_steps or more or stop_file or time.time() > self.deadline:
            trainer.should_stop = True


class PoisonParameters(phalanx.Callback):
    """An attacker that sets its parameters to one value after every batch (they reach others by state averaging)."""

    def __init__(self, value: float) -> None:
        self.value = value

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        with torch.no_grad():
            for parameter in module.parameters():
                parameter.fill_(self.value)


def _tampered_state(kind: str):
    """hivemind's get_current_state, changed the way ``kind`` says (what this peer serves to joiners)."""
    from hivemind.optim.state_averager import TrainingStateAverager

    original = TrainingStateAverager.get_current_state

    def get_current_state(self):
        metadata, tensors, infos = original(self)
        tensors, infos = list(tensors), list(infos)
        first = tensors[0]
        if kind in ("nan", "inf"):
            tensors[0] = torch.full_like(first, float(kind))
        elif kind == "shape":
            tensors[0] = torch.zeros(first.shape[0] + 1, *first.shape[1:])
        elif kind == "dtype":
            tensors[0] = first.double()
        elif kind == "extra":  # one more, large tensor after the state
            tensors.append(torch.zeros(1 << 20))
        else:
            raise ValueError(f"unknown state attack {kind!r}")
        from hivemind.compression import CompressionInfo

        infos = [CompressionInfo.from_tensor(t, key=i) for i, t in enumerate(tensors)]
        return metadata, tensors, infos

    TrainingStateAverager.get_current_state = get_current_state  # this process is the attacker


def _poisoning(module: phalanx.TrainingModule, attack: str) -> phalanx.Callback:
    """Make this peer an attacker: every gradient VALUE, its parameters VALUE, or its served state tampered."""
    what, _, value = attack.partition("=")
    if what == "grads":
        for parameter in module.parameters():
            parameter.register_hook(lambda grad: torch.full_like(grad, float(value)))
        return phalanx.Callback()
    if what == "params":
        return PoisonParameters(float(value))
    if what == "state":
        _tampered_state(value)
        return phalanx.Callback()
    raise ValueError(f"unknown attack {attack!r}")


def _addresses_in(path: Path, deadline: float) -> list[str]:
    """The addresses another peer wrote as the first line of its record file (waiting until that line is whole)."""
    while time.time() < deadline:
        text = path.read_text() if path.exists() else ""
        if "\n" in text:
            return json.loads(text.split("\n", 1)[0])["addresses"]
        time.sleep(0.1)
    raise TimeoutError(f"{path} held no addresses before the deadline")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--run-id", default="phalanx_test")
    parser.add_argument("--initial-peers", default="")
    parser.add_argument("--peers-from", type=Path, default=None, help="join the peer whose record file this is")
    parser.add_argument("--target-batch-size", type=int, default=256)
    parser.add_argument("--swarm-steps", type=int, default=1000)
    parser.add_argument("--step-sleep", type=float, default=0.02)
    parser.add_argument("--data-seed", type=int, default=1)
    parser.add_argument("--matchmaking-time", type=float, default=3.0)
    parser.add_argument("--averaging-timeout", type=float, default=10.0)
    parser.add_argument("--max-seconds", type=float, default=120.0)
    parser.add_argument("--stop-file", type=Path, default=None)
    parser.add_argument("--go-file", type=Path, default=None)
    parser.add_argument("--more-steps", type=int, default=None)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--save", type=Path, default=None)
    parser.add_argument("--resume", type=Path, default=None)
    parser.add_argument("--options", default="{}", help="more HivemindStrategy arguments, as JSON")
    parser.add_argument("--no-scheduler", action="store_true", help="train without the StepLR")
    parser.add_argument("--poison", default=None, help="an attack: grads=VALUE, params=VALUE or state=KIND")
    args = parser.parse_args()

    # One thread per peer: several peers and their averager processes share a few cores, and torch's intra-op pool
    # in each of them made averaging requests miss their deadlines on a loaded machine.
    torch.set_num_threads(1)
    torch.manual_seed(0)  # the same initial weights on every peer
    module = Regressor(args.step_sleep, args.lr, scheduler=not args.no_scheduler)
    generator = torch.Generator().manual_seed(args.data_seed)  # each peer its own data
    true_map = torch.randn(8, 1, generator=torch.Generator().manual_seed(123))
    x = torch.randn(4096, 8, generator=generator)
    data = TensorDataset(x, x @ true_map + 0.01 * torch.randn(4096, 1, generator=generator))
    deadline = time.time() + args.max_seconds
    initial_peers = [peer for peer in args.initial_peers.split(",") if peer]
    if args.peers_from is not None:
        initial_peers += _addresses_in(args.peers_from, deadline)
    strategy = HivemindStrategy(
        target_batch_size=args.target_batch_size,
        run_id=args.run_id,
        initial_peers=initial_peers,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        matchmaking_time=args.matchmaking_time,
        averaging_timeout=args.averaging_timeout,
        load_state_timeout=15.0,
        verbose=True,  # hivemind's per-round status lines: the test reads which rounds a peer averaged alone
        **json.loads(args.options),
    )
    callbacks = [] if args.poison is None else [_poisoning(module, args.poison)]
    recorder = Recorder(args.out / f"{args.name}.jsonl", args.swarm_steps, deadline, args.stop_file, args.go_file)
    recorder.more_steps = args.more_steps
    trainer = phalanx.Trainer(
        accelerator="cpu",
        strategy=strategy,
        max_epochs=1000,
        callbacks=[recorder, *callbacks],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=args.out,
    )
    while args.resume is not None and not args.resume.exists():  # started early: the checkpoint is written later
        if time.time() > deadline:
            raise TimeoutError(f"{args.resume} did not appear before the deadline")
        time.sleep(0.1)
    trainer.fit(module, DataLoader(data, batch_size=8, shuffle=True), ckpt_path=args.resume)
    if args.save is not None:
        trainer.save_checkpoint(args.save)
    recorder._write({"done": True, "epoch": strategy.hivemind_optimizer.local_epoch})


if __name__ == "__main__":
    main()
