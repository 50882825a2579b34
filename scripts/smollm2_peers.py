"""SmolLM2-135M-Instruct decoded by its peers and by specdec on the same weights, in one run: tokens per second at
batch 1, greedy, on the same chat prompts (the same token ids for every engine).

  python scripts/smollm2_peers.py --prompts experiments/smollm2_eagle/heldout_prompts.txt \
      --out experiments/smollm2_eagle/peers

Engines (each given where its package imports; llama-cpp-python is not a dependency of specdec: pip builds it from
the registry's source, `pip install llama-cpp-python`):
- transformers' `generate` on the GGUF file itself (its own dequantization, float32), the reference tokens;
- llama.cpp (llama-cpp-python) on the F32 and F16 GGUF files that `save_gguf` exports from specdec's float32
  weights, plain and with its prompt-lookup decoding (`LlamaPromptLookupDecoding`);
- specdec alone (autoregressive, float32) and with a drafter (`--drafter`, default the shipped head smollm2_eagle)
  at each `--gamma`.
Every engine decodes every prompt once untimed (compilation, caches), then once timed. Reports tokens/s, the
speed-up over transformers, and on how many prompts the greedy tokens equal transformers' (float32 engines may
part where two logits tie to rounding). Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specdec import decoding
from specdec.data import load_vocabulary, pretrained
from specdec.evaluation import bench
from specdec.training import exports, load_model, save_gguf

Engine = Callable[[list[int]], list[int]]   # prompt ids -> greedy new ids (EOS included where it came)


def _transformers(path: str, max_new: int, eos_id: int) -> Engine:
  import torch
  import transformers
  torch.set_num_threads(os.cpu_count() or 1)
  model = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                            dtype=torch.float32).eval()

  def run(ids: list[int]) -> list[int]:
    with torch.no_grad():
      out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, eos_token_id=eos_id,
                           pad_token_id=eos_id)
    return out[0, len(ids):].tolist()
  return run


def _llama_cpp(path: str, max_new: int, eos_id: int, prompt_lookup: int = 0) -> Engine:
  import llama_cpp
  from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
  draft = LlamaPromptLookupDecoding(num_pred_tokens=prompt_lookup) if prompt_lookup else None
  llm = llama_cpp.Llama(model_path=path, n_ctx=2048, n_threads=os.cpu_count(), n_batch=512, verbose=False,
                        draft_model=draft)

  def run(ids: list[int]) -> list[int]:
    new = []
    for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
      new.append(int(token))
      if token == eos_id or len(new) == max_new:
        break
    return new
  return run


def _specdec(verifier, drafter, gamma: int, max_new: int, eos_id: int) -> Engine:
  method = "autoregressive" if drafter is None else "speculative"

  def run(ids: list[int]) -> list[int]:
    out = decoding.generate(jax.random.PRNGKey(0), drafter, verifier, jnp.asarray([ids], jnp.int32),
                            jnp.asarray([len(ids)]), method=method, gamma=gamma, temperature=0.0,
                            max_new_tokens=max_new, eos_id=eos_id)
    return np.asarray(out.tokens[0, :int(out.stats.generated[0])]).tolist()
  return run


def _time(engine: Engine, prompts: Sequence[list[int]]) -> tuple[float, list[list[int]]]:
  for ids in prompts:      # untimed: compilation and warm caches
    engine(ids)
  start, outputs = time.perf_counter(), [engine(ids) for ids in prompts]
  return time.perf_counter() - start, outputs


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--prompts", required=True, help="chat prompts, one per line")
  parser.add_argument("--out", required=True, help="OUT.json and OUT.md are written")
  parser.add_argument("--max_new_tokens", type=int, default=128)
  parser.add_argument("--drafter", default="smollm2_eagle", help="specdec's drafter (a head directory or name)")
  parser.add_argument("--gamma", type=int, nargs="+", default=[3, 4])
  parser.add_argument("--prompt_lookup", type=int, default=10, help="llama.cpp's prompt-lookup drafts per call")
  args = parser.parse_args(argv)
  path = str(pretrained.path("smollm2"))
  vocab = load_vocabulary(path)
  with open(args.prompts) as f:
    texts = [line.strip() for line in f if line.strip()]
  prompts = [vocab.chat_prompt(t) for t in texts]
  verifier = load_model(path)
  drafter = exports.load_drafter(pretrained.resolve(args.drafter), verifier)
  n, eos = args.max_new_tokens, vocab.eos_id
  engines: dict[str, Callable[[], Engine]] = {}
  if importlib.util.find_spec("transformers") and importlib.util.find_spec("torch"):
    engines["transformers generate (float32)"] = lambda: _transformers(path, n, eos)
  with tempfile.TemporaryDirectory() as tmp:
    if importlib.util.find_spec("llama_cpp"):
      for dtype in ("f32", "f16"):
        exported = save_gguf(verifier, os.path.join(tmp, f"smollm2.{dtype}.gguf"), dtype=dtype, metadata_from=path)
        engines[f"llama.cpp ({dtype.upper()})"] = lambda exported=exported: _llama_cpp(exported, n, eos)
        engines[f"llama.cpp ({dtype.upper()}) prompt lookup {args.prompt_lookup}"] = (
            lambda exported=exported: _llama_cpp(exported, n, eos, args.prompt_lookup))
    engines["specdec alone (float32)"] = lambda: _specdec(verifier, None, 1, n, eos)
    for gamma in args.gamma:
      engines[f"specdec + {os.path.basename(os.path.normpath(args.drafter))} γ={gamma}"] = (
          lambda gamma=gamma: _specdec(verifier, drafter, gamma, n, eos))
    rows, reference = [], None
    for name, make in engines.items():
      seconds, outputs = _time(make(), prompts)
      reference = reference or outputs
      tokens = sum(map(len, outputs))
      rows.append({"engine": name, "seconds": seconds, "tokens": tokens, "tokens_per_second": tokens / seconds,
                   "same_tokens_as_first": sum(a == b for a, b in zip(outputs, reference))})
      print(f"{name:<44} {tokens / seconds:7.1f} tokens/s  ({tokens} tokens, {seconds:.1f} s; "
            f"{rows[-1]['same_tokens_as_first']}/{len(prompts)} prompts as {rows[0]['engine']})", flush=True)
  base = rows[0]["tokens_per_second"]
  record = {"command": " ".join(["python", "scripts/smollm2_peers.py", *(argv or sys.argv[1:])]),
            "machine": bench.machine(),
            "prompts": len(prompts), "max_new_tokens": n, "rows": rows}
  with open(args.out + ".json", "w") as f:
    json.dump(record, f, indent=1)
  with open(args.out + ".md", "w") as f:
    f.write(f"| engine | tokens/s | relative to {rows[0]['engine']} | prompts with its greedy tokens |\n"
            "|---|---:|---:|---:|\n")
    for row in rows:
      f.write(f"| {row['engine']} | {row['tokens_per_second']:.1f} | {row['tokens_per_second'] / base:.2f}x | "
              f"{row['same_tokens_as_first']}/{len(prompts)} |\n")
  print(f"wrote {args.out}.json, {args.out}.md")


if __name__ == "__main__":
  main()
