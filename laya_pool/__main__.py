"""`laya-pool` (also `python -m laya_pool`): the pool's commands and the tools, one program.

    laya-pool up | api | status | drain | restart-worker | predict | keys | broker ...     (broker/cli.py)
    laya-pool make-checkpoint | bench | load | compare-workers | demo ...            (tools/)

The pool's commands are the broker room's CLI; the tools (tools/) use every room, so this dispatcher, which
belongs to no room, is where both meet. A tool is loaded only when it is asked for: `laya-pool status` on a
client-only install loads neither torch nor the tools.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys

# command -> (module under tools/, what it does)
TOOLS = {
    "make-checkpoint": ("make_checkpoint", "write a seeded checkpoint in the SDK's layout (--out DIR --preset tiny)"),
    "demo": ("demo", "a pool on this machine, a few decisions with their latency, a clean stop"),
    "bench": ("bench", "warm latency per shape and configuration, the SDK in the same run"),
    "load": ("load", "closed-loop throughput, concurrency sweeps, a worker killed under load"),
    "compare-workers": ("compare_workers", "the frozen cases through every worker and mode, against the reference"),
    "check-cache-gpu": ("check_cache_gpu", "graph-cache policies on a real GPU"),
}
# (The benchmarks behind the documented figures are not installed: benchmarks/ in a checkout, benchmarks/README.md.)
# Modules only the server extra brings (laya-pool[server]): a command that needs one says so instead of a traceback.
SERVER_ONLY = ("torch", "safetensors", "psutil", "prometheus_client", "cuda", "triton", "fastapi", "starlette",
               "uvicorn")
# The pool's own commands that start workers (which need the server extra) on this machine.
NEEDS_SERVER = {"up": ("torch", "safetensors", "psutil", "prometheus_client"), "api": ("fastapi", "uvicorn")}


def _needs_server(command: str, missing: list[str]) -> int:
    print(f"laya-pool {command} needs the server install ({', '.join(missing)} missing): "
          "pip install 'laya-pool[server]'", file=sys.stderr)
    return 2


def run_tool(command: str, args: list[str]) -> int:
    module_name = TOOLS[command][0]
    sys.argv = [f"laya-pool {command}", *args]      # argparse's prog, and the tools that read sys.argv
    try:
        # Tools import torch, safetensors, ... where they use them (make-checkpoint only when it writes), so a
        # missing server module surfaces from main() as often as from the import.
        tool = importlib.import_module(f"{__package__}.tools.{module_name}")
        return tool.main() or 0
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] in SERVER_ONLY:
            return _needs_server(command, [(e.name or "?").split(".")[0]])
        raise


def tools_help() -> str:
    """The tools, for the end of `laya-pool --help` (however it is asked for: `-h`, after `--log-level`, ...)."""
    lines = [f"  {command:17} {what}" for command, (_, what) in TOOLS.items()]
    return "\n\ntools (laya-pool TOOL --help):\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if args and args[0] in TOOLS:
        return run_tool(args[0], args[1:])
    missing = [m for m in NEEDS_SERVER.get(args[0] if args else "", ()) if importlib.util.find_spec(m) is None]
    if missing:
        return _needs_server(args[0], missing)
    from .broker.cli import main as pool_main
    if not args:
        try:
            pool_main(["--help"], tools_help())
        except SystemExit:
            pass
        return 2
    return pool_main(args, tools_help())


if __name__ == "__main__":
    sys.exit(main())
