"""deploy/: what an orchestrator runs must be what the pool is.

Every Kubernetes manifest, systemd unit and Grafana dashboard is parsed; every `laya-pool` command line in them goes
through the CLI's own parser (broker/cli.py `build_parser`); the probes and scrape annotations are on the port of the
command's `--http`, the workers reach the broker's backend through a Service that exists, and each role mounts the keys
it needs; every metric a dashboard panel queries, and every label it selects or groups by, is one that a running CPU
pool exports (`laya-pool broker --http` and `laya-pool workers --http`, scraped after a few requests). A planted
unknown metric is found, so none can drift.
"""
from __future__ import annotations

import configparser
import json
import re
import shlex
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from conftest import ROOT, SUBPROCESS_ENV, free_port, wait_until
from prometheus_client.parser import text_string_to_metric_families

from laya_pool import Client, PoolError
from laya_pool.broker import cli
from laya_pool.protocol import contract

yaml = pytest.importorskip("yaml")

DEPLOY = ROOT / "deploy"
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
UNITS = sorted((DEPLOY / "systemd").glob("*.service"))
DASHBOARDS = sorted((DEPLOY / "grafana").glob("*.json"))
# What the kubelet puts in place of $(NAME) in a container's command line (from the downward API): sample values.
DOWNWARD = {"spec.nodeName": "gpu-node-1", "status.podIP": "10.0.0.5"}
# The files each role reads from its --keys directory (broker/security.py).
KEY_FILES = {"broker": {"server.key", "server.key_secret", "authorized/client.key", "authorized-workers/worker.key",
                        "authorized-operators/operator.key"},
             "workers": {"server.key", "worker.key", "worker.key_secret", "authorized/client.key"}}


def test_there_is_something_to_test():
    assert MANIFESTS and len(UNITS) == 2 and DASHBOARDS


# ------------------------------------------------------------------------------------------------ the manifests

def _docs() -> list[tuple[str, dict]]:
    return [(p.name, d) for p in MANIFESTS for d in yaml.safe_load_all(p.read_text()) if d]


def _pods() -> list[tuple[str, dict, dict]]:
    """(where, the workload, its pod template) of each Deployment and DaemonSet."""
    return [(f"{name}: {d['kind']} {d['metadata']['name']}", d, d["spec"]["template"]) for name, d in _docs()
            if d["kind"] in ("Deployment", "DaemonSet")]


