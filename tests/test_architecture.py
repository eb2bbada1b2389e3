"""Tensor-name knowledge (dghard_cli.architecture): layers, embeddings, the head; and layer depth
from the tensor names of real architectures (table-driven), with the number of blocks from
config.json and the names, which must agree."""

from __future__ import annotations

import pytest

from dghard_cli.architecture import (
    EMBED,
    HEAD,
    block_index,
    config_num_layers,
    is_input_embedding,
    is_vocab_matrix,
    layer_index,
    layer_module,
    model_depth,
    tensor_depth,
    tensor_place,
    tensor_role,
)
from dghard_cli.errors import InputError

# (architecture, tensor name, where it sits: "embed", a block index, "head")
TABLE = [
    # Llama / Mistral / Qwen2 / Gemma / Phi-3
    ("llama", "model.embed_tokens.weight", EMBED),
    ("llama", "model.layers.0.input_layernorm.weight", 0),
    ("llama", "model.layers.7.self_attn.q_proj.weight", 7),
    ("llama", "model.layers.31.mlp.down_proj.weight", 31),
    ("llama", "model.layers.3.self_attn.rotary_emb.inv_freq", 3),
    ("llama", "model.norm.weight", HEAD),
    ("llama", "lm_head.weight", HEAD),
    ("llama", "score.weight", HEAD),  # LlamaForSequenceClassification
    ("llama (Meta original)", "tok_embeddings.weight", EMBED),
    ("llama (Meta original)", "layers.2.attention.wq.weight", 2),
    ("llama (Meta original)", "norm.weight", HEAD),
    ("llama (Meta original)", "output.weight", HEAD),
    ("qwen2", "model.layers.5.self_attn.k_proj.bias", 5),
    ("mixtral", "model.layers.4.block_sparse_moe.experts.6.w1.weight", 4),
    ("qwen2-moe", "model.layers.1.mlp.shared_expert.up_proj.weight", 1),
    ("gemma3 text", "model.language_model.layers.2.mlp.gate_proj.weight", 2),
    ("gemma3 text", "model.language_model.embed_tokens.weight", EMBED),
    ("gemma3 text", "model.language_model.norm.weight", HEAD),
    # GPT-2 / GPT-J / Bloom / Falcon / CodeGen
    ("gpt2", "transformer.wte.weight", EMBED),
    ("gpt2", "transformer.wpe.weight", EMBED),
    ("gpt2", "transformer.h.0.ln_1.bias", 0),
    ("gpt2", "transformer.h.11.attn.c_attn.weight", 11),
    ("gpt2", "transformer.h.11.attn.bias", 11),
    ("gpt2", "transformer.ln_f.weight", HEAD),
    ("gpt2 (no prefix)", "wte.weight", EMBED),
    ("gpt2 (no prefix)", "h.3.mlp.c_fc.weight", 3),
    ("gpt2 (no prefix)", "ln_f.bias", HEAD),
    ("bloom", "transformer.word_embeddings.weight", EMBED),
    ("bloom", "transformer.word_embeddings_layernorm.weight", EMBED),
    ("bloom", "transformer.h.2.self_attention.query_key_value.weight", 2),
    ("falcon", "transformer.h.1.self_attention.dense.weight", 1),
    # GPT-NeoX / Pythia
    ("gpt_neox", "gpt_neox.embed_in.weight", EMBED),
    ("gpt_neox", "gpt_neox.layers.4.attention.query_key_value.weight", 4),
    ("gpt_neox", "gpt_neox.final_layer_norm.weight", HEAD),
    ("gpt_neox", "embed_out.weight", HEAD),
    # OPT
    ("opt", "model.decoder.embed_tokens.weight", EMBED),
    ("opt", "model.decoder.embed_positions.weight", EMBED),
    ("opt", "model.decoder.project_in.weight", EMBED),
    ("opt", "model.decoder.layers.9.fc1.weight", 9),
    ("opt", "model.decoder.final_layer_norm.weight", HEAD),
    ("opt", "model.decoder.project_out.weight", HEAD),
    # Phi-2, MPT, Mamba, ChatGLM, RWKV
    ("phi", "model.final_layernorm.weight", HEAD),
    ("mpt", "transformer.blocks.3.attn.Wqkv.weight", 3),
    ("mpt", "transformer.norm_f.weight", HEAD),
    ("mamba", "backbone.embeddings.weight", EMBED),
    ("mamba", "backbone.layers.6.mixer.in_proj.weight", 6),
    ("mamba", "backbone.norm_f.weight", HEAD),
    ("chatglm", "transformer.embedding.word_embeddings.weight", EMBED),
    ("chatglm", "transformer.encoder.layers.2.self_attention.query_key_value.weight", 2),
    ("chatglm", "transformer.encoder.final_layernorm.weight", HEAD),
    ("chatglm", "transformer.output_layer.weight", HEAD),
    ("chatglm", "transformer.rotary_pos_emb.inv_freq", EMBED),
    ("rwkv", "rwkv.embeddings.weight", EMBED),
    ("rwkv", "rwkv.blocks.0.pre_ln.weight", 0),
    ("rwkv", "rwkv.ln_out.weight", HEAD),
    ("rwkv", "head.weight", HEAD),
    # BERT / RoBERTa / DistilBERT / sentence-transformers (all-MiniLM-L6-v2)
    ("bert", "bert.embeddings.word_embeddings.weight", EMBED),
    ("bert", "bert.embeddings.position_embeddings.weight", EMBED),
    ("bert", "bert.embeddings.token_type_embeddings.weight", EMBED),
    ("bert", "bert.embeddings.LayerNorm.weight", EMBED),
    ("bert", "bert.embeddings.position_ids", EMBED),
    ("bert", "bert.encoder.layer.0.attention.self.query.weight", 0),
    ("bert", "bert.encoder.layer.5.output.LayerNorm.bias", 5),
    ("bert", "bert.encoder.layer.5.output.dense.weight", 5),
    ("bert", "bert.pooler.dense.weight", HEAD),
    ("bert", "cls.predictions.transform.dense.weight", HEAD),
    ("bert", "cls.predictions.bias", HEAD),
    ("bert", "classifier.weight", HEAD),
    ("minilm", "embeddings.word_embeddings.weight", EMBED),
    ("minilm", "encoder.layer.3.attention.output.dense.weight", 3),
    ("minilm", "pooler.dense.bias", HEAD),
    ("roberta", "roberta.encoder.layer.11.intermediate.dense.weight", 11),
    ("roberta", "lm_head.dense.weight", HEAD),
    ("roberta", "lm_head.layer_norm.weight", HEAD),
    ("roberta", "lm_head.bias", HEAD),
    ("distilbert", "distilbert.transformer.layer.2.ffn.lin1.weight", 2),
    ("distilbert", "pre_classifier.weight", HEAD),
    ("distilbert", "vocab_projector.weight", HEAD),
    # ViT (HF and timm)
    ("vit", "vit.embeddings.patch_embeddings.projection.weight", EMBED),
    ("vit", "vit.embeddings.cls_token", EMBED),
    ("vit", "vit.encoder.layer.8.attention.attention.query.weight", 8),
    ("vit", "vit.layernorm.weight", HEAD),
    ("timm vit", "patch_embed.proj.weight", EMBED),
    ("timm vit", "pos_embed", EMBED),
    ("timm vit", "cls_token", EMBED),
    ("timm vit", "blocks.4.attn.qkv.weight", 4),
    ("timm vit", "norm.weight", HEAD),
    ("timm vit", "head.weight", HEAD),
]


