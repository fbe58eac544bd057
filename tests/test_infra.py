"""Static checks of infra/: Ray cluster launcher configs, the KubeRay manifest, the Dockerfiles
and the MLflow compose file. Nothing here talks to a cloud, a cluster or a Docker engine; the
external validators (kubeconform, docker compose) run only where they are installed."""

from __future__ import annotations

import importlib.util
import ipaddress
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
INFRA = ROOT / "infra"
CLUSTER_YAMLS = sorted((INFRA / "ray").glob("cluster-*.yaml"))
KUBERAY_YAMLS = sorted((INFRA / "k8s").glob("*.yaml"))
COMPOSE = INFRA / "mlflow" / "docker-compose.yaml"
ENV_EXAMPLE = INFRA / "mlflow" / ".env.example"
DOCKERFILES = {
    "cuda": INFRA / "docker" / "Dockerfile",
    "rocm": INFRA / "docker" / "Dockerfile.rocm",
}

# Hardware keys kharness tunes for, each of which must be a node type everywhere. ``auto``
# (detect the local device) and ``cpu`` (the interpreter) are not node types.
GPU_KEYS = ("H100", "H200", "A100", "V710")
NON_NODE_KEYS = {"auto", "cpu"}
ACCEL_PREFIX = "accelerator_type:"
# Node labels a worker group may select GPU nodes by (GPU Feature Discovery, AMD labeller).
GPU_NODE_LABELS = {"nvidia.com/gpu.product", "amd.com/gpu.product-name", "amd.com/gpu.device-id"}
GPU_RESOURCES = {"nvidia.com/gpu", "amd.com/gpu"}

SECRET_PATTERNS = [
    re.compile(r"AKIA[0-9A-Z]{16}"),  # AWS access key id
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    re.compile(r"(?i)aws_secret_access_key\s*[:=]\s*['\"]?[A-Za-z0-9/+]{30,}"),
]


# -- helpers ------------------------------------------------------------------------------


def _load(path: Path) -> Any:
    with open(path) as f:
        return yaml.safe_load(f)


def _load_all(path: Path) -> list[Any]:
    with open(path) as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def _ids(paths: list[Path]) -> list[str]:
    return [p.name for p in paths]


def _ray_package_dir() -> Path:
    """The installed ray package, found without importing it."""
    spec = importlib.util.find_spec("ray")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("ray is not installed (pip install .[tune])")
    return Path(next(iter(spec.submodule_search_locations)))


def _accelerator_keys(resources: dict[str, Any]) -> set[str]:
    return {k[len(ACCEL_PREFIX) :] for k in resources if k.startswith(ACCEL_PREFIX)}


def _cluster_node_types(cfg: dict) -> dict[str, set[str]]:
    """Worker node type name -> hardware keys it advertises."""
    head = cfg["head_node_type"]
    return {
        name: _accelerator_keys(nt.get("resources", {}))
        for name, nt in cfg["available_node_types"].items()
        if name != head
    }


def _kuberay_cluster() -> dict:
    clusters = [
        doc
        for path in KUBERAY_YAMLS
        for doc in _load_all(path)
        if isinstance(doc, dict) and doc.get("kind") == "RayCluster"
    ]
    assert len(clusters) == 1, f"expected one RayCluster under infra/k8s, found {len(clusters)}"
    return clusters[0]


def _ray_start_resources(params: dict[str, str]) -> dict[str, Any]:
    """KubeRay's ``resources`` start param: a JSON object wrapped in one more pair of quotes,
    as ``ray start --resources=...`` receives it through a shell."""
    raw = params.get("resources")
    if raw is None:
        return {}
    assert isinstance(raw, str), "rayStartParams values must be strings"
    text = raw.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1].replace('\\"', '"')
    value = json.loads(text)
    assert isinstance(value, dict), f"resources must be a JSON object, got {raw!r}"
    return value


def _kuberay_group_keys() -> dict[str, set[str]]:
    spec = _kuberay_cluster()["spec"]
    return {
        g["groupName"]: _accelerator_keys(_ray_start_resources(g.get("rayStartParams", {})))
        for g in spec.get("workerGroupSpecs", [])
    }


