"""Every environment variable laya-pool reads, declared once: its name, type, default, meaning and reader.

Code reads the environment only through `get` (the typed value) or `raw` (the text, for a reader that checks it
itself, as argparse does for `laya-pool up`'s options); a name that is not declared here is a programming error, and
tests/test_settings.py fails when code under laya_pool/ reads one directly. docs/operations.md holds `table()`'s
output, and the same test fails when it drifts.

Values. Unset and empty are the same: the default. `bool` takes 1/0, true/false, yes/no, on/off (any case); `choice`
takes one of its choices (any case); `int` and `float` take Python's literals; `str` and `path` take any text. A value
a declaration refuses raises a ValueError naming the variable and the value (so every caller's `except ValueError`
catches it; no exception class of its own, which a client would have to import).

Reads on the hot path (kernels/launch.py asks for LAYA_PDL and LAYA_LAUNCH_CACHE on every kernel launch, ~200 a
forward; a GEMM plan's key holds three switches) are cached, not hoisted to the start: `get` keeps the value it parsed
last with the raw bytes it came from, looks the variable up in CPython's bytes dict behind os.environ, and returns the
kept value while those bytes are the same object: no encoding, decoding or parsing, so cheaper than os.environ.get
itself; `snapshot` gives a key's part as the raw bytes alone. Hoisted to import, a value would ignore the tests and
benchmarks that change a switch between two launches in one process (tests/test_runtime_gpu.py turns the launch cache
off and on); cached, a change is seen at the next launch and each value is parsed once. Values read once (a worker's
flags, TRITON_INTERPRET at import) need no cache and go through the same `get`.

A LAYA_* variable that nothing declares (a typo, or a switch that was removed) gets one warning in each process that
starts (`warn_undeclared`: the worker, the broker, `laya-pool` commands, the first Client of a process), naming the
nearest declared name; `laya-pool up` leaves such variables out of its children's environment, so a pool warns once.
The official SDK's own LAYA_* variables are not ours and are never warned about.
"""
from __future__ import annotations

import argparse
import difflib
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

BOOL, INT, FLOAT, STR, CHOICE, PATH = "bool", "int", "float", "str", "choice", "path"
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")

# The table's sections, in order.
POOL, COMMANDS, WORKER, KERNELS, FAULTS, OTHERS = ("pool", "commands", "worker", "kernels", "faults", "others")
SECTIONS = {
    POOL: "`laya-pool up` and `laya-pool workers`: each option's default (a flag on the command line beats its "
          "variable; a bad value fails the command with exit 2 naming the variable)",
    COMMANDS: "Every command, and clients",
    WORKER: "Each worker, at start",
    KERNELS: "The fast path's kernels (each worker; a change takes effect at the next launch)",
    FAULTS: "Faults for tests (no CPU can cause them; never set in production)",
    OTHERS: "Variables of other programs that laya-pool reads too",
}


@dataclass(frozen=True)
class Setting:
    name: str
    kind: str               # BOOL, INT, FLOAT, STR, CHOICE or PATH
    default: Any            # what `get` gives when unset or empty; None: the reader decides (the meaning says how)
    section: str
    readers: str            # which processes read it
    meaning: str            # one sentence: what it changes and why one would set it
    choices: tuple[str, ...] = ()

    def parse(self, raw: str | None) -> Any:
        """The typed value of `raw` (None or '': the default), or ValueError naming the variable and the value."""
        if raw is None or raw == "":
            return self.default
        if self.kind == BOOL:
            low = raw.strip().lower()
            if low in TRUE or low in FALSE:
                return low in TRUE
            return self._refuse(raw, "not a boolean (1/0, true/false, yes/no, on/off)")
        if self.kind == CHOICE:
            low = raw.strip().lower()
            for choice in self.choices:
                if low == choice.lower():
                    return choice
            return self._refuse(raw, f"not one of {', '.join(self.choices)}")
        if self.kind in (INT, FLOAT):
            try:
                return int(raw) if self.kind == INT else float(raw)
            except ValueError:
                return self._refuse(raw, f"not {'an integer' if self.kind == INT else 'a number'}")
        return raw

    def _refuse(self, raw: str, why: str) -> Any:
        raise ValueError(f"${self.name}={raw!r}: {why}")


DECLARED: dict[str, Setting] = {}


