"""The Kubernetes manifests (``deploy/kubernetes``), checked offline: there is no cluster here.

- each overlay renders with ``kubectl kustomize`` (skipped, saying why, without kubectl);
- every rendered object validates against the Kubernetes OpenAPI schema (``kubernetes-validate``,
  strict: unknown fields fail) for the newest version it knows and for 1.27, the first with GA
  gRPC probes;
- every pdserve command line in them (container args, with ``$(VAR)`` filled in from the
  container's environment, and the preStop hook's shell line) parses with pdserve's own CLI
  parser, so a flag renamed in the CLI fails here instead of in a deployment (shown below with a
  renamed flag and with a misspelt one);
- the pieces agree: workers register with the routers' headless Service and drain through the
  client-facing one, probes and scrape annotations name the ports the commands bind, the grace
  period outlasts the drain, each pool has its HPA on a metric pdserve exports, and only the gpu
  overlay asks for GPUs;
- several routers run: an HPA of at least two owns their count, a rolling update keeps one ready,
  and workers register with every router pod, ready or not, through a headless Service.
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from pdserve.cli.main import build_parser
from tests.unit.test_observability import exported_names

ROOT = Path(__file__).resolve().parents[2]
KUSTOMIZE_DIR = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("cpu", "gpu")
GRPC_PROBES_GA = "1.27.0"
# What the kubelet would put in fieldRef variables: any plausible value will do for parsing.
FIELD_REFS = {"status.podIP": "10.1.2.3", "metadata.name": "pdserve-decode-7d9c-x2x4q"}
_VAR = re.compile(r"\$\((\w+)\)")
_SHELL_VAR = re.compile(r"\$\{?(\w+)\}?")


def render(overlay: str) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: cannot render the kustomizations (`kubectl kustomize`)")
    done = subprocess.run(
        [kubectl, "kustomize", str(KUSTOMIZE_DIR / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, render(request.param)


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def container_env(container: dict, docs: list[dict]) -> dict[str, str]:
    """The environment the kubelet would give ``container`` (fieldRefs: FIELD_REFS)."""
    configmaps = by_kind(docs, "ConfigMap")
    env: dict[str, str] = {}
    for src in container.get("envFrom", []):
        env.update(configmaps[src["configMapRef"]["name"]]["data"])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            env[var["name"]] = FIELD_REFS[var["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def _fill(text: str, env: dict[str, str], where: str, pattern: re.Pattern[str] = _VAR) -> str:
    """``text`` with its variable references replaced (``$(VAR)`` in args, ``$VAR`` in a shell line)."""
    missing = [v for v in pattern.findall(text) if v not in env]
    assert not missing, f"{where}: {text} names {missing}, which its environment lacks"
    return pattern.sub(lambda m: env[m.group(1)], text)


def command_lines(docs: list[dict]) -> list[tuple[str, list[str]]]:
    """(where, argv after `pdserve`) of every pdserve command in the Deployments."""
    lines = []
    for name, dep in by_kind(docs, "Deployment").items():
        for c in dep["spec"]["template"]["spec"]["containers"]:
            if c.get("command") != ["pdserve"]:
                continue
            env, where = container_env(c, docs), f"{name}/{c['name']}"
            lines.append((f"{where} args", [_fill(a, env, where) for a in c["args"]]))
            hook = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
            if hook:
                assert hook[:2] == ["/bin/sh", "-c"], hook
                words = shlex.split(_fill(hook[2], env, where, _SHELL_VAR))
                words = words[1:] if words[0] == "exec" else words
                assert words[0] == "pdserve", hook
                lines.append((f"{where} preStop", words[1:]))
    return lines


def parse_errors(lines: list[tuple[str, list[str]]], parser: argparse.ArgumentParser) -> list[str]:
    errors = []
    for where, argv in lines:
        try:
            parser.parse_args(argv)
        except SystemExit:
            errors.append(f"{where}: {shlex.join(argv)}")
    return errors


# ---- tests ------------------------------------------------------------------------------------------------


def test_every_object_validates_against_the_kubernetes_schema(rendered):
    import kubernetes_validate

    overlay, docs = rendered
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(
        ["ConfigMap", "PodDisruptionBudget"]
        + ["Deployment"] * 3
        + ["Service"] * 2
        + ["HorizontalPodAutoscaler"] * 3
    ), kinds
    versions = {kubernetes_validate.latest_version(), GRPC_PROBES_GA}
    for version in versions:
        for doc in docs:
            # strict: a misspelt or misplaced field fails instead of being ignored
            kubernetes_validate.validate(doc, version, strict=True)


def test_the_validator_rejects_a_bad_object():
    import kubernetes_validate

    dep = by_kind(render("cpu"), "Deployment")["pdserve-decode"]
    probe = dep["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]
    probe["grpc"]["prot"] = probe["grpc"].pop("port")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, kubernetes_validate.latest_version(), strict=True)


def test_every_pdserve_command_line_parses_with_the_cli_parser(rendered):
    _, docs = rendered
    lines = command_lines(docs)
    assert {w.split()[1] for w, _ in lines} == {"args", "preStop"}
    assert len(lines) == 5, [w for w, _ in lines]  # router; prefill and decode, each with its hook
    assert parse_errors(lines, build_parser()) == []


def test_a_flag_renamed_in_the_cli_fails_the_check(monkeypatch):
    """As if someone renamed `pdserve worker --drain-timeout` in worker/flags.py."""
    lines = command_lines(render("cpu"))
    real = argparse.ArgumentParser.add_argument

    def renaming(self, *names, **kw):
        names = tuple("--drain-seconds" if n == "--drain-timeout" else n for n in names)
        return real(self, *names, **kw)

    monkeypatch.setattr(argparse.ArgumentParser, "add_argument", renaming)
    renamed = build_parser()
    monkeypatch.undo()
    errors = parse_errors(lines, renamed)
    assert sorted(e.split(":")[0] for e in errors) == [
        "pdserve-decode/worker args",
        "pdserve-prefill/worker args",
    ]


def test_a_misspelt_flag_in_a_manifest_fails_the_check():
    lines = [
        (w, [a.replace("--metrics-port", "--metric-port") for a in argv])
        for w, argv in command_lines(render("cpu"))
    ]
    assert len(parse_errors(lines, build_parser())) == 3  # the router and both pools' args


def test_the_manifests_agree_with_each_other_and_with_the_cli(rendered):
    overlay, docs = rendered
    parser = build_parser()
    deployments, services = by_kind(docs, "Deployment"), by_kind(docs, "Service")
    router_svc = services["pdserve-router"]
    svc_ports = {p["name"]: p["port"] for p in router_svc["spec"]["ports"]}
    parsed = {where: parser.parse_args(argv) for where, argv in command_lines(docs)}

    router = parsed["pdserve-router/router args"]
    assert router.command == "router" and router.host == "0.0.0.0"
    assert svc_ports["grpc"] == router.port and svc_ports["metrics"] == router.metrics_port
    r_pod = deployments["pdserve-router"]["spec"]["template"]
    # A gRPC probe's service must be one the router's health service knows: an unknown name answers
    # NOT_FOUND, a failure to the kubelet (the liveness probe named pdserve.v1.Registry, which does not
    # exist: the router was restarted every ~70 s).
    from pdserve.router.server import GENERATION_SERVICE, REGISTRY_SERVICE

    [rc] = r_pod["spec"]["containers"]
    probes = {p: rc[p]["grpc"].get("service", "") for p in ("readinessProbe", "livenessProbe") if p in rc}
    assert probes == {"readinessProbe": GENERATION_SERVICE, "livenessProbe": REGISTRY_SERVICE}
    assert router_svc["spec"]["selector"].items() <= r_pod["metadata"]["labels"].items()

    hpas = by_kind(docs, "HorizontalPodAutoscaler")
    exported = exported_names()
    for role in ("prefill", "decode"):
        dep = deployments[f"pdserve-{role}"]
        pod = dep["spec"]["template"]
        [c] = pod["spec"]["containers"]
        w = parsed[f"pdserve-{role}/worker args"]
        assert w.command == "worker" and w.role == role and w.cluster_token_file is not None
        # registers with every router through the headless Service, at the gRPC port
        assert w.router == f"pdserve-router-workers:{svc_ports['grpc']}"
        assert w.host == FIELD_REFS["status.podIP"] and w.worker_id == FIELD_REFS["metadata.name"]
        from pdserve.worker.shell import REGISTERED_SERVICE

        # The overall status (SERVING from the model load on), but readiness: registered with the router.
        want = {"startupProbe": "", "readinessProbe": REGISTERED_SERVICE, "livenessProbe": ""}
        for probe, service in want.items():
            assert c[probe]["grpc"]["port"] == w.port, probe
            assert c[probe]["grpc"].get("service", "") == service, probe
        assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(w.metrics_port)
        assert pod["spec"]["terminationGracePeriodSeconds"] > w.drain_timeout
        drain = parsed[f"pdserve-{role}/worker preStop"]
        # any ready router carries out a drain for all: the client-facing Service
        assert drain.command == "drain" and drain.worker_id == w.worker_id
        assert drain.router == f"pdserve-router:{svc_ports['grpc']}"
        assert drain.timeout < pod["spec"]["terminationGracePeriodSeconds"]
        # its own HPA, on a metric pdserve exports
        [hpa] = [h for h in hpas.values() if h["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"]]
        assert hpa["apiVersion"] == "autoscaling/v2"
        for m in hpa["spec"]["metrics"]:
            assert m[m["type"].lower()]["metric"]["name"] in exported
        # torch threads: the cores requested (a pod sees all of its node's: one thread on each, else)
        assert w.threads == int(c["resources"]["requests"]["cpu"])
        gpus = c["resources"].get("limits", {}).get("nvidia.com/gpu")
        assert (gpus == "1") == (overlay == "gpu"), (overlay, c["resources"])
        assert w.dtype == {"cpu": "float32", "gpu": "bfloat16"}[overlay]
        assert w.device == {"cpu": "cpu", "gpu": "cuda"}[overlay]


def test_several_routers_run_and_workers_find_every_one(rendered):
    _, docs = rendered
    deployments, services = by_kind(docs, "Deployment"), by_kind(docs, "Service")
    router = deployments["pdserve-router"]
    pod = router["spec"]["template"]
    # The HPA owns the count (a replicas field would reset it on every apply): at least two routers.
    assert "replicas" not in router["spec"]
    [hpa] = [
        h
        for h in by_kind(docs, "HorizontalPodAutoscaler").values()
        if h["spec"]["scaleTargetRef"]
        == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "pdserve-router"}
    ]
    assert 2 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    [metric] = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu"
    assert pod["spec"]["containers"][0]["resources"]["requests"]["cpu"]  # what Utilization is a share of
    # A rolling update adds the new router before an old one goes.
    assert router["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
    }
    [pdb] = by_kind(docs, "PodDisruptionBudget").values()
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    [term] = pod["spec"]["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert (
        term["podAffinityTerm"]["labelSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    )

    # Workers resolve the headless Service: one address per router pod, ready (tokenizer loaded, not
    # draining) or not, at the router's gRPC port.
    headless = services["pdserve-router-workers"]["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True
    assert headless["selector"].items() <= pod["metadata"]["labels"].items()
    assert headless["selector"] == services["pdserve-router"]["spec"]["selector"]
    [port] = headless["ports"]
    assert port["targetPort"] == "grpc"
    parsed = {where: build_parser().parse_args(argv) for where, argv in command_lines(docs)}
    assert port["port"] == parsed["pdserve-router/router args"].port
    for role in ("prefill", "decode"):
        assert parsed[f"pdserve-{role}/worker args"].router == f"pdserve-router-workers:{port['port']}"
