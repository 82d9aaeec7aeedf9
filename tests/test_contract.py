"""The contract is written once and the document agrees with it."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from laya_pool.protocol import contract

ROOT = Path(__file__).resolve().parents[1]
PROTOCOL_MD = (ROOT / "docs" / "protocol.md").read_text(encoding="utf-8")


def _reasons_table() -> set[str]:
    section = PROTOCOL_MD.split("## Reasons", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([a-z -]+)` \|", section, flags=re.M))


def test_protocol_md_lists_every_reason_and_no_other():
    assert _reasons_table() == {r.value for r in contract.Reason}


@pytest.mark.parametrize("leave", list(contract.Leave))
def test_protocol_md_names_every_disconnect_reason(leave):
    assert f"`{leave.value}`" in PROTOCOL_MD


@pytest.mark.parametrize("name", [n for n in dir(contract) if n.startswith("EXIT_")])
def test_protocol_md_gives_every_exit_code(name):
    assert re.search(rf"\b{getattr(contract, name)}\b [a-z]", PROTOCOL_MD.split("## Worker exit codes", 1)[1])


def test_reasons_travel_as_their_text():
    assert str(contract.Reason.WORKER_FAULT) == "worker-fault" and f"{contract.Leave.HUNG}" == "hung"
    assert contract.Reason("busy") is contract.Reason.BUSY


def _reason_literals(path: Path) -> list[str]:
    """`reason="..."` keyword arguments and `{"reason": "..."}` entries: words that bypass the enum."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.keyword) and node.arg == "reason" and isinstance(node.value, ast.Constant):
            out.append(f"{path.name}:{node.value.lineno} reason={node.value.value!r}")
        if isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values):
                if isinstance(k, ast.Constant) and k.value == "reason" and isinstance(v, ast.Constant):
                    out.append(f"{path.name}:{v.lineno} reason {v.value!r}")
    return out


def test_no_reason_is_spelled_out_as_a_string():
    files = [p for room in ("broker", "client", "worker", "protocol") for p in (ROOT / "laya_pool" / room).glob("*.py")]
    assert [hit for p in files for hit in _reason_literals(p)] == []


def test_one_fingerprint_for_directory_card_and_checkpoint(tiny_ckpt):
    from laya_pool.client.card import directory_fingerprint
    from laya_pool.worker.checkpoint import load_checkpoint

    fp = contract.fingerprint(tiny_ckpt)
    assert len(fp) == 64 and directory_fingerprint(tiny_ckpt) == fp
    assert load_checkpoint(tiny_ckpt, with_tensors=False).fingerprint == fp
