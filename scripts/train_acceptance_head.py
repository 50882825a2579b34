"""Trains SpecDec++'s acceptance-prediction head on a frozen drafter (`specdec.training.acceptance`).

  python scripts/train_acceptance_head.py --gin_file=configs/train/debian_acceptance_head.gin

Reads prompts with the verifier's own responses (`scripts/make_distill_data.py` writes them), labels
every response token with the exact acceptance probability of the drafter's proposal there, trains the
head with token mixing and the weighted BCE, reports validation binary KL against the constant
prediction, and writes the head into the drafter's export directory (`acceptance_head/`, loaded by
`training.acceptance.load_head`). Gin files are looked up from the working directory, then the repository.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import gin
import jax
import numpy as np

from specdec import cli, sampling
from specdec.data import tasks
from specdec.models.acceptance_head import HeadConfig
from specdec.training import acceptance, load_model

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def _rows(generated: str, names: list[str], split: str, n: int) -> tasks.Tokenized:
  """The first n generated rows of each task, padded to one width."""
  parts = [tasks.read_generated(generated, name, split) for name in names]
  width = max(part.tokens.shape[1] for part in parts)
  pad = lambda x: np.pad(x[:n], ((0, 0), (0, width - x.shape[1])))
  return tasks.Tokenized(tokens=np.concatenate([pad(p.tokens) for p in parts]),
                         prompt_lengths=np.concatenate([p.prompt_lengths[:n] for p in parts]),
                         lengths=np.concatenate([p.lengths[:n] for p in parts]), records=())


@gin.configurable
def train_acceptance_head(*, drafter: str, verifier: str, generated: str, task_names: list[str],
                          n_train: int = 4096, n_validation: int = 512, temperature: float = 0.0,
                          depth: int = 1, w_acc: float = 1.0, w_rej: float = 1.0, mix_fraction: float = 0.5,
                          steps: int = 2000, batch_size: int = 32, learning_rate: float = 1e-3, seed: int = 0,
                          out: str | None = None) -> dict:
  """Labels, trains, evaluates and saves a head (module docstring); `out` defaults to the drafter's export."""
  drafter_model, verifier_model = load_model(drafter), load_model(verifier)
  s = sampling.Sampling(temperature)
  start = time.perf_counter()
  train = acceptance.label_rows(drafter_model, verifier_model, _rows(generated, task_names, "train", n_train),
                                key=jax.random.PRNGKey(seed), sampling=s)
  valid = acceptance.label_rows(drafter_model, verifier_model,
                                _rows(generated, task_names, "validation", n_validation),
                                key=jax.random.PRNGKey(seed + 1), sampling=s)
  print(f"labelled {train.response.sum():,} train / {valid.response.sum():,} validation response tokens in "
        f"{time.perf_counter() - start:.0f} s; mean acceptance {train.labels[train.response].mean():.3f} "
        f"(T={temperature})",
        flush=True)
  config = HeadConfig(drafter_model.config.embed_dim, depth=depth)
  head, metrics = acceptance.train_head(drafter_model, train, valid, config=config, steps=steps,
                                        batch_size=batch_size, learning_rate=learning_rate,
                                        mix_fraction=mix_fraction, w_acc=w_acc, w_rej=w_rej, seed=seed)
  print("validation: " + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items()),
        flush=True)
  settings = dict(verifier=verifier, generated=generated, tasks=task_names, n_train=n_train, temperature=temperature,
                  depth=depth, w_acc=w_acc, w_rej=w_rej, mix_fraction=mix_fraction, steps=steps,
                  batch_size=batch_size, learning_rate=learning_rate, seed=seed)
  path = acceptance.save_head(out or drafter, head, metadata={"training": settings, "validation": metrics})
  print(f"wrote {path}", flush=True)
  return metrics


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--gin_file", action="append", default=[])
  parser.add_argument("--gin_bindings", action="append", default=[])
  args = parser.parse_args(argv)
  gin.add_config_file_search_path(str(REPO_ROOT))
  gin.parse_config_files_and_bindings(args.gin_file, args.gin_bindings)
  return train_acceptance_head()


if __name__ == "__main__":
  sys.exit(cli.run(main, sys.argv[1:], "scripts/train_acceptance_head.py"))
