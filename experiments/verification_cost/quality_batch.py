"""Seconds for the sweep's quality pass (`sweep.quality`) on 128 examples at several batch sizes: the verifier
alone, BiLD* (α = 3) and SpecCascade [OPT] (α = 0.1), γ = 5, T = 1, each after a compile call.

  JAX_PLATFORMS=cpu python experiments/verification_cost/quality_batch.py en_de 64 16 8 4
  JAX_PLATFORMS=cpu python experiments/verification_cost/quality_batch.py en_de 1 2
"""

import dataclasses
import sys
import time

import jax

from specdec.evaluation import grid, sweep

task = sys.argv[1]
experiment = grid.parse_gin([f"configs/experiments/protocol_{task}_table2.gin"], ["Experiment.n_examples = 128"])
timed = [p for p in grid.expand_grid(experiment) if p.is_baseline
         or (p.family == "SpecCascade [OPT]" and p.alpha == 0.1) or (p.family == "BiLD*" and p.alpha == 3.0)]
for size in [int(s) for s in sys.argv[2:]]:
  workload = sweep.load_workload(dataclasses.replace(experiment, batch_size=size))
  for point in timed:
    sweep.decode_rows(point, workload, jax.random.PRNGKey(0), sweep.batches(workload)[0])  # compile
    start = time.perf_counter()
    sweep.quality(point, workload)
    print(f"batch {size:3d} {point.family:20s} {dict(point.params)}: {time.perf_counter() - start:6.1f} s "
          "for 128 examples", flush=True)
