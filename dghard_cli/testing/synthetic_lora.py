"""Synthetic PEFT LoRA adapters with PEFT's on-disk layout, for tests, benchmarks and demos.

Writes ``adapter_config.json`` (the keys PEFT writes) and ``adapter_model.safetensors`` with
PEFT's tensor names (``base_model.model.<module>.lora_A.weight`` ...) for the linear modules of a
Llama/Qwen2 layout from :mod:`dghard_cli.testing.synthetic`. PEFT itself is not needed.
"""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

from dghard_cli.testing.synthetic import ARCHITECTURES, ArchConfig

LINEAR_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PREFIX = "base_model.model."
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def peft_config(**overrides: object) -> dict:
    """An ``adapter_config.json`` as PEFT writes it for a causal LM LoRA."""
    cfg = {
        "alpha_pattern": {},
        "auto_mapping": None,
        "base_model_name_or_path": "Qwen/Qwen2.5-0.5B",
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "layer_replication": None,
        "layers_pattern": None,
        "layers_to_transform": None,
        "loftq_config": {},
        "lora_alpha": 16,
        "lora_bias": False,
        "lora_dropout": 0.05,
        "megatron_config": None,
        "megatron_core": "megatron.core",
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": 8,
        "rank_pattern": {},
        "revision": None,
        "target_modules": ["q_proj", "v_proj"],
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": False,
    }
    cfg.update(overrides)
    return cfg


def linear_modules(arch: ArchConfig, targets: tuple[str, ...] = LINEAR_TARGETS) -> list[tuple[str, int, int]]:
    """``(module, out, in)`` of every targeted linear layer, in model order."""
    out = []
    for name, shape in ARCHITECTURES[arch.model_type](arch):
        if len(shape) != 2 or not name.endswith(".weight"):
            continue
        module = name[: -len(".weight")]
        if module.rsplit(".", 1)[-1] in targets:
            out.append((module, shape[0], shape[1]))
    return out


def _gen(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)


def lora_factors(
    module: str, out: int, inp: int, r: int, *, seed: int = 0, scaling: float = 2.0, rel: float = 0.01
) -> tuple[torch.Tensor, torch.Tensor]:
    """Trained-looking factors (float64): A ~ N(0, 1/in) like PEFT's init, B sized so that
    ‖scaling·B·A‖_F ≈ rel · ‖W_base‖_F for base weights of std 0.02."""
    g = _gen(seed, module)
    a = torch.randn((r, inp), generator=g, dtype=torch.float64) / math.sqrt(inp)
    b_std = rel * 0.02 * math.sqrt(inp / r) / max(abs(scaling), 1e-12)
    b = b_std * torch.randn((out, r), generator=g, dtype=torch.float64)
    return a, b


def write_adapter(directory: Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    """Write ``adapter_model.safetensors`` and ``adapter_config.json`` into ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return directory


def make_adapter(
    directory: Path,
    arch: ArchConfig | None = None,
    *,
    r: int = 8,
    alpha: float = 16,
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
    dtype: str = "float32",
    seed: int = 0,
    rel: float = 0.01,
    config: dict | None = None,
) -> tuple[Path, dict[str, torch.Tensor], dict]:
    """A healthy adapter on ``arch``'s linear layers. Returns (dir, tensors, config) so a test can
    plant a defect and rewrite it with :func:`write_adapter`."""
    arch = arch or ArchConfig()
    cfg = peft_config(r=r, lora_alpha=alpha, target_modules=list(targets))
    cfg.update(config or {})
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    tensors: dict[str, torch.Tensor] = {}
    tdtype = _DTYPES[dtype]
    for module, out, inp in linear_modules(arch, targets):
        a, b = lora_factors(module, out, inp, r, seed=seed, scaling=scaling, rel=rel)
        tensors[f"{PREFIX}{module}.lora_A.weight"] = a.to(tdtype)
        tensors[f"{PREFIX}{module}.lora_B.weight"] = b.to(tdtype)
    write_adapter(directory, tensors, cfg)
    return Path(directory), tensors, cfg
