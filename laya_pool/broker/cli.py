"""`laya-pool`: run a pool and operate it.

    laya-pool up --model DIR [--devices cuda:0,cuda:1|cpu] [--workers-per-device N] [--frontend ENDPOINT]
    laya-pool status [--json]              the worker table
    laya-pool drain ID                     stop dispatching to a worker; it finishes its work and leaves
    laya-pool restart-worker ID            drain, restart, rejoin (no request fails meanwhile)
    laya-pool reload --model DIR           roll the pool onto another checkpoint, one worker at a time
    laya-pool predict --state TEXT --questions JSON
    laya-pool keys --out DIR               CURVE keys (needed to bind a non-loopback address)
    laya-pool api --listen [HOST:]PORT     the SDK server's HTTP API (/v1/systemone) in front of a pool
    laya-pool broker ...                   a broker alone (workers started elsewhere)
    laya-pool workers --broker ENDPOINT --model DIR    this host's workers, joining a broker on another host

Operator commands talk to the pool through its frontend (`--frontend`, default $LAYA_POOL_FRONTEND or
tcp://127.0.0.1:5555), as wire commands the broker answers.

A user's mistake never ends in a traceback: one line on stderr names what to fix, and the exit code says
which kind of failure it was (EXIT_CODES, shown by `--help` and docs/operations.md).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from laya_pool.protocol import contract, logs, settings, wire
from laya_pool.protocol.contract import WorkerState

log = logging.getLogger("laya-pool.cli")

# ------------------------------------------------------------------------------------------------ exit codes

EXIT_OK = contract.EXIT_OK              # 0
EXIT_FAILED = 1                         # the command ran and did not succeed
EXIT_USAGE = contract.EXIT_USAGE        # 2
EXIT_UNREACHABLE = 3                    # the pool did not answer (not listening, busy, no worker, timed out)
EXIT_NOT_ALLOWED = 4                    # the pool refused: this user lacks the operator credential
EXIT_CONFIG = contract.EXIT_CONFIG      # 78
EXIT_INTERRUPTED = 130                  # Ctrl-C

EXIT_CODES = (
    (EXIT_OK, "success"),
    (EXIT_FAILED, "the command ran and failed (a worker did not come back, a reload did not finish, the pool "
                  "refused the request, `up` stopped because its pool failed)"),
    (EXIT_USAGE, "usage: a bad option, value or file on the command line (nothing was started or sent)"),
    (EXIT_UNREACHABLE, "the pool did not answer: nothing listening at the frontend, or busy / no worker until the "
                       "timeout"),
    (EXIT_NOT_ALLOWED, "not allowed: drain / restart-worker / reload need the pool's operator credential"),
    (EXIT_CONFIG, "`up`, `workers`, `broker`, `api`: the checkpoint or the configuration is unusable, or an endpoint "
                  "or an --http / --api port is taken (restarting will not help)"),
    (EXIT_INTERRUPTED, "interrupted (SIGINT) while waiting"),
)

ENV_PREFIX = "LAYA_POOL_"


class UsageError(Exception):
    """A bad value on the command line (or in its environment variable): exit 2 with this one line."""


def _client(a: argparse.Namespace, **kw: Any):
    """A client for an operator command: with the pool's operator secret when this user has it, and under
    CURVE the operator key pair when the key directory holds one (broker.operator)."""
    from laya_pool.client.pool import Client

    from .operator import read_secret
    if a.keys and not Path(a.keys).is_dir():
        raise UsageError(f"--keys: {a.keys} is not a directory (laya-pool keys --out DIR makes one)")
    role = "operator" if a.keys and (Path(a.keys) / "operator.key_secret").is_file() else "client"
    try:
        return Client(a.frontend, timeout=a.timeout, keys=a.keys, operator=read_secret(a.frontend), key_role=role,
                      **kw)
    except (OSError, ValueError) as e:      # unreadable or malformed keys
        raise UsageError(f"--keys: {e}") from e


def _fail(message: str, code: int = EXIT_FAILED) -> int:
    print(f"laya-pool: {message}", file=sys.stderr)
    return code


# ------------------------------------------------------------------------------------------------ commands

def _devices(spec: str) -> list[str]:
    devices = [d.strip() for d in spec.split(",") if d.strip()]
    if not devices:
        raise UsageError("--devices: empty (cpu, or cuda:0,cuda:1,...)")
    for d in devices:
        if d != "cpu" and not (d.startswith("cuda:") and d[5:].isdigit()) and d != "cuda":
            raise UsageError(f"--devices: {d!r} is not cpu or cuda:N")
    return ["cuda:0" if d == "cuda" else d for d in devices]


def _checkpoint_dir(flag: str, path: str) -> Path:
    """A directory holding every file the fingerprint covers (what a worker needs), or a UsageError."""
    p = Path(path)
    if not p.is_dir():
        raise UsageError(f"{flag}: {path} is not a directory (give a checkpoint directory; "
                         "`laya-pool make-checkpoint --out DIR` writes a tiny one)")
    missing = [f for f in contract.FINGERPRINT_FILES if not (p / f).is_file()]
    if missing:
        raise UsageError(f"{flag}: {path} is not a checkpoint: missing {', '.join(missing)}")
    return p.resolve()


def worker_argv(a: argparse.Namespace) -> list[str]:
    """The worker options `up` was given, as each worker's command line takes them (what was not given is left to
    the worker's own default)."""
    out: list[str] = ["--warmup-shapes", a.warmup_shapes] if a.warmup_shapes else []
    if a.warmup_merged is not None:          # '' too: no merged buckets
        out += ["--warmup-merged", a.warmup_merged]
    for name in ("max_tokens", "max_rows", "max_markers", "threads", "max_batch", "merge_waste", "compute_timeout"):
        v = getattr(a, name)
        if v is not None:
            out += [f"--{name.replace('_', '-')}", str(v)]
    return out


