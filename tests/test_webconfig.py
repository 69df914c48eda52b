"""`apply --web-config FILE`: the exporter's TLS and basic auth from a web config file in the
exporter-toolkit format, checked against real clients: Python's ssl verifying against the
test's own CA (`helpers/tls.py`, made with `cryptography`), hashes made by the `bcrypt`
package, `promtool check web-config` and Debian's Prometheus reading the same file."""

from __future__ import annotations

import base64
import json
import shutil
import ssl
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Optional

import bcrypt
import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from helpers import REPO
from helpers.outputs import served
from helpers.processes import Proc, child_env, start_apply
from helpers.tls import Pki, make_pki
from hookpolicy.export.webconfig import LiveWebConfig, WebConfigError, load_web_config

PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
PASSWORD = "s3cret-scrape"


def _hash(password: str) -> str:
    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=4)).decode()


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return make_pki(tmp_path)


def _web_config(folder: Path, pki: Pki, *, users: bool = True, mutual: bool = False, relative: bool = True) -> Path:
    def name(path: Path) -> str:
        return path.name if relative else str(path)

    tls = {"cert_file": name(pki.server_cert), "key_file": name(pki.server_key)}
    if mutual:
        tls.update(client_auth_type="RequireAndVerifyClientCert", client_ca_file=name(pki.ca))
    config: dict[str, Any] = {"tls_server_config": tls}
    if users:
        config["basic_auth_users"] = {"prometheus": _hash(PASSWORD)}
    path = folder / "web.yml"
    path.write_text(json.dumps(config))  # JSON is YAML: the same file both read
    return path


def _registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    Counter("probe_events", "events the test counted", registry=registry).inc(7)
    return registry


def _get(port: int, *, context: Optional[ssl.SSLContext], auth: Optional[tuple[str, str]] = None,
         scheme: str = "https") -> tuple[int, dict[str, str], str]:
    request = urllib.request.Request(f"{scheme}://127.0.0.1:{port}/metrics")
    if auth is not None:
        request.add_header("Authorization", "Basic " + base64.b64encode(":".join(auth).encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as response:
            return response.status, dict(response.headers), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read().decode()


def _client_context(pki: Pki, *, cert: bool = False) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki.ca))
    if cert:
        context.load_cert_chain(str(pki.client_cert), str(pki.client_key))
    return context


def _probe_value(text: str) -> float:
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "probe_events"]
    return float(family.samples[0].value)


# -- the exporter over TLS with basic auth, against Python's own ssl client


def test_a_tls_scrape_verifies_against_the_tests_ca_and_needs_the_password(free_port: int, pki: Pki) -> None:
    web = load_web_config(str(_web_config(pki.ca.parent, pki)))
    with served(_registry(), free_port, web=web):
        status, _, body = _get(free_port, context=_client_context(pki), auth=("prometheus", PASSWORD))
        assert status == 200 and _probe_value(body) == 7.0
        for auth in (None, ("prometheus", "wrong"), ("nobody", PASSWORD), ("prometheus", "")):
            status, headers, body = _get(free_port, context=_client_context(pki), auth=auth)
            assert status == 401, auth
            assert headers["WWW-Authenticate"].startswith("Basic") and "probe_events" not in body
        # a client that trusts only the system's CAs refuses the certificate
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            _get(free_port, context=ssl.create_default_context(), auth=("prometheus", PASSWORD))
        # plain HTTP on the TLS port gets no metrics
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            _get(free_port, context=None, auth=("prometheus", PASSWORD), scheme="http")


