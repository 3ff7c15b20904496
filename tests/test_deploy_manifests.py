"""deploy/k8s, offline: every variant renders (kubectl kustomize where kubectl is installed, and the Python subset
renderer, which must agree with it), every resource validates against the Kubernetes API's schemas, and the pod
matches the daemon its ConfigMap configures: probes, ports, keys, grace period, writable paths, GPUs."""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest

from tests.support.deploy_helpers import (
    K8S,
    KUBERNETES_VERSION,
    VARIANTS,
    WORKLOAD_VARIANTS,
    Pod,
    by_kind,
    config_arg,
    container,
    container_env,
    lay_out,
    mount_of,
    mounts,
    pod_spec,
    port_number,
    render_variant,
    stages,
    workload,
)
from tests.support.kustomize_subset import Unsupported, render
from trio_gpuworker.daemon.config import DaemonConfig, parse_config

GRACE_MARGIN_S = 10  # past every bound the daemon sets itself: hypercorn's last writes, reaping, the exit
DAEMON = "gpuworkerd"


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    work = tmp_path_factory.mktemp("k8s")
    out = {}
    for variant in VARIANTS:
        ours, kubectls = render_variant(variant, work)
        if kubectls is not None:  # the subset renderer stands in for kubectl only where it renders the same
            key = lambda r: (r["apiVersion"], r["kind"], r["metadata"]["name"])  # noqa: E731
            assert {key(r): r for r in ours} == {key(r): r for r in kubectls}, variant
            assert len(ours) == len(kubectls)
        out[variant] = kubectls if kubectls is not None else ours
    return out


def daemon_config(resources: list[dict[str, Any]], tmp_path: Path) -> tuple[Pod, DaemonConfig]:
    """The daemon's configuration as it starts in the pod: the ConfigMap's file, the pod's environment, the
    image's working directory."""
    pod = lay_out(resources, tmp_path)
    (workdir,) = stages()["final"].all("WORKDIR")
    return pod, parse_config(pod.config.read_text(), pod.fs(workdir), pod.env)


# ServiceMonitor is a CRD of the Prometheus operator, which kubernetes-validate has no schema for: the fields of
# monitoring.coreos.com/v1 ServiceMonitorSpec and Endpoint (its API reference) as a closed schema, and the
# metadata and label selector against the Kubernetes definitions.
DURATION = r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
META = "io.k8s.apimachinery.pkg.apis.meta.v1."
SERVICE_MONITOR = {
    "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "ServiceMonitor"},
        "metadata": {"$ref": f"#/$defs/{META}ObjectMeta"},
        "spec": {"type": "object", "additionalProperties": False, "required": ["selector", "endpoints"],
                 "properties": {
                     "selector": {"$ref": f"#/$defs/{META}LabelSelector"},
                     "namespaceSelector": {"type": "object", "additionalProperties": False, "properties": {
                         "any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}}},
                     "jobLabel": {"type": "string"},
                     "targetLabels": {"type": "array", "items": {"type": "string"}},
                     "podTargetLabels": {"type": "array", "items": {"type": "string"}},
                     "sampleLimit": {"type": "integer", "minimum": 0},
                     "endpoints": {"type": "array", "minItems": 1, "items": {
                         "type": "object", "additionalProperties": False, "properties": {
                             "port": {"type": "string"}, "path": {"type": "string"},
                             "scheme": {"enum": ["http", "https"]},
                             "interval": {"type": "string", "pattern": DURATION},
                             "scrapeTimeout": {"type": "string", "pattern": DURATION},
                             "honorLabels": {"type": "boolean"}, "honorTimestamps": {"type": "boolean"}}}}}}}}


def validate(resource: dict[str, Any]) -> None:
    if resource["kind"] != "ServiceMonitor":
        kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)
        return
    defs = importlib.resources.files("kubernetes_validate").joinpath(
        f"kubernetes-json-schema/v{KUBERNETES_VERSION}.0-local-strict/_definitions.json")
    schema = {**SERVICE_MONITOR, "$defs": json.loads(defs.read_text())["$defs"]}
    jsonschema.Draft202012Validator(schema).validate(resource)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_variant_renders_and_validates(rendered: dict[str, list[dict[str, Any]]], variant: str) -> None:
    resources = rendered[variant]
    kinds = set(by_kind(resources))
    expected = {"ConfigMap", "Service", "PodDisruptionBudget"}
    expected |= {"Deployment", "PersistentVolumeClaim"} if variant.startswith("cpu-deployment") else set()
    expected |= {"DaemonSet"} if "daemonset" in variant else set()
    expected |= {"ServiceMonitor"} if variant.endswith("+servicemonitor") else set()
    assert kinds == expected
    for resource in resources:
        validate(resource)