def _declare(name: str, kind: str, default: Any, section: str, readers: str, meaning: str,
             choices: tuple[str, ...] = ()) -> None:
    assert name not in DECLARED, name
    assert (kind == CHOICE) == bool(choices), name
    DECLARED[name] = Setting(name, kind, default, section, readers, meaning, choices)


def _up(option: str, kind: str, default: Any, meaning: str, choices: tuple[str, ...] = (),
        readers: str = "`laya-pool up`") -> None:
    """A `laya-pool up` option's variable: LAYA_POOL_<OPTION> (broker/cli.py `env_name`)."""
    name = "LAYA_POOL_" + option.upper().replace("-", "_")
    _declare(name, kind, default, POOL, readers, f"`--{option}`: {meaning}", choices)


BOTH = "`laya-pool up`, `laya-pool workers`"
_up("model", PATH, None, "the checkpoint directory the pool serves.", readers=BOTH)
_up("devices", STR, "cpu", "where workers run: cpu, or cuda:0,cuda:1,...", readers=BOTH)
_up("workers-per-device", INT, 1, "worker processes per device.", readers=BOTH)
_up("frontend", STR, "tcp://127.0.0.1:5555", "the endpoint clients connect to; clients and operator commands use "
    "it too when given none.", readers="`laya-pool` commands, clients, the broker")
_up("backend", STR, None, "the endpoint workers connect to (unset: a private ipc socket).")
_up("heartbeat-ms", INT, 1000, "milliseconds between heartbeats of the broker and each worker.", readers=BOTH)
_up("liveness", INT, 3, "heartbeats missed before a worker counts as dead.", readers=BOTH)
_up("queue-size", INT, 1024, "requests waiting for a worker before the pool answers busy.")
_up("queue-timeout", FLOAT, 30.0, "seconds a request may wait for a worker.")
_up("queue-max-bytes", INT, 1 << 30, "request payload bytes waiting or running, together.")
_up("cache-max-bytes", INT, 256 << 20, "bytes of finished replies kept for retries.")
_up("max-attempts", INT, 3, "workers a request may be lost on before it fails.")
_up("job-timeout", FLOAT, 300.0, "seconds a worker may hold one request before it counts as hung.")
_up("max-message-bytes", INT, 16 << 20, "the largest frame a client may send.")
_up("max-restarts", INT, 6, "restart-worker commands accepted per --restart-window.")
_up("restart-window", FLOAT, 60.0, "seconds over which --max-restarts counts.")
_up("client-hwm", INT, 1000, "replies queued per client before more are dropped.")
_up("unread-max-bytes", INT, 64 << 20, "bytes of replies the broker holds that their clients have not taken yet, all "
    "clients together: beyond them no reply goes to a client that has left one untaken for 50 ms.")
_up("poll-us", INT, 0, "microseconds the broker keeps polling after each message, so the next one finds it awake "
    "(costs a core while traffic flows).")
_up("keys", PATH, None, "the CURVE key directory (`laya-pool keys` makes one); operator commands use it too.",
    readers="`laya-pool` commands")
_up("broker", STR, None, "the broker's worker endpoint this host's workers join: tcp://HOST:PORT, or ipc://PATH on the "
    "broker's host.",
    readers="`laya-pool workers`")
_up("name", STR, None, "this host's name in its workers' ids (unset: the host name).", readers="`laya-pool workers`")
_up("direct-host", STR, None, "the address clients reach this host's workers at (unset: with keys and a broker beyond "
    "loopback, this host's address towards the broker).", readers="`laya-pool workers`")
_up("worker-secret-file", PATH, None, "without --keys: the broker's worker secret, which each worker proves it was "
    "started for the pool with (unset: the one in this user's run directory).", readers="`laya-pool workers`")
_up("insecure-backend", BOOL, False, "take workers without keys or proof: a tcp backend without keys, and on an ipc "
    "one workers the pool did not start (development only).")
_up("mode", CHOICE, None, "each worker's execution mode (unset: graph-cached on CUDA, eager on a CPU).",
    ("eager", "graph-fixed", "graph-cached"), readers=BOTH)
_up("credit", INT, None, "requests a worker holds at once (unset: twice its --max-batch, at least 2).", readers=BOTH)
_up("max-batch", INT, None, "queued requests a worker merges into one forward (unset: 32 on CUDA, 1 on a CPU).",
    readers=BOTH)
