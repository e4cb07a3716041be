"""dashboards/ and train/export.py: the Grafana dashboard queries only what recgrid exports, and
what recgrid exports reaches a real Ray node's metrics endpoint under those names."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from recgrid.launch.local import free_port
from recgrid.train import export
from recgrid.train.export import METRICS, RAY_PREFIX, RayMetricsExporter, exported_names, metric_by_exported_name, resolve

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "dashboards" / "recgrid.json"
PROVISIONING = ROOT / "dashboards" / "provisioning"
# labels Ray puts on every user metric series, next to the metric's own tag keys
RAY_LABELS = {"Component", "NodeAddress", "SessionName", "Version", "WorkerId", "instance", "job"}
# what the dashboard must show (issue 8): QPS, step-time split, sync seconds and bytes, lookup
# imbalance, per-worker memory, training NE, recovery events
REQUIRED = {"ray_recgrid_train_qps", "ray_recgrid_phase_seconds", "ray_recgrid_train_step_seconds",
            "ray_recgrid_sync_seconds", "ray_recgrid_sync_bytes", "ray_recgrid_lookup_imbalance",
            "ray_recgrid_worker_memory_peak_bytes", "ray_recgrid_train_ne", "ray_recgrid_recovery_count",
            "ray_recgrid_recovery_seconds", "ray_recgrid_recovery_steps_lost"}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _queries(dash: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every panel target and query variable."""
    out = [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            out.append((f"${var['name']}", q))
    return out


def _metric_names(expr: str) -> set[str]:
    bare = re.sub(r"\{[^}]*\}", "{}", expr)  # label matchers hold no metric names
    return {m for m in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", bare) if m.startswith(RAY_PREFIX)}


# ---- the dashboard, statically ---------------------------------------------------------------
def test_dashboard_is_grafana_json_with_panels_and_targets():
    dash = _dashboard()
    assert dash["title"] and dash["uid"] and isinstance(dash["schemaVersion"], int)
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "run"} <= variables
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    graphs = [p for p in dash["panels"] if p["type"] != "row"]
    assert len(graphs) >= 10
    for p in dash["panels"]:
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in "hwxy") and 0 < g["w"] and g["x"] + g["w"] <= 24, p["title"]
    for p in graphs:
        assert p["type"] in ("timeseries", "stat", "gauge", "bargauge", "table"), p["title"]
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], f"panel {p['title']!r} has no query"
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
            for var in re.findall(r"\$(\w+)", t["expr"] + t.get("legendFormat", "")):
                assert var in variables or var.startswith("__"), f"{p['title']}: ${var} is not a dashboard variable"


def test_every_queried_metric_is_declared_in_export_with_its_labels():
    declared = metric_by_exported_name()
    queried: set[str] = set()
    for title, expr in _queries(_dashboard()):
        names = _metric_names(expr)
        assert names, f"{title}: queries no recgrid metric: {expr}"
        unknown = names - declared.keys()
        assert not unknown, f"{title}: {sorted(unknown)} not declared in recgrid/train/export.py"
        queried |= names
        labels = set().union(*(declared[n].tag_keys for n in names)) | RAY_LABELS
        used = {m.group(1) for block in re.findall(r"\{([^}]*)\}", expr)
                for m in re.finditer(r"(\w+)\s*(?:=~|!~|!=|=)", block)}
        for group in re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", expr):
            used |= {x.strip() for x in group.split(",") if x.strip()}
        if expr.startswith("label_values("):
            used |= {expr.rstrip(")").split(",")[-1].strip()}
        assert used <= labels, f"{title}: labels {sorted(used - labels)} are on none of {sorted(names)}"
    missing = REQUIRED - queried
    assert not missing, f"the dashboard shows nothing of {sorted(missing)}"