def test_validation_would_catch_a_mistake(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """The schemas are strict: a misspelt field or a wrong type fails (so passing means something)."""
    ds = by_kind(rendered["gpu-daemonset"])["DaemonSet"]
    typo = json.loads(json.dumps(ds))
    c = container(typo["spec"]["template"]["spec"], DAEMON)
    c["readinesProbe"] = c.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        validate(typo)
    sm = json.loads(json.dumps(by_kind(rendered["gpu-daemonset+servicemonitor"])["ServiceMonitor"]))
    sm["spec"]["endpoints"][0]["interval"] = "15 seconds"
    with pytest.raises(jsonschema.ValidationError):
        validate(sm)


def test_the_renderer_refuses_what_it_does_not_implement(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("namePrefix: x-\nresources: []\n")
    with pytest.raises(Unsupported, match="namePrefix"):
        render(tmp_path)


@pytest.mark.parametrize("variant", WORKLOAD_VARIANTS)
def test_probes_and_ports_are_the_daemons(rendered: dict[str, list[dict[str, Any]]], variant: str,
                                          tmp_path: Path) -> None:
    resources = rendered[variant]
    pod, cfg = daemon_config(resources, tmp_path)
    c = pod.container
    host, _, port = cfg.http.listen.rpartition(":")
    assert host not in ("127.0.0.1", "localhost", "::1") and cfg.http.allow_remote and cfg.http.api_keys
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = c[probe]["httpGet"]
        assert port_number(c, get["port"]) == int(port), probe
        assert get["path"] in cfg.http.open_routes, f"{probe} would need an API key"  # kubelet sends none
    assert c["livenessProbe"]["httpGet"]["path"] == "/livez"  # never fails because workers are down
    assert c["readinessProbe"]["httpGet"]["path"] == c["startupProbe"]["httpGet"]["path"] == "/readyz"
    # the listener opens after the first load; the startup budget covers the daemon's own bounds on it
    startup = c["startupProbe"]
    budget = startup.get("initialDelaySeconds", 0) + startup["periodSeconds"] * startup["failureThreshold"]
    assert budget >= cfg.supervisor.windows.setup_s + cfg.supervisor.windows.load_s
    service = by_kind(resources)["Service"]
    (sport,) = service["spec"]["ports"]
    assert port_number(c, sport["targetPort"]) == int(port)
    if variant.endswith("+servicemonitor"):
        (endpoint,) = by_kind(resources)["ServiceMonitor"]["spec"]["endpoints"]
        assert endpoint["port"] == sport["name"] and endpoint["path"] == "/metrics" in cfg.http.open_routes


@pytest.mark.parametrize("variant", WORKLOAD_VARIANTS)
def test_the_grace_period_covers_the_drain(rendered: dict[str, list[dict[str, Any]]], variant: str,
                                           tmp_path: Path) -> None:
    """An evicted pod gets preStop, then SIGTERM: readiness fails, requests are admitted for shutdown_delay_s,
    those in flight get drain_s, the workers shutdown_s + kill_grace_s; all inside the grace period."""
    pod, cfg = daemon_config(rendered[variant], tmp_path)
    pre_stop = pod.container["lifecycle"]["preStop"]["sleep"]["seconds"]
    w = cfg.supervisor.windows
    needed = pre_stop + cfg.shutdown_delay_s + cfg.drain_s + w.shutdown_s + w.kill_grace_s + GRACE_MARGIN_S
    assert pod.pod["terminationGracePeriodSeconds"] >= needed
    assert cfg.shutdown_delay_s > 0  # routers that poll /readyz see it fail before requests are refused


@pytest.mark.parametrize("variant", WORKLOAD_VARIANTS)
def test_non_root_read_only_and_every_written_path_on_a_volume(rendered: dict[str, list[dict[str, Any]]],
                                                               variant: str, tmp_path: Path) -> None:
    pod, cfg = daemon_config(rendered[variant], tmp_path)
    spec = pod.pod
    sc = spec["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] > 0 and sc["runAsGroup"] > 0 and "fsGroup" in sc
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert spec["automountServiceAccountToken"] is False
    for c in [*spec.get("initContainers", []), *spec["containers"]]:
        csc = c["securityContext"]
        assert csc["readOnlyRootFilesystem"] is True and csc["allowPrivilegeEscalation"] is False, c["name"]
        assert csc["capabilities"]["drop"] == ["ALL"], c["name"]
        if c["name"] == "state-owner":  # the one root container: CHOWN alone, the state directory alone
            assert csc["runAsUser"] == 0 and csc["capabilities"]["add"] == ["CHOWN"]
            assert [m["name"] for m in c["volumeMounts"]] == ["state"]
            assert c["command"][:2] == ["chown", f"{sc['runAsUser']}:{sc['runAsGroup']}"]
            assert c["command"][2] == mount_of(cfg_path(pod, cfg.supervisor.state_dir), mounts(spec, pod.container))
        else:
            assert "runAsUser" not in csc and csc["runAsNonRoot"] is True, c["name"]
    # everything the daemon writes lies on a writable volume: state, runtime dir, API socket, temp, home
    table = mounts(spec, pod.container)
    written = [cfg.supervisor.state_dir, cfg.supervisor.runtime_dir, Path(cfg.http.unix_socket).parent,
               *(Path(pod.env[k]) for k in ("TMPDIR", "HOME", "XDG_CACHE_HOME"))]
    for path in written:
        mount = mount_of(cfg_path(pod, path), table)
        assert mount is not None, f"{path} is on the read-only root filesystem"
        volume, read_only = table[mount]
        assert not read_only and {"emptyDir", "hostPath", "persistentVolumeClaim"} & set(volume), path
    # the configuration and the keys come from read-only volumes: the ConfigMap and the Secret
    assert "configMap" in table[mount_of(config_arg(pod.container), table)][0]
    keys = table[mount_of(cfg_path(pod, tomllib.loads(pod.config.read_text())["http"]["api_keys_file"]), table)]
    assert keys[1] and keys[0]["secret"]["secretName"] == "gpuworkerd-api-keys"
    assert keys[0]["secret"]["defaultMode"] == 0o440  # the fsGroup may read it, nobody else
    assert not [r for r in rendered[variant] if r["kind"] == "Secret"]  # created by the operator, not shipped


def cfg_path(pod: Pod, path: Path | str) -> str:
    """A path of the laid-out pod back as the container sees it."""
    return "/" + str(Path(path).relative_to(pod.fs.root))


@pytest.mark.parametrize("variant", WORKLOAD_VARIANTS)
def test_the_tune_init_container_pre_tunes_the_daemons_model(rendered: dict[str, list[dict[str, Any]]],
                                                             variant: str, tmp_path: Path) -> None:
    pod, cfg = daemon_config(rendered[variant], tmp_path)
    tune = container(pod.pod, "tune", init=True)
    assert [c["name"] for c in pod.pod["initContainers"]][-1] == "tune"  # after state-owner, where there is one
    args = tune["args"]
    model = args[args.index("tune") + 1]
    assert cfg.supervisor.model(model).beam > 0
    assert config_arg(tune) == config_arg(pod.container)
    for key in ("image", "env", "securityContext", "volumeMounts"):
        assert tune[key] == pod.container[key], key  # the daemon's caches, seen as the daemon sees them
    assert tune["resources"] == pod.container["resources"]  # the GPU too, on GPU nodes


def test_the_daemonset_and_the_deployment_run_the_same_pod(rendered: dict[str, list[dict[str, Any]]]) -> None:
    ds, dep = pod_spec(rendered["cpu-daemonset"]), pod_spec(rendered["cpu-deployment"])
    state = lambda pod: next(v for v in pod["volumes"] if v["name"] == "state")  # noqa: E731
    assert state(ds)["hostPath"]["type"] == "DirectoryOrCreate"
    assert state(dep)["persistentVolumeClaim"]["claimName"] == by_kind(
        rendered["cpu-deployment"])["PersistentVolumeClaim"]["metadata"]["name"]
    strip = lambda pod: {**pod, "volumes": [v for v in pod["volumes"] if v["name"] != "state"],  # noqa: E731
                         "initContainers": [c for c in pod["initContainers"] if c["name"] != "state-owner"]}
    assert strip(ds) == strip(dep)
    assert [c["name"] for c in ds["initContainers"]] == ["state-owner", "tune"]
    assert workload(rendered["cpu-deployment"])["spec"]["strategy"] == {"type": "Recreate"}  # ReadWriteOnce claim


def test_the_gpu_component(rendered: dict[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    gpu, cpu = pod_spec(rendered["gpu-daemonset"]), pod_spec(rendered["cpu-daemonset"])
    assert gpu["nodeSelector"] == {"nvidia.com/gpu.present": "true"} and "nodeSelector" not in cpu
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in gpu["tolerations"]
    for name, init in ((DAEMON, False), ("tune", True)):
        assert container(gpu, name, init)["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert "nvidia.com/gpu" not in container(cpu, name, init)["resources"]["limits"]
        assert container(gpu, name, init)["image"].endswith(":cuda")
        assert container(cpu, name, init)["image"].endswith(":cpu")
    _, gpu_cfg = daemon_config(rendered["gpu-daemonset"], tmp_path / "gpu")
    _, cpu_cfg = daemon_config(rendered["cpu-daemonset"], tmp_path / "cpu")
    assert {ln.device for ln in gpu_cfg.supervisor.lanes} == {"CUDA"}
    assert {ln.device for ln in cpu_cfg.supervisor.lanes} == {"CPU"}
    # the two configurations differ in the lanes' devices and replicas only
    lanes = lambda cfg: [(ln.id.split("-")[0], ln.models) for ln in cfg.supervisor.lanes]  # noqa: E731
    assert sorted(set(lanes(gpu_cfg))) == sorted(set(lanes(cpu_cfg)))
    same = lambda cfg: dataclasses.replace(  # noqa: E731
        cfg, supervisor=dataclasses.replace(cfg.supervisor, lanes=(), state_dir=Path(), runtime_dir=Path()),
        http=dataclasses.replace(cfg.http, api_keys=frozenset(), api_keys_file="", unix_socket=""))
    assert same(gpu_cfg) == same(cpu_cfg)
    # one embedding worker per CPU the pod requests
    cpus = int(container(cpu, DAEMON)["resources"]["requests"]["cpu"])
    assert sum(ln.models == ("all-MiniLM-L6-v2",) for ln in cpu_cfg.supervisor.lanes) == cpus


@pytest.mark.parametrize("variant", WORKLOAD_VARIANTS)
def test_the_service_and_the_budget_select_the_pods(rendered: dict[str, list[dict[str, Any]]], variant: str) -> None:
    kinds = by_kind(rendered[variant])
    w = workload(rendered[variant])
    labels = w["spec"]["template"]["metadata"]["labels"]
    for selector in (kinds["Service"]["spec"]["selector"], kinds["PodDisruptionBudget"]["spec"]["selector"]
                     ["matchLabels"], w["spec"]["selector"]["matchLabels"]):
        assert selector.items() <= labels.items()
    assert kinds["PodDisruptionBudget"]["spec"]["maxUnavailable"] >= 1  # a budget that never blocks a drain
    if variant.endswith("+servicemonitor"):
        sm = kinds["ServiceMonitor"]["spec"]["selector"]["matchLabels"]
        assert sm.items() <= kinds["Service"]["metadata"]["labels"].items()


def test_the_pods_environment_names_the_daemons_paths(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """The manifest sets what the image sets, so it does not depend on how the image was built."""
    c = container(pod_spec(rendered["gpu-daemonset"]), DAEMON)
    env = container_env(c)
    assert {k for k in env if k.startswith("GPUWORKER_")} == {"GPUWORKER_STATE_DIR", "GPUWORKER_RUNTIME_DIR",
                                                               "GPUWORKER_UNIX_SOCKET"}
    assert mount_of(env["GPUWORKER_UNIX_SOCKET"], mounts(pod_spec(rendered["gpu-daemonset"]), c)) == \
        env["GPUWORKER_RUNTIME_DIR"]
    assert (K8S / "kustomization.yaml").is_file()
