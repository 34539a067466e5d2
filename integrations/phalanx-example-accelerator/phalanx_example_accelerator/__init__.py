"""An example third-party package: a custom Accelerator and a Strategy that uses it, registered by entry points.

After ``pip install ./integrations/phalanx-example-accelerator``:
``Trainer(accelerator="example_cpu", strategy="example_single_device")`` trains on the CPU through these classes.
"""

from phalanx_example_accelerator.accelerator import ExampleCPUAccelerator
from phalanx_example_accelerator.strategy import ExampleStrategy

__all__ = ["ExampleCPUAccelerator", "ExampleStrategy"]
