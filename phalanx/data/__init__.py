"""Data services shared by the Trainer and the Cohort: distributed samplers and loaders."""
