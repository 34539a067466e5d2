"""What the Trainer logs: metrics, results, loggers and the barebones switch."""
