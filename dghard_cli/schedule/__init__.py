"""Layer-wise strengths (LiNeS, Wang et al., ICLR 2025, arXiv 2410.17146) on top of any method.

Every scheduled tensor becomes ``W = W_base + λ(ℓ)·(W_method − W_base)``: the update the method
would write (Δ for a plain schedule, Δ* of DG-Hard or a shrinker, the merged task vector of a
merge) scaled by the strength of the tensor's layer. Two forms:

- ``--lines A,B``: ``λ(ℓ) = A + B·ℓ/(L−1)`` for block ℓ = 0 … L−1; the embeddings take the
  shallowest strength (A) and the final norm and head the deepest (A + B). With a single block
  (L = 1) the block sits midway, λ = A + B/2.
- ``--layer-strengths 'embed=0.2,0-7=0.3,8-15=0.6,16-23=0.9,head=1'`` (or a YAML file of the
  same mapping): one strength per group; the embeddings, the head and every block must be
  covered exactly once.

Which tensors: every tensor of a block (norms and biases included) takes its block's λ, so under
a schedule the 1-D, small and ≥3-D tensors that the spectral methods leave at the fine-tune's
value become ``W_base + λ·Δ`` (action ``scaled``). Tensors only in the fine-tune, non-floating
tensors and tensors left out by ``--include``/``--exclude`` keep the fine-tune's value; rows a
fine-tune added to a resized vocabulary keep the fine-tune's values (the shared rows are
scheduled); tied embeddings are one parameter and take the embeddings' λ.

Precision: the wrapped method writes its result in float64, the schedule is applied in float64
(``b + λ·(w − b)``), and the result is cast to the output dtype once.

Layer depth comes from the tensor names and config.json (:mod:`dghard_cli.architecture`).

The code is in three modules: :mod:`dghard_cli.schedule.spec` (the schedule as given:
parsing ``A,B``, the per-group form, YAML, recipe keys, and its strengths for a layer stack),
:mod:`dghard_cli.schedule.bind` (the schedule bound to one checkpoint: its depth, the plan's jobs
annotated) and :mod:`dghard_cli.schedule.op` (the wrapper that applies it while tensors stream).
"""
