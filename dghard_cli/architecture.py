"""What tensor names say about the architecture, in one place: embeddings, the output head, the
layer a tensor belongs to and its module inside the layer.

Names follow the Hugging Face conventions of the families dghard is used on:

- layers: ``model.layers.N.`` (Llama, Qwen, Mistral, Gemma), ``transformer.h.N.`` (GPT-2),
  ``encoder.layer.N.`` (BERT), ``blocks.N.`` / ``block.N.``;
- input embeddings: ``embed_tokens``, ``wte``, ``word_embeddings``, ``tok_embeddings``,
  ``embed_in``, ``shared`` (T5), and position embeddings ``wpe``, ``embed_positions``;
- the output head: ``lm_head``, ``embed_out`` (GPT-NeoX), a bare ``output.weight``.

Every module that needs such knowledge (the plan's vocabulary-resize rule, RECALL's layer
groups, the report's heat maps, the LoRA audit, the adapter output's module kinds and the
modules transformers 5 loads under other names) asks here.

Layer depth (used by the layer-wise strength schedule, ``--lines`` / ``--layer-strengths``)
---------------------------------------------------------------------------------------------

Every tensor of a transformer belongs to one of three places along the depth of the network:

- a **block** ``ℓ`` of the layer stack: the first ``<stack>.<N>.`` in its name, where the stack
  segment is ``layers``, ``layer``, ``h``, ``blocks`` or ``block`` — ``model.layers.N.`` (Llama,
  Qwen, Mistral, Gemma, Phi), ``transformer.h.N.`` (GPT-2, GPT-J, Bloom, Falcon),
  ``gpt_neox.layers.N.`` (Pythia), ``model.decoder.layers.N.`` (OPT), ``encoder.layer.N.``
  (BERT, RoBERTa, ViT), ``transformer.blocks.N.`` (MPT), ``blocks.N.`` (timm), ``backbone.layers.N.``
  (Mamba), ``transformer.encoder.layers.N.`` (ChatGLM). Everything under the block (attention,
  MLP, norms, biases, nested experts) is that block's;
- the **embeddings** (the shallowest place): ``embed_tokens``, ``wte``, ``wpe``,
  ``word_embeddings``, ``position_embeddings``, ``token_type_embeddings``, BERT's
  ``embeddings.*`` (its ``embeddings.LayerNorm`` included), ``embed_in``, ``embed_positions``,
  ``tok_embeddings``, ``rotary_emb``, ``patch_embed``, ``pos_embed``, ``cls_token``,
  ``project_in`` …;
- the **head** (the deepest place): ``lm_head``, ``embed_out``, the final norm (``model.norm``,
  ``transformer.ln_f``, ``final_layer_norm``, ``final_layernorm``, ``norm_f``, ``ln_out``,
  ViT's ``layernorm``), BERT's ``pooler`` and ``cls.*`` heads, ``classifier``, ``score``,
  ``qa_outputs``, ``project_out``, ``output_layer`` ….

The number of blocks ``L`` comes from the checkpoint: ``config.json``'s ``num_hidden_layers``
(or ``n_layer``, ``n_layers``, ``num_layers``; also inside ``text_config``) and the block
indices in the tensor names must agree (indices exactly ``0 … L−1``). Two layer stacks in one
checkpoint (an encoder and a decoder, a vision tower beside a language model) have no single
depth: that is an error naming a tensor of the second stack, as is a tensor that is in none of
the three places. Nothing falls back to a uniform strength silently.

These functions are pure (names and a config dict in, answers out); the error type is the
package's :class:`~dghard_cli.errors.InputError` (exit 2).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from dghard_cli.errors import InputError

#: Container names whose next component is a layer index: the one table of layer patterns.
LAYER_CONTAINERS = ("layers", "layer", "h", "blocks", "block")
_CONTAINER = "(?:" + "|".join(LAYER_CONTAINERS) + ")"

#: The first ``<stack>.<N>.`` of a name: group 1 is the stack's path (``model.layers``), group 2 N;
#: what follows the match is the module inside the layer (``mlp.down_proj.weight``).
BLOCK_NAME = re.compile(rf"^((?:.*?\.)?{_CONTAINER})\.(\d+)(?:\.|$)")

#: Token embedding matrices (their rows are the vocabulary: a resize adds or removes rows),
#: position embeddings, and the output head (vocabulary rows too): the name tables the patterns
#: below and the depth places (EMBED_SEGMENTS, HEAD_SEGMENTS) are built from.
TOKEN_EMBEDDINGS = ("embed_tokens", "wte", "word_embeddings", "tok_embeddings", "embed_in", "shared")
POSITION_EMBEDDINGS = ("wpe", "embed_positions")
OUTPUT_HEADS = ("lm_head", "embed_out")


def _alt(names) -> str:
    return "(" + "|".join(names) + ")"


VOCAB_EMBEDDING = re.compile(rf"(^|\.){_alt(TOKEN_EMBEDDINGS)}\.weight$")
OUTPUT_HEAD = re.compile(rf"(^|\.){_alt(OUTPUT_HEADS)}\.weight$|^output\.weight$")
#: Any input embedding, token or position (the representation before the first layer); T5's
#: ``shared`` feeds the encoder and the decoder and is not counted.
INPUT_EMBEDDING = re.compile(
    rf"(^|\.){_alt([*(n for n in TOKEN_EMBEDDINGS if n != 'shared'), *POSITION_EMBEDDINGS])}\."
)
#: Embedding tables whose rows are not the vocabulary: positions and token types. They are
#: ``nn.Embedding`` modules (a PEFT LoRA of one is an embedding LoRA, applied to whatever the module
#: is called with, which is not token ids for OPT's learned positions), so an adapter output
#: writes them whole.
POSITION_TABLES = (*POSITION_EMBEDDINGS, "position_embeddings", "token_type_embeddings")
POSITION_TABLE = re.compile(rf"(^|\.){_alt(POSITION_TABLES)}\.weight$")
#: Checkpoint module names that transformers 5 builds under another name when it loads the model
#: (a PEFT adapter names the loaded model's modules): ``(model types, or None for any; the
#: module-name pattern; what the loaded model has instead)``.
LOADED_UNDER_ANOTHER_NAME = (
    (("gpt_neox",), re.compile(r"^embed_out$"), "'lm_head'"),
    (None, re.compile(r"(^|\.)block_sparse_moe(\.|$)"), "'mlp' (Mixtral-style MoE blocks)"),
    (
        None,
        re.compile(r"(^|\.)experts\.\d+(\.|$)"),
        "3-D parameters of all experts (experts.gate_up_proj, ...)",
    ),
)
#: Leaf module names of output layers (PEFT's ``all-linear`` leaves them out).
OUTPUT_LAYER_NAMES = (*OUTPUT_HEADS, "output_layer")
#: Substrings of module names that are embeddings or the head (a LoRA adapter may save them whole).
EMBEDDING_OR_HEAD_PARTS = ("embed", "wte", "lm_head", "word_embeddings")
#: Leaf module names whose rows are the vocabulary (a shape mismatch there means a resize).
VOCAB_LEAVES = ("lm_head", "embed_tokens")


def block_index(name: str) -> tuple[str, int] | None:
    """``(stack path, index)`` of the first layer-stack segment of ``name``, or None.

    >>> block_index("model.layers.12.mlp.experts.3.up_proj.weight")
    ('model.layers', 12)
    """
    m = BLOCK_NAME.match(name)
    if not m:
        return None
    digits = m.group(2)
    if len(digits) > MAX_INDEX_DIGITS:  # int() of 5,000 digits raises; no model has 10^9 blocks
        raise InputError(f"tensor {name[:200]!r}: block index {digits[:20]}... is absurdly large")
    return m.group(1), int(digits)


def layer_index(name: str) -> int | None:
    """The index of the layer a tensor belongs to (``model.layers.3.mlp...`` -> 3), or None."""
    b = block_index(name)
    return b[1] if b is not None else None


def layer_module(name: str) -> tuple[int, str] | None:
    """Layer index and module name of a per-layer tensor, or None (embeddings, lm_head, ...)."""
    m = BLOCK_NAME.match(name)
    if not m or m.end() == len(name):
        return None
    module = name[m.end() :]
    return int(m.group(2)), module[: -len(".weight")] if module.endswith(".weight") else module


def loaded_module_name(module: str, model_type: str | None) -> str | None:
    """What transformers 5 has instead of a checkpoint's module ``module`` once it loads the model
    (``'lm_head'`` for GPT-NeoX's ``embed_out``), or None when the loaded model has that module."""
    for types, pattern, loaded in LOADED_UNDER_ANOTHER_NAME:
        if (types is None or model_type in types) and pattern.search(module):
            return loaded
    return None


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


# -- layer depth -------------------------------------------------------------------------------

#: Segments that put a tensor (outside the blocks) with the embeddings: the shallowest place.
EMBED_SEGMENTS = (
    *TOKEN_EMBEDDINGS,
    *POSITION_EMBEDDINGS,
    "word_embeddings_layernorm",
    "position_embeddings",
    "token_type_embeddings",
    "embeddings",
    "embedding",
    "embed_layer_norm",
    "emb_ln",
    "rotary_emb",
    "rotary_pos_emb",
    "patch_embed",
    "pos_embed",
    "cls_token",
    "project_in",
)

#: Segments that put a tensor (outside the blocks) with the head: the deepest place.
HEAD_SEGMENTS = (
    *OUTPUT_HEADS,
    "output",
    "output_layer",
    "norm",
    "ln_f",
    "final_layer_norm",
    "final_layernorm",
    "final_norm",
    "norm_f",
    "ln_out",
    "layernorm",
    "fc_norm",
    "head",
    "pooler",
    "cls",
    "classifier",
    "pre_classifier",
    "score",
    "qa_outputs",
    "project_out",
    "vocab_transform",
    "vocab_layer_norm",
    "vocab_projector",
)

_EMBED = re.compile(r"(?:^|\.)(?:" + "|".join(EMBED_SEGMENTS) + r")(?:\.|$)")
_HEAD = re.compile(r"(?:^|\.)(?:" + "|".join(HEAD_SEGMENTS) + r")(?:\.|$)")

#: The most blocks a layer stack may have (a count or an index past it is refused before anything
#: is allocated for it; the deepest released models have a few hundred).
MAX_LAYERS = 100_000
MAX_INDEX_DIGITS = 9

#: Config keys that give the number of blocks, in the order they are tried.
LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")

EMBED = "embed"
HEAD = "head"

#: Where a tensor sits: ``"embed"``, a block index, or ``"head"``.
Place = str | int


def tensor_place(name: str) -> Place | None:
    """``"embed"``, the block index, or ``"head"`` for a tensor name; None when unknown."""
    b = block_index(name)
    if b is not None:
        return b[1]
    if _EMBED.search(name):
        return EMBED
    if _HEAD.search(name):
        return HEAD
    return None


def tensor_depth(name: str, num_layers: int) -> float:
    """Relative depth ``t`` in [0, 1] of a tensor: embeddings 0, block ℓ ``ℓ/(L−1)``, head 1.

    With a single block (``L = 1``) the block sits midway (t = ½) between the embeddings and
    the head. Raises InputError for a name whose place cannot be read, or a block index
    outside ``0 … L−1``.
    """
    place = tensor_place(name)
    if place is None:
        raise InputError(unknown_place_message(name))
    return place_depth(place, num_layers, name)


def place_depth(place: Place, num_layers: int, name: str = "") -> float:
    """Relative depth of a place (see :func:`tensor_depth`)."""
    if place == EMBED:
        return 0.0
    if place == HEAD:
        return 1.0
    assert isinstance(place, int)
    if not 0 <= place < num_layers:
        raise InputError(
            f"tensor {name!r} is in block {place}, but the model has {num_layers} blocks (0-{num_layers - 1})"
        )
    return 0.5 if num_layers == 1 else place / (num_layers - 1)


def unknown_place_message(name: str) -> str:
    return (
        f"cannot tell the layer depth of tensor {name!r}: it is in no layer stack "
        "(model.layers.N., transformer.h.N., encoder.layer.N., blocks.N., ...) and is neither an "
        "embedding nor the final norm or head; the layer-wise strengths (--lines, "
        "--layer-strengths) need every scheduled tensor's depth (leave it out with --exclude REGEX)"
    )


def config_num_layers(config: Mapping | None) -> tuple[int, str] | None:
    """``(L, key)`` from a config.json mapping (``text_config`` too), or None if it has none."""
    if not isinstance(config, Mapping):
        return None
    for where, cfg in (("", config), ("text_config.", config.get("text_config"))):
        if not isinstance(cfg, Mapping):
            continue
        for key in LAYER_COUNT_KEYS:
            v = cfg.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and v >= 1:
                if v > MAX_LAYERS:
                    raise InputError(
                        f"config.json: {where + key} = {v} is absurd (more than {MAX_LAYERS} layers); "
                        "refusing to use it"
                    )
                return v, where + key
    return None


@dataclass(frozen=True)
class ModelDepth:
    """The layer stack of a checkpoint: its path, its number of blocks, and where L came from."""

    num_layers: int
    stack: str  # e.g. "model.layers"
    source: str  # e.g. "config.json num_hidden_layers" or "tensor names"


def model_depth(names: Iterable[str], config: Mapping | None, where: str = "the checkpoint") -> ModelDepth:
    """The layer stack of a checkpoint from its tensor names and its config.json.

    Raises InputError when the names hold no layer stack, two stacks, block indices that are
    not exactly ``0 … L−1``, or a config whose layer count disagrees with the names.
    """
    stacks: dict[str, tuple[str, set[int]]] = {}
    for name in names:
        b = block_index(name)
        if b is None:
            continue
        stack, i = b
        if stack not in stacks:
            stacks[stack] = (name, set())
        stacks[stack][1].add(i)
    if not stacks:
        raise InputError(
            f"{where}: no layer stack in the tensor names (model.layers.N., transformer.h.N., "
            "encoder.layer.N., blocks.N., ...), so there is no layer depth for --lines/--layer-strengths"
        )
    if len(stacks) > 1:
        (s1, (n1, _)), (s2, (n2, _)) = list(stacks.items())[:2]
        raise InputError(
            f"{where} has two layer stacks, {s1!r} (e.g. {n1!r}) and {s2!r} (e.g. {n2!r}); an "
            "encoder-decoder or multi-tower model has no single layer depth for --lines/--layer-strengths"
        )
    ((stack, (example, indices)),) = stacks.items()
    found = f"blocks {format_ranges(sorted(indices))} in the tensor names (e.g. {example!r})"
    top = max(indices)
    if top >= MAX_LAYERS:
        raise InputError(
            f"{where}: a tensor name puts a block at index {top} (more than {MAX_LAYERS} layers); "
            "refusing to use it"
        )

    def complete(n: int) -> bool:  # indices == {0 … n−1}, without building that set
        return len(indices) == n and min(indices) == 0 and top == n - 1

    cfg = config_num_layers(config)
    if cfg is not None:
        n, key = cfg
        if not complete(n):
            raise InputError(
                f"{where}: config.json says {key} = {n} but there are {found}; "
                "the config and the weights must describe the same model"
            )
        return ModelDepth(num_layers=n, stack=stack, source=f"config.json {key}")
    n = top + 1
    if not complete(n):
        missing = next(i for i in range(n) if i not in indices)
        raise InputError(f"{where}: block {missing} is missing ({found}) and no config.json gives the count")
    return ModelDepth(num_layers=n, stack=stack, source="tensor names (no layer count in config.json)")


def format_ranges(xs: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out: list[str] = []
    start = prev = None
    for x in xs:
        if start is None:
            start = prev = x
        elif x == prev + 1:  # type: ignore[operator]
            prev = x
        else:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = x
    if start is not None:
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ", ".join(out)
