"""The images: versioned tags, pull policy, the control plane's without torch, the build.

Every image a deployment file names is ``phalanx`` (agents, ranks: the ``full`` target
of deploy/Dockerfile) or ``phalanx-control-plane`` (the services: its ``control-plane``
target), tagged with the package version (``-cuda`` for the GPU overlay's agents), and
Kubernetes pulls it only when missing. The control-plane target installs
``deploy/requirements.py``'s list, pyproject.toml's dependencies less torch, numpy,
matplotlib and nvidia-ml-py; the processes standing in for its containers
(``deploy_local``) cannot import what it lacks. No engine builds the images here: the
``source`` stage's files, copied as its ``COPY`` lines say, must build phalanx's wheel.
"""

from __future__ import annotations

import fnmatch
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from deploy_local import DEPLOY, REPO, TARGETS, Container, Image, World, stages
from test_deploy_compose import compose_config, is_phalanx, load
from test_deploy_k8s import OVERLAYS, containers_of, render

from phalanx import schemas
from phalanx.services import control_plane

DOCKERFILE = DEPLOY / "Dockerfile"
REQUIREMENTS = DEPLOY / "requirements.py"
#: What the control-plane image leaves out, as import names (nvidia-ml-py is pynvml).
AGENT_MODULES = ("torch", "numpy", "matplotlib", "pynvml")


def version() -> str:
    """The package version, as pyproject.toml and ``phalanx.schemas`` both give it."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["version"] == schemas.__version__, "pyproject.toml and schemas disagree"
    return project["version"]


def requirements(pyproject: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REQUIREMENTS), str(pyproject)],
                          capture_output=True, text=True, timeout=60)


# --- tags and pull policy ------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kubernetes_images_carry_the_package_version_and_a_pull_policy(overlay: str) -> None:
    for workload, c in containers_of(render(overlay)):
        name = workload["metadata"]["name"]
        agent = workload["kind"] == "DaemonSet"
        want = "phalanx" if agent else "phalanx-control-plane"
        tag = version() + ("-cuda" if agent and overlay == "gpu" else "")
        assert c["image"] == f"{want}:{tag}", name
        assert c.get("imagePullPolicy") == "IfNotPresent", f"{name}: a versioned tag's policy"


def test_compose_images_carry_the_package_version() -> None:
    resolved, read = compose_config(), load()["services"]  # compose's reader and ours
    ours = {n: s for n, s in resolved.items() if is_phalanx(s)}
    assert ours
    for name, service in ours.items():
        target = service["build"]["target"]
        assert read[name]["build"]["target"] == target, f"{name}: the readers disagree"
        image = {t: i for i, t in TARGETS.items()}[target]
        assert service["image"] == f"{image}:{version()}", name
        assert (target == "control-plane") == (name in control_plane.SERVICES), name


def build_commands(text: str) -> list[list[str]]:
    """The ``docker build`` commands ``text`` shows (in a comment or a code block)."""
    lines = [re.sub(r"^#\s?", "", line) for line in text.splitlines()]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    return [shlex.split(line, comments=True) for line in map(str.strip, joined.splitlines())
            if line.startswith("docker build ")]


@pytest.mark.parametrize("path", [DOCKERFILE, REPO / "docs" / "deploy.md"], ids=lambda p: p.name)
def test_documented_builds_tag_each_target_with_the_version(path: Path) -> None:
    default = list(stages())[-1]
    built = []
    for argv in build_commands(path.read_text()):
        reference = argv[argv.index("-t") + 1]
        assert ":" in reference, f"{path.name}: {reference} without a tag"
        image, tag = reference.split(":")
        target = argv[argv.index("--target") + 1] if "--target" in argv else default
        assert TARGETS.get(image) == target, argv
        cuda = any(a.startswith("TORCH_INDEX=") and "/whl/cpu" not in a for a in argv)
        assert tag == version() + ("-cuda" if cuda else ""), argv
        built.append((image, tag))
    assert sorted(built) == [("phalanx", version()), ("phalanx", f"{version()}-cuda"),
                             ("phalanx-control-plane", version())], path.name


def test_every_image_reference_in_the_docs_and_files_has_the_version() -> None:
    """Prose, comments and commands too: ``phalanx:<tag>`` anywhere in docs/, the README
    and deploy/ is a tag of this version (``chown phalanx:phalanx`` is no image)."""
    reference = re.compile(r"(?<![\w.])(phalanx(?:-control-plane)?):(?!phalanx\b)([\w.-]+)")
    files = [*(REPO / "docs").glob("*.md"), REPO / "README.md",
             *(p for p in DEPLOY.rglob("*") if p.is_file())]
    found = [(f.relative_to(REPO), m[1], m[2]) for f in files
             for m in reference.finditer(f.read_text(errors="replace"))]
    assert len(found) > 10
    wrong = [(f, name, tag) for f, name, tag in found
             if tag not in (version(), f"{version()}-cuda")
             or (name == "phalanx-control-plane" and tag != version())]
    assert not wrong, wrong


# --- the control plane's image -------------------------------------------------------------


def test_control_plane_requirements_are_pyprojects_less_the_agents() -> None:
    result = requirements(REPO / "pyproject.toml")
    assert result.returncode == 0, result.stderr
    listed = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    printed = result.stdout.splitlines()
    left_out = [d for d in listed if d not in printed]
    assert [re.match(r"[\w.-]+", d)[0] for d in left_out] == \
        ["numpy", "matplotlib", "nvidia-ml-py", "torch"]
    assert [d for d in listed if d in printed] == printed


def test_control_plane_requirements_refuse_a_renamed_dependency(tmp_path: Path) -> None:
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text((REPO / "pyproject.toml").read_text()
                         .replace('"nvidia-ml-py>=12"', '"pynvml>=12"'))
    result = requirements(pyproject)
    assert result.returncode != 0 and not result.stdout
    assert "no dependency named ['nvidia-ml-py']" in result.stderr


def test_control_plane_target_installs_only_that_list() -> None:
    """The assumption behind ``deploy_local.SLIM_TARGETS``: the control-plane target's
    virtualenv is built from requirements.py's output and phalanx without dependencies."""
    found = stages()
    _, commands = found["control-plane"]
    (venv,) = [c for c in commands if c.cmd == "COPY" and "/opt/venv" in c.value]
    source = venv.flags[0].removeprefix("--from=")
    (run,) = [c.value[0] for c in found[source][1] if c.cmd == "RUN"]
    assert "python3 deploy/requirements.py pyproject.toml > requirements.txt" in run
    installs = re.findall(r"/opt/venv/bin/pip install ([^&]*)", run)
    assert [i.split() for i in installs] == [["--no-cache-dir", "-r", "requirements.txt"],
                                             ["--no-cache-dir", "--no-deps", "."]]
    assert list(found)[-1] == "full", "docker build without --target builds the agents' image"


