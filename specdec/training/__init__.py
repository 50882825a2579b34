"""Training (layer 4): optax steps on a `TrainState`, the training loop, orbax checkpoints, model export.

  state = TrainState.create(model.params, make_optimizer(total_steps=1000))
  state, metrics = train_step(state, batch, model)      # batch: 'inputs' [B, L], 'weights' [B, L]
  evaluate(model, state.params, batches)                 # loss, accuracy, perplexity
  train_and_evaluate(model_dir=..., preset='6m', ...)    # the loop; resumes from model_dir
  save_params(path, model); load_model(path)             # export / import a trained model (export_name: its label)

The weighted-loss convention (weights[:, t] marks token t as a target) is in `train`'s docstring.
"""

from specdec.training.checkpoint import (CheckpointError, Checkpointer, Restored, export_name, load_model,
                                         model_spec, restore_latest, save_params)
from specdec.training.train import (Batch, DataSource, MarkovChain, TrainState, cast_params, eval_step, evaluate,
                                    learning_rate_schedule, make_optimizer, markov_batches, train_and_evaluate,
                                    train_step)

__all__ = ["Batch", "CheckpointError", "Checkpointer", "DataSource", "MarkovChain", "Restored", "TrainState",
           "cast_params", "eval_step", "evaluate", "export_name", "learning_rate_schedule", "load_model",
           "make_optimizer", "markov_batches", "model_spec", "restore_latest", "save_params", "train_and_evaluate",
           "train_step"]
