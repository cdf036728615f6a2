"""Node agent: registers its machine, heartbeats, and (later) runs rank processes."""
