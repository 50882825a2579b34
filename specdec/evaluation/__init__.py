"""Evaluation (layer 5): `metrics` (BLEU, ROUGE-2, the verifier's log-likelihood, cost rates), `sweep`
(gin-configured quality/latency grids stored as resumable JSON lines), `pareto` (frontiers, Table 2,
Figure 3/4 plots) and `timing` (median wall-clock of jitted calls, for the benchmarks)."""
