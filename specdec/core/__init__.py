"""Layer 1, the core math: pure functions on probability arrays with a leading batch shape, no models, no
I/O, all jit-able (docs/design.md, "Layers").

  sampling   S(·): temperature, top-k, top-P; `Sampling`; drawing tokens
  targets    the target rules π = T(q, p) of the speculative-cascades paper
  verify     block verification: accept a prefix of γ drafts against π (Alg. 4/5)
  spectr     SpecTr's K-SEQ draft selection
  tree       token trees of K drafts; SpecInfer's verification over them
  theory     the papers' cost models (expected tokens per call, speed-ups)
  rng        one key or one key per row for the samplers
  checks     argument checks that name the parameter and its allowed range

`from specdec import sampling, targets, verify` imports them from here.
"""