def cmd_up(a: argparse.Namespace) -> int:
    from .supervisor import Supervisor, SupervisorConfig

    devices = _devices(a.devices)
    from .security import SecurityError, check_endpoints
    try:
        check_endpoints(a.frontend, a.backend or "ipc://", a.keys, a.insecure_backend)
    except SecurityError as e:
        raise UsageError(str(e)) from e
    if a.http is not None:
        from .ops_http import refusal
        if (why := refusal(a.http, a.keys)) is not None:
            raise UsageError(why)
    if a.keys and not Path(a.keys).is_dir():
        raise UsageError(f"--keys: {a.keys} is not a directory (laya-pool keys --out DIR makes one)")
    api_key = _api_key(a, "--api") if a.api is not None else None
    model = _checkpoint_dir("--model", a.model)
    from .broker import policy_argv
    broker_args = policy_argv(a) + (["--insecure-backend"] if a.insecure_backend else [])
    worker_args = worker_argv(a)
    cfg = SupervisorConfig(model=str(model), devices=devices, workers_per_device=a.workers_per_device,
                           frontend=a.frontend, backend=a.backend, heartbeat_ms=a.heartbeat_ms, liveness=a.liveness,
                           mode=a.mode, credit=a.credit, keys=a.keys, broker_args=broker_args,
                           worker_args=worker_args, drain_timeout=a.drain_timeout)
    cfg.http, cfg.api, cfg.api_key, cfg.api_processes = a.http, a.api, api_key, a.api_processes
    return Supervisor(cfg).run()


def worker_name(value: str | None) -> str:
    """`workers --name` (default: this host's name), fit for worker ids NAME-0, NAME-1, ..., or a UsageError."""
    import re

    from .remote import default_name
    name = value or default_name()
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", name):
        raise UsageError(f"--name: {name!r} is not a host name for worker ids (letters, digits, '.', '_', '-'; "
                         "at most 100)")
    return name


def cmd_workers(a: argparse.Namespace) -> int:
    from .remote import RemoteWorkers, WorkersConfig
    devices = _devices(a.devices)
    if not a.keys and a.broker.startswith("tcp://") and not wire.is_loopback(a.broker):
        raise UsageError(f"--broker {a.broker}: not a loopback address and no CURVE keys (the workers would take "
                         "requests unencrypted from whoever answers there): pass --keys DIR, the pool's key directory "
                         "(`laya-pool keys --out DIR`)")
    if a.keys and not Path(a.keys).is_dir():
        raise UsageError(f"--keys: {a.keys} is not a directory (laya-pool keys --out DIR makes one)")
    if a.http is not None:
        from .ops_http import refusal
        if (why := refusal(a.http, a.keys)) is not None:
            raise UsageError(why)
    name = worker_name(a.name)
    model = _checkpoint_dir("--model", a.model)
    cfg = WorkersConfig(model=str(model), devices=devices, workers_per_device=a.workers_per_device,
                        heartbeat_ms=a.heartbeat_ms, liveness=a.liveness, mode=a.mode, credit=a.credit, keys=a.keys,
                        worker_args=worker_argv(a), drain_timeout=a.drain_timeout, http=a.http, broker=a.broker,
                        name=name, direct_host=a.direct_host, worker_secret_file=a.worker_secret_file)
    return RemoteWorkers(cfg).run()


