"""Training (layer 4): optax steps on a `TrainState`, the training loop, orbax checkpoints, model export.

  state = TrainState.create(model.params, make_optimizer(total_steps=1000))
  state, metrics = train_step(state, batch, model)      # batch: 'inputs' [B, L], 'weights' [B, L]
  evaluate(model, state.params, batches)                 # loss, accuracy, perplexity
  train_and_evaluate(model_dir=..., preset='6m', ...)    # the loop; resumes from model_dir
  distill_step(state, batch, drafter, verifier)          # token-level distillation (KL or TV to the verifier)
  distill.write(directory, verifier, task, split, n)     # sequence-level distillation data
  save_params(path, model); load_model(path_or_name)     # export a trained model; load any model a user names: an
                                                         # export, a save_pretrained directory, a GGUF file, "smollm2"
  load_gguf(path); save_gguf(model, path)                # llama.cpp's GGUF files (the Llama family)
  load_hf(directory)                                     # a save_pretrained directory by model_type: t5, gemma2, llama
  load_hf_t5(directory); load_t5x(path, config)          # T5 checkpoints: Hugging Face safetensors, T5X
  load_gemma(path, preset)                               # Gemma 2 in the gemma library's Orbax layout
  save_hf_t5(model, directory)                           # T5 export for transformers' from_pretrained

The weighted-loss convention (weights[:, t] marks token t as a target) is in `train`'s docstring.
"""

from specdec.training.checkpoint import (CheckpointError, Checkpointer, Restored, export_name, load_export,
                                         model_spec, restore_latest, save_params)
from specdec.training import distill
from specdec.training.convert import load_hf
from specdec.training.hf_t5_checkpoints import load_hf_t5, save_hf_t5
from specdec.training.t5x_checkpoints import load_t5x
from specdec.training.decoder_checkpoints import load_gemma, load_hf_decoder
from specdec.training.gguf_checkpoints import load_gguf, save_gguf
from specdec.training.loading import load_model
from specdec.models import cast_params
from specdec.training.train import (DISTILL_LOSSES, Batch, DataSource, MarkovChain, TrainState,
                                    distill_eval_step, distill_step, eval_step, evaluate, learning_rate_schedule,
                                    make_optimizer, markov_batches, train_and_evaluate, train_step)

__all__ = ["DISTILL_LOSSES", "Batch", "CheckpointError", "Checkpointer", "DataSource", "MarkovChain", "Restored",
           "TrainState", "cast_params", "distill", "distill_eval_step", "distill_step", "eval_step", "evaluate",
           "export_name", "learning_rate_schedule", "load_export", "load_gemma", "load_gguf", "load_hf",
           "load_hf_decoder", "load_hf_t5", "load_model", "load_t5x", "make_optimizer", "markov_batches",
           "model_spec", "restore_latest", "save_gguf", "save_hf_t5", "save_params", "train_and_evaluate",
           "train_step"]
