"""The tools find the checkout and their data from where they live (laya_pool/tools/), so a checkout's `make demo`
writes its checkpoint in the checkout and compare-workers reads the frozen cases shipped beside it."""
from conftest import ROOT

from laya_pool.tools import compare_workers, demo


def test_the_demo_keeps_its_checkpoint_in_the_checkout():
    assert demo._default_model() == ROOT / "checkpoints" / "tiny"


def test_compare_workers_reads_the_cases_beside_it():
    assert compare_workers.CASES.is_file() and compare_workers.CASES.parent.parent == ROOT / "laya_pool" / "tools"
