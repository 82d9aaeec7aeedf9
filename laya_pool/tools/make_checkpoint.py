#!/usr/bin/env python3
"""Write a Laya checkpoint with seeded random weights, in exactly the layout the official SDK loads.

    laya-pool make-checkpoint --out DIR --preset tiny|large|multilingual --seed N

No weights can be downloaded where this project is built, so every test, demo and benchmark runs
on checkpoints from here: the real architecture and tensor names, a real trained BPE tokenizer, and
weights scaled so that answers differ between options and between inputs (the default 0.02 init
makes every option look the same, which would let a parity test pass on anything).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import numpy as np

from laya_pool.kernels.arch import parse_arch  # noqa: E402
from laya_pool.protocol.qtypes import NOUL_FALSE_TEXT, NOUL_TRUE_TEXT, QUESTION_TYPES

SPECIALS = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
TOKENIZER_VOCAB = 1024

PRESETS = {
    # A few layers with both attention kinds and a 16-token local window, so ordinary test
    # requests are longer than the window and exercise it.
    "tiny": dict(vocab_size=1024, hidden_size=128, num_hidden_layers=4, num_attention_heads=2,
                 intermediate_size=192, local_attention=16, max_position_embeddings=512,
                 thetas=(160000.0, 10000.0)),
    # ModernBERT-large shapes: 421 M parameters with the head.
    "large": dict(vocab_size=50368, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                  intermediate_size=2624, local_attention=128, max_position_embeddings=8192,
                  thetas=(160000.0, 10000.0)),
    # mmBERT-base shapes; both RoPE thetas 160000, which the SDK reads through `rope_parameters`.
    "multilingual": dict(vocab_size=256000, hidden_size=768, num_hidden_layers=22, num_attention_heads=12,
                         intermediate_size=1152, local_attention=128, max_position_embeddings=8192,
                         thetas=(160000.0, 160000.0)),
}

_WORDS = """ticket customer refund invoice urgent billing account password reset login error crash
payment card declined shipping delayed order package lost damaged return exchange warranty support
team engineering sales legal security privacy outage server database latency timeout deploy rollback
release feature request bug report priority high low medium escalate resolve close reopen assign
agent manager review approve reject pending waiting reply email phone chat message thread summary
the a an is are was were be been of to in on for with from by at as and or not no yes this that
it they we you he she my your our their please thanks hello hi sorry today tomorrow week month
price plan upgrade downgrade cancel subscription trial discount coupon tax receipt statement balance
""".split()
_UNICODE = """Grüße Straße naïve café résumé façade jalapeño Zürich Ärger über schön
東京 注文 返金 緊急 サポート 顧客 Привет заказ возврат срочно مرحبا طلب 🙂 ✅ €100 ¥500""".split()


def _corpus(seed: int = 1234, lines: int = 6000) -> list[str]:
    """A deterministic corpus shaped like decision-loop traffic: prose, JSON and chat turns."""
    rng = random.Random(seed)
    out = []
    for i in range(lines):
        n = rng.randint(4, 24)
        words = [rng.choice(_WORDS if rng.random() > 0.08 else _UNICODE) for _ in range(n)]
        text = " ".join(words)
        kind = i % 5
        if kind == 1:
            text = json.dumps({"subject": text, "priority": rng.choice(["low", "high"]), "id": i},
                              ensure_ascii=False)
        elif kind == 2:
            text = json.dumps([{"role": "user", "content": text}], ensure_ascii=False)
        elif kind == 3:
            text = f"choice question: {text}" if rng.random() > 0.5 else f"level {rng.randint(0, 9)}: {text}"
        out.append(text)
    # the texts every row's head repeats: noul's default options, and each type's "<type> question: " prefix
    prompts = [f"{t.name} question: " for t in QUESTION_TYPES]
    out += [NOUL_FALSE_TEXT, NOUL_TRUE_TEXT, "false: ", "true: ", *prompts] * 20
    return out


def build_tokenizer(out_dir: Path, max_len: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    specials = {"cls_token": "[CLS]", "sep_token": "[SEP]", "mask_token": "[MASK]", "pad_token": "[PAD]",
                "unk_token": "[UNK]"}
    config = dict(specials, tokenizer_class="PreTrainedTokenizerFast", model_max_length=max_len,
                  clean_up_tokenization_spaces=False)
    _write_json(out_dir / "tokenizer_config.json", config)
    _write_json(out_dir / "special_tokens_map.json", specials)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def encoder_config(preset: str) -> dict:
    p = PRESETS[preset]
    layers = p["num_hidden_layers"]
    cfg = {k: v for k, v in p.items() if k != "thetas"}
    cfg.update(
        model_type="modernbert", architectures=["ModernBertModel"], hidden_activation="gelu",
        norm_eps=1e-5, norm_bias=False, attention_bias=False, mlp_bias=False,
        global_attn_every_n_layers=3,
        layer_types=["sliding_attention" if i % 3 else "full_attention" for i in range(layers)],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": p["thetas"][0]},
                         "sliding_attention": {"rope_type": "default", "rope_theta": p["thetas"][1]}},
        global_rope_theta=p["thetas"][0], local_rope_theta=p["thetas"][1],
        pad_token_id=SPECIALS.index("[PAD]"), cls_token_id=SPECIALS.index("[CLS]"),
        sep_token_id=SPECIALS.index("[SEP]"), bos_token_id=SPECIALS.index("[CLS]"),
        eos_token_id=SPECIALS.index("[SEP]"), initializer_range=0.02, embedding_dropout=0.0,
        attention_dropout=0.0, mlp_dropout=0.0,
    )
    return cfg


def agent_config(preset: str) -> dict:
    return {
        "encoder": f"laya-pool/{preset}-random",
        "head_layers": 2,
        "act_costs": {"defer": 0.2},
        "max_len": 512,
        "head_max_len": 192,
        "amp_dtype": "bf16",
        "option_layout": "sequential",
        # Non-trivial temperatures so decoding is tested: a per-type list, and per-option buckets
        # with one value the SDK clamps from below (as its shipped `choice:11+`) and one from above.
        "temperature": [1.0, 1.25, 0.8],
        "temperature_by_options": {"choice:3-5": 1.5, "choice:11+": 0.1006, "score:6-10": 7.0},
    }


def _std(name: str, shape: tuple[int, ...]) -> tuple[float, float]:
    """(mean, std) for one tensor: scaled so signals neither vanish nor saturate through the depth."""
    fan_in = shape[-1] if len(shape) > 1 else 1
    if name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "scorer.0.weight", "attn_norm.weight",
                      "mlp_norm.weight", "final_norm.weight")):
        return 1.0, 0.1
    if name.endswith("bias"):
        return 0.0, 0.1
    if name.endswith(("tok_embeddings.weight", "type_emb.weight")):
        return 0.0, 1.0
    if name == "scorer.3.weight":
        return 0.0, 8.0 / np.sqrt(fan_in)     # logits with a spread of a few units
    if name.startswith("act_head.2"):
        return 0.0, 2.0 / np.sqrt(fan_in)
    return 0.0, 1.0 / np.sqrt(fan_in)


def make_weights(arch, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in sorted(arch.tensor_shapes().items()):
        if name == "temperature":
            out[name] = np.ones(shape, np.float32)
            continue
        mean, std = _std(name, shape)
        t = rng.standard_normal(shape, dtype=np.float32)
        t *= np.float32(std)
        if mean:
            t += np.float32(mean)
        out[name] = t
    return out


def make_checkpoint(out: str | os.PathLike, preset: str = "tiny", seed: int = 0) -> Path:
    from safetensors.numpy import save_file

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; use one of {sorted(PRESETS)}")
    out = Path(out)
    (out / "encoder").mkdir(parents=True, exist_ok=True)
    enc, agent = encoder_config(preset), agent_config(preset)
    arch = parse_arch(agent, enc)
    _write_json(out / "encoder" / "config.json", enc)
    _write_json(out / "rl_agent_config.json", agent)
    build_tokenizer(out / "tokenizer", agent["max_len"])
    tmp = out / "model.safetensors.tmp"
    save_file(make_weights(arch, seed), str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / "model.safetensors")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    path = make_checkpoint(args.out, args.preset, args.seed)
    arch = parse_arch(json.loads((path / "rl_agent_config.json").read_text()),
                      json.loads((path / "encoder" / "config.json").read_text()))
    print(f"wrote {args.preset} checkpoint to {path}: {arch.parameter_count() / 1e6:.1f} M parameters, "
          f"seed {args.seed}, {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
