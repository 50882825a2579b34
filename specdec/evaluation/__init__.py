"""Evaluation (layer 5): timing now; quality metrics, sweeps and Pareto frontiers come with the
experiments issue."""