def test_a_right_password_is_checked_by_bcrypt_once_a_wrong_one_every_time(
        free_port: int, pki: Pki, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[bytes] = []
    checkpw = bcrypt.checkpw

    def counting(password: bytes, hashed: bytes) -> bool:
        calls.append(password)
        return bool(checkpw(password, hashed))

    monkeypatch.setattr(bcrypt, "checkpw", counting)
    web = load_web_config(str(_web_config(pki.ca.parent, pki)))
    with served(_registry(), free_port, web=web):
        for _ in range(3):
            assert _get(free_port, context=_client_context(pki), auth=("prometheus", PASSWORD))[0] == 200
            assert _get(free_port, context=_client_context(pki), auth=("prometheus", "wrong"))[0] == 401
    assert calls == [PASSWORD.encode(), b"wrong", b"wrong", b"wrong"]


def test_mutual_tls_refuses_a_client_without_a_certificate(free_port: int, pki: Pki) -> None:
    web = load_web_config(str(_web_config(pki.ca.parent, pki, users=False, mutual=True)))
    with served(_registry(), free_port, web=web):
        status, _, body = _get(free_port, context=_client_context(pki, cert=True))
        assert status == 200 and _probe_value(body) == 7.0
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            _get(free_port, context=_client_context(pki))


def test_basic_auth_without_tls_still_refuses_a_wrong_password(free_port: int, tmp_path: Path) -> None:
    path = tmp_path / "web.yml"
    path.write_text(f"basic_auth_users:\n  prometheus: {_hash(PASSWORD)}\n")
    with served(_registry(), free_port, web=load_web_config(str(path))):
        assert _get(free_port, context=None, auth=("prometheus", "wrong"), scheme="http")[0] == 401
        status, _, body = _get(free_port, context=None, auth=("prometheus", PASSWORD), scheme="http")
        assert status == 200 and _probe_value(body) == 7.0


def test_a_renewed_certificate_and_a_changed_password_are_taken_without_a_restart(free_port: int, pki: Pki) -> None:
    """As cert-manager renews a Secret: the same file names, new contents (another CA here, so that which
    certificate is served shows), and a new password; the next connections get them."""
    folder = pki.ca.parent
    path = _web_config(folder, pki)
    with served(_registry(), free_port, web=load_web_config(str(path))):
        assert _get(free_port, context=_client_context(pki), auth=("prometheus", PASSWORD))[0] == 200
        (folder / "renewed").mkdir()
        renewed = make_pki(folder / "renewed", name="renewed")
        shutil.copy(renewed.server_cert, pki.server_cert)
        shutil.copy(renewed.server_key, pki.server_key)
        path.write_text(json.dumps({"tls_server_config": {"cert_file": pki.server_cert.name,
                                                          "key_file": pki.server_key.name},
                                    "basic_auth_users": {"prometheus": _hash("renewed-password")}}))
        deadline = time.monotonic() + 30
        while True:  # the exporter looks at the files at most once a second
            try:
                status = _get(free_port, context=_client_context(renewed), auth=("prometheus", "renewed-password"))[0]
            except urllib.error.URLError:
                status = 0
            if status == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert status == 200
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            _get(free_port, context=_client_context(pki), auth=("prometheus", "renewed-password"))
        assert _get(free_port, context=_client_context(renewed), auth=("prometheus", PASSWORD))[0] == 401


def test_a_changed_file_that_does_not_load_or_drops_tls_is_not_taken(
        pki: Pki, capfd: pytest.CaptureFixture[str]) -> None:
    path = _web_config(pki.ca.parent, pki)
    first = load_web_config(str(path))
    now = [0.0]
    live = LiveWebConfig(first, clock=lambda: now[0])
    for text, said in ((f"basic_auth_users:\n  prometheus: {PASSWORD}\n", "does not load"),
                       (f"basic_auth_users:\n  prometheus: {_hash(PASSWORD)}\n", "between TLS and plain HTTP")):
        path.write_text(text)
        now[0] += 2
        assert live.current() is first
        err = capfd.readouterr().err
        assert said in err and "keeps the previous one" in err, err
    path.write_text(json.dumps({"tls_server_config": {"cert_file": pki.server_cert.name, "key_file": pki.server_key.name}}))
    now[0] += 0.5  # looked at most once a second: not yet
    assert live.current() is first
    now[0] += 1
    renewed = live.current()
    assert renewed is not first and renewed.tls is not None and renewed.credentials is None
    assert "read again: TLS" in capfd.readouterr().err


# -- files that cannot secure the endpoint: one problem each, at its line, and what would be right

BAD = {
    "unknown-key": ("tls_server_config:\n  cert_file: a\n  key_file: b\n  cert_flie: c\n",
                    4, "unknown key 'cert_flie'"),
    "no-key-file": ("tls_server_config:\n  cert_file: a.crt\n", 2, "needs key_file"),
    "plain-password": (f"basic_auth_users:\n  prometheus: {PASSWORD}\n", 2, "must be a bcrypt hash"),
    "not-implemented": ("tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n  cipher_suites: [TLS_AES_128_GCM_SHA256]\n",
                        4, "does not implement it"),
    "unverified-client": ("tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n  client_auth_type: RequireAnyClientCert\n",
                          4, "without verifying it"),
    "ca-without-auth": ("tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n  client_ca_file: {ca}\n",
                        4, "client_auth_type is NoClientCert"),
    "bad-version": ("tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n  min_version: TLS14\n",
                    4, "must be one of TLS10, TLS11, TLS12, TLS13"),
    "missing-cert": ("tls_server_config:\n  cert_file: nowhere.crt\n  key_file: {key}\n", 2, "cannot load"),
    "empty": ("", 0, "neither tls_server_config nor basic_auth_users"),
}
#: Those that exporter-toolkit refuses too, as `promtool check web-config` says.
TOOLKIT_REFUSES = {"unknown-key", "no-key-file", "ca-without-auth", "bad-version", "missing-cert"}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_web_config_that_cannot_secure_the_endpoint_is_refused_with_its_line(
        case: str, pki: Pki, tmp_path: Path) -> None:
    text, line, words = BAD[case]
    path = tmp_path / f"{case}.yml"
    path.write_text(text.format(cert=pki.server_cert, key=pki.server_key, ca=pki.ca))
    with pytest.raises(WebConfigError) as raised:
        load_web_config(str(path))
    (problem,) = raised.value.problems
    assert problem.file == str(path) and problem.line == line and words in problem.message, problem
    if PROMTOOL is not None and case in TOOLKIT_REFUSES:
        checked = subprocess.run([PROMTOOL, "check", "web-config", str(path)], capture_output=True, text=True)
        assert checked.returncode != 0, checked.stdout


def test_an_encrypted_key_is_refused_not_asked_for_on_the_terminal(pki: Pki, tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(pki.server_key.read_bytes(), None)
    encrypted = tmp_path / "encrypted.key"
    encrypted.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                            serialization.BestAvailableEncryption(b"pass")))
    path = tmp_path / "web.yml"
    path.write_text(f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: {encrypted.name}\n")
    with pytest.raises(WebConfigError) as raised:
        load_web_config(str(path))
    (problem,) = raised.value.problems
    assert problem.line == 2 and "cannot load" in problem.message and "the private key is encrypted" in problem.message


@pytest.mark.skipif(PROMTOOL is None, reason="promtool (Debian package prometheus) is not installed")
def test_promtool_accepts_the_files_hookpolicy_accepts(pki: Pki) -> None:
    for mutual, users in ((False, True), (True, False), (True, True)):
        path = _web_config(pki.ca.parent, pki, users=users, mutual=mutual)
        load_web_config(str(path))
        checked = subprocess.run([PROMTOOL, "check", "web-config", str(path)], capture_output=True, text=True)
        assert checked.returncode == 0, checked.stdout + checked.stderr


def test_apply_refuses_a_bad_web_config_before_the_command_runs(tmp_path: Path) -> None:
    bad = tmp_path / "web.yml"
    bad.write_text(f"basic_auth_users:\n  prometheus: {PASSWORD}\n")
    marker = tmp_path / "ran"
    command = [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    for options, status, words in ((["--metrics-port", "9400", "--web-config", str(bad)], 1, f"{bad}:2:"),
                                   (["--web-config", str(bad)], 2, "only --metrics-port N starts")):
        done = subprocess.run([sys.executable, "-m", "hookpolicy", "apply", "policies/nan-guard.yaml", *options,
                               "--", *command], cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120)
        assert done.returncode == status and words in done.stderr, done.stderr
        assert "Traceback" not in done.stderr and not marker.exists()
        if status == 1:
            assert "must be a bcrypt hash" in done.stderr and "did not run" in done.stderr


# -- the real Prometheus scraping a run under apply over TLS with basic auth

TRAIN = textwrap.dedent("""\
    import sys, time, torch
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(100000):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        time.sleep(0.05)
""")


def _prometheus_query(port: int, pki: Pki, promql: str) -> Any:
    url = f"https://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    request = urllib.request.Request(url, headers={
        "Authorization": "Basic " + base64.b64encode(f"prometheus:{PASSWORD}".encode()).decode()})
    with urllib.request.urlopen(request, timeout=5, context=_client_context(pki)) as response:
        return json.loads(response.read())["data"]["result"]


