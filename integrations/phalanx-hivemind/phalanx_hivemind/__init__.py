"""phalanx-hivemind: collaborative training over the internet with hivemind, as a phalanx Strategy.

``Trainer(strategy=HivemindStrategy(target_batch_size=4096, initial_peers=[...]))``, or ``strategy="hivemind"`` (found
through the ``phalanx.strategies`` entry point; options then come from ``PHALANX_HIVEMIND_*`` environment variables).
Importing this package does not import hivemind: that happens when a run starts.
"""

from phalanx_hivemind.download import SwarmStateError
from phalanx_hivemind.options import COMPRESSIONS, INITIAL_PEERS_ENV, RUN_ID_ENV, TARGET_BATCH_SIZE_ENV
from phalanx_hivemind.strategy import HivemindStrategy
from phalanx_hivemind.swarm import SwarmProgress, SwarmScheduler
from phalanx_hivemind.trust import SwarmTrustError, SwarmTrustWarning

__version__ = "0.1.0"

__all__ = [
    "COMPRESSIONS",
    "INITIAL_PEERS_ENV",
    "RUN_ID_ENV",
    "TARGET_BATCH_SIZE_ENV",
    "HivemindStrategy",
    "SwarmProgress",
    "SwarmScheduler",
    "SwarmStateError",
    "SwarmTrustError",
    "SwarmTrustWarning",
]