def test_provisioning_adds_to_rays_and_overwrites_nothing():
    from ray.dashboard.modules.metrics import templates

    rays_provisioning = templates.DASHBOARD_PROVISIONING_TEMPLATE.format(dashboard_output_folder="/x")
    rays_provider = yaml.safe_load(rays_provisioning)["providers"][0]
    rays_datasource = yaml.safe_load(templates.GRAFANA_DATASOURCE_TEMPLATE("Prometheus", "http://x", {}, {}))["datasources"][0]
    providers = yaml.safe_load((PROVISIONING / "dashboards" / "recgrid.yaml").read_text())["providers"]
    datasources = yaml.safe_load((PROVISIONING / "datasources" / "recgrid.yaml").read_text())["datasources"]
    files = {p.name for p in PROVISIONING.rglob("*.y*ml")}
    assert "default.yml" not in files, "Ray writes provisioning/*/default.yml; ours must not replace it"
    assert all(p["name"] != rays_provider["name"] and p["folder"] != rays_provider["folder"] for p in providers)
    (ds,) = datasources
    assert ds["type"] == "prometheus" and ds["name"] != rays_datasource["name"]
    assert rays_datasource["isDefault"] and not ds.get("isDefault"), "two default datasources make Grafana refuse both"
    picker = next(v for v in _dashboard()["templating"]["list"] if v["name"] == "datasource")
    assert picker["type"] == "datasource" and picker["query"] == "prometheus"  # Ray's datasource works too
    assert picker["current"]["value"] == ds["uid"]


# ---- the declarations -------------------------------------------------------------------------
def test_declared_metrics_are_valid_unique_prometheus_names():
    names = [m.name for m in METRICS]
    assert len(names) == len(set(names)) and len({m.key for m in METRICS}) == len(METRICS)
    for m in METRICS:
        assert re.fullmatch(r"recgrid_[a-z0-9_]+", m.name) and not m.name.endswith("_total"), m.name
        assert m.description.endswith(".") and m.scope in ("job", "worker")
        assert ("rank" in m.tag_keys) == (m.scope == "worker")


def test_the_trainers_metric_keys_resolve():
    """The keys `reduce_metrics` really returns (and the phases the trainer times) are exported."""
    import torch

    from recgrid.train.metrics import PHASES, TrainMetrics, reduce_metrics

    phases = tuple(dict.fromkeys(PHASES + ("lookup_kernel",)))  # the trainer's one phase list
    m = TrainMetrics(window_steps=4, phases=phases, imbalance_phase="lookup_kernel")
    m.timer.add("lookup", 0.5)
    m.timer.add("lookup_kernel", 0.25)
    m.update(torch.tensor([0.2, 0.7, 0.4]), torch.tensor([0.0, 1.0, 1.0]), loss=0.5)
    values = reduce_metrics(train=m)
    wanted = [k for k in values if k.split("/")[0] in ("time", "imbalance", "memory")
              or k in ("train/qps", "train/step_time_s", "train/ne", "train/loss", "train/examples_total")]
    assert len(wanted) >= 2 * len(phases) + 6
    for key in wanted:
        assert resolve(key) is not None, f"{key} is logged to MLflow but not exported"
    metric, tags = resolve("time/lookup_kernel_s_max")
    assert metric.name == "recgrid_phase_seconds_max" and tags == {"phase": "lookup_kernel"}
    assert resolve("time/interval_s")[0].name == "recgrid_interval_seconds"  # not a phase called "interval"
    assert resolve("eval/logloss") is None


def test_export_without_ray_is_a_no_op():
    import ray

    if ray.is_initialized():
        pytest.skip("an earlier test left Ray initialised in this process")
    before = dict(export._GAUGES)
    RayMetricsExporter("r", 0).export({"train/qps": 1.0, "memory/peak_mb": 2.0}, 1)
    assert export._GAUGES == before and not ray.is_initialized()


# ---- the real endpoint ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def metrics_port():
    import ray

    port = free_port()
    # address="local": a new cluster of our own even when another one runs on this machine
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False, _metrics_export_port=port,
             _system_config={"metrics_report_interval_ms": 1000})
    try:
        yield port
    finally:
        ray.shutdown()