@pytest.mark.slow
@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus (Debian package prometheus) is not installed")
def test_prometheus_scrapes_apply_over_tls_with_basic_auth(
        free_port: int, pki: Pki, tmp_path: Path, procs: list[Proc]) -> None:
    """Prometheus reads the same web config for its own endpoint (--web.config.file) as apply does for the
    exporter: the format is the ecosystem's, not one that merely looks like it. A scrape job with the wrong
    password is refused (up 0, 401) while the right one is answered."""
    web = _web_config(tmp_path, pki)
    (tmp_path / "train.py").write_text(TRAIN)
    metrics_port, prometheus_port = free_port, free_port + 1

    def job(name: str, password: str) -> dict[str, Any]:
        return {"job_name": name, "scheme": "https", "tls_config": {"ca_file": str(pki.ca)},
                "basic_auth": {"username": "prometheus", "password": password},
                "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}]}

    (tmp_path / "prometheus.yml").write_text(json.dumps({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [job("secured", PASSWORD), job("wrong-password", "not-it")]}))
    train = start_apply(procs, tmp_path / "apply", ["policies/gradient-monitor.yaml", "--metrics-port", str(metrics_port),
                                                    "--web-config", str(web), "--", sys.executable,
                                                    str(tmp_path / "train.py")], HOOKPOLICY_OUTPUT_DIR=str(tmp_path))
    prometheus = Proc(tmp_path / "prometheus", [
        str(PROMETHEUS), f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
        f"--web.listen-address=127.0.0.1:{prometheus_port}", f"--web.config.file={web}"], child_env())
    procs.append(prometheus)

    def ready() -> bool:
        try:
            ups = {r["metric"]["job"]: r["value"][1] for r in _prometheus_query(prometheus_port, pki, "up")}
            steps = _prometheus_query(prometheus_port, pki, 'hookpolicy_steps_total{job="secured"}')
        except (OSError, ValueError):
            return False
        return ups == {"secured": "1", "wrong-password": "0"} and bool(steps) and float(steps[0]["value"][1]) >= 2

    prometheus.wait_for(ready, 90, f"both scrape jobs' first results; apply's stderr:\n{train.stderr}")
    assert f"metrics on https://127.0.0.1:{metrics_port}/metrics (TLS and basic auth (1 user(s))" in train.stderr
    # Prometheus itself, behind the same file, refuses a query without the password
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"https://127.0.0.1:{prometheus_port}/api/v1/query?query=up", timeout=5,
                               context=_client_context(pki))
    assert refused.value.code == 401
    request = urllib.request.Request(f"https://127.0.0.1:{prometheus_port}/api/v1/targets", headers={
        "Authorization": "Basic " + base64.b64encode(f"prometheus:{PASSWORD}".encode()).decode()})
    with urllib.request.urlopen(request, timeout=5, context=_client_context(pki)) as response:
        targets = {t["labels"]["job"]: t for t in json.loads(response.read())["data"]["activeTargets"]}
    assert targets["secured"]["health"] == "up" and targets["secured"]["scrapeUrl"].startswith("https://")
    assert "401" in targets["wrong-password"]["lastError"], targets["wrong-password"]
