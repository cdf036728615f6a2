"""Node registry: which nodes exist, with what slots, and whether they are alive."""
