"""phalanx services: admission, elasticity, health, checkpoint, agent, and the CLI."""
