"""Tensor-name knowledge (dghard_cli.architecture): layers, embeddings, the head."""

import pytest

from dghard_cli.architecture import (
    is_input_embedding,
    is_vocab_matrix,
    layer_index,
    layer_module,
    tensor_role,
)


@pytest.mark.parametrize(
    "name,index",
    [
        ("model.layers.12.mlp.down_proj.weight", 12),
        ("transformer.h.3.attn.c_attn.weight", 3),
        ("bert.encoder.layer.7.attention.self.query.weight", 7),
        ("blocks.0.attn.qkv.weight", 0),
        ("model.embed_tokens.weight", None),
        ("lm_head.weight", None),
        ("model.norm.weight", None),
        ("model.layers_extra.1.weight", None),  # not a layer container
    ],
)
def test_layer_index(name, index):
    assert layer_index(name) == index


def test_layer_module_and_roles():
    assert layer_module("model.layers.2.self_attn.q_proj.weight") == (2, "self_attn.q_proj")
    assert layer_module("model.layers.2.input_layernorm.bias") == (2, "input_layernorm.bias")
    assert layer_module("lm_head.weight") is None
    roles = {
        "model.layers.0.mlp.up_proj.weight": "layer",
        "model.embed_tokens.weight": "embedding",
        "transformer.wpe.weight": "embedding",
        "shared.weight": "embedding",
        "lm_head.weight": "head",
        "gpt_neox.embed_out.weight": "head",
        "output.weight": "head",
        "model.norm.weight": "other",
    }
    assert {n: tensor_role(n) for n in roles} == roles


def test_vocab_matrices_and_input_embeddings():
    assert is_vocab_matrix("model.embed_tokens.weight") and is_vocab_matrix("lm_head.weight")
    assert not is_vocab_matrix("transformer.wpe.weight")  # positions: no vocabulary rows
    assert is_input_embedding("transformer.wpe.weight") and not is_input_embedding("lm_head.weight")
    assert not is_vocab_matrix("model.layers.0.mlp.embed_tokens_gate.weight")