_up("merge-waste", INT, None, "padding tokens a merged forward may hold (unset: the worker's LAYA_MERGE_WASTE).",
    readers=BOTH)
_up("max-tokens", INT, None, "tokens one forward may hold (unset: the worker's workspace size).", readers=BOTH)
_up("max-rows", INT, None, "rows one forward may hold (unset: the worker's workspace size).", readers=BOTH)
_up("max-markers", INT, None, "option markers one forward may hold (unset: the worker's workspace size).", readers=BOTH)
_up("threads", INT, None, "torch threads per worker (unset: the cores it is pinned to).", readers=BOTH)
_up("compute-timeout", FLOAT, None, "seconds a forward may take before the device counts as hung (unset: 10 on "
    "CUDA, 30 on a CPU).", readers=BOTH)
_up("warmup-shapes", STR, None, "graph-cached: the buckets each worker captures before it is ready, "
    "ROWSxLENGTHxMARKERS,...", readers=BOTH)
_up("warmup-merged", STR, None, "graph-cached: request classes whose merged groups each worker captures before it "
    "is ready.", readers=BOTH)
_up("drain-timeout", FLOAT, 5.0, "seconds a stopping worker may take to finish its work before it is killed.",
    readers=BOTH)
_up("http", STR, None, "[HOST:]PORT to serve /metrics and /health on (unset: off).", readers=BOTH)
_up("api", STR, None, "[HOST:]PORT to serve the SDK server's HTTP API on (`laya-pool api` beside the pool; unset: "
    "off).")
_up("api-processes", INT, 1, "the HTTP API's processes, sharing its port (`laya-pool api --processes`); one "
    "answers about 2,300 decisions/s on an H100 host, eight 8,455 from 64 clients.")
_up("api-key", STR, None, "the bearer key HTTP clients must send (`Authorization: Bearer KEY`); needed to serve the "
    "API beyond loopback.", readers="`laya-pool up`, `laya-pool api`")
_up("api-key-file", PATH, None, "a file holding that key (one line).", readers="`laya-pool up`, `laya-pool api`")

_declare("LAYA_POOL_LOG", CHOICE, "info", COMMANDS, "every process", "The log level (`--log-level`), which `up` "
         "hands to the whole pool.", ("debug", "info", "warning", "error", "critical"))
_declare("LAYA_POOL_LOG_FORMAT", CHOICE, "text", COMMANDS, "every process", "The log format (`--log-format`): json "
         "writes one object per line, for log shippers.", ("text", "json"))
_declare("LAYA_POOL_MAX_STATE_BYTES", INT, 16 << 20, COMMANDS, "clients", "The largest state a client sends (its "
         "text in UTF-8; a dict or list as JSON): a larger one is refused at once with RequestFailed naming `state` "
         "(`max_state_bytes=` on a client overrides it). Below it a client holds under 20 bytes per byte of state.")
_declare("LAYA_POOL_RUNTIME_DIR", PATH, None, COMMANDS, "the broker, workers, operator commands", "Where the operator "
         "and worker secrets live (unset: $XDG_RUNTIME_DIR/laya-pool, else ~/.cache/laya-pool/run); set it when those "
         "are not private.")

_declare("LAYA_FORWARD", CHOICE, "fast", WORKER, "worker", "fast: the packed Triton forward where it runs (CUDA, "
         "bf16), the reference elsewhere; reference: the plain-torch forward everywhere, a fallback.",
         ("fast", "reference"))
_declare("LAYA_GRAPH_LAUNCH", CHOICE, "direct", WORKER, "worker", "How a captured graph is launched: direct "
         "(cudaGraphLaunch through cuda-python, 19-20 us less host time) or torch (CUDAGraph.replay); the same bits, "
         "torch is the fallback.", ("direct", "torch"))
_declare("LAYA_MERGE_WASTE", INT, 512, WORKER, "worker", "`--merge-waste`: padding tokens a merged forward may hold "
         "beyond what its requests pad to alone; negative: no bound.")
_declare("LAYA_WARMUP_MERGED", STR, None, WORKER, "worker", "`--warmup-merged`: request classes RxTxM,... whose merged "
         "groups are captured before READY (unset: one question over 48, 64 or 128 tokens).")
_declare("LAYA_OVERLAP", CHOICE, "on", WORKER, "worker", "`--overlap`: off packs and launches one group at a time "
         "instead of the next beside the current one (for measuring).", ("on", "off"))
