"""k8s/: every manifest validates, and the lock-down, the job wiring and the image are checked.

Core objects are validated strictly with kubernetes-validate; KubeRay objects with jsonschema
against KubeRay 1.7's CRD schemas (made strict: the API server would silently prune an unknown
field), and the pod templates inside them strictly as Kubernetes PodTemplates. The rest reads the
manifests the way the cluster would: which pods a NetworkPolicy selects and admits, which
container runs as whom, where each secret comes from, what the RayJob's command does.
"""

from __future__ import annotations

import copy
import gzip
import hashlib
import ipaddress
import json
import math
import os
import re
import shlex
from fractions import Fraction
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from recgrid.cli import build_parser
from recgrid.config import load_config
from recgrid.engine.grid import Grid

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "k8s"
EXAMPLES = K8S / "examples"  # not applied: k8s/README.md applies k8s/*.yaml
SCHEMAS = K8S / "schemas" / "kuberay-v1.7.0"  # KubeRay's CRDs, gzip-compressed (its README.md: source, license)
K8S_VERSION = "1.33.0"  # the oldest Kubernetes the manifests are checked against
NAMESPACE = "recgrid"
CRD_FILES = {"RayCluster": "ray.io_rayclusters.yaml.gz", "RayJob": "ray.io_rayjobs.yaml.gz"}
# labels KubeRay puts on the pods it creates, next to the template's own
KUBERAY_POD_LABELS = {"head": {"ray.io/node-type": "head", "ray.io/is-ray-node": "yes"},
                      "worker": {"ray.io/node-type": "worker", "ray.io/is-ray-node": "yes"}}
SECRET_NAME = re.compile(r"PASSWORD|TOKEN|SECRET|CREDENTIAL|(^|_)KEY$", re.I)


