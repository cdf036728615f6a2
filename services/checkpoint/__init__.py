"""The checkpoint service: the catalog of every job's snapshots and where it can resume."""