def _api_key(a: argparse.Namespace, flag: str) -> str | None:
    """The gateway's API key from the arguments (or their variables), refused where the address needs one."""
    import laya_pool.gateway.options as options
    try:
        key = options.api_key(a.api_key, a.api_key_file)
    except ValueError as e:
        raise UsageError(str(e)) from e
    why = options.refusal(getattr(a, flag.lstrip("-")), key, flag)
    if why is not None:
        raise UsageError(why)
    return key


def cmd_api(a: argparse.Namespace) -> int:
    import laya_pool.gateway.options as options
    if a.keys and not Path(a.keys).is_dir():
        raise UsageError(f"--keys: {a.keys} is not a directory (laya-pool keys --out DIR makes one)")
    try:
        cfg = options.config_from_args(a)
    except ValueError as e:
        raise UsageError(str(e)) from e
    from laya_pool.gateway.server import serve
    return serve(cfg)


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def cmd_status(a: argparse.Namespace) -> int:
    with _client(a, retries=a.retries) as c:
        st = c.status()
    if a.json:
        print(json.dumps(st, indent=2, sort_keys=True))
        return 0
    b = st.get("broker", {})
    print(f"broker pid {b.get('pid')}  frontend {b.get('frontend')}  model {str(b.get('fingerprint'))[:12]}  "
          f"queue {b.get('queue')}/{b.get('queue_size')}  in flight {b.get('inflight')}  "
          f"up {b.get('uptime_s', 0):.0f} s")
    rows = [["ID", "DEVICE", "STATE", "PID", "MODEL", "INFLIGHT", "CREDIT", "DONE", "FAILED", "LOST", "REG", "UP",
             "SEEN"]]
    for w in st.get("workers", []):
        rows.append([str(w.get("id")), str(w.get("device")), str(w.get("state")), str(w.get("pid")),
                     str(w.get("fingerprint"))[:12], str(w.get("inflight")), str(w.get("credit")),
                     str(w.get("completed")), str(w.get("failed")), str(w.get("lost")), str(w.get("registrations")),
                     f"{w.get('up_s', 0):.0f}s", f"{w.get('last_seen_ms', 0):.0f}ms"])
    print(_table(rows))
    if len(rows) == 1:
        print("(no workers registered)")
    return 0


def _find(st: dict, wid: str) -> dict | None:
    return next((w for w in st.get("workers", []) if w.get("id") == wid), None)


def cmd_drain(a: argparse.Namespace) -> int:
    with _client(a) as c:
        r = c.drain(a.id)
        print(f"worker {a.id}: {r.get('state')} ({r.get('inflight')} in flight)")
        if not a.wait:
            return 0
        deadline = time.monotonic() + a.wait_timeout
        while time.monotonic() < deadline:
            w = _find(c.status(), a.id)
            if w is None or w.get("state") not in (WorkerState.DRAINING, WorkerState.READY):
                print(f"worker {a.id}: {w.get('state') if w else 'gone'}")
                return 0
            time.sleep(0.2)
        return _fail(f"worker {a.id} still draining after {a.wait_timeout:g} s")


def cmd_restart_worker(a: argparse.Namespace) -> int:
    from laya_pool.client.errors import PoolError
    with _client(a) as c:
        before = _find(c.status(), a.id)
        if before is None:
            return _fail(f"no worker {a.id!r} in this pool (`laya-pool status` lists them)")
        r = c.drain(a.id, restart=True)
        print(f"worker {a.id}: {r.get('state')} for a restart ({r.get('inflight')} in flight)")
        if a.no_wait:
            return 0
        deadline = time.monotonic() + a.wait_timeout
        while time.monotonic() < deadline:
            time.sleep(0.2)
            try:
                w = _find(c.status(), a.id)
            except PoolError:
                continue
            rejoined = w and w.get("registrations", 0) > before.get("registrations", 0)
            if rejoined and w.get("state") == WorkerState.READY:
                print(f"worker {a.id}: ready again (pid {w.get('pid')}, was {before.get('pid')})")
                return 0
        return _fail(f"worker {a.id} did not come back within {a.wait_timeout:g} s")


