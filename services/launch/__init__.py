"""Process management: what a deployment runs (deployment), running and restarting it (supervisor, child),
health checks and each process's logging."""
