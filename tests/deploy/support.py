"""Helpers of the deployment tests: read the env files, render the compose file, pick services by profile.

Rendering uses the real Debian `docker-compose` (v1.29) binary: `docker-compose config` interpolates and
validates without a Docker daemon. It renders every service whatever the profiles, so which services a
host would start is computed here with compose's own rule (compose/project.py `get_services` and
`_inject_deps` in 1.29): a service starts when it has no profiles or one of them is enabled, and a
dependency outside the enabled profiles is an error.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker-compose.yml"
ENV_DIR = REPO / "deploy" / "env"
ENV_FILES = {role: ENV_DIR / f"{role}.env" for role in ("head", "prefill", "decode")}
DOCKER_DIR = REPO / "deploy" / "docker"

_LINE = re.compile(r"^([A-Z_][A-Z0-9_]*)=(.*)$")


class EnvFileError(ValueError):
    pass


def read_env_file(path: Path) -> dict[str, str]:
    """Parse an env file in the strict subset the files promise: KEY=value, comments on their own lines.

    Stricter than docker-compose on purpose: quotes, `export`, `${...}` and inline comments are parsed
    differently by v1 (python-dotenv), v2 (compose-go) and shells, so they are refused here.
    """
    values: dict[str, str] = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            raise EnvFileError(f"{path.name}:{number}: not KEY=value: {raw!r}")
        key, value = m.groups()
        if any(c in value for c in "\"'$`") or " #" in value:
            raise EnvFileError(f"{path.name}:{number}: quotes, $ or inline comments in {key}'s value")
        if key in values:
            raise EnvFileError(f"{path.name}:{number}: {key} set twice")
        values[key] = value
    return values


def docker_compose() -> str:
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.fail("docker-compose (Debian package docker-compose, v1.29) is needed to render docker-compose.yml")
    return exe


def clean_env(overrides: Mapping[str, str] | None = None) -> dict[str, str]:
    """A process environment without the caller's PDGATE_*/COMPOSE_* variables: they would override the
    env file (compose gives the shell precedence), and a test must see only what it sets."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PDGATE_", "COMPOSE_", "DOCKER_"))}
    env.update(overrides or {})
    return env


def render(
    env_files: Path | Iterable[Path],
    overrides: Mapping[str, str] | None = None,
    *,
    interpolate: bool = True,
) -> dict[str, Any]:
    """`docker-compose --env-file F config`, parsed. Several files are concatenated, later ones winning,
    which is the single-host recipe of deploy/README.md."""
    result = run_config(env_files, overrides, interpolate=interpolate)
    if result.returncode != 0:
        raise AssertionError(f"docker-compose config failed ({result.returncode}):\n{result.stderr}")
    data: dict[str, Any] = yaml.safe_load(result.stdout)
    return data


def run_config(
    env_files: Path | Iterable[Path],
    overrides: Mapping[str, str] | None = None,
    *,
    interpolate: bool = True,
) -> subprocess.CompletedProcess[str]:
    files = [env_files] if isinstance(env_files, Path) else list(env_files)
    with tempfile.TemporaryDirectory() as tmp:
        if len(files) == 1:
            env_file = files[0]
        else:
            env_file = Path(tmp) / "combined.env"
            env_file.write_text("\n".join(f.read_text() for f in files))
        cmd = [docker_compose(), "--project-directory", str(REPO), "-f", str(COMPOSE_FILE)]
        cmd += ["--env-file", str(env_file), "config"]
        if not interpolate:
            cmd.append("--no-interpolate")
        return subprocess.run(cmd, capture_output=True, text=True, env=clean_env(overrides), cwd=REPO, check=False)


def profiles_of(env: Mapping[str, str]) -> list[str]:
    return [p.strip() for p in env.get("COMPOSE_PROFILES", "").split(",") if p.strip()]


def enabled_services(config: Mapping[str, Any], profiles: Iterable[str]) -> set[str]:
    """The services `up` starts with these profiles; AssertionError if one depends on a disabled service."""
    active = set(profiles)
    services: Mapping[str, Any] = config["services"]

    def on(name: str) -> bool:
        svc_profiles = services[name].get("profiles") or []
        return not svc_profiles or bool(active & set(svc_profiles))

    chosen = {name for name in services if on(name)}
    for name in chosen:
        for dep in depends_on(services[name]):
            assert dep in chosen, (
                f"service {name!r} depends on {dep!r}, which profiles {sorted(active)} do not enable "
                "(docker-compose refuses to start it)"
            )
    return chosen


def published_ports(service: Mapping[str, Any]) -> set[tuple[str, int, int]]:
    """(host ip, published port, container port) of each `ports` entry. v1 renders the short syntax
    ("0.0.0.0:8300:8300/tcp"), v2 the long one ({host_ip, published, target}): both are accepted."""
    out: set[tuple[str, int, int]] = set()
    for entry in service.get("ports") or []:
        if isinstance(entry, Mapping):
            out.add((str(entry.get("host_ip", "")), int(entry["published"]), int(entry["target"])))
            continue
        spec = str(entry).split("/", 1)[0]
        host_ip, published, target = spec.rsplit(":", 2) if spec.count(":") >= 2 else ("", *spec.split(":"))
        out.add((host_ip, int(published), int(target)))
    return out


def depends_on(service: Mapping[str, Any]) -> dict[str, str]:
    """Dependency name -> condition, for both the list and the mapping forms."""
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):
        return dict.fromkeys(deps, "service_started")
    return {name: (spec or {}).get("condition", "service_started") for name, spec in deps.items()}


def load_engine_cmd() -> ModuleType:
    """deploy/docker/engine_cmd.py, imported by path: it is copied into images, not a package module."""
    name = "pdgate_engine_cmd"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, DOCKER_DIR / "engine_cmd.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
