"""What tensor names say about the architecture, in one place: embeddings, the output head, the
layer a tensor belongs to and its module inside the layer.

Names follow the Hugging Face conventions of the families dghard is used on:

- layers: ``model.layers.N.`` (Llama, Qwen, Mistral, Gemma), ``transformer.h.N.`` (GPT-2),
  ``encoder.layer.N.`` (BERT), ``blocks.N.`` / ``block.N.``;
- input embeddings: ``embed_tokens``, ``wte``, ``word_embeddings``, ``tok_embeddings``,
  ``embed_in``, ``shared`` (T5), and position embeddings ``wpe``, ``embed_positions``;
- the output head: ``lm_head``, ``embed_out`` (GPT-NeoX), a bare ``output.weight``.

Every module that needs such knowledge (the plan's vocabulary-resize rule, RECALL's layer
groups, the report's heat maps, the LoRA audit) asks here.
"""

from __future__ import annotations

import re

#: Container names whose next component is a layer index.
LAYER_CONTAINERS = ("layers", "layer", "h", "blocks", "block")
_CONTAINER = "(?:" + "|".join(LAYER_CONTAINERS) + ")"

#: ``...layers.12.`` and the other containers: group 1 is the layer index.
LAYER_INDEX = re.compile(rf"(?:^|\.){_CONTAINER}\.(\d+)\.")
#: ``model.layers.12.mlp.down_proj.weight`` -> (12, ``mlp.down_proj``).
LAYER_NAME = re.compile(rf"(?:^|\.){_CONTAINER}\.(\d+)\.(.+?)(?:\.weight)?$")

#: Token embedding matrices: their rows are the vocabulary (a resize adds or removes rows).
VOCAB_EMBEDDING = re.compile(
    r"(^|\.)(embed_tokens|wte|word_embeddings|tok_embeddings|embed_in|shared)\.weight$"
)
#: The output head (vocabulary rows too).
OUTPUT_HEAD = re.compile(r"(^|\.)(lm_head|embed_out)\.weight$|^output\.weight$")
#: Any input embedding, token or position (the representation before the first layer).
INPUT_EMBEDDING = re.compile(
    r"(^|\.)(embed_tokens|wte|wpe|word_embeddings|tok_embeddings|embed_in|embed_positions)\."
)
#: Leaf module names of output layers (PEFT's ``all-linear`` leaves them out).
OUTPUT_LAYER_NAMES = ("lm_head", "embed_out", "output_layer")
#: Substrings of module names that are embeddings or the head (a LoRA adapter may save them whole).
EMBEDDING_OR_HEAD_PARTS = ("embed", "wte", "lm_head", "word_embeddings")
#: Leaf module names whose rows are the vocabulary (a shape mismatch there means a resize).
VOCAB_LEAVES = ("lm_head", "embed_tokens")


def layer_index(name: str) -> int | None:
    """The index of the layer a tensor belongs to (``model.layers.3.mlp...`` -> 3), or None."""
    m = LAYER_INDEX.search(name)
    return int(m.group(1)) if m else None


def layer_module(name: str) -> tuple[int, str] | None:
    """Layer index and module name of a per-layer tensor, or None (embeddings, lm_head, ...)."""
    m = LAYER_NAME.search(name)
    if not m:
        return None
    return int(m.group(1)), m.group(2)


def is_vocab_matrix(name: str) -> bool:
    """Input or output embedding: the tensors whose rows a vocabulary resize adds or removes."""
    return bool(VOCAB_EMBEDDING.search(name) or OUTPUT_HEAD.search(name))


def is_input_embedding(name: str) -> bool:
    """A token or position embedding (its output is the representation before layer 0)."""
    return bool(INPUT_EMBEDDING.search(name))


def tensor_role(name: str) -> str:
    """``layer`` (inside a numbered layer), ``embedding`` (an input embedding), ``head`` (the
    output head) or ``other`` (final norm, pooler, ...)."""
    if layer_index(name) is not None:
        return "layer"
    if is_input_embedding(name) or VOCAB_EMBEDDING.search(name):
        return "embedding"
    if OUTPUT_HEAD.search(name):
        return "head"
    return "other"
