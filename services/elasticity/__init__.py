"""Elasticity: the membership of running jobs, as a sequence of generations."""