def cmd_reload(a: argparse.Namespace) -> int:
    """Ask the pool to roll onto another checkpoint (the supervisor does it, broker.supervisor.Reload) and
    follow it in the status until every worker serves the new model."""
    from laya_pool.client.errors import PoolError

    from . import reload as rl

    model = _checkpoint_dir("--model", a.model)
    try:
        fp = contract.fingerprint(model)
    except OSError as e:
        raise UsageError(f"--model: cannot read {model}: {e}") from e
    with _client(a) as c:
        st = c.status()
        if st.get("broker", {}).get("fingerprint") == fp and rl.all_on(st, fp):
            print(f"the pool already serves {model} (model {fp[:12]})")
            return 0
        before = {w["id"]: w for w in st.get("workers", [])}
        r = c.reload(str(model), fp, reload_id=uuid.uuid4().hex)
        print(f"reload to {model} (model {fp[:12]}) accepted; the supervisor moves the workers one at a time")
        if a.no_wait:
            return 0
        deadline = time.monotonic() + a.wait_timeout
        seen: set[str] = set()
        while time.monotonic() < deadline:
            time.sleep(0.3)
            try:
                st = c.status()
            except PoolError:
                continue        # the broker restarting: the reload goes on (the supervisor drives it)
            for wid, w in rl.moved(st, before, fp).items():
                if wid not in seen:
                    seen.add(wid)
                    print(f"worker {wid}: on the new model (pid {w.get('pid')})")
            problem = rl.problem(st, before, fp, r.get("reload", {}).get("id"))
            if problem:
                return _fail(problem)
            if rl.finished(st, before, fp, seen):
                print(f"reload done: {len(seen)} workers serve model {fp[:12]}")
                return 0
        return _fail(f"the reload did not finish within {a.wait_timeout:g} s (`laya-pool status` shows where it is;"
                     " the supervisor's log says why)")


def _read_arg(flag: str, value: str) -> str:
    """`@FILE` reads the file (a one-line error when it cannot); anything else is the value itself."""
    if not value.startswith("@"):
        return value
    try:
        return Path(value[1:]).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{flag}: cannot read {value[1:]}: {getattr(e, 'strerror', None) or e}") from e


def _json_arg(flag: str, value: str) -> Any:
    try:
        return json.loads(_read_arg(flag, value))
    except json.JSONDecodeError as e:
        raise UsageError(f"{flag}: not JSON ({e})") from e


def cmd_predict(a: argparse.Namespace) -> int:
    from laya_pool.client.errors import RequestFailed
    questions = _json_arg("--questions", a.questions)
    if a.state_json is not None:
        state = _json_arg("--state-json", a.state_json)
    elif a.state is not None:
        state = _read_arg("--state", a.state)
    else:
        raise UsageError("give --state TEXT or --state-json JSON (either may be @FILE)")
    with _client(a) as c:
        t = time.perf_counter()
        try:
            out = c.predict(state, questions, worker=a.worker, mode=a.mode)
        except RequestFailed:
            raise
        except (ValueError, TypeError) as e:      # the questions do not follow the SDK's schema
            raise UsageError(f"--questions: {e}") from e
        ms = (time.perf_counter() - t) * 1e3
    print(json.dumps(out, indent=2, ensure_ascii=False))
    print(f"({ms:.1f} ms)", file=sys.stderr)
    return 0


def cmd_keys(a: argparse.Namespace) -> int:
    from .security import SecurityError, generate
    try:
        keys = generate(a.out, overwrite=a.force)
    except SecurityError as e:
        return _fail(str(e))
    print(f"wrote CURVE keys to {a.out}: server public key {keys['server']}, client public key {keys['client']}")
    print(f"broker:  laya-pool up ... --keys {a.out}   clients / workers: keys={a.out!r}")
    return 0


def cmd_broker(a: argparse.Namespace) -> int:
    from .broker import config_from_args, serve
    if a.http is not None:
        from .ops_http import refusal
        if (why := refusal(a.http, a.keys)) is not None:
            raise UsageError(why)
    return serve(config_from_args(a))


# ------------------------------------------------------------------------------------------------ parser