_declare("LAYA_CAPTURE_MISSES", CHOICE, "idle", WORKER, "worker", "`--capture-misses`: inline makes a request whose "
         "bucket was never captured wait for its capture instead of running in a larger bucket or eager.",
         ("idle", "inline"))
_declare("LAYA_GIL_SWITCH_MS", FLOAT, None, WORKER, "worker", "`--gil-switch-ms`: how long a thread may hold the GIL "
         "while another waits (unset: Python's 5 ms); for measuring.")
_declare("LAYA_COMPILE_PROCS", INT, None, WORKER, "worker", "`--compile-procs`: processes that compile the warm-up's "
         "kernels when Triton's cache lacks them (unset: one per spare core, at most 8; 0: none).")
_declare("LAYA_COMPILE_EARLY", BOOL, False, WORKER, "worker", "Start those compile processes first thing, beside the "
         "checkpoint load, instead of once the warm-up knows their work (READY from a cold cache 14.9 s either way on "
         "an H100 host, hence off).")
_declare("LAYA_COMPILE_KEYS", PATH, None, WORKER, "worker, its compile processes", "A diagnostic: append the parts of "
         "every Triton cache key computed to this file, to compare a worker's keys with its compile processes'.")
_declare("LAYA_WORKER_POLL_US", INT, None, WORKER, "worker", "`--poll-us`: microseconds the data thread polls after "
         "each reply before it sleeps (unset: 2000 on CUDA, 0 on a CPU).")
_declare("LAYA_DATA_REQUESTS", CHOICE, "auto", WORKER, "worker", "`--data-requests`: whether the broker sends requests "
         "to the data thread's own socket (auto: on with CUDA) or to the I/O thread.", ("auto", "on", "off"))
_declare("LAYA_DIRECT", CHOICE, "auto", WORKER, "worker", "`--direct`: whether clients may send requests to the worker "
         "themselves, skipping the broker (auto: when requests go to the data thread).", ("auto", "on", "off"))
_declare("LAYA_DIRECT_ENDPOINT", STR, "tcp://127.0.0.1:*", WORKER, "worker, `up`", "`--direct-endpoint`: where that "
         "direct socket binds (a free tcp port, beyond loopback only with keys, or ipc://...{id}...).")
_declare("LAYA_LANES", CHOICE, "auto", WORKER, "worker", "`--lanes`: whether clients on the host may send requests "
         "through shared memory (auto: with the direct socket on x86-64 Linux).", ("auto", "on", "off"))
_declare("LAYA_DATA_CPU", STR, "off", WORKER, "worker", "`--data-cpu`: off, or a CPU number to pin the data thread "
         "to (a core the host keeps for it); CUDA workers only.")

_declare("LAYA_ATTN", CHOICE, "triton", KERNELS, "worker", "The fast path's attention: triton (ours, packed) or sdpa "
         "(torch's, on the SDK's padded layout); the same bits, sdpa 0.25 ms slower at 1x48.", ("triton", "sdpa"))
_declare("LAYA_GEGLU", CHOICE, "pairs", KERNELS, "worker", "The GeGLU GEMM: pairs (input and gate rows interleaved, "
         "one accumulator, 7% faster at M = 8,192) or two (two accumulators); the same bits.", ("pairs", "two"))
_declare("LAYA_CUBLAS", BOOL, True, KERNELS, "worker", "At M >= 256 tokens, use cuBLAS's product wherever a proof on "
         "the device shows our bits (a 32x48 group 17% faster on an H100); off: our GEMMs everywhere.")
_declare("LAYA_LAUNCH_CACHE", BOOL, True, KERNELS, "worker", "Launch each kernel kind after its first launch without "
         "Triton's dispatch (~3x less host time in eager mode, the same bits); off: Triton's dispatch, a fallback.")
_declare("LAYA_PDL", BOOL, True, KERNELS, "worker", "Programmatic dependent launch on Hopper and later (each kernel "
         "launched while its predecessor finishes; the same bits, 1x48 7% faster); off: a fallback for a driver or "
         "Triton that mishandles it.")
_declare("LAYA_TMA", BOOL, True, KERNELS, "worker", "GEMM operands at M >= 1,024 through the copy engine (TMA, 20-40% "
         "faster a GEMM; the same bits); off: a fallback for a driver or Triton that mishandles it.")
