"""Load and validate a Laya checkpoint directory before anything is built from it.

Every failure names the file (and the tensor) that is wrong, because an operator reading a worker's
exit message has nothing else to go on.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from laya_pool.kernels.arch import Arch, ConfigError, parse_arch
from laya_pool.protocol.contract import FINGERPRINT_FILES, fingerprint

# Every file the fingerprint covers must be there, and nothing else is needed.
REQUIRED_FILES = FINGERPRINT_FILES
_DTYPES = {torch.float32, torch.bfloat16, torch.float16}


class CheckpointError(ValueError):
    """A checkpoint directory we refuse to serve."""


@dataclass
class Checkpoint:
    path: Path
    agent_cfg: dict[str, Any]
    encoder_cfg: dict[str, Any]
    arch: Arch
    fingerprint: str
    tensors: dict[str, torch.Tensor]

    def card(self) -> dict[str, Any]:
        """What a client needs to encode requests and decode answers, with no files of its own."""
        tok = self.path / "tokenizer"
        return {
            "fingerprint": self.fingerprint,
            "agent_config": self.agent_cfg,
            "tokenizer_json": (tok / "tokenizer.json").read_text(encoding="utf-8"),
            "tokenizer_config": json.loads((tok / "tokenizer_config.json").read_text(encoding="utf-8")),
            "vocab_size": self.arch.vocab_size,
        }


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read JSON ({e})") from e
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _read_tensors(weights: Path, arch: Arch) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    expected = arch.tensor_shapes()
    try:
        handle = safe_open(str(weights), framework="pt")
    except Exception as e:  # safetensors raises its own error types for a bad header or a short file
        raise CheckpointError(f"{weights}: not a readable safetensors file, truncated or corrupt ({e})") from e
    with handle as f:
        names = set(f.keys())
        missing = sorted(set(expected) - names)
        if missing:
            raise CheckpointError(f"{weights}: missing tensor {missing[0]!r}"
                                  + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        unexpected = sorted(names - set(expected))
        if unexpected:
            raise CheckpointError(f"{weights}: unexpected tensor {unexpected[0]!r} for this architecture")
        out = {}
        for name, shape in expected.items():
            try:
                t = f.get_tensor(name)
            except Exception as e:
                raise CheckpointError(f"{weights}: tensor {name!r} cannot be read ({e})") from e
            if tuple(t.shape) != shape:
                raise CheckpointError(f"{weights}: tensor {name!r} has shape {tuple(t.shape)}, "
                                      f"the config describes {shape}")
            if t.dtype not in _DTYPES:
                raise CheckpointError(f"{weights}: tensor {name!r} has dtype {t.dtype}; "
                                      "expected float32, bfloat16 or float16")
            if not torch.isfinite(t).all():
                raise CheckpointError(f"{weights}: tensor {name!r} holds NaN or infinity")
            out[name] = t
    return out


def load_checkpoint(path: str | Path, with_tensors: bool = True) -> Checkpoint:
    """Validate `path` and load it; raises `CheckpointError` naming what is wrong."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint directory")
    for rel in REQUIRED_FILES:
        if not (path / rel).is_file():
            raise CheckpointError(f"{path / rel}: missing file")
    agent_cfg = _read_json(path / "rl_agent_config.json")
    enc_cfg = _read_json(path / "encoder" / "config.json")
    try:
        arch = parse_arch(agent_cfg, enc_cfg)
    except ConfigError as e:
        raise CheckpointError(f"{path}/{e}") from e
    if not with_tensors:
        return Checkpoint(path, agent_cfg, enc_cfg, arch, fingerprint(path), {})
    # The fingerprint hashes every byte of the weights (2 s for the large preset on one core) and hashlib drops
    # the GIL while it does: hash in a thread while the tensors are read and checked, not after.
    with ThreadPoolExecutor(1, thread_name_prefix="fingerprint") as pool:
        fp = pool.submit(fingerprint, path)
        tensors = _read_tensors(path / "model.safetensors", arch)
        return Checkpoint(path, agent_cfg, enc_cfg, arch, fp.result(), tensors)
