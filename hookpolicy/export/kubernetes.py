"""Kubernetes objects for a job under hookpolicy (`hookpolicy export kubernetes`).

A pure function of the typed policies and the files they came from, like the rules and
the dashboard: the Prometheus Operator's `PrometheusRule` (the generated alerting rules,
`monitoring.coreos.com/v1`) and `PodMonitor` (one endpoint per rank's port), the policies
as a `ConfigMap`, and an example `Job` that mounts it as a folder (so `--watch` sees its
updates), runs `apply` under torchrun with one named container port per local rank
(`hookpolicy-<r>`, at most 15 characters, on `port + r`) and gives each attempt its
own run identity (the pod's uid, `HOOKPOLICY_RUN_ID`). The Job is an example to adapt
(image, command, resources), the other objects are meant to be applied as they are.

With `web_secret` (`--web-config-secret NAME`) the endpoints are served over TLS with basic
auth: the Job mounts only `web.yml`, `tls.crt` and `tls.key` of that Secret and passes
`--web-config`, and the PodMonitor scrapes over https, verifying the certificate against
the Secret's `ca.crt` for the name `server_name` and authenticating with its `username` and
`password` (`WEB_SECRET_KEYS`). The Secret itself is the operator's to make: it holds keys.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml

from .rules import prometheus_rules
from ..environment import ENV_RUN_ID
from ..policy.model import Policy

__all__ = ["POLICY_MOUNT", "WEB_MOUNT", "WEB_SECRET_KEYS", "kubernetes_objects"]

#: Where the example Job mounts the policies' ConfigMap.
POLICY_MOUNT = "/etc/hookpolicy/policies"
#: Where it mounts the web config Secret's files the pod needs.
WEB_MOUNT = "/etc/hookpolicy/web"
#: The keys of the web config Secret: the pod's files (an exporter-toolkit web.yml naming tls.crt and tls.key
#: beside it, with a bcrypt hash of the password), then what Prometheus reads (the CA, the user, the password).
WEB_SECRET_KEYS = ("web.yml", "tls.crt", "tls.key", "ca.crt", "username", "password")


def kubernetes_objects(
    policies: Sequence[Policy], *, name: str = "hookpolicy", ranks: int = 1, port: int = 9400,
    image: str = "registry.example.com/hookpolicy:0.1.0", command: Sequence[str] = ("/work/train.py",),
    web_secret: Optional[str] = None,
) -> str:
    """The objects as one multi-document YAML stream: PrometheusRule, PodMonitor, ConfigMap, Job.

    `ranks` is the number of ranks per pod (torchrun's `--nproc_per_node`); each serves on
    `port + LOCAL_RANK` under the port name `hookpolicy-<LOCAL_RANK>`. Raises ValueError
    when two policy files share a file name (a ConfigMap key) or a rank's port is not a port.
    """
    if not 1 <= ranks <= 9999 or not 1 <= port <= 65536 - ranks:
        raise ValueError(f"ranks {ranks} from port {port} do not fit the port range (1-65535, at most 9999 ranks)")
    files: dict[str, str] = {}
    for policy in policies:
        key = os.path.basename(policy.source)
        if key in files:
            raise ValueError(f"two policy files are named {key!r}: a ConfigMap needs distinct file names")
        files[key] = Path(policy.source).read_text(encoding="utf-8")
    selector = {"app.kubernetes.io/name": name}
    labels = {**selector, "app.kubernetes.io/component": "training"}
    ports = [{"name": f"hookpolicy-{r}", "containerPort": port + r} for r in range(ranks)]
    endpoint: dict[str, Any] = {"path": "/metrics", "interval": "15s"}
    web_args: list[str] = []
    mounts = [{"name": "policies", "mountPath": POLICY_MOUNT, "readOnly": True}]
    # a folder mount, never subPath: only a folder receives the ConfigMap's updates
    volumes: list[dict[str, Any]] = [{"name": "policies", "configMap": {"name": f"{name}-policies"}}]
    if web_secret is not None:
        # the pod reads its three files (never the password itself); Prometheus the other three
        endpoint.update(scheme="https", tlsConfig={"ca": {"secret": {"name": web_secret, "key": "ca.crt"}},
                                                   "serverName": name},
                        basicAuth={"username": {"name": web_secret, "key": "username"},
                                   "password": {"name": web_secret, "key": "password"}})
        web_args = ["--web-config", f"{WEB_MOUNT}/web.yml"]
        mounts.append({"name": "web-config", "mountPath": WEB_MOUNT, "readOnly": True})
        volumes.append({"name": "web-config", "secret": {
            "secretName": web_secret, "items": [{"key": k, "path": k} for k in WEB_SECRET_KEYS[:3]]}})
    objects: list[dict[str, Any]] = [
        {
            "apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": {"name": f"{name}-rules", "labels": dict(selector)},
            "spec": {"groups": yaml.safe_load(prometheus_rules(policies))["groups"]},
        },
        {
            "apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
            "metadata": {"name": name, "labels": dict(selector)},
            "spec": {
                "selector": {"matchLabels": dict(selector)},
                "podMetricsEndpoints": [{"port": p["name"], **endpoint} for p in ports],
            },
        },
        {
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": f"{name}-policies", "labels": dict(selector)},
            "data": files,
        },
        {
            "apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": name, "labels": dict(labels)},
            "spec": {
                "backoffLimit": 2,
                "template": {
                    "metadata": {"labels": dict(labels)},
                    "spec": {
                        "restartPolicy": "Never",
                        "containers": [{
                            "name": "train", "image": image,
                            "args": ["apply", POLICY_MOUNT, "--watch", "--metrics-addr", "0.0.0.0", "--metrics-port",
                                     str(port), *web_args, "--", "torchrun", "--standalone", "--nproc_per_node", str(ranks),
                                     *command],
                            "env": [{"name": ENV_RUN_ID,  # one per attempt: a retried pod is a new run
                                     "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}}],
                            "ports": ports,
                            "volumeMounts": mounts,
                        }],
                        "volumes": volumes,
                    },
                },
            },
        },
    ]
    header = ("# Kubernetes objects generated by `hookpolicy export kubernetes` from "
              + (", ".join(_one_line(p.source) for p in policies) or "no policy") + ".\n"
              "# PrometheusRule and PodMonitor need the Prometheus Operator; the Job is an example to adapt.\n"
              + ("" if web_secret is None else
                 f"# TLS and basic auth: the Secret {_one_line(web_secret)} must hold {', '.join(WEB_SECRET_KEYS)}; its "
                 f"certificate must name {_one_line(name)} (the PodMonitor's serverName).\n"))
    return header + yaml.safe_dump_all(objects, sort_keys=False, default_flow_style=False, width=100000,
                                       allow_unicode=True)


def _one_line(text: str) -> str:
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