class _Parser(argparse.ArgumentParser):
    """One line for a usage error, exit 2 (argparse prints the whole usage block first). No abbreviations: `up
    --worker 2` is an error, not `--workers-per-device 2` (an abbreviation that works today breaks when a flag
    sharing its prefix is added). Subcommands' parsers are this class too."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see {self.prog} --help)\n")


class _Help(argparse.RawDescriptionHelpFormatter):
    """Every option's default in its help, unless the text already says it (or there is none to show)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or "default" in text or action.default in (None, False, argparse.SUPPRESS)
                or isinstance(action, (argparse._HelpAction, argparse._VersionAction))):
            return text
        return text + " (default: %(default)s)"


def _endpoint(value: str) -> str:
    """argparse type: a ZeroMQ endpoint this pool can use."""
    if not value.startswith(("tcp://", "ipc://")) or len(value) <= len("tcp://"):
        raise argparse.ArgumentTypeError(f"{value!r} is not an endpoint: give tcp://HOST:PORT or ipc://PATH")
    if value.startswith("tcp://"):
        port = value.rsplit(":", 1)[-1]
        if ":" not in value[len("tcp://"):] or not (port.isdigit() and 0 < int(port) < 65536):
            raise argparse.ArgumentTypeError(f"{value!r}: give a port, tcp://HOST:PORT (1..65535)")
    return value


