"""The Trainer's loops: fit, evaluation and prediction, with their data and optimizer steps."""
