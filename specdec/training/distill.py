"""Sequence-level distillation data (layer 4): a task's prompts with the verifier's own continuations.

A drafter is accepted where it predicts what the *verifier* writes, not what the references say
(DistillSpec, Zhou et al. 2024: on-policy or teacher-generated data distils acceptance best). `generate`
decodes a task split's prompts with the verifier (greedy by default) and returns a `tasks.Tokenized` whose
targets are those continuations; `write` keeps them as chunked .npz files so a killed run resumes where it
stopped; `tasks.read_generated` reads them back and `tasks.prefix_lm_batches(..., generated=directory)`
trains on them like any task.
"""

from __future__ import annotations

import pathlib
import time

import jax
import numpy as np

from specdec import decoding
from specdec.data import tasks

CHUNK = 1024   # examples per file


def generate(verifier, split: tasks.Tokenized, rows: np.ndarray, *, max_new_tokens: int, eos_id: int,
             batch_size: int = 64, temperature: float = 0.0, seed: int = 0) -> tasks.Tokenized:
  """The prompts of `split`'s `rows` followed by the verifier's continuation (eos included when it ends).

  Rows are decoded in batches of similar prompt length (widths rounded up to 32), so a batch wastes
  little compute on padding; the result keeps the order of `rows`. Continuations are cut to fit the
  split's row width.
  """
  prompts, prompt_lengths = split.prompts(rows)
  width = split.tokens.shape[1]
  tokens = np.zeros((len(rows), width), np.int32)
  lengths = np.zeros(len(rows), np.int32)
  order = np.argsort(prompt_lengths, kind="stable")
  for start in range(0, len(rows), batch_size):
    batch = order[start:start + batch_size]
    padded = np.concatenate([batch, np.full(batch_size - len(batch), batch[-1])])   # one shape per width
    prompt_width = tasks.bucket_width(prompt_lengths[batch].max())
    # Row ids: a row's continuation depends on (seed, its row of the split), not on the batching.
    out = decoding.generate(jax.random.PRNGKey(seed), None, verifier, prompts[padded, :prompt_width],
                            prompt_lengths[padded], method="autoregressive", temperature=temperature,
                            max_new_tokens=max_new_tokens, eos_id=eos_id, row_ids=np.asarray(rows)[padded])
    new_tokens, new_lengths = np.asarray(out.tokens)[:len(batch)], np.asarray(out.lengths)[:len(batch)]
    for i, row in enumerate(batch):
      n_prompt = int(prompt_lengths[row])
      n_new = min(int(new_lengths[i]), width - n_prompt)
      tokens[row, :n_prompt] = prompts[row, :n_prompt]
      tokens[row, n_prompt:n_prompt + n_new] = new_tokens[i, :n_new]
      lengths[row] = n_prompt + n_new
  return tasks.Tokenized(tokens=tokens, prompt_lengths=prompt_lengths.astype(np.int32), lengths=lengths,
                         records=tuple(split.records[i] for i in rows))


def write(directory: str | pathlib.Path, verifier, task: str, split: str, n_examples: int, *, source: str,
          eos_id: int, batch_size: int = 64, temperature: float = 0.0, seed: int = 0) -> None:
  """Generates the first `n_examples` of a seeded permutation of the split, CHUNK examples per .npz file;
  chunks already on disk are skipped (resume)."""
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  split_data = tasks.tokenized(task, split, source=source)
  if not 1 <= n_examples <= len(split_data):
    raise ValueError(f"n_examples must lie in [1, {len(split_data)}] for {task}/{split}; got {n_examples}")
  rows = np.random.default_rng(seed).permutation(len(split_data))[:n_examples]
  max_new_tokens = tasks.get_task(task).max_target_tokens
  for index, start in enumerate(range(0, n_examples, CHUNK)):
    path = tasks.generated_chunk_path(directory, task, split, index)
    if path.exists():
      continue
    began = time.perf_counter()
    chunk = generate(verifier, split_data, rows[start:start + CHUNK], max_new_tokens=max_new_tokens,
                     eos_id=eos_id, batch_size=batch_size, temperature=temperature, seed=seed + start)
    partial = path.with_suffix(".partial.npz")
    np.savez(partial, tokens=chunk.tokens, prompt_lengths=chunk.prompt_lengths, lengths=chunk.lengths,
             rows=rows[start:start + CHUNK])
    partial.rename(path)   # a killed run leaves no half-written chunk under a final name
    print(f"{task}/{split}: examples {start}-{start + len(chunk) - 1} in {time.perf_counter() - began:.0f} s, "
          f"mean continuation {np.mean(chunk.lengths - chunk.prompt_lengths):.1f} tokens", flush=True)
