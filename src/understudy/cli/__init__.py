"""The `understudy` command line: generate, bench, serve, simulate, train-head."""
