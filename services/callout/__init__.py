"""The auth callout: admits each job's ranks to the bus as their job (Kubernetes)."""
