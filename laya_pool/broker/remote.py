"""`laya-pool workers`: this host's workers, joining a broker on another host.

    laya-pool workers --broker tcp://HOST:PORT --model DIR [--devices cuda:0,cuda:1] [--workers-per-device N]
                      [--name NAME] [--keys DIR] [--http [HOST:]PORT] [the worker options of `up`]

`--broker` is the broker's worker endpoint (its `--backend`). The workers are supervised as `up` supervises its own
(broker/processes.py: restarts by exit code, with backoff after a crash), with three differences that come from the
broker being elsewhere:

- their ids are NAME-0, NAME-1, ... (NAME: `--name`, by default this host's name), unique across the pool's hosts
  and the same after a restart, so a host that comes back takes its old rows in the broker's table;
- their direct sockets (clients send their requests there, the broker only tells them where) listen where clients on
  other hosts reach them: with keys and a broker beyond loopback, on this host's address towards the broker (the
  address its route to the broker leaves from), or `--direct-host`; `--direct-endpoint` among the worker options, or
  LAYA_DIRECT_ENDPOINT, wins;
- `--http` serves this host's own health and metrics (broker/host.py): /health/live, /health/ready (every worker
  meant to run is registered with the broker), /metrics (its workers by state, restarts).

SIGTERM / SIGINT: every worker finishes what it holds, tells the broker and leaves (SIGKILL after --drain-timeout);
exit 0. Exit 78 when no worker can start (configuration errors) or the --http port is taken.
"""
from __future__ import annotations

import logging
import shutil
import signal
import socket
import time
from dataclasses import dataclass

from laya_pool.protocol import contract, settings, wire

from . import children, rundir
from .host import HostObserver, HostView
from .processes import WorkerOptions, WorkerProcesses

log = logging.getLogger("laya-pool.supervisor")
VIEW_EVERY_S = 1.0      # how often the host's view (its workers' states) is taken for --http


@dataclass
class WorkersConfig(WorkerOptions):
    broker: str = ""                    # the broker's worker endpoint
    name: str = ""                      # the workers' id prefix (NAME-0, NAME-1, ...)
    direct_host: str | None = None      # where the workers' direct sockets listen (None: see `direct_endpoint`)


def default_name() -> str:
    """This host's name, as a worker id takes it (a worker id has no '/')."""
    return socket.gethostname().replace("/", "-") or "host"


def route_address(endpoint: str) -> str:
    """The address of this host that its route to `endpoint`'s host leaves from (a UDP socket's connect: no packet is
    sent), so clients that reach the broker from that network reach this host there too."""
    host = wire.endpoint_host(endpoint).strip("[]")
    port = int(endpoint.rsplit(":", 1)[1])
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind, proto) as s:
        s.connect(addr)
        return s.getsockname()[0]


def direct_endpoint(cfg: WorkersConfig, env: dict[str, str]) -> str | None:
    """The --direct-endpoint each worker gets (None: the worker's own default, loopback)."""
    if settings.raw("LAYA_DIRECT_ENDPOINT", env) is not None or any(
            a.startswith("--direct-endpoint") for a in cfg.worker_args):
        return None
    host = cfg.direct_host
    if host is None and cfg.keys and cfg.broker.startswith("tcp://") and not wire.is_loopback(cfg.broker):
        try:
            host = route_address(cfg.broker)
        except OSError as e:            # a name that does not resolve (yet): the unit's restart tries again
            raise OSError(f"--broker {cfg.broker}: no route to it from this host ({e}); where do clients reach this "
                          "host's workers? give --direct-host ADDRESS") from e
    if host is None:
        return None
    return f"tcp://[{host}]:*" if ":" in host else f"tcp://{host}:*"


class RemoteWorkers:
    def __init__(self, cfg: WorkersConfig):
        self.cfg = cfg
        self.tmp = rundir.make_private()          # the workers' presence files (protocol/presence.py)
        env = children.environment()
        self.processes = WorkerProcesses(cfg, cfg.broker, env, name=cfg.name, direct=direct_endpoint(cfg, env),
                                         presence_dir=self.tmp)
        self.devices = {wid: c.argv[c.argv.index("--device") + 1] for wid, c in self.processes.children.items()}
        self.stopping = False
        self.observer: HostObserver | None = None
        self.http = None                # broker.ops_http.MetricsServer, with --http
        self.viewed = 0.0

    def run(self) -> int:
        def on_signal(signum, _frame):
            if not self.stopping:
                log.info("received %s: draining this host's workers", signal.Signals(signum).name)
            self.stopping = True

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        try:
            if self.cfg.http and not self._serve_http():
                return contract.EXIT_CONFIG
            ids = ", ".join(self.processes.children)
            log.info("workers %s joining the broker at %s", ids, self.cfg.broker)
            self.processes.start_all()
            code = self._supervise()
            self._view(force=True)
            self.processes.stop()
            log.info("this host's workers stopped")
            return code
        finally:
            if self.http is not None:
                self.http.close()
            shutil.rmtree(self.tmp, ignore_errors=True)

    def _supervise(self) -> int:
        """Until told to stop (0), or until no worker can start (78)."""
        while not self.stopping:
            self.processes.reap(self.stopping)
            if self.processes.none_can_start():
                log.error("no worker can start (configuration errors); stopping")
                return contract.EXIT_CONFIG
            self.processes.restart_due()
            self._view()
            time.sleep(0.1)
        return contract.EXIT_OK

    def _view(self, force: bool = False) -> None:
        """This host's view for --http, once a second (each worker's presence file read here, not at scrape time)."""
        now = time.monotonic()
        if self.observer is None or (now - self.viewed < VIEW_EVERY_S and not force):
            return
        self.viewed = now
        self.observer.update(HostView(self.processes.states(), self.devices, self.processes.restarts(),
                                      self.stopping))

    def _serve_http(self) -> bool:
        """Bind --http before any worker starts: a taken port fails at once instead of a host without health."""
        from .ops_http import MetricsServer
        self.observer = HostObserver()
        try:
            self.http = MetricsServer(self.cfg.http, self.observer)
        except (OSError, ValueError) as e:
            log.error("cannot serve --http %s: %s", self.cfg.http, e)
            return False
        self._view(force=True)
        return True
