"""What a Laya checkpoint is: the architecture its two config files describe, and the tensors it holds.

One description shared by the checkpoint generator, the loader and the forward, so the three cannot
disagree about a name or a shape. Pure Python: no torch import, the client-side tools read it too.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from laya_pool.protocol.qtypes import QUESTION_TYPES

OPTION_LAYOUTS = ("sequential", "parallel")


class ConfigError(ValueError):
    """A config file that does not describe a model we can serve."""


@dataclass(frozen=True)
class Arch:
    vocab_size: int
    hidden: int
    layers: int
    heads: int
    intermediate: int
    local_window: int          # ModernBERT `local_attention`: keys within ±local_window//2 are visible
    global_every: int
    global_theta: float
    local_theta: float
    norm_eps: float
    max_position: int
    pad_id: int
    head_layers: int
    n_act: int
    max_len: int
    head_max_len: int
    layer_types: tuple[str, ...] = field(default=())

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def head_heads(self) -> int:
        # The SDK's decision head: nn.TransformerEncoderLayer with d/64 heads.
        return max(1, self.hidden // 64)

    @property
    def half_window(self) -> int:
        return self.local_window // 2

    def is_global(self, layer: int) -> bool:
        return self.layer_types[layer] == "full_attention"

    def theta(self, layer: int) -> float:
        return self.global_theta if self.is_global(layer) else self.local_theta

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the SDK's `DecisionModel.state_dict()` holds, with its shape."""
        d, ff = self.hidden, self.intermediate
        s: dict[str, tuple[int, ...]] = {
            "temperature": (len(QUESTION_TYPES),),
            "encoder.embeddings.tok_embeddings.weight": (self.vocab_size, d),
            "encoder.embeddings.norm.weight": (d,),
        }
        for i in range(self.layers):
            p = f"encoder.layers.{i}."
            if i > 0:  # ModernBERT's first layer has no attention norm
                s[p + "attn_norm.weight"] = (d,)
            s[p + "attn.Wqkv.weight"] = (3 * d, d)
            s[p + "attn.Wo.weight"] = (d, d)
            s[p + "mlp_norm.weight"] = (d,)
            s[p + "mlp.Wi.weight"] = (2 * ff, d)
            s[p + "mlp.Wo.weight"] = (d, ff)
        s["encoder.final_norm.weight"] = (d,)
        for j in range(self.head_layers):
            p = f"head.layers.{j}."
            s[p + "self_attn.in_proj_weight"] = (3 * d, d)
            s[p + "self_attn.in_proj_bias"] = (3 * d,)
            s[p + "self_attn.out_proj.weight"] = (d, d)
            s[p + "self_attn.out_proj.bias"] = (d,)
            s[p + "linear1.weight"] = (4 * d, d)
            s[p + "linear1.bias"] = (4 * d,)
            s[p + "linear2.weight"] = (d, 4 * d)
            s[p + "linear2.bias"] = (d,)
            for n in ("norm1", "norm2"):
                s[p + n + ".weight"] = (d,)
                s[p + n + ".bias"] = (d,)
        s["type_emb.weight"] = (len(QUESTION_TYPES), d)       # one row per question type, indexed by its id
        s["scorer.0.weight"] = (d,)
        s["scorer.0.bias"] = (d,)
        s["scorer.1.weight"] = (d, d)
        s["scorer.1.bias"] = (d,)
        s["scorer.3.weight"] = (1, d)
        s["scorer.3.bias"] = (1,)
        s["act_head.0.weight"] = (256, d + 4)
        s["act_head.0.bias"] = (256,)
        s["act_head.2.weight"] = (self.n_act, 256)
        s["act_head.2.bias"] = (self.n_act,)
        return s

    def parameter_count(self) -> int:
        total = 0
        for name, shape in self.tensor_shapes().items():
            if name == "temperature":
                continue
            n = 1
            for x in shape:
                n *= x
            total += n
        return total


def _need(cfg: dict[str, Any], key: str, where: str, kind: type | tuple[type, ...] = int) -> Any:
    if key not in cfg:
        raise ConfigError(f"{where}: missing key {key!r}")
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ConfigError(f"{where}: {key!r} must be {getattr(kind, '__name__', kind)}, got {value!r}")
    return value


