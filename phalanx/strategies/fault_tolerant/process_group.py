"""The process group across replica groups, whose rendezvous and collectives each have their own bound."""

from __future__ import annotations

from datetime import timedelta
from typing import Any


def cross_group_gloo(torchft: Any, rendezvous_timeout: timedelta, collective_timeout: timedelta) -> Any:
    """A torchft ``ProcessGroupGloo`` whose rendezvous (``configure``, at each quorum change) waits at most
    ``rendezvous_timeout`` for the quorum's other groups, while each collective keeps ``collective_timeout``.

    torchft gives gloo one timeout for both. A group killed inside the rendezvous then held its peers for the whole
    step timeout (a long one, chosen for slow collectives), and the restarted group waited the same time for a quorum
    that only those peers could complete. Every member of a quorum has just asked for it, so the rendezvous needs
    seconds; a rendezvous that times out declines the step, and the next quorum (without the dead group) reconfigures.
    """
    group = torchft.process_group.ProcessGroupGloo(timeout=rendezvous_timeout)
    options_hook = group._opts_hook

    def with_collective_timeout(options: Any) -> Any:
        options = options_hook(options)
        # A timeout on the options overrides gloo's own (the rendezvous bound) for this collective only; one a caller
        # set is kept (unset is negative).
        timeout = getattr(options, "timeout", None)
        if timeout is not None and timeout < timedelta(0):
            options.timeout = collective_timeout
        return options

    # An attribute of this instance only: torchft passes every collective's options through ``_opts_hook``.
    group._opts_hook = with_collective_timeout
    return group
