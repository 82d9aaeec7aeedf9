"""A calibration file (`laya.load(dir, calibration=PATH)`, `Agent.save_calibration`) read for decoding.

The file replaces the checkpoint's `temperature` and `temperature_by_options` (clamped as the checkpoint's are)
and may carry a `binning_map` that recalibrates `answer_confidence` per option-count bucket. The checks and
their messages are the SDK's (laya 0.4.15 `laya.calibrate.apply_calibration_payload`): a bad temperature is
clamped with a warning, a bad binning value is refused with a ValueError naming the field.

One difference: the SDK warns when the file was fitted for another checkpoint, by model path and config;
a client knows no model path, so it warns when the recorded config differs from the pool's.
No I/O beyond reading the file.
"""
from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass
from typing import Any

from laya_pool.protocol.qtypes import QUESTION_TYPES

from .card import TEMP_MAX, TEMP_MIN, clamp_temperature, temperature_rejected

CALIBRATION_VERSION = 2
_IDENTITY_SKIP = ("temperature", "temperature_by_options")


@dataclass(frozen=True)
class Calibration:
    temperature: tuple[float, ...]          # one per question type, indexed by its id
    temperature_by_options: dict[str, float]
    binning_map: dict[str, dict[str, Any]] | None
    config: Any = None              # the checkpoint config it was fitted for (version 2 files), temperatures left out
    version: int = 1

    def check_fits(self, card_config: dict[str, Any]) -> None:
        """Warn when the file records a checkpoint config other than `card_config`."""
        if self.version < CALIBRATION_VERSION:
            return
        mine = {str(k): v for k, v in card_config.items() if k not in _IDENTITY_SKIP}
        if self.config != mine:
            warnings.warn("calibration was fitted for a checkpoint whose config differs from the one the pool serves. "
                          "Loading the temperatures anyway.", UserWarning, stacklevel=3)


def load_calibration(source: str | os.PathLike | dict[str, Any]) -> Calibration:
    """A calibration from a file written by `save_calibration` (a path), or from its parsed payload."""
    if not isinstance(source, (str, os.PathLike)):
        return parse_calibration(source)
    with open(source, encoding="utf-8") as f:
        return parse_calibration(json.load(f))


def _version(payload: dict[str, Any]) -> int:
    version = payload.get("version", 1)
    if version is None:
        version = 1
    # 1.9 is not 1: a truncated version would skip the identity check.
    if (isinstance(version, bool) or not isinstance(version, (int, float, str))
            or (isinstance(version, float) and not version.is_integer())):
        raise ValueError(f"calibration JSON version must be an integer, got {version!r}")
    try:
        return int(version)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"calibration JSON version must be an integer, got {version!r}") from exc


def _check_binning(binning: Any) -> None:
    if not isinstance(binning, dict):
        raise ValueError(f"calibration JSON binning_map must be an object of bucket -> {{bins, values}}, "
                         f"got {type(binning).__name__}")
    for name, entry in binning.items():
        if not isinstance(entry, dict):
            raise ValueError(f'calibration JSON binning_map[{name!r}] must be an object with "bins" and "values", '
                             f"got {type(entry).__name__}")
        n_bins, values = entry.get("bins"), entry.get("values")
        if isinstance(n_bins, bool) or not isinstance(n_bins, int) or n_bins < 1:
            raise ValueError(f'calibration JSON binning_map[{name!r}] must have an integer "bins" >= 1, got {n_bins!r}')
        if not isinstance(values, (list, tuple)) or len(values) != n_bins:
            raise ValueError(f'calibration JSON binning_map[{name!r}] must have "values" of length "bins" ({n_bins})')
        try:
            parsed = [float(v) for v in values]
        except (TypeError, ValueError) as exc:
            raise ValueError(f"calibration JSON binning_map[{name!r}] values must be numbers, got {values!r}") from exc
        if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in values):
            raise ValueError(f"calibration JSON binning_map[{name!r}] values must be numbers, got {values!r}")
        for v in parsed:
            if not math.isfinite(v):
                raise ValueError(f"calibration JSON binning_map[{name!r}] values must be finite, got {values!r}")
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"calibration JSON binning_map[{name!r}] values must be in [0, 1], got {values!r}")


def parse_calibration(payload: Any) -> Calibration:
    """The SDK's checks on a calibration payload; its temperatures clamped (with the SDK's warning)."""
    if not isinstance(payload, dict):
        raise ValueError(f"calibration JSON must be an object, got {type(payload).__name__}")
    version = _version(payload)
    temps = payload.get("temperature")
    if not isinstance(temps, (list, tuple)) or len(temps) != len(QUESTION_TYPES):
        raise ValueError(f"calibration JSON must contain temperature: [{len(QUESTION_TYPES)} floats]")
    by_options = payload.get("temperature_by_options")
    if by_options is None:
        by_options = {}
    if not isinstance(by_options, dict):
        raise ValueError(f"calibration JSON temperature_by_options must be an object of bucket -> float, "
                         f"got {type(by_options).__name__}")
    binning = payload.get("binning_map")
    if binning is not None:
        _check_binning(binning)
    applied_t = tuple(clamp_temperature(t) for t in temps)
    raw_b = {str(k): v for k, v in by_options.items()}
    applied_b = {k: clamp_temperature(v) for k, v in raw_b.items()}
    entries = [(f"temperature[{i}]", raw, applied_t[i]) for i, raw in enumerate(temps)]
    entries += [(key, raw_b[key], applied_b[key]) for key in raw_b]
    rejected = [f"{name}={raw!r} -> {applied:g}" for name, raw, applied in entries
                if temperature_rejected(raw, applied)]
    if rejected:
        warnings.warn(f"laya: calibration temperatures are invalid or outside [{TEMP_MIN:g}, {TEMP_MAX:g}]; using "
                      f"{', '.join(rejected)}. Treat confidence from the affected entries as uncalibrated.",
                      RuntimeWarning, stacklevel=3)
    return Calibration(applied_t, applied_b, binning, payload.get("config"), version)


def apply_binning(confidence: float, bucket: str, binning_map: dict[str, dict[str, Any]]) -> float:
    """`confidence` recalibrated by its bucket's bins; unchanged for a bucket the map has no entry for."""
    entry = binning_map.get(bucket)
    if not entry:
        return float(confidence)
    bins = int(entry["bins"])
    b = min(bins - 1, max(0, int(float(confidence) * bins)))
    return float(entry["values"][b])
