"""The generator writes what the SDK loads; our loader refuses every broken checkpoint by name."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import make_ckpt

from laya_pool.worker.checkpoint import CheckpointError, load_checkpoint

QUESTIONS = {
    "team": {"type": "choice", "instructions": "Which team handles this ticket?",
             "criteria": {"billing": "money issues", "tech": "bugs and crashes", "sales": "", "legal": None}},
    "urgent": {"type": "noul", "instructions": "Is this urgent?"},
    "sev": {"type": "score", "instructions": "How severe?", "criteria": ["none", "minor", "major", "critical"]},
}


def test_same_seed_is_byte_identical_other_seed_differs(tmp_path):
    a, b, c = (make_ckpt(tmp_path / n, seed=s) for n, s in (("a", 0), ("b", 0), ("c", 1)))
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files, "generator wrote nothing"
    for rel in files:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    ta, tc = load_checkpoint(a).tensors, load_checkpoint(c).tensors
    assert not np.allclose(ta["scorer.1.weight"].numpy(), tc["scorer.1.weight"].numpy())


def test_tiny_has_both_attention_kinds_and_a_small_window(tiny_ckpt):
    arch = load_checkpoint(tiny_ckpt, with_tensors=False).arch
    kinds = {arch.is_global(i) for i in range(arch.layers)}
    assert kinds == {True, False}
    assert arch.local_window <= 32


def test_sdk_answers_are_not_uniform_and_follow_the_input(sdk_agent):
    states = ["My card was declined twice and I need a refund today",
              "The server crashes after the last deploy, rollback please",
              {"subject": "hello", "priority": "low"}]
    results = [sdk_agent.predict(s, QUESTIONS)["answers"] for s in states]
    for ans in results:
        for qid in ("team", "sev"):
            probs = list(ans[qid]["probabilities"].values())
            assert max(probs) - min(probs) > 0.03, (qid, probs)
        assert abs(ans["urgent"]["noul"] - 0.5) > 0.01
    # the same question over different states must not give the same distribution
    teams = [tuple(r["team"]["probabilities"].values()) for r in results]
    assert len(set(teams)) == len(teams)
    assert max(abs(a - b) for a, b in zip(teams[0], teams[1])) > 0.02


def test_loader_accepts_and_fingerprints(tiny_ckpt, tmp_path):
    ck = load_checkpoint(tiny_ckpt)
    assert set(ck.tensors) == set(ck.arch.tensor_shapes())
    assert len(ck.fingerprint) == 64
    other = make_ckpt(tmp_path / "s1", seed=1)
    assert load_checkpoint(other).fingerprint != ck.fingerprint
    card = ck.card()
    assert card["fingerprint"] == ck.fingerprint and "model" in json.loads(card["tokenizer_json"])


@pytest.fixture
def broken(tiny_ckpt, tmp_path) -> Path:
    dst = tmp_path / "broken"
    shutil.copytree(tiny_ckpt, dst)
    return dst


def _save(path: Path, tensors: dict) -> None:
    from safetensors.numpy import save_file
    save_file({k: v.numpy() if hasattr(v, "numpy") else v for k, v in tensors.items()}, str(path))


def _tensors(path: Path) -> dict:
    from safetensors.numpy import load_file
    return load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize("rel", ["rl_agent_config.json", "model.safetensors", "encoder/config.json",
                                 "tokenizer/tokenizer.json"])
def test_missing_file_is_named(broken, rel):
    (broken / rel).unlink()
    with pytest.raises(CheckpointError, match=rel.replace(".", r"\.") + ": missing file"):
        load_checkpoint(broken)


def test_truncated_safetensors(broken):
    w = broken / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*truncated or corrupt"):
        load_checkpoint(broken)


def test_corrupt_header(broken):
    w = broken / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[8:40] = b"\xff" * 32
    w.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load_checkpoint(broken)


def test_wrong_shape_names_tensor(broken):
    t = _tensors(broken)
    t["encoder.layers.1.mlp.Wi.weight"] = t["encoder.layers.1.mlp.Wi.weight"][:-1]
    _save(broken / "model.safetensors", t)
    with pytest.raises(CheckpointError, match=r"'encoder\.layers\.1\.mlp\.Wi\.weight' has shape"):
        load_checkpoint(broken)


def test_missing_and_unexpected_tensor(broken):
    t = _tensors(broken)
    del t["scorer.3.bias"]
    _save(broken / "model.safetensors", t)
    with pytest.raises(CheckpointError, match=r"missing tensor 'scorer\.3\.bias'"):
        load_checkpoint(broken)
    t = _tensors(broken)
    t["scorer.3.bias"] = np.zeros(1, np.float32)
    t["scorer.9.weight"] = np.zeros(1, np.float32)
    _save(broken / "model.safetensors", t)
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'scorer\.9\.weight'"):
        load_checkpoint(broken)


def test_wrong_dtype_names_tensor(broken):
    t = _tensors(broken)
    t["type_emb.weight"] = t["type_emb.weight"].astype(np.int32)
    _save(broken / "model.safetensors", t)
    with pytest.raises(CheckpointError, match=r"'type_emb\.weight' has dtype"):
        load_checkpoint(broken)


def _edit_json(path: Path, **changes) -> None:
    cfg = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    path.write_text(json.dumps(cfg))


def test_parallel_layout_refused_clearly(broken):
    _edit_json(broken / "rl_agent_config.json", option_layout="parallel")
    with pytest.raises(CheckpointError, match=r"rl_agent_config\.json: option_layout 'parallel' is not supported"):
        load_checkpoint(broken)


def test_unknown_layout_and_missing_key(broken):
    _edit_json(broken / "rl_agent_config.json", option_layout="diagonal")
    with pytest.raises(CheckpointError, match=r"option_layout must be one of sequential, parallel"):
        load_checkpoint(broken)
    _edit_json(broken / "rl_agent_config.json", option_layout=None, head_layers=None)
    with pytest.raises(CheckpointError, match=r"rl_agent_config\.json: missing key 'head_layers'"):
        load_checkpoint(broken)


def test_bad_json_is_named(broken):
    (broken / "encoder" / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"encoder/config\.json: cannot read JSON"):
        load_checkpoint(broken)


def test_config_shape_disagreeing_with_weights(broken):
    _edit_json(broken / "encoder" / "config.json", intermediate_size=100)
    with pytest.raises(CheckpointError, match=r"'encoder\.layers\.0\.mlp\.Wi\.weight' has shape"):
        load_checkpoint(broken)