def _walk_hardware(node: Any) -> Iterator[str]:
    """Every hardware key in an experiment file: values of ``hardware`` keys that are a list or
    a string. Mappings under ``hardware`` are per-hardware search-space overrides, not
    requests for nodes."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "hardware" and isinstance(value, str):
                yield value
            elif key == "hardware" and isinstance(value, list):
                yield from (str(v) for v in value)
            else:
                yield from _walk_hardware(value)
    elif isinstance(node, list):
        for item in node:
            yield from _walk_hardware(item)


def _experiment_hardware_keys() -> dict[str, set[str]]:
    """Hardware keys each configs/*.yaml asks for, read at test time."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / "configs").glob("*.y*ml")):
        keys = {k for doc in _load_all(path) for k in _walk_hardware(doc)}
        if keys:
            found[path.name] = keys
    return found


def _dockerfile_lines(path: Path) -> list[str]:
    """Logical Dockerfile instructions: comments dropped, continuation lines joined."""
    lines: list[str] = []
    buf = ""
    for raw in path.read_text().splitlines():
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        lines.append(buf + stripped)
        buf = ""
    if buf:
        lines.append(buf.strip())
    return lines


def _dockerfile_args(path: Path) -> dict[str, str]:
    args = {}
    for line in _dockerfile_lines(path):
        m = re.match(r"ARG\s+(\w+)=(\S+)", line)
        if m:
            args[m.group(1)] = m.group(2)
    return args


def _is_private_bind(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return not ip.is_unspecified and (ip.is_loopback or ip.is_private)


def _interpolation_default(value: str) -> str:
    """``${VAR:-default}`` -> ``default``; other text unchanged."""
    return re.sub(r"\$\{\w+:?-([^}]*)\}", r"\1", value)


# -- Ray cluster launcher configs ---------------------------------------------------------


def test_cluster_yamls_exist() -> None:
    names = _ids(CLUSTER_YAMLS)
    assert "cluster-aws.yaml" in names
    assert any("azure" in n for n in names), names


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=_ids(CLUSTER_YAMLS))
def test_cluster_yaml_matches_ray_schema(path: Path) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema_path = _ray_package_dir() / "autoscaler" / "ray-schema.json"
    if not schema_path.is_file():
        pytest.skip(f"the installed ray ships no {schema_path.name}")
    schema = json.loads(schema_path.read_text())
    validator = jsonschema.Draft7Validator(schema)
    errors = sorted(validator.iter_errors(_load(path)), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=_ids(CLUSTER_YAMLS))
def test_cluster_yaml_passes_ray_validation(path: Path) -> None:
    """Ray's own checks after filling in the provider defaults, as `ray up` does before it
    contacts the cloud (head type, per-type max_workers, docker and auth sections)."""
    _ray_package_dir()
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(_load(path)))


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=_ids(CLUSTER_YAMLS))
def test_cluster_node_types_declare_accelerators(path: Path) -> None:
    cfg = _load(path)
    node_types = cfg["available_node_types"]
    head = node_types[cfg["head_node_type"]]
    assert not _accelerator_keys(head["resources"]), "the head must not advertise a GPU type"
    assert head["resources"].get("GPU", 0) == 0
    workers = _cluster_node_types(cfg)
    assert workers, "no worker node types"
    for name, keys in workers.items():
        resources = node_types[name]["resources"]
        assert len(keys) == 1, f"{name}: wants exactly one accelerator_type, has {keys}"
        (key,) = keys
        assert key in GPU_KEYS, f"{name}: unknown hardware key {key}"
        assert resources[ACCEL_PREFIX + key] == 1, f"{name}: Ray advertises 1 per node"
        assert resources.get("GPU", 0) >= 1, f"{name}: no GPU resource"
        assert node_types[name].get("max_workers", 0) >= 1, f"{name}: can never start"


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=_ids(CLUSTER_YAMLS))
def test_cluster_security_defaults(path: Path) -> None:
    cfg = _load(path)
    # Token auth: every `ray start` in token mode, the container too, and the token shipped.
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = [c for c in cfg[key] if "ray start" in c]
        assert starts, f"{key}: no ray start"
        assert all("RAY_AUTH_MODE=token" in c for c in starts), f"{key}: token auth off"
    assert any("RAY_AUTH_MODE=token" in o for o in cfg["docker"]["run_options"])
    mounts = {k.replace("/home/ubuntu/", "~/"): v for k, v in cfg["file_mounts"].items()}
    assert mounts.get("~/.ray/auth_token") == "~/.ray/auth_token", "auth token not mounted"
    # Dashboard / Jobs API on a private address of the head, never 0.0.0.0.
    (head_start,) = [c for c in cfg["head_start_ray_commands"] if "ray start" in c]
    m = re.search(r"--dashboard-host[= ](\S+)", head_start)
    assert m, "--dashboard-host must be explicit (Ray's sample configs use 0.0.0.0)"
    assert _is_private_bind(m.group(1)), f"dashboard binds {m.group(1)}"
    if cfg["provider"]["type"] == "aws":
        for name, nt in cfg["available_node_types"].items():
            profile = nt["node_config"].get("IamInstanceProfile", {})
            assert profile.get("Arn") or profile.get("Name"), f"{name}: no instance profile"
            assert nt["node_config"].get("MetadataOptions", {}).get("HttpTokens") == "required"


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=_ids(CLUSTER_YAMLS))
def test_cluster_installs_the_harness(path: Path) -> None:
    cfg = _load(path)
    assert "kharness" in cfg["docker"]["image"], "nodes must run the kharness image"
    installs = [c for c in cfg["setup_commands"] if "pip install" in c]
    assert any("kernel_harness" in c for c in installs), "setup_commands install no harness"
    assert "./dist" in cfg["file_mounts"].values(), "the harness wheel is not synced"


def test_every_gpu_key_is_a_node_type() -> None:
    cluster_keys = set().union(
        *(keys for p in CLUSTER_YAMLS for keys in _cluster_node_types(_load(p)).values())
    )
    assert set(GPU_KEYS) <= cluster_keys, (
        f"missing in cluster YAMLs: {set(GPU_KEYS) - cluster_keys}"
    )
    kuberay_keys = set().union(*_kuberay_group_keys().values())
    assert set(GPU_KEYS) <= kuberay_keys, f"missing in KubeRay: {set(GPU_KEYS) - kuberay_keys}"


def test_experiment_hardware_keys_have_node_types() -> None:
    """Every hardware key an experiment in configs/ asks for can be scheduled on both the
    cluster-launcher clusters and KubeRay."""
    cluster_keys = set().union(
        *(keys for p in CLUSTER_YAMLS for keys in _cluster_node_types(_load(p)).values())
    )
    kuberay_keys = set().union(*_kuberay_group_keys().values())
    missing = []
    for name, keys in _experiment_hardware_keys().items():
        for key in sorted(keys - NON_NODE_KEYS):
            if key not in cluster_keys:
                missing.append(f"{name}: {key} has no node type in infra/ray/cluster-*.yaml")
            if key not in kuberay_keys:
                missing.append(f"{name}: {key} has no worker group in infra/k8s")
    assert not missing, "\n".join(missing)


def test_hardware_walk_reads_lists_and_skips_overrides() -> None:
    doc = {
        "hardware": ["auto", "H100"],
        "studies": [{"hardware": "H200"}],
        "search_space": {"hardware": {"A100": {"params": {}}}},
    }
    assert sorted(_walk_hardware(doc)) == ["H100", "H200", "auto"]


def test_iam_policies_scope_s3_to_a_prefix() -> None:
    for path in sorted((INFRA / "ray" / "iam").glob("*.json")):
        policy = json.loads(path.read_text())
        for stmt in policy["Statement"]:
            actions = stmt["Action"] if isinstance(stmt["Action"], list) else [stmt["Action"]]
            if any(a.startswith("s3:") for a in actions):
                assert stmt["Resource"] != "*", f"{path.name}: S3 on every bucket"
                assert "s3:*" not in actions, f"{path.name}: s3:*"


# -- KubeRay ------------------------------------------------------------------------------


def test_kuberay_raycluster_structure() -> None:
    rc = _kuberay_cluster()
    assert rc["apiVersion"] == "ray.io/v1"
    assert rc["metadata"]["name"]
    spec = rc["spec"]
    assert spec.get("authOptions", {}).get("mode") == "token", "token auth off"

    head = spec["headGroupSpec"]
    assert isinstance(head["rayStartParams"], dict)
    assert all(isinstance(v, str) for v in head["rayStartParams"].values())
    assert head.get("serviceType", "ClusterIP") == "ClusterIP", "head Service must stay private"
    assert not head.get("enableIngress", False)
    head_containers = head["template"]["spec"]["containers"]
    assert head_containers and head_containers[0]["image"]
    assert not GPU_RESOURCES & set(head_containers[0].get("resources", {}).get("limits", {}))

    groups = spec["workerGroupSpecs"]
    names = [g["groupName"] for g in groups]
    assert len(names) == len(set(names)), f"duplicate groupName in {names}"
    for g in groups:
        name = g["groupName"]
        lo, hi = g["minReplicas"], g["maxReplicas"]
        replicas = g.get("replicas", lo)
        assert all(isinstance(v, int) for v in (lo, hi, replicas)), name
        assert 0 <= lo <= replicas <= hi and hi >= 1, f"{name}: replicas {lo}/{replicas}/{hi}"
        assert isinstance(g["rayStartParams"], dict), name
        assert all(isinstance(v, str) for v in g["rayStartParams"].values()), name
        pod = g["template"]["spec"]
        (container,) = [c for c in pod["containers"] if c["name"] == "ray-worker"]
        assert container["image"], name
        limits = container["resources"]["limits"]
        gpu = GPU_RESOURCES & set(limits)
        assert len(gpu) == 1, f"{name}: requests GPUs as {gpu}"
        assert int(limits[gpu.pop()]) >= 1, name
        keys = _accelerator_keys(_ray_start_resources(g["rayStartParams"]))
        assert len(keys) == 1 and keys <= set(GPU_KEYS), f"{name}: accelerator types {keys}"


def _selected_labels(pod: dict) -> set[str]:
    labels = set(pod.get("nodeSelector", {}))
    terms = (
        pod.get("affinity", {})
        .get("nodeAffinity", {})
        .get("requiredDuringSchedulingIgnoredDuringExecution", {})
        .get("nodeSelectorTerms", [])
    )
    for term in terms:
        labels |= {e["key"] for e in term.get("matchExpressions", [])}
    return labels


def test_kuberay_groups_pin_their_gpu() -> None:
    """Each group lands only on nodes with its GPU, and asks for it the vendor's way."""
    spec = _kuberay_cluster()["spec"]
    for g in spec["workerGroupSpecs"]:
        pod = g["template"]["spec"]
        (key,) = _accelerator_keys(_ray_start_resources(g["rayStartParams"]))
        labels = _selected_labels(pod)
        assert labels & GPU_NODE_LABELS, f"{g['groupName']}: no GPU node label in {labels}"
        limits = pod["containers"][0]["resources"]["limits"]
        amd = key == "V710"
        assert ("amd.com/gpu" in limits) == amd, g["groupName"]
        assert ("rocm" in pod["containers"][0]["image"]) == amd, g["groupName"]
        assert any(label.startswith("amd.com/") for label in labels) == amd, g["groupName"]


def test_kuberay_pods_run_as_non_root() -> None:
    spec = _kuberay_cluster()["spec"]
    pods = [spec["headGroupSpec"]["template"]["spec"]] + [
        g["template"]["spec"] for g in spec["workerGroupSpecs"]
    ]
    for pod in pods:
        ctx = pod.get("securityContext", {})
        assert ctx.get("runAsNonRoot") is True and ctx.get("runAsUser", 0) != 0


def test_kuberay_ray_version_matches_images() -> None:
    ray_version = _kuberay_cluster()["spec"]["rayVersion"]
    for path in DOCKERFILES.values():
        assert _dockerfile_args(path).get("RAY_VERSION") == ray_version, path.name


def test_kuberay_manifest_with_kubeconform(tmp_path: Path) -> None:
    exe = shutil.which("kubeconform")
    if exe is None:
        pytest.skip("kubeconform is not on PATH (no registry package ships it)")
    schema_dir = os.environ.get("KUBECONFORM_SCHEMA_DIR")
    if not schema_dir:
        pytest.skip(
            "set KUBECONFORM_SCHEMA_DIR to local Kubernetes + RayCluster CRD JSON schemas "
            "(kubeconform fetches them from the network otherwise)"
        )
    location = os.path.join(schema_dir, "{{ .ResourceKind }}{{ .KindSuffix }}.json")
    result = subprocess.run(
        [exe, "-strict", "-summary", "-schema-location", location, *map(str, KUBERAY_YAMLS)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# -- Dockerfiles --------------------------------------------------------------------------


@pytest.mark.parametrize("flavour", sorted(DOCKERFILES))
def test_dockerfile_sanity(flavour: str) -> None:
    path = DOCKERFILES[flavour]
    lines = _dockerfile_lines(path)
    assert any(line.startswith("FROM ") for line in lines), "no FROM"
    runs = [line for line in lines if line.startswith("RUN ")]
    assert any("pip install" in r and re.search(r"\.\[tune,s3\]", r) for r in runs), (
        "the harness is not installed with its tune and s3 extras"
    )
    index = _dockerfile_args(path).get("TORCH_INDEX_URL", "")
    assert ("/rocm" in index) == (flavour == "rocm") and ("/cu" in index) == (flavour == "cuda")
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users, "no USER: the image would run as root"
    assert users[-1].split(":")[0] not in {"root", "0"}, f"runs as {users[-1]}"
    env = " ".join(line for line in lines if line.startswith("ENV "))
    assert "RAY_AUTH_MODE=token" in env, "Ray token auth not on by default"


def test_dockerfiles_agree_on_cluster_wide_versions() -> None:
    """Ray needs one Python and one Ray version across a cluster that mixes both images."""
    cuda, rocm = (_dockerfile_args(p) for p in (DOCKERFILES["cuda"], DOCKERFILES["rocm"]))
    for arg in ("PYTHON_VERSION", "RAY_VERSION", "USER_UID"):
        assert cuda.get(arg) and cuda.get(arg) == rocm.get(arg), arg


@pytest.mark.parametrize("flavour", sorted(DOCKERFILES))
def test_dockerignore_keeps_secrets_out(flavour: str) -> None:
    ignore = DOCKERFILES[flavour].with_name(DOCKERFILES[flavour].name + ".dockerignore")
    rules = {line.strip() for line in ignore.read_text().splitlines()}
    for rule in (".git", ".venv", "**/.env", "**/auth_token"):
        assert rule in rules, f"{ignore.name} lacks {rule}"


