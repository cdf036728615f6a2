"""Gang admission: all-or-nothing placement, priorities, quotas, preemption."""
