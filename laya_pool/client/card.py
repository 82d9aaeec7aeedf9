"""What a client knows about the model it talks to: the tokenizer and the config, never the weights.

A card comes from the pool (`Checkpoint.card()`, sent on a describe call) or straight from a checkpoint
directory. It carries exactly the numbers the SDK reads at load time, applied the way the SDK applies
them (temperatures clamped to [0.5, 5.0], `max_len` / `head_max_len` defaulting to 512 / 192), so
encoding and decoding here cannot drift from `laya.Agent`.

Only the `tokenizers` library is used: a client must not pay for importing torch or transformers.
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from laya_pool.protocol.contract import fingerprint
from laya_pool.protocol.qtypes import QUESTION_TYPES

from .state import WindowPolicy

# The SDK refuses to apply a temperature outside this range (laya.common.TEMP_MIN / TEMP_MAX).
TEMP_MIN = 0.5
TEMP_MAX = 5.0
DEFAULT_MAX_LEN = 512
DEFAULT_HEAD_MAX_LEN = 192
_QUESTION_CACHE_SIZE = 4096
# transformers' `clean_up_tokenization`, in its order
_CLEAN_UP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
             (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


class CardError(ValueError):
    """A model card (or checkpoint directory) a client cannot encode requests for."""


def clamp_temperature(t: Any, lo: float = TEMP_MIN, hi: float = TEMP_MAX) -> float:
    """`t` confined to [lo, hi]; 1.0 for anything that is not a finite number (a bool is not one)."""
    if isinstance(t, bool):
        return 1.0
    try:
        t = float(t)
    except (TypeError, ValueError):
        return 1.0
    if math.isnan(t) or math.isinf(t):
        return 1.0
    return min(hi, max(lo, t))


def temperature_rejected(raw: Any, applied: float) -> bool:
    """Whether `raw` is not the number `clamp_temperature` turned into `applied` (a bool never is one)."""
    if isinstance(raw, bool):
        return True
    try:
        value = float(raw)
    except (TypeError, ValueError):
        return True
    return value != applied


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json stores a special token either as its text or as a serialized AddedToken.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


@dataclass(frozen=True, eq=False)
class ModelCard:
    fingerprint: str
    config: dict[str, Any]
    tokenizer: Tokenizer = field(repr=False)
    vocab_size: int
    mask_token: str
    cls_id: int
    sep_id: int
    mask_id: int
    pad_id: int
    max_len: int
    head_max_len: int
    temperature: tuple[float, ...]          # one per question type, indexed by its id
    temperature_by_options: dict[str, float]
    n_act: int
    # tokenizer_config.json's clean_up_tokenization_spaces: what transformers' decode() does to text
    clean_up_spaces: bool = False

    @classmethod
    def from_card(cls, card: dict[str, Any]) -> ModelCard:
        """Build from the dict `worker.checkpoint.Checkpoint.card()` returns (what a describe call sends)."""
        for key in ("agent_config", "tokenizer_json", "tokenizer_config"):
            if key not in card:
                raise CardError(f"model card: missing {key!r}")
        try:
            tok = Tokenizer.from_str(card["tokenizer_json"])
        except Exception as e:  # the Rust side raises its own exception type for a bad document
            raise CardError(f"model card: tokenizer_json is not a tokenizer ({e})") from e
        return cls._build(card.get("fingerprint", ""), card["agent_config"], tok, card["tokenizer_config"],
                          card.get("vocab_size"))

    @classmethod
    def from_dir(cls, path: str | Path, fingerprint: str | None = None) -> ModelCard:
        """Build from a checkpoint directory. The fingerprint (sha256 over configs, tokenizer and weights,
        the same as the pool's) is computed unless given, which reads the whole weights file once."""
        path = Path(path)
        tok_dir = path / "tokenizer"
        try:
            agent_cfg = json.loads((path / "rl_agent_config.json").read_text(encoding="utf-8"))
            tok_cfg = json.loads((tok_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
            enc_cfg = json.loads((path / "encoder" / "config.json").read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CardError(f"{path}: cannot read the checkpoint configs ({e})") from e
        try:
            tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
        except Exception as e:
            raise CardError(f"{tok_dir / 'tokenizer.json'}: not a tokenizer ({e})") from e
        if fingerprint is None:
            fingerprint = directory_fingerprint(path)
        return cls._build(fingerprint, agent_cfg, tok, tok_cfg, enc_cfg.get("vocab_size"))

    @classmethod
    def _build(cls, fingerprint: str, agent_cfg: Any, tok: Tokenizer, tok_cfg: Any, vocab_size: Any) -> ModelCard:
        if not isinstance(agent_cfg, dict):
            raise CardError(f"agent config must be a JSON object, got {type(agent_cfg).__name__}")
        if not isinstance(tok_cfg, dict):
            raise CardError(f"tokenizer config must be a JSON object, got {type(tok_cfg).__name__}")
        # The SDK's fast tokenizer switches off any truncation or padding tokenizer.json ships before
        # an untruncated call; doing it once here also keeps the shared tokenizer immutable afterwards.
        tok.no_truncation()
        tok.no_padding()
        ids = {}
        for name in ("cls_token", "sep_token", "mask_token", "pad_token"):
            text = _token_text(tok_cfg.get(name))
            if text is None:
                raise CardError(f"tokenizer_config.json: no {name}")
            tid = tok.token_to_id(text)
            if tid is None:
                raise CardError(f"tokenizer_config.json: {name} {text!r} is not in the tokenizer's vocabulary")
            ids[name] = (text, tid)
        temps = agent_cfg.get("temperature", [1.0] * len(QUESTION_TYPES))
        if not isinstance(temps, (list, tuple)) or len(temps) != len(QUESTION_TYPES):
            # The SDK refuses this at load for the same reason: decoding indexes it by question type.
            raise CardError(f"rl_agent_config.json: temperature must be a list of {len(QUESTION_TYPES)} floats, "
                            f"got {temps!r}")
        by_options = agent_cfg.get("temperature_by_options") or {}
        if not isinstance(by_options, dict):
            raise CardError(f"rl_agent_config.json: temperature_by_options must be a mapping, got {by_options!r}")
        acts = agent_cfg.get("act_costs", {})
        try:
            n_act = len(acts) + 1  # the SDK's build_model: one act per cost, plus "answer"
        except TypeError:
            raise CardError(f"rl_agent_config.json: act_costs must be a mapping, got {acts!r}") from None
        try:
            temperature = tuple(clamp_temperature(t) for t in temps)
            temperature_by_options = {k: clamp_temperature(v) for k, v in by_options.items()}
        except OverflowError as e:  # an integer too large for a float; the SDK cannot load it either
            raise CardError(f"rl_agent_config.json: temperature out of range ({e})") from e
        return cls(
            fingerprint=str(fingerprint or ""),
            config=agent_cfg,
            tokenizer=tok,
            vocab_size=int(vocab_size) if vocab_size is not None else tok.get_vocab_size(with_added_tokens=True),
            mask_token=ids["mask_token"][0],
            cls_id=ids["cls_token"][1],
            sep_id=ids["sep_token"][1],
            mask_id=ids["mask_token"][1],
            pad_id=ids["pad_token"][1],
            # `cfg.get(key, default)` exactly as the SDK reads it
            max_len=agent_cfg.get("max_len", DEFAULT_MAX_LEN),
            head_max_len=agent_cfg.get("head_max_len", DEFAULT_HEAD_MAX_LEN),
            temperature=temperature,
            temperature_by_options=temperature_by_options,
            n_act=n_act,
            clean_up_spaces=bool(tok_cfg.get("clean_up_tokenization_spaces", False)),
        )

    def __post_init__(self) -> None:
        # Question texts repeat across the calls of a decision loop; states rarely do. Cache the
        # former per card (tokenizers.Tokenizer.encode is thread-safe once truncation is fixed).
        object.__setattr__(self, "_question_ids", functools.lru_cache(_QUESTION_CACHE_SIZE)(self._encode_tuple))
        object.__setattr__(self, "window", WindowPolicy.for_tokenizer(self.tokenizer))
        # The batch entry point skips the offsets nobody here reads (~30% of the time) and releases the GIL,
        # so the background count of a long state runs beside the caller; older `tokenizers` lack it.
        fast = getattr(self.tokenizer, "encode_batch_fast", None)
        object.__setattr__(self, "_fast", fast)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` without special tokens: the SDK's `tok(text, add_special_tokens=False)`."""
        return self.encode_many([text])[0]

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        """`encode` of each text, in one call: the tokenizer spreads a batch over its threads (client/state.py
        `in_parts`)."""
        if self._fast is not None:  # type: ignore[attr-defined]
            return [e.ids for e in self._fast(texts, add_special_tokens=False)]  # type: ignore[attr-defined]
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, special tokens kept: the SDK's `tok.decode(ids)` (transformers 5 skips the
        clean-up of spaces for BPE tokenizers, which it would corrupt, and applies it otherwise)."""
        text = self.tokenizer.decode(list(ids), skip_special_tokens=False)
        if self.clean_up_spaces and type(self.tokenizer.model).__name__ != "BPE":
            for before, after in _CLEAN_UP:
                text = text.replace(before, after)
        return text

    def encode_question_text(self, text: str) -> tuple[int, ...]:
        """`encode`, cached: for instruction and option texts, which a decision loop sends again and again."""
        return self._question_ids(text)  # type: ignore[attr-defined]

    def _encode_tuple(self, text: str) -> tuple[int, ...]:
        return tuple(self.encode(text))

    @property
    def option_layout(self) -> str:
        return self.config.get("option_layout", "sequential")


def directory_fingerprint(path: str | Path) -> str:
    """`protocol.contract.fingerprint` (what the pool reports for the same directory), as a `CardError`."""
    try:
        return fingerprint(path)
    except OSError as e:
        raise CardError(f"{e.filename or path}: cannot read ({e})") from e