def _level(value: str) -> str:
    try:
        return logs.check_level(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _format(value: str) -> str:
    try:
        return logs.check_format(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("laya-pool")
    except Exception:  # noqa: BLE001 - run from a source tree that was never installed
        return "unknown (not installed)"


def _epilog() -> str:
    codes = "\n".join(f"  {code:>3}  {text}" for code, text in EXIT_CODES)
    return (f"exit codes:\n{codes}\n\n`--log-level` and `--log-format` go before or after the command. "
            f"Every `up` option also reads an environment variable ({ENV_PREFIX}<OPTION>, e.g. LAYA_POOL_MODEL, "
            f"LAYA_POOL_DEVICES; `laya-pool up --help` names each); a flag beats its variable. docs/operations.md "
            f"has the details.")


def _common() -> argparse.ArgumentParser:
    """Options every command takes, before or after its name (SUPPRESS: an absent one leaves the other's)."""
    c = _Parser(add_help=False)
    c.add_argument("--log-level", type=_level, default=argparse.SUPPRESS, metavar="LEVEL",
                   help=f"debug, info, warning, error (default: ${logs.LEVEL_ENV} or info)")
    c.add_argument("--log-format", type=_format, default=argparse.SUPPRESS, choices=logs.FORMATS,
                   help=f"text, or json: one object per line (default: ${logs.FORMAT_ENV} or text)")
    return c


def build_parser(more_help: str = "") -> argparse.ArgumentParser:
    """`more_help`: text after the top-level help's epilog (the program's tools, which this room does not know)."""
    from .broker import add_arguments
    common = _common()
    p = _Parser(prog="laya-pool", description="a multi-process worker pool serving Laya models",
                epilog=_epilog() + more_help, formatter_class=_Help, parents=[common])
    p.add_argument("--version", action="version", version=f"laya-pool {_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, parents=[common], formatter_class=_Help,
                              epilog=_epilog())

    up = command("up", "run a pool in the foreground until SIGINT/SIGTERM")
    _add_up(up)
    _add_operator_commands(command)
    _add_api(command)
    s = command("keys", "generate CURVE keys")
    s.add_argument("--out", required=True, help="directory to write the keys to")
    s.add_argument("--force", action="store_true", help="replace existing keys")
    s.set_defaults(fn=cmd_keys)
    s = command("broker", "run a broker alone (workers started elsewhere)")
    add_arguments(s)
    s.set_defaults(fn=cmd_broker)
    _check_endpoint_types(s)
    _add_workers(command("workers", "run this host's workers, joining a broker on another host, until SIGINT/SIGTERM"))
    return p


def _check_endpoint_types(p: argparse.ArgumentParser) -> None:
    for action in p._actions:
        if action.dest in ("frontend", "backend"):
            action.type = _endpoint


def _add_up(up: argparse.ArgumentParser) -> None:
    from .broker import add_arguments
    up.add_argument("--model", required=True,
                    help="checkpoint directory (`laya-pool make-checkpoint --out DIR` makes a tiny one)")
    up.add_argument("--devices", default="cpu", help="cpu, or cuda:0,cuda:1,...")
    up.add_argument("--workers-per-device", type=settings.positive(int), default=1, help="worker processes per device")
    add_arguments(up, supervised=True)          # the broker's flags, defined once in broker.broker
    _add_worker_options(up)
    up.add_argument("--http", default=None, metavar="[HOST:]PORT",
                    help="serve /metrics and /health/{live,ready} here (a bare port: 127.0.0.1; default: off)")
    up.add_argument("--api", default=None, metavar="[HOST:]PORT",
                    help="serve the SDK server's HTTP API here (`laya-pool api` beside the pool; a bare port: "
                         "127.0.0.1; beyond loopback only with an API key; default: off)")
    up.add_argument("--api-processes", type=settings.positive(int), default=1,
                    help="the HTTP API's processes, sharing its port (`laya-pool api --processes`)")
    from laya_pool.gateway.options import add_key_arguments
    add_key_arguments(up)
    _check_endpoint_types(up)
    _from_environment(up)
    up.set_defaults(fn=cmd_up)


def _add_workers(s: argparse.ArgumentParser) -> None:
    s.add_argument("--broker", required=True, type=_endpoint,
                   help="the broker's worker endpoint (its --backend): tcp://HOST:PORT (beyond loopback with "
                        "--keys), or ipc://PATH on the broker's host")
    s.add_argument("--model", required=True, help="checkpoint directory (the one the pool serves, on this host)")
    s.add_argument("--devices", default="cpu", help="cpu, or cuda:0,cuda:1,...")
    s.add_argument("--workers-per-device", type=settings.positive(int), default=1, help="worker processes per device")
    s.add_argument("--name", default=None,
                   help="this host's name in its workers' ids (NAME-0, NAME-1, ...): unique in the pool, the same "
                        "after a restart (default: the host name)")
    s.add_argument("--direct-host", default=None, metavar="ADDRESS",
                   help="the address clients reach this host's workers at, for their requests (default: with keys and "
                        "a broker beyond loopback, this host's address towards the broker; else loopback)")
    s.add_argument("--heartbeat-ms", type=settings.positive(int), default=contract.HEARTBEAT_MS,
                   help="milliseconds between heartbeats of the broker and each worker (the broker's)")
    s.add_argument("--liveness", type=settings.positive(int), default=contract.LIVENESS,
                   help="heartbeats missed before a worker takes the broker for gone and registers again")
    s.add_argument("--keys", default=None, help="the pool's CURVE key directory (needed beyond loopback)")
    s.add_argument("--worker-secret-file", default=None, metavar="FILE",
                   help="without --keys: the broker's worker secret, which proves that its workers were started for "
                        "the pool (the file the broker logs at start; read at every registration). Default: the one "
                        "in this user's run directory, where a broker on this host under the same user wrote it")
    _add_worker_options(s)
    s.add_argument("--http", default=None, metavar="[HOST:]PORT",
                   help="serve this host's /health/{live,ready} and /metrics here (a bare port: 127.0.0.1; beyond "
                        "loopback with --keys only; default: off)")
    _from_environment(s)
    s.set_defaults(fn=cmd_workers)


def _add_worker_options(p: argparse.ArgumentParser) -> None:
    """The workers' options, which `up` and `workers` both take and hand to every worker they start (None leaves the
    worker's own default, which depends on its device)."""
    p.add_argument("--mode", default=None, choices=contract.MODES,
                   help="execution mode (default: graph-cached on CUDA, eager on CPU)")
    p.add_argument("--credit", type=settings.positive(int), default=None,
                   help="requests a worker holds at once (default: twice its --max-batch, at least 2)")
    p.add_argument("--max-batch", type=settings.positive(int), default=None,
                   help="queued requests a worker merges into one forward (default: 32 on CUDA, 1 on CPU)")
    p.add_argument("--merge-waste", type=int, default=None,
                   help="padding tokens a merged forward may hold beyond what its requests pad to alone; a request "
                        "that would take it past waits for the next group (default 512; negative: no bound)")
    p.add_argument("--max-tokens", type=settings.positive(int), default=None,
                   help="tokens one forward may hold (default: the worker's workspace size)")
    p.add_argument("--max-rows", type=settings.positive(int), default=None,
                   help="rows (questions) one forward may hold (default: the worker's workspace size)")
    p.add_argument("--max-markers", type=settings.positive(int), default=None,
                   help="option markers one forward may hold (default: the worker's workspace size)")
    p.add_argument("--threads", type=settings.positive(int), default=None,
                   help="torch threads per worker (default: the cores it is pinned to)")
    p.add_argument("--compute-timeout", type=settings.positive(float), default=None,
                   help="seconds a worker's forward may take before its device counts as hung (default 10 on CUDA, "
                        "30 on CPU); the worker leaves, its requests go to other workers, the supervisor restarts it")
    p.add_argument("--warmup-shapes", default=None, metavar="RxLxM,...",
                   help="graph-cached mode: the shape buckets each worker captures before it reports ready, as "
                        "ROWSxROW_LENGTHxMARKERS_PER_ROW,... e.g. 4x256x8,16x512x8 (default: a common set, see "
                        "worker/runtime.py DEFAULT_WARMUP); more buckets mean a longer start and fewer captures "
                        "under traffic. Ignored in eager mode (the CPU default)")
    p.add_argument("--warmup-merged", default=None, metavar="RxTxM,...",
                   help="graph-cached mode: request classes (one request's rows x tokens per row x markers per row) "
                        "whose merged groups each worker also captures before it reports ready, e.g. "
                        "1x48x4,4x256x4 for a load of both; '' for none (default: one question over 48, 64 or 128 "
                        "tokens, or none with --warmup-shapes). The buckets traffic missed most show in `status "
                        "--json` (a worker's stats.runtime.missed_shapes, with counts)")
    p.add_argument("--drain-timeout", type=settings.positive(float), default=5.0,
                   help="seconds a stopping worker may take to finish its in-flight work before it is killed "
                        "(default 5, so that a stop ends within seconds even with a hung device: `up` within 10 s; a "
                        "longer one lets slow requests finish)")


def _add_api(command: Any) -> None:
    import laya_pool.gateway.options as options
    s = command("api", "serve the SDK server's HTTP API (laya serve: /v1/systemone, /health) in front of a pool")
    s.add_argument("--frontend", type=_endpoint, default=contract.default_frontend(),
                   help=f"the pool's client endpoint (default: ${contract.FRONTEND_ENV} or %(default)s)")
    s.add_argument("--keys", default=settings.raw(ENV_PREFIX + "KEYS"),
                   help=f"CURVE key directory of a pool that has keys (default: ${ENV_PREFIX}KEYS, else none)")
    options.add_arguments(s)
    for action in s._actions:
        if action.dest in ("api_key", "api_key_file"):
            action.help += f" [${env_name(action)}]"
    s.set_defaults(fn=cmd_api)


def env_name(action: argparse.Action) -> str:
    """`--queue-timeout` reads $LAYA_POOL_QUEUE_TIMEOUT."""
    return ENV_PREFIX + action.option_strings[0].lstrip("-").upper().replace("-", "_")


def _from_environment(p: argparse.ArgumentParser) -> None:
    """Every option of `p` reads $LAYA_POOL_<OPTION> as its default, so a flag given still beats it. A bad value
    is reported when the command runs (`_env_problems`), naming the variable."""
    problems: list[str] = []
    for action in p._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction) or action.dest in ("log_level",
                                                                                                   "log_format"):
            continue
        name = env_name(action)
        action.help = (action.help or "") + f" [${name}]"
        raw = settings.raw(name)
        if raw is None:
            continue
        if isinstance(action, argparse._StoreTrueAction):
            if raw.lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                problems.append(f"${name}: {raw!r} is not a boolean (1/0, true/false)")
                continue
            action.default = raw.lower() in ("1", "true", "yes", "on")
            continue
        try:
            value = action.type(raw) if action.type else raw
        except (argparse.ArgumentTypeError, ValueError) as e:
            problems.append(f"${name}: {e}")
            continue
        if action.choices is not None and value not in action.choices:
            problems.append(f"${name}: {raw!r} is not one of {', '.join(map(str, action.choices))}")
            continue
        action.default, action.required = value, False
    p.set_defaults(env_problems=problems)


def _add_operator_commands(command: Any) -> None:
    def operator(name: str, help: str) -> argparse.ArgumentParser:
        s = command(name, help)
        s.add_argument("--frontend", type=_endpoint, default=contract.default_frontend(),
                       help=f"the pool's client endpoint (default: ${contract.FRONTEND_ENV} or %(default)s)")
        s.add_argument("--timeout", type=settings.positive(float), default=5.0,
                       help="seconds for the whole call (every attempt within it)")
        s.add_argument("--keys", default=settings.raw(ENV_PREFIX + "KEYS"),
                       help=f"CURVE key directory (default: ${ENV_PREFIX}KEYS, else none)")
        return s

    s = operator("status", "the worker table")
    s.add_argument("--json", action="store_true", help="the broker's whole status as JSON")
    s.add_argument("--retries", type=int, default=1, help="attempts after the first")
    s.set_defaults(fn=cmd_status)

    s = operator("drain", "stop dispatching to a worker; it finishes its work and leaves")
    s.add_argument("id", help="worker id (laya-pool status)")
    s.add_argument("--wait", action="store_true", help="wait until it has left")
    s.add_argument("--wait-timeout", type=settings.positive(float), default=120.0, help="seconds --wait waits")
    s.set_defaults(fn=cmd_drain)

    s = operator("restart-worker", "drain a worker, restart it, wait until it rejoins")
    s.add_argument("id", help="worker id (laya-pool status)")
    s.add_argument("--no-wait", action="store_true", help="return once the drain is accepted")
    s.add_argument("--wait-timeout", type=settings.positive(float), default=180.0,
                   help="seconds to wait for it to rejoin")
    s.set_defaults(fn=cmd_restart_worker)

    s = operator("reload", "roll the pool onto another checkpoint, one worker at a time, failing no request")
    s.add_argument("--model", required=True, help="the new checkpoint directory (readable by the pool's user)")
    s.add_argument("--no-wait", action="store_true", help="return once the pool has accepted the reload")
    s.add_argument("--wait-timeout", type=settings.positive(float), default=1800.0,
                   help="seconds to wait for every worker to serve the new model")
    s.set_defaults(fn=cmd_reload)

    s = operator("predict", "ask questions about a state; prints the SDK's answer dict as JSON")
    s.add_argument("--state", default=None, help="the state as text, or @FILE")
    s.add_argument("--state-json", default=None, help="the state as JSON (a dict or a conversation list), or @FILE")
    s.add_argument("--questions", required=True, help="JSON {id: definition}, or @FILE")
    s.add_argument("--worker", default=None, help="ask this worker only (diagnostics)")
    s.add_argument("--mode", default=None, choices=contract.MODES, help="execution mode for this request")
    s.set_defaults(fn=cmd_predict)


# ------------------------------------------------------------------------------------------------ main

def exit_code(e: BaseException) -> int:
    """The exit code for an error a command let through (see EXIT_CODES)."""
    from laya_pool.client.errors import PoolError, PoolUnavailable, RequestFailed
    from laya_pool.protocol.contract import Reason
    if isinstance(e, UsageError):
        return EXIT_USAGE
    if isinstance(e, PoolUnavailable):
        return EXIT_UNREACHABLE
    if isinstance(e, RequestFailed) and e.reason == Reason.NOT_ALLOWED:
        return EXIT_NOT_ALLOWED
    if isinstance(e, PoolError):
        return EXIT_FAILED
    return EXIT_FAILED


def main(argv: list[str] | None = None, more_help: str = "") -> int:
    a = build_parser(more_help).parse_args(argv)
    try:
        a.log_level = getattr(a, "log_level", None) or logs.check_level(settings.raw(logs.LEVEL_ENV) or "INFO")
    except ValueError as e:
        return _fail(f"${logs.LEVEL_ENV}: {e}", EXIT_USAGE)
    try:
        a.log_format = getattr(a, "log_format", None) or logs.check_format(settings.raw(logs.FORMAT_ENV) or "text")
    except ValueError as e:
        return _fail(f"${logs.FORMAT_ENV}: {e}", EXIT_USAGE)
    for problem in getattr(a, "env_problems", []):
        return _fail(problem, EXIT_USAGE)
    # The pool's processes inherit these: one level and one format for the whole pool (protocol.logs).
    os.environ[logs.LEVEL_ENV], os.environ[logs.FORMAT_ENV] = a.log_level, a.log_format
    logs.setup("supervisor" if a.command == "up" else a.command, a.log_level, a.log_format)
    settings.warn_undeclared(log)
    try:
        return a.fn(a)
    except KeyboardInterrupt:
        return _fail("interrupted", EXIT_INTERRUPTED)
    except Exception as e:  # noqa: BLE001 - a user sees one line; --log-level debug shows the traceback
        code = exit_code(e)
        if code == EXIT_FAILED and not _expected(e):
            log.debug("traceback", exc_info=True)
            return _fail(f"unexpected error: {type(e).__name__}: {e} (--log-level debug shows the traceback)", code)
        return _fail(str(e), code)


def _expected(e: BaseException) -> bool:
    from laya_pool.client.errors import PoolError
    return isinstance(e, (UsageError, PoolError, OSError))


if __name__ == "__main__":
    sys.exit(main())