# ---- loading --------------------------------------------------------------------------------
def _load(directory: Path = K8S) -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(directory.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs.append((path.name, doc))
    return docs


DOCS = _load()
EXAMPLE_DOCS = _load(EXAMPLES)


def _kind(kind: str) -> list[dict]:
    return [d for _, d in DOCS if d["kind"] == kind]


def _ids(docs):
    return [f"{f}:{d['kind']}/{d['metadata']['name']}" for f, d in docs]


@pytest.fixture(scope="module")
def crd_schemas() -> dict[str, dict]:
    out = {}
    for kind, name in CRD_FILES.items():
        text = gzip.decompress((SCHEMAS / name).read_bytes())
        assert hashlib.sha256(text).hexdigest() in (SCHEMAS / "README.md").read_text(), f"{name}: not the README's file"
        crd = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
        out[kind] = _strict(v1["schema"]["openAPIV3Schema"])
    return out


def _strict(schema):
    """The CRD schema with unknown fields refused where the schema lists the fields."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def _pod_templates(doc: dict) -> list[tuple[str, dict]]:
    """(role, pod template) of every pod an object makes: 'head', 'worker', 'submitter' or 'pod'."""
    spec = doc.get("spec", {})
    if doc["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        return [("pod", spec["template"])]
    if doc["kind"] == "RayCluster":
        return _ray_templates(spec)
    if doc["kind"] == "RayJob":
        out = _ray_templates(spec["rayClusterSpec"])
        if "submitterPodTemplate" in spec:
            out.append(("submitter", spec["submitterPodTemplate"]))
        return out
    return []


def _ray_templates(spec: dict) -> list[tuple[str, dict]]:
    return [("head", spec["headGroupSpec"]["template"])] + [("worker", g["template"]) for g in spec["workerGroupSpecs"]]


def _ray_specs() -> list[tuple[str, dict]]:
    return ([(c["metadata"]["name"], c["spec"]) for c in _kind("RayCluster")]
            + [(j["metadata"]["name"], j["spec"]["rayClusterSpec"]) for j in _kind("RayJob")])


POD_TEMPLATES = [(f"{d['metadata']['name']}/{role}", t) for _, d in DOCS for role, t in _pod_templates(d)]


def _cluster_of(doc: dict) -> str | None:
    """The `ray.io/cluster` KubeRay labels a Ray object's pods with: a RayCluster's name, or for a
    RayJob the cluster it creates, named `<rayjob>-<5 random characters>`."""
    name = doc["metadata"]["name"]
    return {"RayCluster": name, "RayJob": f"{name}-x7k2q"}.get(doc["kind"])


# ---- schema validation ------------------------------------------------------------------------
def test_manifests_exist():
    kinds = {d["kind"] for _, d in DOCS}
    assert {"Namespace", "ServiceAccount", "ConfigMap", "PersistentVolumeClaim", "NetworkPolicy", "Deployment",
            "Service", "RayCluster", "RayJob"} <= kinds
    assert {n for _, d in DOCS if d["kind"] == "RayCluster" for n in [d["metadata"]["name"]]} >= {"recgrid-gpu", "recgrid-cpu"}


CORE = [x for x in DOCS + EXAMPLE_DOCS if x[1]["kind"] not in CRD_FILES]
KUBERAY = [x for x in DOCS if x[1]["kind"] in CRD_FILES]


@pytest.mark.parametrize("doc", [d for _, d in CORE], ids=_ids(CORE))
def test_core_objects_validate(doc):
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    if doc["kind"] != "Namespace":
        assert doc["metadata"].get("namespace") == NAMESPACE


@pytest.mark.parametrize("doc", [d for _, d in KUBERAY], ids=_ids(KUBERAY))
def test_kuberay_objects_validate(doc, crd_schemas):
    assert doc["apiVersion"] == "ray.io/v1"
    assert doc["metadata"].get("namespace") == NAMESPACE
    jsonschema.validate(doc, crd_schemas[doc["kind"]])
    for role, template in _pod_templates(doc):  # the embedded pods, as Kubernetes itself checks pods
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": role},
                                      "template": template}, K8S_VERSION, strict=True)


def test_strict_crd_schema_refuses_unknown_fields(crd_schemas):
    """The strictness above is real: a misspelt field fails."""
    cluster = copy.deepcopy(_kind("RayCluster")[0])
    cluster["spec"]["workerGroupSpecs"][0]["minReplica"] = 1
    with pytest.raises(jsonschema.ValidationError, match="minReplica"):
        jsonschema.validate(cluster, crd_schemas["RayCluster"])


# ---- locked down ----------------------------------------------------------------------------------
def test_services_are_cluster_ip_only():
    for svc in _kind("Service"):
        spec = svc["spec"]
        assert spec.get("type", "ClusterIP") == "ClusterIP", svc["metadata"]["name"]
        assert not spec.get("externalIPs") and not any("nodePort" in p for p in spec["ports"])
    for name, spec in _ray_specs():
        head = spec["headGroupSpec"]
        assert head.get("serviceType") == "ClusterIP", name  # KubeRay's head Service
        assert not head.get("enableIngress"), name


def _selects(selector: dict, labels: dict) -> bool:
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions") or []:
        k, op, values = e["key"], e["operator"], e.get("values", [])
        if op == "In" and labels.get(k) not in values:
            return False
        if op == "NotIn" and labels.get(k) in values:
            return False
        if op == "Exists" and k not in labels:
            return False
        if op == "DoesNotExist" and k in labels:
            return False
    return True


def _port_matches(ports, number: int, name: str | None) -> bool:
    if not ports:
        return True  # a rule without ports admits every port
    for p in ports:
        port = p.get("port")
        if port is None or port == number or (name is not None and port == name):
            return True
        if isinstance(port, int) and p.get("endPort") and port <= number <= p["endPort"]:
            return True
    return False


def admitted_peers(pod_labels: dict, port: int, port_name: str | None = None) -> list[dict] | None:
    """The NetworkPolicy peers that may reach `port` of a pod with `pod_labels` in NAMESPACE:
    None if no ingress policy selects the pod (everything may), [{}] if some rule has no `from`
    (anyone may), else the union of the matching rules' `from` peers."""
    selecting = [p for p in _kind("NetworkPolicy") if p["metadata"]["namespace"] == NAMESPACE
                 and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
                 and _selects(p["spec"]["podSelector"], pod_labels)]
    if not selecting:
        return None
    peers: list[dict] = []
    for policy in selecting:
        for rule in policy["spec"].get("ingress") or []:
            if _port_matches(rule.get("ports"), port, port_name):
                if not rule.get("from"):
                    return [{}]
                peers += rule["from"]
    return peers


def _in_namespace_only(peer: dict) -> bool:
    """A peer that can only be a pod of NAMESPACE: a podSelector without a namespaceSelector
    (the policy's own namespace), or a namespaceSelector pinned to NAMESPACE's name."""
    if "ipBlock" in peer or not peer:
        return False
    if "namespaceSelector" not in peer:
        return "podSelector" in peer
    ns = peer["namespaceSelector"]
    return (ns.get("matchLabels") or {}).get("kubernetes.io/metadata.name") == NAMESPACE and not ns.get("matchExpressions")


def _pod_labels(cluster: str | None, role: str, template: dict) -> dict:
    """A pod's labels: its template's, and KubeRay's for a Ray pod of `cluster`."""
    kuberay = {**KUBERAY_POD_LABELS[role], "ray.io/cluster": cluster} if role in KUBERAY_POD_LABELS else {}
    return {**(template.get("metadata", {}).get("labels") or {}), **kuberay}


# (what, labels) of every pod the manifests make
POD_LABELS = [(f"{d['metadata']['name']}/{role}", _pod_labels(_cluster_of(d), role, t))
              for _, d in DOCS for role, t in _pod_templates(d)]


def test_network_policy_admits_ray_and_mlflow_ports_only_from_the_namespace():
    heads = [labels for what, labels in POD_LABELS if labels.get("ray.io/node-type") == "head"]
    (mlflow,) = [d for d in _kind("Deployment") if d["metadata"]["name"] == "recgrid-mlflow"]
    mlflow_labels = mlflow["spec"]["template"]["metadata"]["labels"]
    mlflow_port = mlflow["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]
    cases = ([(h, 8265, "dashboard") for h in heads] + [(h, 6379, "gcs-server") for h in heads]
             + [(mlflow_labels, mlflow_port, "http")])
    for labels, port, name in cases:
        peers = admitted_peers(labels, port, name)
        assert peers is not None, f"no NetworkPolicy selects {labels}: port {port} is open to all"
        assert peers, f"port {port} of {labels} is closed to everyone, the namespace included"
        outside = [p for p in peers if not _in_namespace_only(p)]
        assert not outside, f"port {port} of {labels} is admitted from outside namespace {NAMESPACE}: {outside}"


def test_network_policy_semantics_are_checked():
    """The checker itself: a pod no policy selects is open, and an outside peer is caught."""
    assert _in_namespace_only({"podSelector": {}})
    assert not _in_namespace_only({"namespaceSelector": {}, "podSelector": {}})  # every namespace
    assert not _in_namespace_only({"ipBlock": {"cidr": "0.0.0.0/0"}})
    assert not _in_namespace_only({})
    # every pod is under the default deny: nothing is open by omission
    assert admitted_peers({"app.kubernetes.io/name": "anything-new"}, 8265) == []


CLUSTER_KEYS = ("ray.io/cluster", "recgrid.io/rayjob")  # a Ray pod's cluster: KubeRay's label, or its RayJob's


def _open_ingress(policy: dict) -> list[dict]:
    """The ingress rules of `policy` that list no ports and admit a peer not named by its Ray cluster."""
    named = lambda peer: any(k in ((peer.get("podSelector") or {}).get("matchLabels") or {}) for k in CLUSTER_KEYS)  # noqa: E731
    return [r for r in policy["spec"].get("ingress") or [] if not r.get("ports") and not all(map(named, r.get("from") or [{}]))]


def test_ray_pods_admit_only_their_own_cluster_on_every_port():
    """torch's TCPStores and torchft's manager servers listen on every interface of a Ray pod: it
    admits, on every port, only pods of its own cluster (one policy per cluster); anyone else only
    on the ports a rule lists (the operator and the submitters the heads' dashboard port)."""
    ray_pods = [(w, labels) for w, labels in POD_LABELS if labels.get("app.kubernetes.io/name") == "ray"]
    policies = [p for p in _kind("NetworkPolicy") if "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
                and any(_selects(p["spec"]["podSelector"], labels) for _, labels in ray_pods)]
    for policy in policies:
        assert not _open_ingress(policy), f"{policy['metadata']['name']} admits on every port: {_open_ingress(policy)}"
    admits = lambda peers, labels: any("namespaceSelector" not in p and _selects(p["podSelector"], labels)  # noqa: E731
                                       for p in peers)
    for what, labels in ray_pods:
        for other, other_labels in ray_pods:  # 29500: any port no rule lists (a TCPStore's)
            same = labels["ray.io/cluster"] == other_labels["ray.io/cluster"]
            assert admits(admitted_peers(labels, 29500), other_labels) == same, f"{what} admits {other}: {not same}"
        head = labels["ray.io/node-type"] == "head"
        for client in (OPERATOR_LABELS, {"app.kubernetes.io/name": "ray-submitter"}):
            assert admits(admitted_peers(labels, 8265, "dashboard"), client) == head, (what, client)
            assert not admits(admitted_peers(labels, 6379, "gcs-server"), client), (what, client)
    assert _open_ingress({"spec": {"ingress": [{"from": [{"podSelector": {}}]}]}})  # the checker: the old rule
    assert not _open_ingress({"spec": {"ingress": [{"from": [{"podSelector": {}}], "ports": [{"port": 8080}]}]}})


def test_postgres_only_from_mlflow_and_metrics_from_monitoring():
    (pg,) = [d for d in _kind("Deployment") if d["metadata"]["name"] == "recgrid-postgres"]
    peers = admitted_peers(pg["spec"]["template"]["metadata"]["labels"], 5432, "postgres")
    assert peers and all(_in_namespace_only(p) for p in peers)
    (mlflow,) = [d for d in _kind("Deployment") if d["metadata"]["name"] == "recgrid-mlflow"]
    ray_head = _pod_labels("recgrid-cpu", "head", _kind("RayCluster")[0]["spec"]["headGroupSpec"]["template"])
    assert all(_selects(p["podSelector"], mlflow["spec"]["template"]["metadata"]["labels"]) for p in peers)
    assert not any(_selects(p["podSelector"], ray_head) for p in peers), "Ray pods may reach PostgreSQL"
    metrics = admitted_peers(ray_head, 8080, "metrics")
    assert any((p.get("namespaceSelector") or {}).get("matchLabels", {}).get("kubernetes.io/metadata.name") == "monitoring"
               for p in metrics), "Prometheus in namespace monitoring cannot scrape the Ray metrics port"


# ---- egress ---------------------------------------------------------------------------------------
METADATA_IP = ipaddress.ip_address("169.254.169.254")  # every cloud's instance metadata (credentials)
OPERATOR_LABELS = {"app.kubernetes.io/name": "kuberay-operator"}  # installed into the namespace (k8s/README.md, step 2)


def egress_rules(pod_labels: dict) -> list[dict] | None:
    """The egress rules that apply to a pod with `pod_labels`: None if no policy with Egress selects it
    (all egress open), else the union of the selecting policies' rules ([] = default deny)."""
    selecting = [p for p in _kind("NetworkPolicy") if "Egress" in p["spec"].get("policyTypes", [])
                 and _selects(p["spec"]["podSelector"], pod_labels)]
    if not selecting:
        return None
    return [r for p in selecting for r in p["spec"].get("egress") or []]


def admits_ip(rules: list[dict] | None, ip: str, port: int = 80) -> bool:
    """Whether the rules let a pod connect to `ip:port` outside the cluster (ipBlock peers only
    match such addresses; a rule without `to` matches every address)."""
    if rules is None:
        return True
    addr = ipaddress.ip_address(ip)
    for rule in rules:
        if not _port_matches(rule.get("ports"), port, None):
            continue
        if not rule.get("to"):
            return True
        for peer in rule["to"]:
            block = peer.get("ipBlock")
            if block and addr in ipaddress.ip_network(block["cidr"]) and not any(
                    addr in ipaddress.ip_network(e) for e in block.get("except", [])):
                return True
    return False


EGRESS_PODS = POD_LABELS + [("kuberay-operator", OPERATOR_LABELS)]


@pytest.mark.parametrize("what,labels", EGRESS_PODS, ids=[w for w, _ in EGRESS_PODS])
def test_egress_is_denied_by_default_and_never_reaches_cloud_metadata(what, labels):
    rules = egress_rules(labels)
    assert rules is not None, f"{what}: no egress policy selects it: all egress is open"
    if labels.get("app.kubernetes.io/name") == "postgres":
        assert rules == [], f"{what}: PostgreSQL has egress: {rules}"
        return
    for port in (80, 443, 53):
        assert not admits_ip(rules, str(METADATA_IP), port), f"{what}: may reach {METADATA_IP}:{port}"
    assert not admits_ip(rules, "8.8.8.8", 53) and not admits_ip(rules, "93.184.215.14", 80), f"{what}: open egress"
    for rule in rules:  # every exception names its peers
        assert rule.get("to"), f"{what}: an egress rule without `to` admits every address"
        for peer in rule["to"]:
            if "ipBlock" in peer:
                net = ipaddress.ip_network(peer["ipBlock"]["cidr"])
                excepted = [ipaddress.ip_network(e) for e in peer["ipBlock"].get("except", [])]
                if net.prefixlen == 0:
                    assert any(METADATA_IP in e for e in excepted), f"{what}: 0.0.0.0/0 without the metadata range excepted"
                    assert rule.get("ports"), f"{what}: 0.0.0.0/0 on every port"
    # DNS is the exception every pod has; the pods it reaches are named, never the whole namespace
    dns = [r for r in rules if _port_matches(r.get("ports"), 53, None) and r.get("ports") and any(
        (p.get("namespaceSelector") or {}).get("matchLabels", {}).get("kubernetes.io/metadata.name") == "kube-system"
        for p in r["to"])]
    assert dns, f"{what}: no DNS"
    assert not any(p.get("podSelector") == {} and "namespaceSelector" not in p for r in rules for p in r["to"]), \
        f"{what}: may reach every pod of the namespace"


def test_mlflow_egress_reaches_postgres_only():
    (mlflow,) = [d for d in _kind("Deployment") if d["metadata"]["name"] == "recgrid-mlflow"]
    rules = [r for r in egress_rules(mlflow["spec"]["template"]["metadata"]["labels"]) if 53 not in
             {p.get("port") for p in r.get("ports", [])}]
    assert rules and all(r.get("ports") == [{"port": 5432, "protocol": "TCP"}] and r["to"] == [
        {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "postgres"}}}] for r in rules), rules


