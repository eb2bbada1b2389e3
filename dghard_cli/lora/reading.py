"""Reading a PEFT LoRA adapter against BASE: its config checked (keys that change the weights'
meaning, variants whose update is not ``scaling·B·A``, initialisations relative to a modified
base), its tensors classified, each module's factors checked against BASE's weight (ranks,
shapes, orientation, DoRA magnitude, ``lora_bias``), a tied output layer's alias dropped, and
the view's tensor table built.

:class:`AdapterReading` is the reading half of
:class:`~dghard_cli.lora.source.AdapterCheckpoint` (its ``_discover``, which
:class:`~dghard_cli.io.checkpoint.Checkpoint` calls when it opens); it uses the attributes
``AdapterCheckpoint.__init__`` sets (``adapter``, ``base``, ``modules``, ``full``, ``cfg``).
Relies on :mod:`dghard_cli.lora.adapter` and :mod:`dghard_cli.lora.config` for the files
and :mod:`dghard_cli.lora.view` for the computed tensors.
"""

from __future__ import annotations

import dataclasses

import torch

from dghard_cli.architecture import OUTPUT_HEAD, VOCAB_EMBEDDING
from dghard_cli.errors import InputError
from dghard_cli.io.checkpoint import Checkpoint, TensorInfo
from dghard_cli.io.safetensors_format import FLOAT_DTYPES
from dghard_cli.lora.adapter import ADAPTER_WEIGHTS, PEFT_PREFIX, classify_tensors
from dghard_cli.lora.config import ADAPTER_CONFIG, LoraConfig, parse_config
from dghard_cli.lora.view import ModuleDelta, _computed

#: transformers model types whose attention/MLP layers are Conv1D (weights stored ``in x out``).
CONV1D_MODEL_TYPES = frozenset({"gpt2", "openai-gpt", "imagegpt", "decision_transformer", "clvp"})

#: Config keys whose truthy value makes PEFT's update something other than scaling·B·A.
UNSUPPORTED_KEYS = {
    "velora_config": "VeLoRA changes the forward pass",
    "alora_invocation_tokens": "an activated LoRA (aLoRA) applies only after its invocation tokens",
    "monteclora_config": "MonteCLoRA samples its update",
    "use_bdlora": "BD-LoRA's factors are block-diagonal and sharded",
    "arrow_config": "Arrow routes between several adapters per token",
    "kasa_config": "KaSA's update is not scaling·B·A",
    "use_qalora": "QA-LoRA pools the input before lora_A",
    "layer_replication": "layer replication adds layers the base does not have",
    "target_parameters": "LoRA on nn.Parameter targets (MoE experts) is not read here",
    "trainable_token_indices": "trainable tokens replace embedding rows outside LoRA",
}

#: ``init_lora_weights`` values whose saved update is relative to a modified base.
UNSUPPORTED_INIT = ("pissa", "olora", "corda", "loftq", "astra", "lora_ga")

#: CONFIG_INVALID findings on these keys change what the weights mean: refused.
WEIGHT_KEYS = {"peft_type", "lora_alpha", "use_rslora", "use_dora", "fan_in_fan_out", "lora_bias"}
WEIGHT_KEYS |= {"rank_pattern", "alpha_pattern"}


