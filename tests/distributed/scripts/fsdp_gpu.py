"""FSDP on every visible GPU (NCCL): bf16-mixed, and cpu_offload keeping the sharded parameters in host memory.

Usage: python fsdp_gpu.py OUT.json   (run by tests/gpu/test_fsdp_gpu.py on a CUDA machine)
"""

import json
import sys

import torch
from sharded_common import MLP, loader, quiet

import phalanx
from phalanx.strategies import FSDPStrategy

if __name__ == "__main__":
    devices = torch.cuda.device_count()
    results = {}
    for name, strategy in (("bf16", FSDPStrategy()), ("offload", FSDPStrategy(cpu_offload=True))):
        phalanx.seed_everything(7)
        module = MLP(width=256)
        trainer = quiet(strategy=strategy, accelerator="cuda", devices=devices, precision="bf16-mixed", max_steps=30)
        trainer.fit(module, loader(devices))
        local = next(module.parameters()).to_local()
        results[name] = {
            "first": module.losses[0],
            "last": module.losses[-1],
            "param_device": local.device.type,
            "peak_bytes": torch.cuda.max_memory_allocated(),
        }
    if trainer.is_global_zero:
        with open(sys.argv[1], "w") as handle:
            json.dump(results, handle)
