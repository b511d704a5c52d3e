"""The Dockerfiles agree with the compose file and the build context (no Docker daemon needed).

Nothing here builds an image. What is checked is what breaks a build or a container start and can be
seen statically: a COPY source that is missing or excluded by .dockerignore, and a command name the
compose file runs that the service's image does not install.
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.support import DOCKER_DIR, ENV_FILES, REPO, read_env_file, render

DOCKERFILES = sorted(DOCKER_DIR.glob("*.Dockerfile"))


def _ignore_patterns() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def _ignored(rel: str, patterns: list[str]) -> bool:
    """Docker's rule, enough for our patterns: a path is excluded when it or a parent folder matches."""
    parts = Path(rel).parts
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        for candidate in candidates:
            if fnmatch.fnmatch(candidate, pattern) or fnmatch.fnmatch(candidate, pattern.removeprefix("**/")):
                return True
            if pattern.startswith("**/") and fnmatch.fnmatch(Path(candidate).name, pattern.removeprefix("**/")):
                return True
    return False


def _copies(dockerfile: Path) -> list[tuple[list[str], str]]:
    """(sources, destination) of every COPY from the build context (not --from=stage)."""
    out = []
    for line in dockerfile.read_text().splitlines():
        m = re.match(r"^COPY\s+(.*)$", line.strip())
        if not m or "--from=" in m.group(1):
            continue
        *sources, dest = m.group(1).split()
        out.append((sources, dest))
    return out


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_copy_sources_exist_and_reach_the_build_context(dockerfile: Path) -> None:
    patterns = _ignore_patterns()
    copies = _copies(dockerfile)
    assert copies, dockerfile.name
    for sources, _ in copies:
        for src in sources:
            assert (REPO / src).exists(), f"{dockerfile.name}: COPY {src}: no such path"
            assert not _ignored(src.rstrip("/"), patterns), f"{dockerfile.name}: COPY {src} is in .dockerignore"


def test_dockerignore_keeps_the_heavy_and_private_paths_out() -> None:
    patterns = _ignore_patterns()
    for rel in (".venv", ".venv-vllm", ".git", "models", "tests", "router/__pycache__/x.pyc", "deploy/env"):
        assert _ignored(rel, patterns), rel
    for rel in ("pyproject.toml", "README.md", "router", "metaserver", "connector", "deploy/local", "deploy/docker"):
        assert not _ignored(rel, patterns), rel


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    return render(ENV_FILES["head"])["services"]


def test_every_service_image_installs_the_commands_compose_runs(services: dict[str, Any]) -> None:
    for name, svc in services.items():
        build = svc.get("build")
        if not build:
            continue  # redis, prometheus, grafana: upstream images
        dockerfile = Path(build["context"]) / build["dockerfile"]
        text = dockerfile.read_text()
        installed = {dest.rsplit("/", 1)[-1] for _, dest in _copies(dockerfile) if dest.startswith("/usr/local/bin/")}
        entrypoint = svc.get("entrypoint") or []
        if entrypoint:
            assert entrypoint[0] in installed, (name, entrypoint)
        healthcheck = svc["healthcheck"]["test"]
        if healthcheck[0] == "CMD" and healthcheck[1].startswith("pdgate-"):
            assert healthcheck[1] in installed, (name, healthcheck)
        command = svc.get("command") or []
        if command and command[0].startswith("pdgate-"):
            # console scripts of the pdgate distribution, installed by pip
            assert re.search(r"pip (wheel|install).*\.", text), (name, dockerfile.name)
        assert re.search(r"^HEALTHCHECK ", text, re.M), dockerfile.name


def test_control_plane_and_cpu_engine_images_run_unprivileged() -> None:
    for name in ("control-plane.Dockerfile", "engine-cpu.Dockerfile"):
        users = re.findall(r"^USER\s+(\S+)", (DOCKER_DIR / name).read_text(), re.M)
        assert users and users[-1].split(":")[0] not in ("root", "0"), name


def test_ascend_image_takes_its_base_tag_from_the_env_files(services: dict[str, Any]) -> None:
    text = (DOCKER_DIR / "engine-ascend.Dockerfile").read_text()
    assert re.search(r"^ARG VLLM_ASCEND_TAG=", text, re.M)
    assert re.search(r"^FROM \$\{VLLM_ASCEND_IMAGE\}:\$\{VLLM_ASCEND_TAG\}", text, re.M)
    prefill = render(ENV_FILES["prefill"])["services"]["prefill-ascend"]
    assert prefill["build"]["args"]["VLLM_ASCEND_TAG"] == read_env_file(ENV_FILES["prefill"])["PDGATE_VLLM_ASCEND_TAG"]