def _scrape(port: int) -> dict[str, list[tuple[dict, float]]]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    series: dict[str, list[tuple[dict, float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series.setdefault(sample.name, []).append((sample.labels, sample.value))
    return series


def _full_dict() -> dict[str, float]:
    values = {}
    for i, m in enumerate(METRICS):
        if m.key == "step":
            continue
        keys = [m.key.replace("{phase}", p) for p in ("lookup", "dense", "sync", "data_wait")] if "{" in m.key else [m.key]
        for k in keys:
            values[k] = 1.0 + i
    return values


@pytest.fixture(scope="module")
def exporting(metrics_port):
    """Two Ray actors, ranks 0 and 1, that exported a dict holding every declared metric at step
    40 (kept alive: a dead worker's series leave the endpoint). Returns the dict."""
    import ray

    @ray.remote(num_cpus=0)
    class Worker:
        def __init__(self, rank: int) -> None:
            self.exporter = RayMetricsExporter("run-abc", rank, run_name="T2-M2-K1", node=f"pod-{rank}")

        def log(self, values: dict, step: int) -> int:
            self.exporter.export(values, step)
            return self.exporter.failures

    values = _full_dict()
    workers = [Worker.remote(rank) for rank in (0, 1)]
    assert ray.get([w.log.remote(values, 40) for w in workers]) == [0, 0]
    yield values
    for w in workers:
        ray.kill(w)


def test_exported_metrics_reach_the_nodes_metrics_endpoint_under_the_dashboards_names(metrics_port, exporting):
    values = exporting
    queried = set().union(*(_metric_names(e) for _, e in _queries(_dashboard())))
    deadline, series = time.monotonic() + 60, {}
    while time.monotonic() < deadline:
        series = _scrape(metrics_port)
        if queried <= series.keys() and len(series.get("ray_recgrid_sync_bytes", [])) == 2:
            break
        time.sleep(0.5)
    missing = queried - series.keys()
    assert not missing, f"the dashboard queries names the endpoint does not serve: {sorted(missing)}"
    assert exported_names() <= series.keys()

    def one(name, **labels):
        found = [(lab, v) for lab, v in series[name] if all(lab.get(k) == v for k, v in labels.items())]
        assert len(found) == 1, (name, labels, series[name])
        return found[0]

    labels, value = one("ray_recgrid_train_step")
    assert value == 40 and labels["run_id"] == "run-abc" and labels["run_name"] == "T2-M2-K1"
    assert len(series["ray_recgrid_train_qps"]) == 1 and "rank" not in series["ray_recgrid_train_qps"][0][0]  # rank 0 only
    by_key = {m.key: m for m in METRICS}
    mem = by_key["memory/peak_mb"]
    for rank in (0, 1):  # worker metrics: every rank, tagged, in bytes
        labels, value = one(mem.exported_name, rank=str(rank))
        assert labels["node"] == f"pod-{rank}" and value == values["memory/peak_mb"] * 2**20
    phases = {lab["phase"] for lab, _ in series["ray_recgrid_phase_seconds"]}
    assert phases == {"lookup", "dense", "sync", "data_wait"}
    assert one("ray_recgrid_phase_seconds", phase="sync")[1] == values["time/sync_s"]


def test_export_never_raises_into_training(metrics_port, caplog):
    exporter = RayMetricsExporter("run-bad", 0)
    with caplog.at_level(logging.WARNING, logger=export.__name__):
        exporter.export(None, 1)  # type: ignore[arg-type]  # a bug in the caller
        exporter.export({"train/qps": object()}, 2)  # not a number: skipped
        exporter.export(None, 3)  # type: ignore[arg-type]
        exporter.export({"train/qps": math.nan, "train/ne": "n/a", "no/such_key": 1.0}, 4)
    assert exporter.failures == 2
    assert len([r for r in caplog.records if "exporting metrics to Ray failed" in r.getMessage()]) == 1


def require_tool(name: str) -> None:
    """Skip where the binary `name` is missing (`make tools` installs it), but fail under CI=true:
    CI runs every test."""
    if shutil.which(name) is None:
        why = f"no {name} binary (`make tools` installs Debian's prometheus package)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{why}; CI=true runs every test")
        pytest.skip(why)


def test_dashboard_queries_answer_on_a_real_prometheus(metrics_port, exporting, tmp_path):
    """Every dashboard query, run by a real Prometheus scraping the Ray node: it parses and
    returns series, and the step-time split is the phase's share of the interval times the step time."""
    require_tool("prometheus")
    port = free_port()
    (tmp_path / "prometheus.yml").write_text(
        f"global:\n  scrape_interval: 1s\nscrape_configs:\n- job_name: ray\n  static_configs:\n"
        f"  - targets: ['127.0.0.1:{metrics_port}']\n")
    prom = subprocess.Popen(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--web.listen-address=127.0.0.1:{port}", f"--storage.tsdb.path={tmp_path / 'data'}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    api = f"http://127.0.0.1:{port}/api/v1"

    def query(expr: str) -> list[dict]:
        reply = json.load(urllib.request.urlopen(f"{api}/query?query=" + urllib.parse.quote(expr), timeout=5))
        assert reply["status"] == "success", (expr, reply)
        return reply["data"]["result"]

    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if query("ray_recgrid_worker_memory_peak_bytes") and query("ray_recgrid_train_step"):
                    break
            except OSError:
                pass  # not listening yet
            time.sleep(0.5)
        for title, expr in _queries(_dashboard()):
            if expr.startswith("label_values("):
                metric, label = (x.strip() for x in expr[len("label_values("):-1].split(","))
                url = f"{api}/label/{label}/values?match[]={urllib.parse.quote(metric)}"
                got = json.load(urllib.request.urlopen(url, timeout=5))
                assert "T2-M2-K1" in got["data"], title
                continue
            assert query(expr.replace("$run", "T2-M2-K1")), f"{title}: no series for {expr}"
        (split,) = [p["targets"][0]["expr"] for p in _dashboard()["panels"] if p["title"].startswith("Step time split")]
        got = {r["metric"]["phase"]: float(r["value"][1]) for r in query(split.replace("$run", "T2-M2-K1"))}
        v = exporting
        assert got["lookup"] == pytest.approx(v["time/lookup_s"] / v["time/interval_s"] * v["train/step_time_s"])
    finally:
        prom.terminate()
        prom.wait(timeout=30)


def test_readme_describes_every_panel_of_the_dashboard():
    """dashboards/README.md's panel table lists exactly the dashboard's panels, under their rows."""
    readme = (ROOT / "dashboards" / "README.md").read_text()
    table = readme.split("<!-- panels:", 1)[1]
    documented = {tuple(c.strip() for c in line.strip("|").split("|")[:2])
                  for line in table.splitlines() if line.startswith("| ") and not line.startswith("| row")}
    panels, row = set(), None
    for p in _dashboard()["panels"]:
        if p["type"] == "row":
            row = p["title"]
        else:
            panels.add((row, p["title"]))
    assert documented == panels


def test_local_prometheus_config_is_valid_and_finds_ray_nodes():
    """The local recipe's config passes Prometheus' own check and discovers nodes through the file
    Ray writes."""
    require_tool("promtool")
    from ray._private.ray_constants import PROMETHEUS_SERVICE_DISCOVERY_FILE

    path = ROOT / "dashboards" / "prometheus" / "local.yaml"
    check = subprocess.run(["promtool", "check", "config", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"/tmp/ray/{PROMETHEUS_SERVICE_DISCOVERY_FILE}" in path.read_text()


def test_readme_grafana_recipe_listens_on_loopback_with_a_password_from_the_environment():
    """The local recipe's Grafana (host network) serves 127.0.0.1 only, never admin/admin."""
    readme = (ROOT / "dashboards" / "README.md").read_text()
    (recipe,) = [block for block in readme.split("```")[1::2] if "grafana/grafana-oss" in block]
    assert "-e GF_SERVER_HTTP_ADDR=127.0.0.1" in recipe
    assert "-e GF_SECURITY_ADMIN_PASSWORD " in recipe and "GF_SECURITY_ADMIN_PASSWORD=" not in recipe.split("docker run")[1]
    assert "admin/admin" not in readme
