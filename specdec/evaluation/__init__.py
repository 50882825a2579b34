"""Evaluation (layer 5): `metrics` (BLEU, ROUGE-2, the verifier's log-likelihood, cost rates), `grid`
(gin-configured quality/latency grids: experiments, method families, points), `sweep` (runs a grid: quality
and latency of every point), `results` (the resumable JSON-lines store and its hashes), `pareto` (frontiers,
Table 2, Figure 3/4 plots), `bench` (the benchmark harness: records, timing, the interleaved protocol,
before/after; `specdec-bench`), `hlo_parse` and `hlo` (compiled programs read: parsed, then counted) and
`plan` (TPU programs planned: the slices in `tpu_topology`, the programs in `tpu_programs`, their costs in
`tpu_costs`)."""