@pytest.mark.parametrize("arch, name, place", TABLE, ids=[f"{a}:{n}" for a, n, _ in TABLE])
def test_place_of_real_tensor_names(arch, name, place):
    assert tensor_place(name) == place


@pytest.mark.parametrize(
    "name",
    [
        "deberta.encoder.rel_embeddings.weight",  # shared by all layers: no single depth
        "albert.encoder.albert_layer_groups.0.albert_layers.0.ffn.weight",  # shared layers
        "model.mystery_adapter.weight",
        "sublayers.0.weight",  # 'sublayers' is not a layer stack
    ],
)
def test_names_without_a_depth_are_unknown(name):
    assert tensor_place(name) is None
    with pytest.raises(InputError, match="cannot tell the layer depth of tensor"):
        tensor_depth(name, 4)


def test_block_index_takes_the_first_stack_segment():
    assert block_index("model.layers.12.mlp.experts.3.up_proj.weight") == ("model.layers", 12)
    assert block_index("transformer.h.0.attn.c_attn.weight") == ("transformer.h", 0)
    assert block_index("h.3.ln_1.weight") == ("h", 3)
    assert block_index("model.decoder.layers.1.fc1.weight") == ("model.decoder.layers", 1)
    assert block_index("model.embed_tokens.weight") is None