_declare("LAYA_K_CHUNKS", BOOL, False, KERNELS, "worker", "A residual GEMM's K in two fixed chunks summed apart, more "
         "programs at small M; off by default since one chain gives cuBLAS's, hence the SDK's, bits.")

_declare("LAYA_WORKER_HANG_ROWS", INT, 0, FAULTS, "worker", "Block, as a hung device would, on any request of this "
         "many rows (0: off).")
_declare("LAYA_WORKER_FAULT_ROWS", INT, 0, FAULTS, "worker", "Raise inside the run of any group holding a request of "
         "this many rows, as a device fault would (0: off).")
_declare("LAYA_LARGE_CKPT", PATH, "/tmp/large", FAULTS, "tests/test_cublas_gpu.py", "The large checkpoint the GPU "
         "tests also run on where it exists.")

_declare("TRITON_INTERPRET", BOOL, False, OTHERS, "every process that imports the kernels", "Triton's CPU interpreter "
         "(tests on machines without CUDA): the kernels then do without libdevice and the launch cache.")
_declare("TRITON_LIBDEVICE_PATH", PATH, None, OTHERS, "every process that imports the kernels", "The libdevice Triton "
         "links; set, the kernels leave it alone instead of pointing Triton at the CUDA toolkit's.")
_declare("CUDA_HOME", PATH, None, OTHERS, "every process that imports the kernels", "A CUDA toolkit whose libdevice "
         "gives torch's GELU bits, tried first.")
_declare("CUDA_PATH", PATH, None, OTHERS, "every process that imports the kernels", "A CUDA toolkit, tried after "
         "CUDA_HOME and before /usr/local/cuda.")
_declare("CUDA_VISIBLE_DEVICES", STR, None, OTHERS, "worker", "The GPUs a worker sees (`up` sets it per worker); a "
         "worker maps its --device onto them.")
_declare("XDG_RUNTIME_DIR", PATH, None, OTHERS, "the broker, workers, operator commands", "Where the operator and "
         "worker secrets live when LAYA_POOL_RUNTIME_DIR is unset.")
_declare("XDG_CACHE_HOME", PATH, None, OTHERS, "`laya-pool demo`", "Where the demo keeps its checkpoint (unset: "
         "~/.cache).")

# The official SDK's own variables (laya 0.4): read by the SDK, never by laya-pool, and never warned about.
SDK = frozenset({
    "LAYA_API_KEY", "LAYA_AUTO_TASK", "LAYA_BASE_URL", "LAYA_BODY_READ_TIMEOUT", "LAYA_COMPILE_WARMUP", "LAYA_CPU_AMP",
    "LAYA_CUDA_AMP", "LAYA_DEFAULT_MODEL", "LAYA_DEVICE", "LAYA_EXTRA_MODELS", "LAYA_HOST", "LAYA_IDLE_UNLOAD_SECONDS",
    "LAYA_INDUCTOR_CACHE_DIR", "LAYA_JEV_STRICT", "LAYA_LOG_LEVEL", "LAYA_MAX_BATCH_TOKENS", "LAYA_MAX_CONCURRENT",
    "LAYA_MAX_LOADED", "LAYA_MAX_TOKEN_BUDGET", "LAYA_MODELS", "LAYA_MPS_AMP_MIN_ROWS", "LAYA_PORT", "LAYA_PRELOAD",
    "LAYA_REMOTE_TIMEOUT", "LAYA_REVISION", "LAYA_ROOT_PATH", "LAYA_SHA256_DIGESTS", "LAYA_THREADS",
    "LAYA_TOURNAMENT_GROUP",
})

# ------------------------------------------------------------------------------------------------ reading

# CPython's bytes dict behind os.environ (POSIX); elsewhere (Windows: str keys) os.environ itself, uncached.
_BYTES = getattr(os.environ, "_data", None) if os.name == "posix" else None
_KEYS = {name: os.fsencode(name) for name in DECLARED}
_SEEN: dict[str, tuple] = {}          # name -> (the raw bytes parsed last, their value): one tuple, swapped whole


def positive(kind: type) -> Callable[[str], Any]:
    """An argparse `type` for a flag that takes a number above 0 (`kind` int or float), its refusal naming the value."""
    def check(value: str) -> Any:
        try:
            v = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not {'an integer' if kind is int else 'a number'}") \
                from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"{value!r} must be greater than 0")
        return v
    check.__name__ = kind.__name__
    return check


