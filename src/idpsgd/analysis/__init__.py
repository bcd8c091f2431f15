"""Analysis of runs: metrics, plots and reports (used by the training recipes and the CLI)."""