def test_ray_pods_reach_only_the_named_object_storage():
    head = _pod_labels("recgrid-cpu", "head", _kind("RayCluster")[0]["spec"]["headGroupSpec"]["template"])
    rules = egress_rules(head)
    blocks = [ipaddress.ip_network(p["ipBlock"]["cidr"]) for r in rules for p in r["to"] if "ipBlock" in p]
    assert blocks and all(b.prefixlen > 0 for b in blocks), blocks  # named CIDRs, not the internet
    assert admits_ip(rules, str(blocks[0][1]), 443) and not admits_ip(rules, str(blocks[0][1]), 80)
    (mlflow,) = [d for d in _kind("Deployment") if d["metadata"]["name"] == "recgrid-mlflow"]
    assert not admits_ip(egress_rules(mlflow["spec"]["template"]["metadata"]["labels"]), str(blocks[0][1]), 443)


def test_egress_check_catches_open_rules():
    assert admits_ip([{"to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}]}], "169.254.169.254")
    assert not admits_ip([{"to": [{"ipBlock": {"cidr": "0.0.0.0/0", "except": ["169.254.0.0/16"]}}]}], "169.254.169.254")
    assert admits_ip([{}], "169.254.169.254") and admits_ip(None, "169.254.169.254")
    assert not admits_ip([{"to": [{"podSelector": {}}]}], "169.254.169.254")


def test_mlflow_admits_only_the_ray_pods_and_named_clients():
    (mlflow,) = [d for d in _kind("Deployment") if d["metadata"]["name"] == "recgrid-mlflow"]
    peers = admitted_peers(mlflow["spec"]["template"]["metadata"]["labels"], 5000, "http")
    assert peers and all(_in_namespace_only(p) for p in peers)
    admitted = lambda labels: any(_selects(p["podSelector"], labels) for p in peers)  # noqa: E731
    for what, labels in POD_LABELS:
        assert admitted(labels) == (labels.get("app.kubernetes.io/name") == "ray"), f"{what}: MLflow admits it: {admitted(labels)}"
    assert admitted({"recgrid.io/mlflow-client": "true"})
    assert not admitted({"app.kubernetes.io/name": "someone-elses-job"}) and not admitted(OPERATOR_LABELS)


# ---- MLflow behind authentication -----------------------------------------------------------------
def test_mlflow_server_with_the_manifests_auth_settings_refuses_anonymous_requests(mlflow_server):
    """A real `mlflow server`, with the manifest's arguments and auth config (only the addresses and
    stores moved to this machine: tests/mlflow_server.py): 401 without credentials or with a wrong
    password, 200 for the admin the Secret names, and an MLflow client authenticates with the env
    vars the Ray pods get."""
    (deploy,) = [d for d in _kind("Deployment") if d["metadata"]["name"] == "recgrid-mlflow"]
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    (config_map,) = [c for c in _kind("ConfigMap") if c["metadata"]["name"] == "recgrid-mlflow-auth"]
    env = {e["name"]: e for e in container["env"]}
    ini_name = env["MLFLOW_AUTH_CONFIG_PATH"]["value"].rsplit("/", 1)[-1]
    assert "--app-name=basic-auth" in container["args"]
    assert env["MLFLOW_AUTH_ADMIN_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "recgrid-mlflow-admin"
    assert "admin_password" not in config_map["data"][ini_name]  # the password comes from the Secret only

    path = "/api/2.0/mlflow/experiments/search?max_results=1"
    assert mlflow_server.get(path, user=None)[0] == 401
    assert mlflow_server.get(path, "admin", "not-the-password")[0] == 401
    assert mlflow_server.get(path)[0] == 200
    from mlflow.tracking import MlflowClient

    old = {k: os.environ.get(k) for k in mlflow_server.client_env()}
    os.environ.update(mlflow_server.client_env())  # what the Ray pods get from recgrid-mlflow-client
    try:
        assert MlflowClient(mlflow_server.url).search_experiments(max_results=1) is not None
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)

    # one user per team (k8s/README.md, step 4): a team's experiment is closed to another team's user
    users = {team: (team, f"{team}-{os.urandom(12).hex()}") for team in ("team-a", "team-b")}
    for name, password in users.values():
        assert mlflow_server.post("/api/2.0/mlflow/users/create", {"username": name, "password": password})[0] == 200
    status, body = mlflow_server.post("/api/2.0/mlflow/experiments/create", {"name": "team-a-only"}, *users["team-a"])
    assert status == 200, body
    get = f"/api/2.0/mlflow/experiments/get?experiment_id={json.loads(body)['experiment_id']}"
    assert mlflow_server.get(get, *users["team-a"])[0] == 200
    assert mlflow_server.get(get, *users["team-b"])[0] == 403, "another team's user reads the experiment"


def _quantity(q) -> Fraction:
    units = {"m": Fraction(1, 1000), "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
             "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    m = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(q))
    assert m and (m.group(2) in units or not m.group(2)), f"quantity {q!r}"
    return Fraction(m.group(1)) * units.get(m.group(2), 1)


def _containers(doc: dict) -> list[tuple[str, dict, dict]]:
    """(what, container, pod spec) of every container an object runs, the KubeRay autoscaler included."""
    out = []
    for role, template in _pod_templates(doc):
        pod = template["spec"]
        for c in pod.get("initContainers", []) + pod["containers"]:
            out.append((f"{doc['metadata']['name']}/{role}/{c['name']}", c, pod))
    specs = [doc["spec"]] if doc["kind"] == "RayCluster" else [doc["spec"]["rayClusterSpec"]] if doc["kind"] == "RayJob" else []
    for spec in specs:
        if spec.get("enableInTreeAutoscaling"):
            head_pod = spec["headGroupSpec"]["template"]["spec"]
            out.append((f"{doc['metadata']['name']}/autoscaler", spec.get("autoscalerOptions", {}), head_pod))
    return out


ALL_CONTAINERS = [x for _, d in DOCS for x in _containers(d)]


@pytest.mark.parametrize("what,container,pod", ALL_CONTAINERS, ids=[w for w, _, _ in ALL_CONTAINERS])
def test_containers_run_as_non_root_with_requests_and_limits(what, container, pod):
    pod_sc, sc = pod.get("securityContext") or {}, container.get("securityContext") or {}
    assert sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is True, f"{what}: runAsNonRoot is not true"
    assert sc.get("runAsUser", pod_sc.get("runAsUser", 1)) != 0, f"{what}: runs as uid 0"
    assert sc.get("allowPrivilegeEscalation") is False, f"{what}: may escalate privileges"
    assert not sc.get("privileged"), what
    assert "ALL" in (sc.get("capabilities") or {}).get("drop", []), f"{what}: keeps Linux capabilities"
    assert sc.get("readOnlyRootFilesystem") is True, f"{what}: the root filesystem is writable"
    seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile")) or {}
    assert seccomp.get("type") == "RuntimeDefault", f"{what}: no RuntimeDefault seccomp profile"
    res = container.get("resources") or {}
    for kind in ("requests", "limits"):
        assert {"cpu", "memory", "ephemeral-storage"} <= set(res.get(kind) or {}), \
            f"{what}: no cpu/memory/ephemeral-storage {kind}"
    for name, limit in res["limits"].items():
        assert _quantity(res["requests"].get(name, limit)) <= _quantity(limit), f"{what}: {name} request above its limit"


@pytest.mark.parametrize("change,said", [
    (lambda c, p: (c["securityContext"].update(runAsNonRoot=False), p.get("securityContext", {}).pop("runAsNonRoot", None)),
     "runAsNonRoot"),
    (lambda c, p: c["securityContext"].pop("readOnlyRootFilesystem"), "root filesystem is writable"),
    (lambda c, p: (c["securityContext"].pop("seccompProfile", None), p["securityContext"].pop("seccompProfile", None)),
     "seccomp"),
    (lambda c, p: c["resources"]["limits"].pop("ephemeral-storage"), "ephemeral-storage"),
])
def test_the_container_check_refuses_each_gap(change, said):
    what, container, pod = copy.deepcopy(ALL_CONTAINERS[0])
    change(container, pod)
    with pytest.raises(AssertionError, match=said):
        test_containers_run_as_non_root_with_requests_and_limits(what, container, pod)




def test_namespace_enforces_pod_security_restricted():
    (ns,) = _kind("Namespace")
    labels = ns["metadata"]["labels"]
    for mode in ("enforce", "audit", "warn"):
        assert labels.get(f"pod-security.kubernetes.io/{mode}") == "restricted", f"Pod Security {mode} is not restricted"


@pytest.mark.parametrize("what,template", POD_TEMPLATES, ids=[w for w, _ in POD_TEMPLATES])
def test_pods_get_no_api_token_and_write_only_to_declared_volumes(what, template):
    pod = template["spec"]
    assert pod.get("automountServiceAccountToken") is False, f"{what}: the pod gets a ServiceAccount token"
    accounts = {a["metadata"]["name"]: a for a in _kind("ServiceAccount")}
    sa = pod.get("serviceAccountName")
    assert sa in accounts, f"{what}: runs as ServiceAccount {sa!r}, none of k8s/serviceaccounts.yaml"
    assert accounts[sa].get("automountServiceAccountToken") is False
    bound = [b for b in _kind("RoleBinding") + _kind("ClusterRoleBinding")
             if any(s.get("name") == sa for s in b.get("subjects", []))]
    assert not bound, f"{what}: ServiceAccount {sa} holds rights it does not need: {bound}"
    # with a read-only root, what a container writes goes to a volume: an emptyDir with a size
    # limit, a PersistentVolumeClaim, or nothing (config and secrets are mounted read-only)
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for c in pod["containers"]:
        for m in c.get("volumeMounts", []):
            v = volumes[m["name"]]
            if "emptyDir" in v:
                assert v["emptyDir"].get("sizeLimit"), f"{what}: emptyDir {v['name']} has no sizeLimit"
            elif "persistentVolumeClaim" not in v:
                assert m.get("readOnly") is True, f"{what}: {m['mountPath']} is a writable {set(v) - {'name'}}"


@pytest.mark.parametrize("name,spec", _ray_specs(), ids=[n for n, _ in _ray_specs()])
def test_in_tree_autoscaling_is_off(name, spec):
    """KubeRay's autoscaler sidecar shares the head pod with the jobs' drivers and gets a token that
    may patch the RayCluster: off (k8s/README.md, "Autoscaling", says what turning it on costs)."""
    assert spec.get("enableInTreeAutoscaling") is False, name


EXAMPLE_SECRETS = [d for _, d in EXAMPLE_DOCS if d["kind"] == "Secret"]
EXAMPLE_PREFIX = "example-"


def _secret_keys() -> set[tuple[str, str]]:
    """(real Secret name, key) of every Secret k8s/examples/ shows the shape of."""
    return {(s["metadata"]["name"][len(EXAMPLE_PREFIX):], k) for s in EXAMPLE_SECRETS
            for k in {**s.get("data", {}), **s.get("stringData", {})}}


def test_no_secret_in_the_applied_directory_and_examples_cannot_replace_real_ones():
    """`kubectl apply -f k8s/` must never overwrite the real Secrets with public placeholders."""
    assert not _kind("Secret"), [s["metadata"]["name"] for s in _kind("Secret")]
    assert EXAMPLE_SECRETS
    referenced = {n for n, _ in _secret_keys()}
    for s in EXAMPLE_SECRETS:
        name = s["metadata"]["name"]
        assert name.startswith(EXAMPLE_PREFIX) and name not in referenced, f"example Secret {name} has a real name"
    readme = (K8S / "README.md").read_text() + (ROOT / "README.md").read_text()
    assert "--from-literal" not in readme, "a secret recipe puts its value on the command line"


def test_secrets_are_templates_and_come_from_secret_key_refs():
    for s in EXAMPLE_SECRETS:  # the shipped Secrets are placeholders, never real values
        assert s.get("stringData") and not s.get("data"), s["metadata"]["name"]
        for key, value in s["stringData"].items():
            assert value.startswith("CHANGE_ME"), f"Secret {s['metadata']['name']}.{key} holds a value"
    known = _secret_keys()
    placeholders = [v for s in EXAMPLE_SECRETS for v in s["stringData"].values()]
    refs = 0
    for what, container, _ in ALL_CONTAINERS:
        for env in container.get("env", []):
            ref = (env.get("valueFrom") or {}).get("secretKeyRef")
            if SECRET_NAME.search(env["name"]):
                assert ref and "value" not in env, f"{what}: {env['name']} is not read from a Secret"
            if ref:
                refs += 1
                assert (ref["name"], ref["key"]) in known, f"{what}: {env['name']} names a Secret key no template declares"
            if "value" in env:
                assert not re.search(r"://[^/@\s]*:[^/@\s]*@", env["value"]), f"{what}: credentials in {env['name']}"
        text = " ".join(container.get("command", []) + container.get("args", []))
        assert not re.search(r"://[^/@\s]*:[^/@\s]*@", text), f"{what}: credentials on the command line"
        assert not any(p in text for p in placeholders)
    assert refs >= 4  # PostgreSQL's and MLflow's database password, MLflow's admin, the Ray pods' MLflow user
    for name, spec in _ray_specs():  # the Ray auth token: KubeRay reads it from the named Secret
        auth = spec.get("authOptions") or {}
        assert auth.get("mode") == "token", f"{name}: Ray token authentication is off"
        assert (auth.get("secretName"), "auth_token") in known, f"{name}: authOptions.secretName names no Secret with auth_token"


# ---- Ray: versions, drain, the job ------------------------------------------------------------------
def _lock_pin(package: str) -> str:
    for line in (ROOT / "requirements" / "lock.txt").read_text().splitlines():
        if line.lower().startswith(package + "=="):
            return line.split("==")[1].split()[0]
    raise AssertionError(f"{package} is not pinned in requirements/lock.txt")


def _version() -> str:
    return re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)


def test_ray_version_and_images_match_the_pinned_stack():
    ray_pin, version = _lock_pin("ray"), _version()
    for name, spec in _ray_specs():
        assert spec["rayVersion"] == ray_pin, name
    images = {c["image"].split("@")[0] for _, d in DOCS if d["kind"] in CRD_FILES for _, c, _ in _containers(d) if "image" in c}
    assert len(images) == 1 and images.pop().endswith(f"/recgrid:{version}")
    (mlflow,) = [d for d in _kind("Deployment") if d["metadata"]["name"] == "recgrid-mlflow"]
    assert mlflow["spec"]["template"]["spec"]["containers"][0]["image"].split("@")[0].endswith(f"/recgrid-mlflow:{version}")


@pytest.mark.parametrize("name,spec", _ray_specs(), ids=[n for n, _ in _ray_specs()])
def test_termination_grace_exceeds_ray_drain_timeout(name, spec):
    """`ray start --block` drains its node for RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S seconds on
    SIGTERM (Ray 2.60, ray/_private/ray_constants.py); Kubernetes must not SIGKILL before that."""
    for role, template in _ray_templates(spec):
        pod = template["spec"]
        (ray_container,) = pod["containers"][:1]
        env = {e["name"]: e.get("value") for e in ray_container.get("env", [])}
        assert "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S" in env, f"{name}/{role}: drain timeout left at Ray's default"
        drain = float(env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"])
        assert drain >= 60, f"{name}/{role}: {drain} s is too short to checkpoint"
        assert pod.get("terminationGracePeriodSeconds", 30) > drain, f"{name}/{role}: SIGKILL comes before the drain ends"


def _entrypoint_config(job: dict):
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[0] == "recgrid", argv
    args = build_parser().parse_args(argv[1:])
    assert args.command == "train"
    # the job runs in the image's copy of the repository (runtimeEnvYAML's working_dir)
    runtime_env = yaml.safe_load(job["spec"].get("runtimeEnvYAML") or "{}")
    assert runtime_env.get("working_dir") == "/home/ray/recgrid"
    return load_config(ROOT / args.config, args.set, check_paths=False)


@pytest.mark.parametrize("job", _kind("RayJob"), ids=[j["metadata"]["name"] for j in _kind("RayJob")])
def test_rayjob_runs_a_valid_recgrid_command_on_a_cluster_that_fits_it(job):
    spec = job["spec"]
    assert spec["shutdownAfterJobFinishes"] is True and spec["ttlSecondsAfterFinished"] > 0
    cfg = _entrypoint_config(job)
    # the cluster the job creates is the RayCluster of the same instance, field for field, but for the
    # label its pods carry for the network policy (KubeRay names the job's cluster <rayjob>-<random>)
    instance = job["metadata"]["labels"]["app.kubernetes.io/instance"]
    (cluster,) = [c for c in _kind("RayCluster") if c["metadata"]["name"] == instance]
    own = copy.deepcopy(spec["rayClusterSpec"])
    for _, template in _ray_templates(own):
        assert template["metadata"]["labels"].pop("recgrid.io/rayjob") == job["metadata"]["name"]
    assert own == cluster["spec"]
    (group,) = spec["rayClusterSpec"]["workerGroupSpecs"]
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    gpus = int(limits.get("nvidia.com/gpu", 0))
    assert cfg.train.use_gpu == (gpus > 0), "GPU job on CPU pods or the reverse"
    per_pod = gpus if gpus else math.floor(_quantity(limits["cpu"]) / Fraction(str(cfg.train.cpus_per_worker)))
    # elastic: the worker group's range is the job's range of workers (grid.min_world_size once it exists)
    T = cfg.grid.world_size
    T_min = getattr(cfg.grid, "min_world_size", None) or T
    assert (group["minReplicas"], group["maxReplicas"]) == (math.ceil(T_min / per_pod), math.ceil(T / per_pod))
    assert group["minReplicas"] <= group.get("replicas", group["minReplicas"]) <= group["maxReplicas"]
    # the grid's layout holds on pods of this size (host-local: every replica group inside a pod)
    Grid(world_size=T, num_groups=cfg.grid.num_groups, layout=cfg.grid.layout, workers_per_node=min(per_pod, T))
    # absolute data and storage paths are on a volume every Ray pod mounts (the driver runs on the head)
    for _, template in _ray_templates(spec["rayClusterSpec"]):
        mounts = {m["mountPath"] for m in template["spec"]["containers"][0].get("volumeMounts", [])}
        for path in [*cfg.data.train, *cfg.data.eval, cfg.train.storage_path or ""]:
            if path.startswith("/"):
                assert any(path.startswith(m + "/") or path == m for m in mounts), f"{path} is on no volume of the pods"
    if cfg.tracking.tracking_uri:
        svc = re.match(r"http://([a-z0-9-]+)\.([a-z0-9-]+)\.svc(\.cluster\.local)?:(\d+)$", cfg.tracking.tracking_uri)
        assert svc, cfg.tracking.tracking_uri
        assert any(s["metadata"]["name"] == svc.group(1) and svc.group(2) == NAMESPACE
                   and any(p["port"] == int(svc.group(4)) for p in s["spec"]["ports"]) for s in _kind("Service"))


def test_job_config_refuses_missing_data_unless_paths_are_not_checked():
    """The cluster job config's data live on the cluster: validated here only without the path check."""
    from recgrid.config import ConfigError

    with pytest.raises(ConfigError, match="data.train: no file matches"):
        load_config(ROOT / "jobs" / "criteo_kaggle_cluster.yaml")
    cfg = load_config(ROOT / "jobs" / "criteo_kaggle_cluster.yaml", check_paths=False)
    assert cfg.train.use_gpu and cfg.grid.world_size % 8 == 0
    with pytest.raises(ConfigError, match="grid.num_groups"):  # every other check still runs
        load_config(ROOT / "jobs" / "criteo_kaggle_cluster.yaml", ["grid.num_groups=3"], check_paths=False)


# ---- the image ------------------------------------------------------------------------------------
def test_dockerfile_installs_the_pinned_stack_as_non_root():
    text = (K8S / "Dockerfile").read_text()
    ray_pin = _lock_pin("ray")
    python = re.search(r'requires-python = ">=3\.(\d+)', (ROOT / "pyproject.toml").read_text()).group(1)
    assert re.search(rf"^ARG RAY_IMAGE=rayproject/ray:{re.escape(ray_pin)}-py3{python}-gpu(@sha256:[0-9a-f]{{64}})?$", text, re.M)
    stages = re.split(r"^FROM ", text, flags=re.M)[1:]
    assert [s.splitlines()[0].split()[-1] for s in stages] == ["recgrid", "mlflow"]
    recgrid, mlflow = stages
    # the order make install uses: CUDA torch/fbgemm, torchrec without deps, the lock, the package
    steps = [m.start() for m in (re.search(p, recgrid) for p in (
        r"-r requirements/torch-cuda\.txt", r"--no-deps -r requirements/nodeps\.txt", r"-r requirements/lock\.txt",
        r"--no-deps \.")) if m]
    assert len(steps) == 4 and steps == sorted(steps)
    for name in ("torch-cuda.txt", "nodeps.txt", "lock.txt", "mlflow-server.txt"):
        assert (ROOT / "requirements" / name).is_file()
    assert re.search(r"--require-hashes -r /tmp/requirements/mlflow-server\.txt", mlflow)
    assert "psycopg2-binary==" in (ROOT / "requirements" / "mlflow-server.txt").read_text()
    for stage in stages:  # each image ends as a non-root user, set before its first RUN for recgrid
        users = re.findall(r"^USER (\S+)", stage, re.M)
        assert users and users[-1] not in ("root", "0"), stage.splitlines()[0]


def test_k8s_readme_names_every_manifest_in_apply_order():
    text = (K8S / "README.md").read_text()
    for path in sorted(K8S.glob("*.yaml")):
        assert path.name in text, f"k8s/README.md does not mention {path.name}"
    headings = re.findall(r"^## (.+)$", text, re.M)
    steps = ("image", "Secrets", "MLflow", "RayCluster", "RayJob")
    order = [next(i for i, h in enumerate(headings) if word in h) for word in steps]
    assert order == sorted(order), f"k8s/README.md: image, secrets, MLflow, RayCluster, RayJob; got {headings}"


# ---- images pinned by digest ----------------------------------------------------------------------
DIGEST = re.compile(r"^[^@\s]+@sha256:[0-9a-f]{64}$")


def image_references() -> list[tuple[str, str]]:
    """(where, reference) of every image the manifests run and the Dockerfile builds on."""
    refs = [(w, c["image"]) for _, d in DOCS for w, c, _ in _containers(d) if "image" in c]
    text = (K8S / "Dockerfile").read_text()
    refs += [("Dockerfile ARG " + m.group(1), m.group(2)) for m in re.finditer(r"^ARG (\w*IMAGE)=(\S+)", text, re.M)]
    refs += [("Dockerfile FROM", m.group(1)) for m in re.finditer(r"^FROM (\S+)", text, re.M) if "$" not in m.group(1)]
    return refs


def test_digest_check_accepts_only_digests():
    assert DIGEST.match("postgres:17@sha256:" + "a" * 64)
    assert not DIGEST.match("postgres:17") and not DIGEST.match("postgres@sha256:abc")
    assert (K8S / "pin-images.sh").is_file() and os.access(K8S / "pin-images.sh", os.X_OK)
    where = {w.split(" ")[0].split("/")[0] for w, _ in image_references()}
    assert {"Dockerfile", "recgrid-postgres", "recgrid-mlflow", "recgrid-gpu"} <= where, where  # all of them are read


@pytest.mark.xfail(strict=True, reason="blocked: no container registry is reachable where these manifests were "
                   "written, so no digest could be resolved; run k8s/pin-images.sh (after pushing the recgrid "
                   "images) and delete this mark")
def test_every_image_reference_carries_a_digest():
    unpinned = [(w, r) for w, r in image_references() if not DIGEST.match(r)]
    assert not unpinned, unpinned