def stand_in(target: str, tmp_path: Path, code: str) -> subprocess.CompletedProcess:
    """``python -c code`` as a process standing in for a container of ``target``."""
    image = Image.parse(target)
    argv, env, cwd = World(tmp_path, {}).process(Container(
        target, ["python", "-c", code], dict(image.env), image.workdir, absent=image.absent))
    return subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_control_plane_stand_in_lacks_the_agents_packages(tmp_path: Path) -> None:
    """Every module of every service package (all but ``__main__``, which runs it) and
    the CLI import in the control plane's stand-in; the agents' packages do not."""
    packages = [control_plane.module(s) for s in control_plane.SERVICES]
    code = ("import importlib, pkgutil, phalanx.services.cli\n"
            f"for package in {packages!r}:\n"
            "    for m in pkgutil.iter_modules(importlib.import_module(package).__path__):\n"
            "        if m.name != '__main__':\n"
            "            importlib.import_module(f'{package}.{m.name}')\n"
            f"for m in {AGENT_MODULES!r}:\n"
            "    try:\n"
            "        __import__(m)\n"
            "    except ModuleNotFoundError:\n"
            "        print('absent', m)\n")
    slim = stand_in("control-plane", tmp_path, code)
    assert slim.returncode == 0, slim.stderr
    assert slim.stdout.split() == [w for m in AGENT_MODULES for w in ("absent", m)]
    full = stand_in("full", tmp_path, code)
    assert full.returncode == 0 and full.stdout == "", full.stdout + full.stderr


# --- the build -----------------------------------------------------------------------------


def admitted(path: str) -> bool:
    """Whether deploy/Dockerfile.dockerignore lets ``path`` into the build context (the
    last pattern that matches decides)."""
    keep = True
    for line in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines():
        pattern = line.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negated, pattern = pattern.startswith("!"), pattern.lstrip("!").rstrip("/")
        if fnmatch.fnmatch(path, pattern) or path.startswith(pattern + "/"):
            keep = negated
    return keep


def test_every_file_the_dockerfile_copies_is_in_the_context() -> None:
    for _, commands in stages().values():
        for c in commands:
            if c.cmd == "COPY" and not c.flags:
                for source in c.value[:-1]:
                    assert admitted(source), f"{source}: left out by the .dockerignore"
    assert not admitted("tests/deploy/test_deploy_images.py")


def test_source_stage_builds_the_phalanx_wheel(tmp_path: Path) -> None:
    """The ``source`` stage's tree, copied as its lines say, is one pip can build (a
    package directory pyproject.toml names and the stage does not copy fails here)."""
    source = tmp_path / "src"
    _, commands = stages()["source"]
    for c in commands:
        if c.cmd == "COPY":
            *paths, dest = c.value
            for path in paths:
                target = source / dest / Path(path).name if dest.endswith("/") \
                    else source / dest
                target.parent.mkdir(parents=True, exist_ok=True)
                if (REPO / path).is_dir():
                    shutil.copytree(REPO / path, target,
                                    ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    shutil.copy(REPO / path, target)
    listed = requirements(source / "pyproject.toml")
    assert listed.returncode == 0, listed.stderr
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                            "--no-build-isolation", "-q", "-w", str(tmp_path / "out"), "."],
                           cwd=source, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (tmp_path / "out").glob(f"phalanx-{version()}-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for service in control_plane.SERVICES:
        module = control_plane.module(service).replace(".", "/")
        assert f"{module}/__main__.py" in names, service
    assert "phalanx/services/cli/__init__.py" in names