def test_extras_the_images_install_exist() -> None:
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert {"tune", "s3"} <= set(extras)
    assert any(dep.startswith("ray") for dep in extras["tune"])


# -- MLflow compose -----------------------------------------------------------------------


def test_compose_services_and_private_ports() -> None:
    compose = _load(COMPOSE)
    services = compose["services"]
    assert {"mlflow", "postgres"} <= set(services)
    assert not services["postgres"].get("ports"), "Postgres must not be published"
    ports = services["mlflow"]["ports"]
    assert ports
    for spec in ports:
        resolved = _interpolation_default(str(spec))
        parts = resolved.split(":")
        assert len(parts) == 3, f"{spec}: publish with an explicit host address"
        assert _is_private_bind(parts[0]), f"{spec}: binds {parts[0]}"


def test_compose_has_no_hardcoded_secrets() -> None:
    compose = _load(COMPOSE)
    for name, svc in compose["services"].items():
        env = svc.get("environment", {})
        if isinstance(env, list):
            env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
        for key, value in env.items():
            if re.search(r"PASSWORD|SECRET|TOKEN|ACCESS_KEY", key):
                text = str(value or "")
                assert not text or re.fullmatch(r"\$\{\w+(:?[-?][^}]*)?\}", text), (
                    f"{name}.{key} is hard-coded"
                )
    uri = compose["services"]["mlflow"]["environment"]["MLFLOW_BACKEND_STORE_URI"]
    assert uri.startswith("postgresql://") and "${POSTGRES_PASSWORD" in uri


