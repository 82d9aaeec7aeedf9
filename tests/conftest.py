import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


# Without CUDA, Triton kernels can still run in Triton's CPU interpreter (tests/test_fast.py). Triton reads
# this when a kernel is defined, so it is set here, before any test module imports kernels/.
if not _cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(ROOT))
# For the broker and worker processes tests start: this checkout first, then whatever PYTHONPATH held
# (on the device, that is where pyzmq and laya are carried).
SUBPROCESS_ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


def stop_all(procs: list) -> None:
    """SIGTERM the processes a test started, newest first, and reap them (SIGKILL after 20 s)."""
    for p in reversed(procs):
        p.terminate()
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def make_ckpt(out: Path, preset: str = "tiny", seed: int = 0) -> Path:
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_checkpoint.py"), "--out", str(out),
                    "--preset", preset, "--seed", str(seed)], check=True, capture_output=True)
    return out


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    return make_ckpt(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="session")
def sdk_agent(tiny_ckpt):
    laya = pytest.importorskip("laya")
    with warnings.catch_warnings():
        # The generator ships temperatures the SDK clamps (on purpose); its warning is expected.
        warnings.simplefilter("ignore")
        return laya.load(str(tiny_ckpt), device="cpu")


def pytest_collection_modifyitems(config, items):
    if _cuda():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on the device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
