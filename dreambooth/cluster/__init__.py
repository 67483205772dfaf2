"""Ray for every script: a local cluster or the one RAY_ADDRESS names, token authentication, quiet logs."""