def _rope_theta(enc: dict[str, Any], layer_type: str, legacy_key: str, default: float) -> float:
    # transformers 5 writes `rope_parameters`; 4.x checkpoints carry the flat legacy keys.
    rope = enc.get("rope_parameters")
    if isinstance(rope, dict):
        params = rope.get(layer_type)
        if isinstance(params, dict) and params.get("rope_theta") is not None:
            if params.get("rope_type", "default") != "default":
                raise ConfigError(f"encoder/config.json: rope_type {params['rope_type']!r} is not supported")
            return float(params["rope_theta"])
        if rope.get("rope_theta") is not None:
            return float(rope["rope_theta"])
    return float(enc.get(legacy_key, default))


def parse_arch(agent_cfg: dict[str, Any], enc_cfg: dict[str, Any]) -> Arch:
    """Read `rl_agent_config.json` and `encoder/config.json` into an `Arch`, refusing what we cannot run."""
    a, e = "rl_agent_config.json", "encoder/config.json"
    _need(agent_cfg, "encoder", a, str)
    head_layers = _need(agent_cfg, "head_layers", a)
    layout = agent_cfg.get("option_layout", "sequential")
    if layout not in OPTION_LAYOUTS:
        raise ConfigError(f"{a}: option_layout must be one of {', '.join(OPTION_LAYOUTS)}, got {layout!r}")
    if layout == "parallel":
        raise ConfigError(f"{a}: option_layout 'parallel' is not supported yet (only 'sequential')")
    temps = agent_cfg.get("temperature", [1.0] * len(QUESTION_TYPES))
    if not isinstance(temps, (list, tuple)) or len(temps) != len(QUESTION_TYPES):
        raise ConfigError(f"{a}: temperature must be a list of {len(QUESTION_TYPES)} floats, got {temps!r}")
    acts = agent_cfg.get("act_costs", {})
    if not isinstance(acts, dict):
        raise ConfigError(f"{a}: act_costs must be a mapping, got {acts!r}")
    if enc_cfg.get("model_type") != "modernbert":
        raise ConfigError(f"{e}: model_type must be 'modernbert', got {enc_cfg.get('model_type')!r}")
    if enc_cfg.get("hidden_activation", "gelu") != "gelu":
        raise ConfigError(f"{e}: hidden_activation must be 'gelu', got {enc_cfg.get('hidden_activation')!r}")
    for flag in ("attention_bias", "mlp_bias", "norm_bias"):
        if enc_cfg.get(flag, False):
            raise ConfigError(f"{e}: {flag}=true is not supported")
    hidden = _need(enc_cfg, "hidden_size", e)
    heads = _need(enc_cfg, "num_attention_heads", e)
    layers = _need(enc_cfg, "num_hidden_layers", e)
    if hidden % heads:
        raise ConfigError(f"{e}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
    every = int(enc_cfg.get("global_attn_every_n_layers", 3))
    types = enc_cfg.get("layer_types") or [
        "sliding_attention" if i % every else "full_attention" for i in range(layers)]
    if len(types) != layers or any(t not in ("full_attention", "sliding_attention") for t in types):
        raise ConfigError(f"{e}: layer_types must list {layers} of full_attention/sliding_attention")
    max_pos = int(enc_cfg.get("max_position_embeddings", 8192))
    max_len = int(agent_cfg.get("max_len", 512))
    if not 0 < max_len <= max_pos:
        raise ConfigError(f"{a}: max_len {max_len} must be in 1..{max_pos} (max_position_embeddings)")
    return Arch(
        vocab_size=_need(enc_cfg, "vocab_size", e), hidden=hidden, layers=layers, heads=heads,
        intermediate=_need(enc_cfg, "intermediate_size", e),
        local_window=int(enc_cfg.get("local_attention", 128)), global_every=every,
        global_theta=_rope_theta(enc_cfg, "full_attention", "global_rope_theta", 160000.0),
        local_theta=_rope_theta(enc_cfg, "sliding_attention", "local_rope_theta", 10000.0),
        norm_eps=float(enc_cfg.get("norm_eps", 1e-5)), max_position=max_pos,
        pad_id=int(enc_cfg.get("pad_token_id") or 0), head_layers=head_layers, n_act=len(acts) + 1,
        max_len=max_len, head_max_len=int(agent_cfg.get("head_max_len", 192)), layer_types=tuple(types),
    )
