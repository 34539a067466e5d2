"""Cohort: phalanx's strategies driven from your own training loop."""

from phalanx.cohort.cohort import Cohort
from phalanx.cohort.wrappers import CohortDataLoader, CohortModule

__all__ = ["Cohort", "CohortDataLoader", "CohortModule"]
