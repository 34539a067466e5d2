"""Launchers: how the processes of a job are started."""

from phalanx.strategies.launchers.launcher import Launcher, WorkerState

__all__ = ["Launcher", "WorkerState"]