def test_compose_uses_s3_artifacts_and_env_example() -> None:
    compose = _load(COMPOSE)
    env = compose["services"]["mlflow"]["environment"]
    assert "MLFLOW_ARTIFACTS_DESTINATION" in env and "MLFLOW_S3_ENDPOINT_URL" in env
    example = ENV_EXAMPLE.read_text()
    assert "MLFLOW_ARTIFACTS_DESTINATION=s3://" in example
    assert re.search(r"^POSTGRES_PASSWORD=\s*$", example, re.M), ".env.example holds a password"
    # Every variable the compose file reads is documented in .env.example.
    used = set(re.findall(r"\$\{(\w+)", COMPOSE.read_text()))
    documented = set(re.findall(r"^#?\s*(\w+)=", example, re.M))
    assert used <= documented, f"undocumented: {used - documented}"


def test_compose_env_file_is_git_ignored() -> None:
    git = shutil.which("git")
    if git is None:
        pytest.skip("git is not installed")
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    result = subprocess.run(
        [git, "check-ignore", "-q", "infra/mlflow/.env"], cwd=ROOT, capture_output=True
    )
    assert result.returncode == 0, "infra/mlflow/.env would be committed"


def _compose_cli() -> list[str] | None:
    docker = shutil.which("docker")
    if docker:
        probe = subprocess.run([docker, "compose", "version"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


def _run_compose_config(cli: list[str], env_file: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("POSTGRES_", "MLFLOW_"))}
    return subprocess.run(
        [*cli, "--env-file", str(env_file), "-f", str(COMPOSE), "config"],
        cwd=COMPOSE.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_compose_config_cli(tmp_path: Path) -> None:
    """`docker compose config` needs no engine: it parses, interpolates and validates."""
    cli = _compose_cli()
    if cli is None:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed")
    good = tmp_path / "good.env"
    good.write_text("POSTGRES_PASSWORD=ci-only\nMLFLOW_ARTIFACTS_DESTINATION=s3://ci/prefix\n")
    result = _run_compose_config(cli, good)
    assert result.returncode == 0, result.stderr
    rendered = yaml.safe_load(result.stdout)
    for port in rendered["services"]["mlflow"]["ports"]:
        host_ip = port.get("host_ip") if isinstance(port, dict) else str(port).split(":")[0]
        assert _is_private_bind(host_ip), port
    # Without the password the file must refuse to render instead of starting open.
    bad = tmp_path / "bad.env"
    bad.write_text("MLFLOW_ARTIFACTS_DESTINATION=s3://ci/prefix\n")
    result = _run_compose_config(cli, bad)
    assert result.returncode != 0 and "POSTGRES_PASSWORD" in result.stderr


def test_mlflow_image_runs_as_non_root() -> None:
    lines = _dockerfile_lines(INFRA / "mlflow" / "Dockerfile")
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and users[-1] not in {"root", "0"}
    assert any("psycopg2" in line and "boto3" in line for line in lines)


# -- the whole tree -----------------------------------------------------------------------


def test_no_credentials_in_infra() -> None:
    offenders = []
    for path in sorted(INFRA.rglob("*")):
        if not path.is_file() or path.name == ".env":  # the local, git-ignored secrets file
            continue
        text = path.read_text(errors="ignore")
        offenders += [
            f"{path.relative_to(ROOT)}: {p.pattern}" for p in SECRET_PATTERNS if p.search(text)
        ]
    assert not offenders, "\n".join(offenders)


# -- infra/setup.sh -------------------------------------------------------------------

SETUP = INFRA / "setup.sh"


def test_setup_installs_system_packages_only_when_asked() -> None:
    """apt-get runs only in the --with-chromium branch, never silenced, announced first."""
    lines = SETUP.read_text().splitlines()
    start = lines.index('elif [ "$WITH_CHROMIUM" = 1 ]; then')
    end = start + lines[start:].index("else")
    for i, line in enumerate(lines):
        code = line.split("#", 1)[0]
        if re.search(r"(^\s*|[;&|(]\s*)(sudo\s+)?apt-get\s", code):
            assert start < i < end, f"infra/setup.sh:{i + 1} runs apt-get unasked"
            assert ">/dev/null" not in code, f"infra/setup.sh:{i + 1} hides a system install"
    branch = "\n".join(lines[start:end])
    assert branch.index("say ") < branch.index("apt-get install"), "announce it first"


def test_setup_says_what_it_installs() -> None:
    text = SETUP.read_text()
    for line in text.splitlines():
        if "pip install" in line and "say " not in line:
            # every pip install is announced on one of the lines just before it
            before = text[:text.index(line)].splitlines()[-3:]
            assert any("say " in b for b in before), f"silent install: {line.strip()}"


def test_setup_rejects_unknown_options() -> None:
    proc = subprocess.run(["bash", str(SETUP), "--no-such-option"], capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 2 and "unknown option --no-such-option" in proc.stderr
    proc = subprocess.run(["bash", str(SETUP), "--help"], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 0 and "--with-chromium" in proc.stdout
