"""Training (layer 4): optax steps on a `TrainState`, the training loop, orbax checkpoints, model export.

  state = TrainState.create(model.params, make_optimizer(total_steps=1000))
  state, metrics = train_step(state, batch, model)      # batch: 'inputs' [B, L], 'weights' [B, L]
  evaluate(model, state.params, batches)                 # loss, accuracy, perplexity
  train_and_evaluate(model_dir=..., preset='6m', ...)    # the loop; resumes from model_dir
  distill_step(state, batch, drafter, verifier)          # token-level distillation (KL or TV to the verifier)
  distill.write(directory, verifier, task, split, n)     # sequence-level distillation data
  save_params(path, model); load_model(path)             # export / import a trained model (export_name: its label)
  load_hf(directory)                                     # a save_pretrained directory by model_type: t5, gemma2
  load_hf_t5(directory); load_t5x(path, config)          # T5 checkpoints: Hugging Face safetensors, T5X
  load_gemma(path, preset)                               # Gemma 2 in the gemma library's Orbax layout
  load_any(path)                                         # an export or a save_pretrained directory
  save_hf_t5(model, directory)                           # T5 export for transformers' from_pretrained

The weighted-loss convention (weights[:, t] marks token t as a target) is in `train`'s docstring.
"""

from specdec.training.checkpoint import (CheckpointError, Checkpointer, Restored, export_name, load_model,
                                         model_spec, restore_latest, save_params)
from specdec.training import distill
from specdec.training.convert import load_any, load_gemma, load_hf, load_hf_gemma2, load_hf_t5, load_t5x, save_hf_t5
from specdec.models import cast_params
from specdec.training.train import (DISTILL_LOSSES, Batch, DataSource, MarkovChain, TrainState,
                                    distill_eval_step, distill_step, eval_step, evaluate, learning_rate_schedule,
                                    make_optimizer, markov_batches, train_and_evaluate, train_step)

__all__ = ["DISTILL_LOSSES", "Batch", "CheckpointError", "Checkpointer", "DataSource", "MarkovChain", "Restored",
           "TrainState", "cast_params", "distill", "distill_eval_step", "distill_step", "eval_step", "evaluate",
           "export_name", "learning_rate_schedule", "load_any", "load_gemma", "load_hf", "load_hf_gemma2", "load_hf_t5",
           "load_model", "load_t5x", "make_optimizer",
           "markov_batches", "model_spec", "restore_latest", "save_hf_t5", "save_params", "train_and_evaluate",
           "train_step"]