def _expand(arg: str, env: list[dict]) -> str:
    """`$(NAME)` as the kubelet expands it, from the container's own env (a name it does not define stays, as there)."""
    values = {e["name"]: e.get("value", DOWNWARD.get(e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")))
              for e in env}
    return re.sub(r"\$\((\w+)\)", lambda m: str(values.get(m.group(1), m.group(0))), arg)


def _unit(path: Path) -> configparser.ConfigParser:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str
    unit.read_string(path.read_text())
    return unit


def _command_lines() -> list[tuple[str, list[str], dict | None]]:
    """(where, argv, the container or None) of every command line in deploy/."""
    out = []
    for where, _, pod in _pods():
        for c in pod["spec"]["containers"]:
            argv = [_expand(str(a), c.get("env", [])) for a in c.get("command", []) + c.get("args", [])]
            out.append((f"{where} container {c['name']}", argv, c))
    for unit in UNITS:
        out.append((unit.name, shlex.split(_unit(unit)["Service"]["ExecStart"]), None))
    return out


def _parse(argv: list[str]) -> object:
    assert Path(argv[0]).name == "laya-pool", argv
    try:
        return cli.build_parser().parse_args(argv[1:])
    except SystemExit as e:
        pytest.fail(f"`{shlex.join(argv)}` does not parse (exit {e.code})")


@pytest.mark.parametrize("where,argv,container", _command_lines(), ids=lambda x: x if isinstance(x, str) else "")
def test_every_command_line_parses(where, argv, container):
    a = _parse(argv)
    assert a.command in ("broker", "workers"), where
    if a.command == "workers":
        assert len(cli._devices(a.devices)) >= 1 and cli.worker_name(a.name)
        assert not a.broker.startswith("tcp://") or a.keys, f"{where}: --broker over tcp needs --keys"
    assert a.keys and a.http and a.http.startswith("0.0.0.0:"), f"{where}: keys, and --http on every address"


def test_the_parser_refuses_a_planted_mistake():
    with pytest.raises(pytest.fail.Exception, match="does not parse"):
        _parse(["laya-pool", "workers", "--broker", "tcp://broker:5556", "--model", "/m", "--worker-per-device", "2"])


@pytest.mark.parametrize("where,workload,pod", _pods(), ids=lambda x: x if isinstance(x, str) else "")
def test_probes_and_scrape_annotations_are_on_the_http_port(where, workload, pod):
    (c,) = pod["spec"]["containers"]
    a = _parse([_expand(str(x), c.get("env", [])) for x in c["command"] + c["args"]])
    port = int(a.http.rsplit(":", 1)[1])
    assert c["livenessProbe"]["httpGet"] == {"path": "/health/live", "port": port}, where
    assert c["readinessProbe"]["httpGet"] == {"path": "/health/ready", "port": port}, where
    assert pod["metadata"]["annotations"] == {"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
                                              "prometheus.io/path": "/metrics"}, where
    assert port in [p["containerPort"] for p in c["ports"]], where
    assert workload["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items(), where
    assert pod["spec"]["terminationGracePeriodSeconds"] > (getattr(a, "drain_timeout", 0) or 0), where


def test_each_role_mounts_the_keys_it_reads():
    for where, _, pod in _pods():
        (c,) = pod["spec"]["containers"]
        a = _parse([_expand(str(x), c.get("env", [])) for x in c["command"] + c["args"]])
        mount = next(m for m in c["volumeMounts"] if m["mountPath"] == a.keys)
        volume = next(v for v in pod["spec"]["volumes"] if v["name"] == mount["name"])
        assert {i["path"] for i in volume["secret"]["items"]} >= KEY_FILES[a.command], where
        assert mount.get("readOnly") and volume["secret"]["defaultMode"] == 0o400, where


def test_the_workers_reach_the_brokers_backend_through_a_service_that_lists_it_unready():
    docs = _docs()
    services = {d["metadata"]["name"]: d for _, d in docs if d["kind"] == "Service"}
    (broker,) = [(d, pod) for _, d, pod in _pods() if d["kind"] == "Deployment"]
    bc = broker[1]["spec"]["containers"][0]
    backend_port = int(_parse(bc["command"] + bc["args"]).backend.rsplit(":", 1)[1])
    (workers,) = [pod for _, d, pod in _pods() if d["kind"] == "DaemonSet"]
    wc = workers["spec"]["containers"][0]
    a = _parse([_expand(str(x), wc.get("env", [])) for x in wc["command"] + wc["args"]])
    host, port = a.broker[len("tcp://"):].rsplit(":", 1)
    svc = services[host]
    (sp,) = [p for p in svc["spec"]["ports"] if p["port"] == int(port)]
    named = {p["name"]: p["containerPort"] for p in bc["ports"]}
    assert named[sp["targetPort"]] == backend_port
    assert svc["spec"]["selector"].items() <= broker[1]["metadata"]["labels"].items()
    assert svc["spec"]["publishNotReadyAddresses"] is True     # the broker is ready only once a worker is
    assert wc["resources"]["limits"]["nvidia.com/gpu"] == len(cli._devices(a.devices))
    assert a.name == DOWNWARD["spec.nodeName"] and a.direct_host == DOWNWARD["status.podIP"]


def test_the_kustomization_lists_every_manifest():
    k = yaml.safe_load((DEPLOY / "kubernetes" / "kustomization.yaml").read_text())
    assert sorted(k["resources"]) == sorted(p.name for p in MANIFESTS if p.name != "kustomization.yaml")


# ------------------------------------------------------------------------------------------------ the units

@pytest.mark.parametrize("path", UNITS, ids=lambda p: p.name)
def test_units_stop_gracefully_and_do_not_restart_what_cannot_start(path):
    s = _unit(path)["Service"]
    assert s["KillSignal"] == "SIGTERM" and s["KillMode"] == "mixed"      # the supervisor drains its children
    assert {int(c) for c in s["RestartPreventExitStatus"].split()} == {contract.EXIT_USAGE, contract.EXIT_CONFIG}
    a = _parse(shlex.split(s["ExecStart"]))
    assert float(s["TimeoutStopSec"]) > getattr(a, "drain_timeout", 0)
    assert _unit(path)["Install"]["WantedBy"] == "multi-user.target"


# ------------------------------------------------------------------------------------------------ the dashboards

SELECTOR = re.compile(r"\b(laya_pool_[A-Za-z0-9_]+)(\{[^}]*\})?")
LABEL = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")


def queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, expression) of every target of every panel (rows' panels too)."""
    panels = [p for top in dashboard["panels"] for p in [top, *top.get("panels", [])]]
    return [(p["title"], t["expr"]) for p in panels for t in p.get("targets", [])]


def unknown(dashboard: dict, exported: dict[str, set[str] | None]) -> list[str]:
    """What a dashboard queries that the pool does not export: a series name, or a label of one. `exported`: every
    series name the pool's /metrics holds, with its labels (None: the family had no sample yet, its labels unknown)."""
    out = []
    for title, expr in queries(dashboard):
        names = []
        for name, selector in SELECTOR.findall(expr):
            if name not in exported:
                out.append(f"{title}: {name} is not exported")
                continue
            names.append(name)
            for label in LABEL.findall(selector or ""):
                if exported[name] is not None and label not in exported[name]:
                    out.append(f"{title}: {name} has no label {label!r}")
        known = [exported[n] for n in names if exported[n] is not None]
        for group in GROUPING.findall(expr):
            for label in filter(None, (g.strip() for g in group.split(","))):
                if known and not any(label in labels for labels in known):
                    out.append(f"{title}: no series of `{expr}` has the label {label!r}")
    return out


def _series(text: str) -> dict[str, set[str] | None]:
    """Every series name of a /metrics text, with its label names; a family without samples by the names its type
    gives (a counter's _total, a histogram's _bucket, _sum and _count), labels unknown."""
    out: dict[str, set[str] | None] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, set()).update(s.labels)
        if not fam.samples:
            suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(fam.type, ("",))
            out.update({fam.name + x: None for x in suffixes})
    return out


def _scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as r:
        return r.read().decode()


@pytest.fixture(scope="module")
def exported(tiny_ckpt, tmp_path_factory) -> dict[str, set[str] | None]:
    """The series a running CPU pool exports: a `laya-pool broker --http` and a `laya-pool workers --http` with one
    worker, after a few requests (histograms and per-worker counters appear with traffic)."""
    d = tmp_path_factory.mktemp("deploy-pool")
    frontend, backend = f"tcp://127.0.0.1:{free_port()}", f"ipc://{d}/backend"
    broker_http, host_http = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    log = open(d / "pool.log", "wb")
    procs = [subprocess.Popen([sys.executable, "-m", "laya_pool", "broker", "--frontend", frontend, "--backend",
                               backend, "--heartbeat-ms", "200", "--http", broker_http], env=SUBPROCESS_ENV, cwd=ROOT,
                              stdout=log, stderr=subprocess.STDOUT),
             subprocess.Popen([sys.executable, "-m", "laya_pool", "workers", "--broker", backend, "--model",
                               str(tiny_ckpt), "--name", "h", "--heartbeat-ms", "200", "--threads", "1", "--http",
                               host_http], env=SUBPROCESS_ENV, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)]
    try:
        with Client(frontend, timeout=5.0) as c:
            wait_until(lambda: any(w["state"] == "ready" for w in c.status()["workers"]), 90, "no worker got ready",
                       interval=0.3, ignore=(PoolError,))
            for i in range(4):
                c.predict(f"ticket {i}: the printer on floor {i} is broken", {"team": {
                    "type": "choice", "instructions": "which team handles it?", "criteria": ["it", "facilities"]}})
        wait_until(lambda: "laya_pool_worker_answer_seconds_bucket" in _scrape(broker_http), 10,
                   "the broker's metrics did not show the requests")
        series = _series(_scrape(broker_http))
        series.update(_series(_scrape(host_http)))
        return series
    finally:
        for p in procs[::-1]:
            p.terminate()
            p.wait(20)
        log.close()


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_panel_queries_what_the_pool_exports(path, exported):
    dashboard = json.loads(path.read_text())
    assert queries(dashboard), "a dashboard without queries"
    assert unknown(dashboard, exported) == []
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(set(ids)) == len(ids)
    assert all(t["datasource"]["uid"] == "${datasource}" for p in dashboard["panels"] for t in p["targets"])


def test_a_planted_unknown_metric_or_label_is_found(exported):
    dashboard = json.loads(DASHBOARDS[0].read_text())
    dashboard["panels"].append({"id": 99, "title": "planted", "targets": [
        {"expr": "sum(rate(laya_pool_decisions_made_total[5m]))"},
        {"expr": 'sum by (state) (laya_pool_workers{status="ready"})'},
        {"expr": "sum by (gpu) (rate(laya_pool_worker_busy_seconds_total[5m]))"}]})
    assert unknown(dashboard, exported) == [
        "planted: laya_pool_decisions_made_total is not exported",
        "planted: laya_pool_workers has no label 'status'",
        "planted: no series of `sum by (gpu) (rate(laya_pool_worker_busy_seconds_total[5m]))` has the label 'gpu'"]