class AdapterReading(Checkpoint):
    """How :class:`~dghard_cli.lora.source.AdapterCheckpoint` builds its tensors from the
    adapter and BASE (every refusal a one-line :class:`InputError` naming the module)."""

    # -- building the view ------------------------------------------------------------------------
    def _where(self) -> str:
        return f"{self.label} {self.adapter.source} (a PEFT LoRA adapter)"

    def _discover(self) -> None:
        where = self._where()
        base = self.base
        cfg, findings = parse_config(self.adapter.config_raw, str(self.adapter.path / ADAPTER_CONFIG))
        for f in findings:
            if f.code == "CONFIG_INVALID" and f.details.get("key") in WEIGHT_KEYS:
                raise InputError(f"{where}: {f.message}", hint="`dghard audit-lora` lists every problem")
        self.cfg = cfg
        raw = self.adapter.config_raw
        for key, why in UNSUPPORTED_KEYS.items():
            if raw.get(key):
                raise InputError(
                    f"{where}: {key} is set; {why}, so its update is not the plain LoRA ΔW = scaling·B·A "
                    "that dghard reads (plain LoRA and DoRA adapters are)"
                )
        init = raw.get("init_lora_weights")
        if isinstance(init, str) and init.lower().startswith(UNSUPPORTED_INIT):
            raise InputError(
                f"{where}: init_lora_weights={init!r}: the saved update is relative to the base that "
                "initialisation modified, not to BASE; convert it first with PEFT "
                "(save_pretrained(..., path_initial_model_for_weight_conversion=...))"
            )
        lay = classify_tensors(list(self.adapter.weights.tensors.values()))
        for names, why in (
            (lay.unprefixed, f"lacks PEFT's {PEFT_PREFIX!r} prefix, so PEFT would not load it"),
            (
                lay.adapter_named,
                "still carries an adapter name (lora_A.default.weight), which PEFT does not load",
            ),
            (lay.unrecognized, "is not a LoRA tensor PEFT recognises"),
            (lay.duplicates, "is stored twice"),
            ([t.name for t in lay.tokens], "is a trainable-tokens delta, which dghard does not read"),
        ):
            if names:
                raise InputError(
                    f"{where}: tensor {names[0]!r} {why}", hint="`dghard audit-lora` lists every problem"
                )
        if not lay.modules and not lay.full:
            raise InputError(f"{where}: the adapter holds no LoRA tensors")
        self._drop_tied_alias(lay, where)
        model_type = (base.config() or {}).get("model_type")

        for info, base_name in lay.full:
            if base_name not in base.tensors:
                raise InputError(
                    f"{where}: full tensor {info.name!r} has no counterpart {base_name!r} in BASE "
                    f"({base.source}); is this adapter for another base model?"
                )
            self.full[base_name] = info

        for module, lm in lay.modules.items():
            self.modules[module] = self._module(module, lm, cfg, model_type, where)

        tensors: dict[str, TensorInfo] = {}
        adapter_file = self.adapter.path / ADAPTER_WEIGHTS
        biased = {d.module + ".bias": d for d in self.modules.values() if d.b_bias is not None}
        for name, binfo in base.tensors.items():
            d = self.modules.get(name[: -len(".weight")]) if name.endswith(".weight") else None
            out_dtype = binfo.dtype
            if d is not None:
                tensors[name] = _computed(
                    d.base, name, binfo.shard, adapter_file, d.adapted_rows, d.base.dtype
                )
            elif name in biased:
                full = self.full.get(name, binfo)
                tensors[name] = _computed(
                    binfo, name, binfo.shard, adapter_file, biased[name].adapted_bias(full), out_dtype
                )
            elif name in self.full:
                tensors[name] = dataclasses.replace(self.full[name], name=name, shard=binfo.shard)
            else:
                tensors[name] = binfo
        self.tensors = tensors
        self.index_file = base.index_file
        self.shard_metadata = dict(base.shard_metadata)
        self.shards = [ADAPTER_WEIGHTS, ADAPTER_CONFIG]

    def _drop_tied_alias(self, lay, where: str) -> None:
        """PEFT's ``ensure_weight_tying`` saves the tied output layer's LoRA (the embedding's factors,
        transposed) and its ``base_layer.weight``; a tied BASE does not store that layer, whose
        weight *is* the embedding's. Such an alias is dropped once checked to be the exact tie."""
        base = self.base
        cfg = base.config() or {}
        if not cfg.get("tie_word_embeddings", False) and not (cfg.get("text_config") or {}).get(
            "tie_word_embeddings", False
        ):
            return
        emb = [m for m, lm in lay.modules.items() if lm.embedding and VOCAB_EMBEDDING.search(f"{m}.weight")]
        for m in list(lay.modules):
            if f"{m}.weight" in base.tensors or not OUTPUT_HEAD.search(f"{m}.weight") or len(emb) != 1:
                continue
            out_lm, in_lm = lay.modules[m], lay.modules[emb[0]]
            same = (
                out_lm.a is not None
                and out_lm.b is not None
                and in_lm.a is not None
                and in_lm.b is not None
                and torch.equal(out_lm.a.read(), in_lm.b.read().T)
                and torch.equal(out_lm.b.read(), in_lm.a.read().T)
                and self.cfg.scaling_for(m) == self.cfg.scaling_for(emb[0])
            )
            if not same:
                raise InputError(
                    f"{where}: module {m!r} has its own LoRA update, but BASE ties it to {emb[0]!r} and does "
                    "not store it; a tied checkpoint cannot hold two different updates of one weight"
                )
            del lay.modules[m]
            lay.full = [(t, n) for t, n in lay.full if n != f"{m}.weight"]

    def _module(self, module: str, lm, cfg: LoraConfig, model_type: str | None, where: str) -> ModuleDelta:
        base = self.base
        at = f"{where}: module {module!r}"
        if lm.a is None or lm.b is None:
            missing = "lora_A" if lm.a is None else "lora_B"
            raise InputError(f"{at} has no {missing} tensor; the adapter is incomplete")
        a, b = lm.a, lm.b
        for t in (a, b):
            if t.dtype not in FLOAT_DTYPES:
                raise InputError(f"{at}: tensor {t.name!r} is stored as {t.dtype}, not a float")
            if len(t.shape) != 2:
                raise InputError(
                    f"{at}: tensor {t.name!r} has shape {list(t.shape)}; only Linear, Conv1D and "
                    "Embedding LoRA (2-D factors) are read"
                )
        weight = f"{module}.weight"
        full = self.full.get(weight)
        w = full if full is not None else base.tensors.get(weight)
        if w is None:
            raise InputError(
                f"{at}: BASE ({base.source}) has no tensor {weight!r}; is this adapter for another base model?"
            )
        r = a.shape[0]
        if b.shape[1] != r:
            raise InputError(
                f"{at}: lora_A is {list(a.shape)} and lora_B {list(b.shape)}; their ranks disagree"
            )
        declared = cfg.rank_for(module)
        if declared != r:
            raise InputError(
                f"{at}: the factors have rank {r} but the config gives this module r = {declared} "
                "(r/rank_pattern); PEFT cannot load it"
            )
        scaling = cfg.scaling_for(module)
        if scaling is None:  # pragma: no cover - parse_config refuses an invalid alpha first
            raise InputError(f"{at}: lora_alpha is invalid, so PEFT's scaling is undefined")
        if len(w.shape) != 2:
            raise InputError(f"{at}: the base weight {weight!r} is {list(w.shape)}, not a matrix")
        if lm.embedding:
            transposed = True
            if tuple(w.shape) != (a.shape[1], b.shape[0]):
                raise InputError(
                    f"{at}: embedding factors give ΔW of shape {[a.shape[1], b.shape[0]]} but the base "
                    f"weight is {list(w.shape)}"
                )
        else:
            normal = tuple(w.shape) == (b.shape[0], a.shape[1])
            flipped = tuple(w.shape) == (a.shape[1], b.shape[0])
            if not (normal or flipped):
                raise InputError(
                    f"{at}: lora_B·lora_A is {[b.shape[0], a.shape[1]]} but the base weight {weight!r} "
                    f"is {list(w.shape)}; is this adapter for another base model?"
                )
            # PEFT decides by the layer's type: Conv1D (GPT-2 style, stored in x out) is transposed,
            # nn.Linear is not, whatever fan_in_fan_out says; a square weight needs the model type
            transposed = flipped and (not normal or model_type in CONV1D_MODEL_TYPES)
        magnitude = lm.magnitude
        if cfg.use_dora:
            if magnitude is None:
                raise InputError(f"{at}: use_dora is set but the module has no lora_magnitude_vector")
            if lm.embedding or transposed:
                raise InputError(
                    f"{at}: DoRA on {'an embedding' if lm.embedding else 'a Conv1D layer'} is not read "
                    "(its magnitude normalises columns); only DoRA on Linear layers is"
                )
            if magnitude.numel != w.shape[0] or magnitude.dtype not in FLOAT_DTYPES:
                raise InputError(
                    f"{at}: lora_magnitude_vector is {magnitude.dtype}{list(magnitude.shape)}, expected "
                    f"{w.shape[0]} floats (one per output row)"
                )
        elif magnitude is not None:
            raise InputError(
                f"{at} has a lora_magnitude_vector but use_dora is false; PEFT would drop it — "
                "fix the config (use_dora) or remove the tensor"
            )
        b_bias = lm.b_bias
        if b_bias is not None:
            if not cfg.lora_bias:
                raise InputError(
                    f"{at} has lora_B.bias but lora_bias is false; PEFT would drop it — fix the config "
                    "or remove the tensor"
                )
            if f"{module}.bias" not in base.tensors:
                raise InputError(
                    f"{at}: lora_bias needs a bias in the base layer, and BASE has no {module}.bias "
                    "(PEFT refuses to merge it too)"
                )
            if b_bias.numel != (w.shape[1] if transposed else w.shape[0]):
                raise InputError(f"{at}: lora_B.bias has {b_bias.numel} entries, not the layer's output size")
        return ModuleDelta(
            module=module,
            a=a,
            b=b,
            scaling=float(scaling),
            rank=r,
            transposed=transposed,
            embedding=lm.embedding,
            base=w,
            magnitude=magnitude,
            b_bias=b_bias,
        )
