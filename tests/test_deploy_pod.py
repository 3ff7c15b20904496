"""gpuworkerd as the manifests run it: the real process with the ConfigMap's configuration and the pod's
environment and volumes. Only the engines are fake (tests/support/fakes.py), and the TCP listener moves from all
addresses to loopback (a test listens on no other interface). The probes are the manifest's, read from the rendered
YAML, and act as the kubelet's do (a fresh connection each, success for 200-399); SIGTERM is what the kubelet sends
after preStop.

Two ways to run it. `sandboxed` (root with CAP_SYS_ADMIN, as CI has): in a mount namespace of its own
(tests/support/pod_sandbox.py) the volumes sit at the manifest's paths, everything else is read-only, and the daemon
runs as the manifest's user and groups with no_new_privs: the pod's securityContext, enforced. Otherwise the volumes
lie under a temporary directory, the configuration's and environment's paths are moved there, and the daemon runs
as this test's user."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.support.deploy_helpers import Pod, config_arg, lay_out, port_number, render_variant, stages
from tests.support.fakes import fake_command
from tests.support.helpers import wait_until

SANDBOX = Path(__file__).resolve().parent / "support" / "pod_sandbox.py"
LOOPBACK = "127.0.0.1:0"
PROBES = ("startupProbe", "livenessProbe", "readinessProbe")
EMBED_MODEL = "all-MiniLM-L6-v2"


@contextlib.contextmanager
def pod_root() -> Iterator[Path]:
    """Where the pod's volumes go: a short path, since the worker sockets' paths must fit the kernel's 108 bytes
    (pytest's tmp_path is too long for them), that the manifest's user can reach; removed after."""
    root = Path(tempfile.mkdtemp(prefix="gw-pod-"))
    try:
        os.chmod(root, 0o755)
        yield root
    finally:
        shutil.rmtree(root)


def sandbox_argv(pod: Pod, spec: dict[str, Any], argv: list[str], env: dict[str, str], scratch: Path) -> list[str]:
    """`argv` run by tests/support/pod_sandbox.py as the pod's container: its volumes at their mount paths, the rest
    read-only, as runAsUser / runAsGroup with the fsGroup."""
    sc = spec["securityContext"]
    scratch.mkdir(exist_ok=True)
    (workdir,) = stages()["final"].all("WORKDIR")
    volumes = [{"source": str(pod.fs(m)), "target": m, "read_only": ro} for m, (_, ro) in pod.fs.table.items()]
    desc = {"volumes": volumes, "uid": sc["runAsUser"], "gid": sc["runAsGroup"], "groups": [sc["fsGroup"]],
            "argv": [str(a) for a in argv], "env": env, "cwd": workdir, "scratch": str(scratch)}
    fd, path = tempfile.mkstemp(dir=scratch, suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(desc, f)
    return ["unshare", "--mount", "--propagation", "private", sys.executable, str(SANDBOX), path]


def cannot_sandbox(tmp_path: Path) -> str | None:
    """Why tests/support/pod_sandbox.py cannot run here, or None: as root it runs a probe that must import the project
    as the manifest's user and be refused a write outside the volumes."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return "a mount namespace and another user need root and unshare(1)"
    resources, _ = render_variant("cpu-deployment", tmp_path / "render")
    with pod_root() as root:
        pod = lay_out(resources, root, uid=pod_spec_of(resources)["securityContext"]["runAsUser"], moved=False)
        check = ("import os, trio_gpuworker\n"
                 "try:\n    open('/etc/gw-sandbox-probe', 'w')\nexcept OSError as e:\n    print('refused', e.errno)\n"
                 "print(os.getuid(), os.getgid(), os.getgroups())")
        argv = sandbox_argv(pod, pod_spec_of(resources), [sys.executable, "-c", check], {"PATH": os.environ["PATH"]},
                            root / ".sandbox")
        r = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
        sc = pod_spec_of(resources)["securityContext"]
        expected = f"{sc['runAsUser']} {sc['runAsGroup']} [{sc['fsGroup']}]"
        if r.returncode != 0 or "refused 30" not in r.stdout or expected not in r.stdout:  # 30: EROFS
            return f"the sandbox did not come up: {r.stdout[-500:]} {r.stderr[-1500:]}"
    return None


def pod_spec_of(resources: list[dict[str, Any]]) -> dict[str, Any]:
    return next(r for r in resources if r["kind"] in ("DaemonSet", "Deployment"))["spec"]["template"]["spec"]


def with_fake_engines(config: Path) -> None:
    """Every [[lanes]] table of the ConfigMap's file gets a scripted worker; nothing else changes. The embedding
    lanes answer their first request after 1.5 s, so one can be in flight when SIGTERM comes."""
    slow = json.dumps(list(fake_command("slow", delay=1.5, on_request=1)))
    plain = json.dumps(list(fake_command()))
    out = []
    for block in config.read_text().split("[[lanes]]\n"):
        if out:
            block = f"worker_command = {slow if EMBED_MODEL in block.split('[', 2)[1] else plain}\n" + block
        out.append(block)
    config.write_text("[[lanes]]\n".join(out))
    assert len(tomllib.loads(config.read_text())["lanes"]) == len(out) - 1


def ids(pid: int) -> dict[str, list[int]]:
    """Uid, Gid and Groups of a process, from /proc."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("Uid", "Gid", "Groups", "NoNewPrivs", "CapEff"):
            fields[key] = [int(v, 16 if key == "CapEff" else 10) for v in value.split()]
    return fields


class Kubelet:
    """The manifest's httpGet probes against the daemon's listener: a new connection each, 200-399 is success."""

    def __init__(self, container: dict[str, Any], base_url: str) -> None:
        self.container = container
        self.base_url = base_url

    async def probe(self, name: str) -> int | None:
        """The probe's status code, or None when the connection failed: refused, or closed without an answer
        by a listener that is shutting down (the kubelet counts both as a failed probe)."""
        get = self.container[name]["httpGet"]
        async with httpx.AsyncClient(base_url=self.base_url, timeout=self.container[name]["timeoutSeconds"],
                                     limits=httpx.Limits(max_keepalive_connections=0)) as client:
            try:
                return (await client.get(get["path"])).status_code
            except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
                return None


@pytest.fixture
def sandbox(request: pytest.FixtureRequest, tmp_path: Path) -> bool:
    """The test's `sandboxed` parameter, skipping (sync, so the reason shows) where the sandbox cannot run."""
    sandboxed = request.node.callspec.params["sandboxed"]
    if sandboxed and (why := cannot_sandbox(tmp_path)):
        pytest.skip(f"cannot run the daemon as the pod's container here: {why}")
    return sandboxed


@pytest.mark.parametrize(("variant", "sandboxed"), [("cpu-deployment", False), ("cpu-deployment", True),
                                                   ("gpu-daemonset", True)])
async def test_the_pod_probes_serves_with_keys_and_drains_on_sigterm(tmp_path: Path, variant: str,
                                                                     sandboxed: bool, sandbox: bool) -> None:
    resources, kubectls = render_variant(variant, tmp_path / "render")
    resources = kubectls or resources
    assert sandbox == sandboxed
    with pod_root() as root:
        await run_the_pod(resources, root, tmp_path, sandboxed)


async def run_the_pod(resources: list[dict[str, Any]], root: Path, tmp_path: Path, sandboxed: bool) -> None:
    spec = pod_spec_of(resources)
    sc = spec["securityContext"]
    pod = lay_out(resources, root, uid=sc["runAsUser"] if sandboxed else None, moved=not sandboxed)
    c = pod.container
    listen = tomllib.loads(pod.config.read_text())["http"]["listen"]
    assert {port_number(c, c[p]["httpGet"]["port"]) for p in PROBES} == {int(listen.rpartition(":")[2])}
    with_fake_engines(pod.config)
    (workdir,) = stages()["final"].all("WORKDIR")
    args = c["args"] if sandboxed else [a if a != config_arg(c) else str(pod.config) for a in c["args"]]
    env = {"PATH": os.environ["PATH"], **pod.env, "GPUWORKER_LISTEN": LOOPBACK}
    daemon = [str(Path(sys.prefix) / "bin" / "gpuworkerd"), *args]
    ctl = [str(Path(sys.prefix) / "bin" / "gpuworkerctl"), "--json", "status"]
    if sandboxed:
        daemon = sandbox_argv(pod, spec, daemon, env, root / ".sandbox")
    grace_s = spec["terminationGracePeriodSeconds"] - c["lifecycle"]["preStop"]["sleep"]["seconds"]
    log_path = tmp_path / "stderr"
    records: list[dict[str, Any]] = []

    def logged(msg: str) -> bool:
        records[:] = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
        return any(r["msg"].startswith(msg) for r in records)

    async with trio.open_nursery() as nursery:
        with log_path.open("wb") as log:
            proc = await nursery.start(partial(trio.run_process, daemon, env=env, cwd=pod.fs(workdir), stderr=log,
                                               check=False))
            await wait_until(lambda: logged("gpuworkerd ready") or proc.returncode is not None, within_s=60,
                             poll_s=0.1)
            assert proc.returncode is None, log_path.read_text()[-3000:]
            ready = next(r["msg"] for r in records if r["msg"].startswith("gpuworkerd ready"))
            kubelet = Kubelet(c, ready.split(": ", 1)[1].split(", ")[0])
            for probe in PROBES:  # the startup probe passes, then liveness and readiness
                assert 200 <= (await kubelet.probe(probe) or 0) < 400, probe
            key = {"authorization": f"Bearer {pod.api_key}"}  # the Secret's key
            async with httpx.AsyncClient(base_url=kubelet.base_url, timeout=30) as http:
                r = await http.get("/v1/lanes")
                assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
                lanes = (await http.get("/v1/lanes", headers=key)).json()["data"]
                assert {ln["state"] for ln in lanes} == {"ready"}
                for pid in (proc.pid, *(ln["pid"] for ln in lanes)):
                    got = ids(pid)
                    if sandboxed:  # the daemon and its workers: the manifest's user, no privileges
                        assert got["Uid"] == [sc["runAsUser"]] * 4 and got["Gid"] == [sc["runAsGroup"]] * 4
                        assert got["Groups"] == [sc["fsGroup"]] and got["NoNewPrivs"] == [1] and got["CapEff"] == [0]
                # kubectl exec POD -- gpuworkerctl status: the pod's environment names the API socket
                if sandboxed:
                    ctl = ["nsenter", f"--target={proc.pid}", "--mount", f"--setuid={sc['runAsUser']}",
                           f"--setgid={sc['runAsGroup']}", "--", *ctl]
                with trio.fail_after(30):
                    status = await trio.run_process(ctl, env=env, capture_stdout=True, capture_stderr=True, check=False)
                assert status.returncode == 0, status.stderr
                assert sorted(ln["lane_id"] for ln in json.loads(status.stdout)["data"]) == \
                    sorted(ln["lane_id"] for ln in lanes)

                results: list[int] = []

                async def embed(text: str) -> None:
                    r = await http.post("/v1/embeddings", json={"model": EMBED_MODEL, "input": text}, headers=key)
                    results.append(r.status_code)

                nursery.start_soon(embed, "in flight when SIGTERM comes")

                async def states() -> set[str]:
                    return {ln["state"] for ln in (await http.get("/v1/lanes", headers=key)).json()["data"]}

                with trio.fail_after(10):
                    while "busy" not in await states():  # noqa: ASYNC110 (another process's state: polled)
                        await trio.sleep(0.02)
                t0 = trio.current_time()
                proc.send_signal(signal.SIGTERM)
                readiness: list[int | None] = []
                with trio.fail_after(grace_s):
                    while not readiness or readiness[-1] is not None:
                        readiness.append(await kubelet.probe("readinessProbe"))
                        if len(readiness) == 1:  # admitted during daemon.shutdown_delay_s: a lagging router loses none
                            await embed("sent after SIGTERM")
                            assert await kubelet.probe("livenessProbe") == 200  # stopping is not dying
                        await trio.sleep(0.05)
                    rc = await proc.wait()
                stopped_in = trio.current_time() - t0
        nursery.cancel_scope.cancel()
    # readiness failed at once and stayed failed while the listener was open; then the listener closed
    assert readiness[0] == 503 and set(readiness[:-1]) == {503} and readiness[-1] is None, readiness
    assert results == [200, 200]  # the one in flight finished in the drain, the late one was admitted
    assert rc == 0 and stopped_in <= grace_s, (rc, stopped_in)
    assert logged("gpuworkerd stopped") and records[-1]["msg"] == "gpuworkerd stopped"
    await wait_until(lambda: not any(os.path.exists(f"/proc/{ln['pid']}") for ln in lanes))
    state = pod.fs("/var/lib/gpuworkerd")
    assert (state / "digests.json").is_file() and (state / "cache").is_dir()  # the state volume holds the caches
