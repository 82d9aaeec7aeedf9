"""Device probe (temporary): the SDK's RoPE tables against ours, and taps with the SDK's own tables."""
import sys
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from conftest import make_ckpt  # noqa: E402
from test_reference import REQUESTS, encode, flat_rows, make_requests, nrms, pack, sdk_forward  # noqa: E402

from kernels.reference import ReferenceModel  # noqa: E402
from worker.checkpoint import load_checkpoint  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def main():
    import laya
    for preset in sys.argv[2:]:
        path = make_ckpt(Path(sys.argv[1]) / preset, preset=preset)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            agent = laya.load(str(path), device=DEV)
        ck = load_checkpoint(path)
        a = ck.arch
        ref = ReferenceModel(a, ck.tensors, device=DEV, dtype=torch.bfloat16, gemm="vendor")
        enc = agent.model.encoder
        rot = enc.rotary_emb
        pos = torch.arange(a.max_len, device=DEV)[None]
        x = torch.zeros(1, device=DEV)
        for lt, theta in (("full_attention", a.global_theta), ("sliding_attention", a.local_theta)):
            buf = getattr(rot, f"{lt}_inv_freq", None)
            dim = a.head_dim
            cands = {
                "cpu f32": 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)),
                "cuda f32": (1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float, device=DEV) / dim))).cpu(),
                "cpu int64->f32": 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)),
                "cpu f64->f32": (1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))).float(),
            }
            b = buf.detach().float().cpu() if buf is not None else None
            print(f"[{preset}] {lt} theta {theta}: sdk buffer {None if buf is None else (buf.dtype, buf.device)}")
            for name, c in cands.items():
                print(f"    {name:16s} max|d| vs sdk {float((c - b).abs().max()) if b is not None else 'n/a'}")
            cos, sin = rot(x, pos, lt)
            ours_cos, ours_sin = ref.rope[theta]
            print(f"    cos/sin: sdk {cos.dtype}, max|d| cos {float((cos[0].float() - ours_cos).abs().max()):.3e}"
                  f" sin {float((sin[0].float() - ours_sin).abs().max()):.3e}")
        groups = encode(agent, REQUESTS + make_requests(20, seed=11))
        for label in ("our tables", "sdk tables"):
            if label == "sdk tables":
                for lt, theta in (("full_attention", a.global_theta), ("sliding_attention", a.local_theta)):
                    cos, sin = rot(x, pos, lt)
                    ref.rope[theta] = (cos[0].float().contiguous(), sin[0].float().contiguous())
            worst: dict = {}
            dl = 0.0
            for g in groups[:16]:
                with torch.no_grad(), torch.autocast(DEV, dtype=torch.bfloat16):
                    sl, _, st = sdk_forward(agent, [g], taps=True)
                part = flat_rows([g])
                inputs, slots = pack(part, device=DEV)
                taps: dict = {}
                lo, _ = ref.forward(**inputs, taps=taps)
                lens = [len(i) for i, _, _ in part]
                for name, t in st.items():
                    worst[name] = max(worst.get(name, 0.0), nrms(taps[name].float(), t, lens, slots))
                for r, (_, mk, _) in enumerate(part):
                    dl = max(dl, float((lo[slots[r], :len(mk)].float().cpu() - sl[r, :len(mk)]).abs().max()))
            first = next((k for k, v in worst.items() if v > 0), None)
            print(f"  [{preset}] {label}: first tap that differs: {first}; max|dlogit| {dl:.3e}; "
                  + " ".join(f"{k}={v:.1e}" for k, v in worst.items() if k in ("encoder.1", "final_norm", "head.1")))
        del agent, ref
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
