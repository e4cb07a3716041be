"""A real `mlflow server` for the suite, started the way k8s/ runs it: the manifest's arguments
and basic-auth config, with only the addresses and stores moved to this machine. One per test
session (the `mlflow_server` fixture in conftest.py): the security checks in test_k8s.py and the
run pages `recgrid train` links to (test_launcher.py) share it."""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

from recgrid.launch.local import free_port

K8S = Path(__file__).resolve().parents[1] / "k8s"


def manifest_docs() -> list[dict]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return docs


@dataclass
class MlflowServer:
    url: str  # http://127.0.0.1:<port>
    user: str
    password: str
    proc: subprocess.Popen
    log_path: Path

    def get(self, path_or_url: str, user: str | None = "", password: str | None = None, timeout: float = 120):
        """(status, body) of a GET; with the admin's credentials unless `user` is None (anonymous)
        or given."""
        url = path_or_url if path_or_url.startswith("http") else self.url + path_or_url
        return self._send(urllib.request.Request(url), user, password, timeout)

    def post(self, path: str, body: dict, user: str | None = "", password: str | None = None, timeout: float = 120):
        """(status, body) of a JSON POST, with credentials as `get`."""
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        return self._send(req, user, password, timeout)

    def _send(self, req: urllib.request.Request, user: str | None, password: str | None, timeout: float):
        if user is not None:
            user, password = (user or self.user), (password if password is not None else self.password)
            req.add_header("Authorization", "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode())
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:  # the first request creates the store's tables
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def client_env(self) -> dict[str, str]:
        """What the Ray pods get from the recgrid-mlflow-client Secret."""
        return {"MLFLOW_TRACKING_USERNAME": self.user, "MLFLOW_TRACKING_PASSWORD": self.password}

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()


def start(tmp_path: Path, timeout: float = 120) -> MlflowServer:
    docs = manifest_docs()
    (deploy,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "recgrid-mlflow"]
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "recgrid-mlflow-auth"]
    env = {e["name"]: e for e in container["env"]}
    mount = next(m for m in container["volumeMounts"] if m["name"] == "auth-config")
    ini_name = env["MLFLOW_AUTH_CONFIG_PATH"]["value"][len(mount["mountPath"]) + 1:]
    ini = re.sub(r"^database_uri = .*$", f"database_uri = sqlite:///{tmp_path}/basic_auth.db",
                 config_map["data"][ini_name], flags=re.M)
    (tmp_path / ini_name).write_text(ini)
    port = free_port()
    moved = {"--host": "127.0.0.1", "--port": str(port), "--workers": "1",
             "--backend-store-uri": f"sqlite:///{tmp_path}/mlflow.db", "--artifacts-destination": str(tmp_path / "art")}
    args = [a if a.split("=")[0] not in moved else f"{a.split('=')[0]}={moved[a.split('=')[0]]}" for a in container["args"]]
    password = secrets.token_urlsafe(16)
    server_env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    server_env.update({name: e["value"] for name, e in env.items() if "value" in e})  # the manifest's settings
    server_env.update(MLFLOW_AUTH_CONFIG_PATH=str(tmp_path / ini_name), MLFLOW_AUTH_ADMIN_PASSWORD=password,
                      MLFLOW_FLASK_SERVER_SECRET_KEY=secrets.token_hex(16))
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([str(Path(sys.executable).parent / "mlflow"), "server", *args], cwd=tmp_path,
                                env=server_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = MlflowServer(f"http://127.0.0.1:{port}", "admin", password, proc, log_path)
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(f"{server.url}/health", timeout=5)  # unauthenticated by design
            return server
        except (urllib.error.URLError, ConnectionError, OSError):
            if proc.poll() is not None or time.monotonic() > deadline:
                server.stop()
                raise RuntimeError(f"mlflow server did not start:\n{log_path.read_text()[-3000:]}")
            time.sleep(1)