def test_relative_depth():
    assert tensor_depth("model.embed_tokens.weight", 4) == 0.0
    assert [tensor_depth(f"model.layers.{i}.mlp.up_proj.weight", 4) for i in range(4)] == [0, 1 / 3, 2 / 3, 1]
    assert tensor_depth("lm_head.weight", 4) == 1.0
    assert tensor_depth("model.layers.0.mlp.up_proj.weight", 1) == 0.5  # one block: midway
    with pytest.raises(InputError, match="block 4, but the model has 4 blocks"):
        tensor_depth("model.layers.4.mlp.up_proj.weight", 4)


def _llama_names(n: int) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(n):
        names += [f"model.layers.{i}.self_attn.q_proj.weight", f"model.layers.{i}.input_layernorm.weight"]
    return names


@pytest.mark.parametrize(
    "config, key",
    [
        ({"num_hidden_layers": 3}, "num_hidden_layers"),
        ({"n_layer": 3}, "n_layer"),
        ({"n_layers": 3}, "n_layers"),
        ({"num_layers": 3}, "num_layers"),
        ({"text_config": {"num_hidden_layers": 3}}, "text_config.num_hidden_layers"),
    ],
)
def test_layer_count_from_config(config, key):
    assert config_num_layers(config) == (3, key)
    d = model_depth(_llama_names(3), config)
    assert (d.num_layers, d.stack, d.source) == (3, "model.layers", f"config.json {key}")


def test_layer_count_from_names_without_config():
    d = model_depth(_llama_names(5), None)
    assert d.num_layers == 5 and d.source.startswith("tensor names")
    assert config_num_layers({"num_hidden_layers": True}) is None


def test_config_and_names_must_agree():
    with pytest.raises(InputError, match=r"num_hidden_layers = 4 but there are blocks 0-2"):
        model_depth(_llama_names(3), {"num_hidden_layers": 4}, where="FT (x)")
    names = [n for n in _llama_names(4) if not n.startswith("model.layers.2.")]
    with pytest.raises(InputError, match=r"blocks 0-1, 3 in the tensor names"):
        model_depth(names, {"num_hidden_layers": 4})
    with pytest.raises(InputError, match="block 2 is missing"):
        model_depth(names, None)


def test_two_stacks_and_no_stack_are_errors():
    t5 = ["encoder.block.0.layer.0.SelfAttention.q.weight", "decoder.block.0.layer.0.SelfAttention.q.weight"]
    with pytest.raises(InputError, match="two layer stacks, 'encoder.block'.*'decoder.block'"):
        model_depth(t5, {"num_layers": 1})
    vlm = [
        "model.language_model.layers.0.mlp.up_proj.weight",
        "model.vision_tower.encoder.layers.0.fc1.weight",
    ]
    with pytest.raises(InputError, match="two layer stacks"):
        model_depth(vlm, None)
    with pytest.raises(InputError, match="no layer stack in the tensor names"):
        model_depth(["embed.weight", "lm_head.weight"], {"num_hidden_layers": 2})


# -- layer index, module and role (the plan, RECALL, the heat maps, the LoRA audit) ----------


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