def setting(name: str) -> Setting:
    """The declaration of `name`, or ValueError: code may read only what this module declares."""
    found = DECLARED.get(name)
    if found is None:
        raise ValueError(f"${name} is not declared in laya_pool/protocol/settings.py")
    return found


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The typed value of `name` in `environ` (default: this process's environment, read as the module says)."""
    if environ is None and isinstance(_BYTES, dict):
        key = _KEYS.get(name)
        if key is not None:
            raw = _BYTES.get(key)
            seen = _SEEN.get(name)
            if seen is not None and seen[0] is raw:
                return seen[1]
            value = DECLARED[name].parse(None if raw is None else os.fsdecode(raw))
            _SEEN[name] = (raw, value)
            return value
    return setting(name).parse((os.environ if environ is None else environ).get(name))


def raw(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The text of `name` (None when unset or empty), for a reader that checks it itself."""
    setting(name)
    value = (os.environ if environ is None else environ).get(name)
    return value or None


def snapshot(names: tuple[str, ...]) -> Callable[[], tuple]:
    """A function giving the values of `names` as set now, unparsed (bytes on POSIX; None: unset): part of a cache
    key that is read on every launch, where a changed value only has to give another key (~0.1 us a name)."""
    for name in names:
        setting(name)
    if isinstance(_BYTES, dict):
        keys, read = tuple(_KEYS[name] for name in names), _BYTES.get
        return lambda: tuple(map(read, keys))
    return lambda: tuple(map(os.environ.get, names))


def undeclared(environ: Mapping[str, str] | None = None) -> list[tuple[str, str | None]]:
    """Each LAYA_* name in `environ` that neither this module nor the SDK declares, with the nearest declared name
    when one is close (a typo), sorted."""
    env = os.environ if environ is None else environ
    names = sorted(n for n in env if n.startswith("LAYA_") and n not in DECLARED and n not in SDK)
    return [(n, next(iter(difflib.get_close_matches(n, DECLARED, n=1, cutoff=0.8)), None)) for n in names]


_WARNED: list[bool] = []


def warn_undeclared(log: logging.Logger) -> None:
    """One warning line for each undeclared LAYA_* variable, once per process (the first caller's logger)."""
    if _WARNED:
        return
    _WARNED.append(True)
    for name, near in undeclared():
        hint = f" (did you mean {near}?)" if near else ""
        log.warning("$%s is set but laya-pool has no such setting%s; it changes nothing (docs/operations.md lists "
                    "them)", name, hint)


# ------------------------------------------------------------------------------------------------ the table

def _cell(s: Setting) -> tuple[str, str]:
    kind = f"{s.kind}: {', '.join(s.choices)}" if s.choices else s.kind
    if s.default is None:
        default = "–"
    elif s.kind == BOOL:
        default = "`1`" if s.default else "`0`"
    else:
        default = f"`{s.default}`"
    return kind, default


def table() -> str:
    """The markdown docs/operations.md holds between its settings markers: one table per section, then the SDK's."""
    out: list[str] = []
    for section, title in SECTIONS.items():
        out += [f"{title}:", "", "| variable | type | default | read by | meaning |", "| --- | --- | --- | --- | --- |"]
        for s in DECLARED.values():
            if s.section == section:
                kind, default = _cell(s)
                out.append(f"| `{s.name}` | {kind} | {default} | {s.readers} | {s.meaning} |")
        out.append("")
    out.append("The official SDK's variables are its own; laya-pool reads none of them and does not warn about them: "
               + ", ".join(f"`{n}`" for n in sorted(SDK)) + ".")
    return "\n".join(out) + "\n"


BEGIN = "<!-- settings: begin (from laya_pool/protocol/settings.py: python -m laya_pool.protocol.settings FILE) -->"
END = "<!-- settings: end -->"


def splice(doc: str) -> str:
    """`doc` with `table()` between its BEGIN and END markers (ValueError when it lacks them)."""
    head, found, rest = doc.partition(BEGIN)
    _, ended, tail = rest.partition(END)
    if not found or not ended:
        raise ValueError("the document has no settings markers")
    return f"{head}{BEGIN}\n{table()}{END}{tail}"


if __name__ == "__main__":          # rewrite the table in the documents named
    import sys
    from pathlib import Path
    for arg in sys.argv[1:]:
        Path(arg).write_text(splice(Path(arg).read_text(encoding="utf-8")), encoding="utf-8")
