"""EC2 deployment files: cluster.yaml (Ray cluster launcher, AWS) and serve.yaml (Serve
config). Fast and offline: schemas and rules only, no Ray cluster, no AWS call.

cluster.yaml is checked against the Ray autoscaler's own JSON schema and `ray up`'s own
config preparation, then against the EFA rules for p5en.48xlarge. serve.yaml is checked
against Serve's ServeDeploySchema, its `args` against AppConfig, and its GPU fields
against the node types of cluster.yaml.
"""

from __future__ import annotations

import copy
import json
import re
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
CLUSTER_YAML = REPO / "cluster.yaml"
SERVE_YAML = REPO / "serve.yaml"
EC2_DOC = REPO / "docs" / "ec2.md"

GPU_NODE_TYPES = ("prefill_gpu", "decode_gpu")
P5EN = "p5en.48xlarge"
P5EN_EFA_CARDS = 16
P5EN_GPUS = 8
ROLE_POOL = {"prefill": "prefill_pool", "decode": "decode_pool"}
ROLE_DEPLOYMENT = {"prefill": "PrefillServer", "decode": "DecodeServer"}
PROJECT_DIR = "~/kvturn"
EFA_ENV = {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1"}
UCX_TLS_REQUIRED = {"srd", "cuda_copy", "cuda_ipc"}
# Transports EFA does not offer: UCX warns for each one listed in UCX_TLS.
UCX_TLS_NOT_ON_EFA = {
    "rc",
    "rc_v",
    "rc_x",
    "rc_verbs",
    "rc_mlx5",
    "dc",
    "dc_x",
    "dc_mlx5",
    "ud",
    "ud_v",
    "ud_x",
}


# -- loading -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster() -> dict[str, Any]:
    return yaml.safe_load(CLUSTER_YAML.read_text())


@pytest.fixture(scope="module")
def serve_config() -> dict[str, Any]:
    return yaml.safe_load(SERVE_YAML.read_text())


@pytest.fixture(scope="module")
def app_entry(serve_config) -> dict[str, Any]:
    (entry,) = serve_config["applications"]
    return entry


def ray_autoscaler_schema() -> dict[str, Any]:
    import ray.autoscaler

    return json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())


def worker_setup_commands(cluster: dict[str, Any], node_type: str) -> list[str]:
    """The setup commands the launcher runs on a worker of `node_type`.

    A node type's own worker_setup_commands replace the merged global lists entirely.
    """
    own = cluster["available_node_types"][node_type].get("worker_setup_commands")
    if own is not None:
        return list(own)
    return list(cluster.get("setup_commands", [])) + list(cluster.get("worker_setup_commands", []))


def exported_env(commands: list[str]) -> dict[str, str]:
    """NAME=value pairs of the `export` statements in shell commands."""
    env: dict[str, str] = {}
    for command in commands:
        for statement in re.split(r"[;&\n]", command):
            words = statement.split()
            if words[:1] == ["export"]:
                for word in words[1:]:
                    name, sep, value = word.partition("=")
                    if sep:
                        env[name] = value
    return env


# -- rules (each returns what is wrong; empty when the config is right) ------------------


def efa_problems(cluster: dict[str, Any], node_type: str) -> list[str]:
    """EFA rules for one p5en worker type."""
    problems: list[str] = []
    spec = cluster["available_node_types"][node_type]
    node = spec["node_config"]
    head = cluster["available_node_types"][cluster["head_node_type"]]["node_config"]

    if node.get("InstanceType") != P5EN:
        problems.append(f"InstanceType is {node.get('InstanceType')!r}, not {P5EN}")
    image = str(node.get("ImageId", ""))
    if not image.startswith("ami-"):
        problems.append(f"ImageId {image!r} is not an explicit ami- id (latest_dlami is a CUDA 11 image)")
    if image != head.get("ImageId"):
        problems.append("ImageId differs from the head's")
    if not (node.get("Placement") or {}).get("GroupName"):
        problems.append("no Placement.GroupName (cluster placement group)")
    for key in ("SubnetId", "SubnetIds", "SecurityGroupIds"):
        if key in node:
            problems.append(f"{key} next to NetworkInterfaces (Ray refuses the combination)")

    nics = node.get("NetworkInterfaces") or []
    if len(nics) != P5EN_EFA_CARDS:
        problems.append(f"{len(nics)} network interfaces, p5en has {P5EN_EFA_CARDS} EFA cards")
    cards = [nic.get("NetworkCardIndex") for nic in nics]
    if sorted(c for c in cards if isinstance(c, int)) != list(range(len(nics))) or len(set(cards)) != len(
        cards
    ):
        problems.append(f"NetworkCardIndex values are not distinct 0..{len(nics) - 1}: {cards}")
    primary = [nic for nic in nics if nic.get("InterfaceType") == "efa"]
    if len(primary) != 1:
        problems.append(f"{len(primary)} interfaces of type efa, want exactly 1")
    elif (primary[0].get("NetworkCardIndex"), primary[0].get("DeviceIndex")) != (0, 0):
        problems.append("the efa interface is not on NetworkCardIndex 0 / DeviceIndex 0")
    elif primary[0].get("AssociatePublicIpAddress") is not False:
        problems.append("the primary interface does not set AssociatePublicIpAddress: false")
    secondary = [nic for nic in nics if nic.get("InterfaceType") == "efa-only"]
    if len(secondary) != P5EN_EFA_CARDS - 1:
        problems.append(f"{len(secondary)} efa-only interfaces, want {P5EN_EFA_CARDS - 1}")
    if any(nic.get("DeviceIndex") != 1 for nic in secondary):
        problems.append("an efa-only interface is not at DeviceIndex 1")
    if any(nic.get("InterfaceType") not in ("efa", "efa-only") for nic in nics):
        problems.append("an interface is neither efa nor efa-only")
    if any(nic.get("AssociatePublicIpAddress") for nic in nics):
        problems.append("an interface asks for a public IP")
    if any("AssociatePublicIpAddress" in nic for nic in secondary):
        problems.append(
            "AssociatePublicIpAddress on an efa-only interface (EC2 accepts it on DeviceIndex 0 only)"
        )
    subnets = {nic.get("SubnetId") for nic in nics}
    if len(subnets) != 1 or not str(next(iter(subnets), "")).startswith("subnet-"):
        problems.append(f"interfaces are not all in one subnet: {subnets}")
    elif subnets != set(head.get("SubnetIds", [])):
        problems.append("interfaces are not in the head's subnet")
    groups = {tuple(nic.get("Groups") or ()) for nic in nics}
    if len(groups) != 1 or len(next(iter(groups))) != 1 or not next(iter(groups))[0].startswith("sg-"):
        problems.append(f"interfaces do not all use the same single security group: {groups}")
    elif set(next(iter(groups))) != set(head.get("SecurityGroupIds", [])):
        problems.append("interfaces do not use the head's security group")
    return problems


def role_problems(entry: dict[str, Any], cluster: dict[str, Any]) -> list[str]:
    """GPU fields and replica counts of serve.yaml's prefill/decode against cluster.yaml's
    node types. A role's count is its `deployments:` override, else the one in `args`."""
    from app.config import AppConfig

    problems: list[str] = []
    cfg = AppConfig.from_args(entry["args"])
    overrides = {d["name"]: d.get("num_replicas") for d in entry.get("deployments") or ()}
    node_types = cluster["available_node_types"]
    for role, pool in ROLE_POOL.items():
        spec = getattr(cfg, role)
        count = overrides.get(ROLE_DEPLOYMENT[role]) or spec.num_replicas
        if spec.num_gpus != spec.tensor_parallel_size:
            problems.append(
                f"{role}: num_gpus {spec.num_gpus} != tensor_parallel_size {spec.tensor_parallel_size}"
            )
        if set(spec.resources) != {pool}:
            problems.append(f"{role}: resources {spec.resources} must name exactly {pool!r}")
            continue
        if spec.resources[pool] != spec.num_gpus:
            problems.append(f"{role}: asks {spec.resources[pool]} {pool} units for {spec.num_gpus} GPUs")
        hosts = [name for name, t in node_types.items() if pool in t.get("resources", {})]
        if len(hosts) != 1:
            problems.append(f"{role}: {pool} is declared by node types {hosts}, want exactly one")
            continue
        host = node_types[hosts[0]]
        gpus, units = host["resources"].get("GPU", 0), host["resources"][pool]
        if units != gpus:
            problems.append(f"{role}: node type {hosts[0]} has {units} {pool} units for {gpus} GPUs")
        if not spec.num_gpus or gpus % spec.num_gpus:
            problems.append(f"{role}: {spec.num_gpus} GPUs per replica do not pack onto {gpus}-GPU nodes")
        capacity = host.get("max_workers", 0) * units
        if count * spec.resources[pool] > capacity:
            problems.append(
                f"{role}: {count} replicas need {count * spec.resources[pool]} "
                f"{pool} units, {hosts[0]} offers at most {capacity}"
            )
    return problems


# -- cluster.yaml: Ray's own checks -------------------------------------------------------


def test_cluster_yaml_matches_ray_autoscaler_schema(cluster):
    jsonschema.validate(cluster, ray_autoscaler_schema())


def test_cluster_yaml_survives_ray_up_preparation(cluster):
    """What `ray up` does before touching AWS: fill defaults, merge commands, validate."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(cluster))
    validate_config(prepared)
    assert prepared["provider"]["type"] == "aws"
    assert set(prepared["available_node_types"]) == {cluster["head_node_type"], *GPU_NODE_TYPES}
    # Our commands replaced the launcher's defaults (which install a nightly Ray wheel).
    assert not any("ray-wheels" in c or "anaconda3" in c for c in prepared["worker_setup_commands"])
    assert prepared["worker_setup_commands"] == worker_setup_commands(cluster, "prefill_gpu")


@pytest.mark.parametrize(
    "breakage",
    [
        lambda c: c.__setitem__("unknown_top_level_key", 1),
        lambda c: c["available_node_types"]["prefill_gpu"]["resources"].__setitem__("prefill_pool", 0.5),
        lambda c: c["available_node_types"]["decode_gpu"].pop("node_config"),
        lambda c: c["provider"].pop("type"),
    ],
    ids=["unknown-key", "fractional-resource", "no-node-config", "no-provider-type"],
)
def test_ray_schema_check_rejects_broken_configs(cluster, breakage):
    broken = copy.deepcopy(cluster)
    breakage(broken)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, ray_autoscaler_schema())


# -- cluster.yaml: EC2 and EFA rules ------------------------------------------------------


@pytest.mark.parametrize("node_type", GPU_NODE_TYPES)
def test_p5en_worker_declares_all_efa_cards(cluster, node_type):
    assert efa_problems(cluster, node_type) == []


def _nics(c, node_type="prefill_gpu"):
    return c["available_node_types"][node_type]["node_config"]["NetworkInterfaces"]


def _unshare(c):
    """Give decode_gpu its own node_config copy (the file shares one through a YAML anchor)."""
    types = c["available_node_types"]
    types["decode_gpu"]["node_config"] = copy.deepcopy(types["decode_gpu"]["node_config"])
    return c


@pytest.mark.parametrize(
    "breakage, expected",
    [
        (lambda c: _nics(c).pop(), "network interfaces"),
        (lambda c: _nics(c)[3].__setitem__("InterfaceType", "efa"), "interfaces of type efa"),
        (lambda c: _nics(c)[0].__setitem__("DeviceIndex", 1), "DeviceIndex 0"),
        (lambda c: _nics(c)[5].__setitem__("NetworkCardIndex", 4), "NetworkCardIndex"),
        (lambda c: _nics(c)[7].__setitem__("DeviceIndex", 0), "DeviceIndex 1"),
        (lambda c: _nics(c)[9].__setitem__("SubnetId", "subnet-other"), "one subnet"),
        (lambda c: _nics(c)[2].__setitem__("Groups", ["sg-other"]), "security group"),
        (lambda c: _nics(c)[0].__setitem__("AssociatePublicIpAddress", True), "AssociatePublicIpAddress"),
        (lambda c: _nics(c)[0].pop("AssociatePublicIpAddress"), "AssociatePublicIpAddress"),
        (lambda c: _nics(c)[4].__setitem__("AssociatePublicIpAddress", False), "efa-only interface"),
        (lambda c: c["available_node_types"]["prefill_gpu"]["node_config"].pop("Placement"), "Placement"),
        (
            lambda c: c["available_node_types"]["prefill_gpu"]["node_config"].__setitem__(
                "ImageId", "latest_dlami"
            ),
            "ami-",
        ),
        (
            lambda c: c["available_node_types"]["prefill_gpu"]["node_config"].__setitem__(
                "SubnetIds", ["subnet-x"]
            ),
            "SubnetIds",
        ),
        (
            lambda c: c["available_node_types"]["prefill_gpu"]["node_config"].__setitem__(
                "InstanceType", "p5.48xlarge"
            ),
            "InstanceType",
        ),
        (
            lambda c: c["available_node_types"]["head"]["node_config"].__setitem__(
                "SecurityGroupIds", ["sg-head"]
            ),
            "head's security group",
        ),
    ],
)
def test_efa_rules_catch_mistakes(cluster, breakage, expected):
    broken = _unshare(copy.deepcopy(cluster))
    breakage(broken)
    problems = efa_problems(broken, "prefill_gpu")
    assert any(expected in p for p in problems), problems
    assert efa_problems(broken, "decode_gpu") == [] or "head" in expected


def test_cluster_networking_and_identity(cluster):
    provider = cluster["provider"]
    assert provider["use_internal_ips"] is True
    assert provider["cache_stopped_nodes"] is False
    assert cluster["auth"]["ssh_private_key"]
    for name, spec in cluster["available_node_types"].items():
        # With auth.ssh_private_key set, Ray requires KeyName on every node type.
        assert spec["node_config"].get("KeyName"), name
    head = cluster["available_node_types"][cluster["head_node_type"]]
    assert head["resources"].get("CPU") == 0, "engines and CPU tasks must stay off the head"
    assert "GPU" not in head["resources"] and not set(head["resources"]) & set(ROLE_POOL.values())


def test_gpu_node_types_are_steered_by_distinct_pools(cluster):
    types = cluster["available_node_types"]
    pools = {}
    for name in GPU_NODE_TYPES:
        resources = types[name]["resources"]
        assert resources["GPU"] == P5EN_GPUS, name
        (pool,) = set(resources) & set(ROLE_POOL.values())
        assert resources[pool] == P5EN_GPUS, f"{name}: one {pool} unit per GPU"
        assert 0 < types[name]["min_workers"] <= types[name]["max_workers"], name
        pools[name] = pool
    assert pools == {"prefill_gpu": "prefill_pool", "decode_gpu": "decode_pool"}
    assert cluster["max_workers"] >= sum(types[n]["max_workers"] for n in GPU_NODE_TYPES)


def test_every_placeholder_is_obvious_and_documented(cluster):
    text = CLUSTER_YAML.read_text()
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    body = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
    # Holds until every placeholder is filled in; then there is nothing left to explain.
    placeholders = set(re.findall(r"[\w.~/-]*REPLACE_ME[\w.-]*", body))
    names = {Path(p).name.removesuffix(".pem") for p in placeholders}
    for name in names:
        assert name in header, f"{name} is not explained in cluster.yaml's header"
        assert name in EC2_DOC.read_text(), f"{name} is not explained in docs/ec2.md"
    # Filled in or not, each value is the same on every node that carries it.
    node_configs = [t["node_config"] for t in cluster["available_node_types"].values()]
    assert len({n["ImageId"] for n in node_configs}) == 1
    assert len({n["KeyName"] for n in node_configs}) == 1


# -- cluster.yaml: software and start commands ---------------------------------------------


def test_project_is_shipped_and_installed_with_its_gpu_extra(cluster):
    assert cluster["file_mounts"] == {PROJECT_DIR: "."}
    assert ".gitignore" in cluster["rsync_filter"]  # keeps the local .venv and models/ home
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    gpu_extra = pyproject["project"]["optional-dependencies"]["gpu"]
    assert gpu_extra and all("==" in requirement for requirement in gpu_extra), gpu_extra
    assert any(r.startswith("ray[serve]==") for r in pyproject["project"]["dependencies"])
    install = re.compile(r"cd " + re.escape(PROJECT_DIR) + r" && .*\bpip install\b.* -e '\.\[gpu\]'")
    for node_type in GPU_NODE_TYPES:
        commands = worker_setup_commands(cluster, node_type)
        assert any(install.search(c) for c in commands), (node_type, commands)
        # Versions come from pyproject.toml only, never from a second install line.
        assert not any(re.search(r"\b(vllm|nixl|torch|ray)\b[\[=<>]", c) for c in commands), commands


def test_worker_start_exports_efa_environment(cluster):
    commands = cluster["worker_start_ray_commands"]
    env = exported_env(commands)
    for name, value in EFA_ENV.items():
        assert env.get(name) == value, name
    tls = set(env["UCX_TLS"].split(","))
    assert UCX_TLS_REQUIRED <= tls and not tls & UCX_TLS_NOT_ON_EFA, tls
    assert "UCX_NET_DEVICES" not in env, "leave UCX to pick all EFA devices"
    assert "/opt/amazon/efa/lib" in env["LD_LIBRARY_PATH"]
    start = [c for c in commands if "ray start" in c]
    assert len(start) == 1 and "$RAY_HEAD_IP:6379" in start[0]
    # Exports must come before `ray start` in the same shell so raylet inherits them.
    assert start[0].index("export ") < start[0].index("ray start")
    # Pools come from each node type's `resources`; one shared flag would merge them.
    assert not any(pool in c for c in commands for pool in ROLE_POOL.values())


def test_exported_env_parser_reads_export_statements():
    commands = ["ray stop", "export A=1 B=x,y; ulimit -n 1; export C=/p:${D:-}\nray start"]
    assert exported_env(commands) == {"A": "1", "B": "x,y", "C": "/p:${D:-}"}


# -- serve.yaml ----------------------------------------------------------------------------


def test_serve_yaml_matches_serve_deploy_schema(serve_config):
    from ray.serve.schema import ServeApplicationSchema, ServeDeploySchema

    schema = ServeDeploySchema.model_validate(serve_config)
    assert len(schema.applications) == 1
    # Serve ignores unknown keys silently; a typo would just vanish.
    assert set(serve_config) <= set(ServeDeploySchema.model_fields)
    assert set(serve_config["applications"][0]) <= set(ServeApplicationSchema.model_fields)


def test_serve_schema_check_rejects_a_bad_import_path(serve_config):
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    broken = copy.deepcopy(serve_config)
    broken["applications"][0]["import_path"] = "app"
    with pytest.raises(ValidationError):
        ServeDeploySchema.model_validate(broken)


def test_serve_application_entry(app_entry):
    assert app_entry["import_path"] == "app:graph"
    assert app_entry["route_prefix"] == "/"
    assert app_entry["args"]["app_name"] == app_entry["name"]
    assert "working_dir" not in app_entry["runtime_env"], "the code is installed on every node"


def test_app_builder_named_by_import_path_exists(app_entry):
    import importlib

    module_name, attr = app_entry["import_path"].split(":")
    builder = getattr(importlib.import_module(module_name), attr)
    assert callable(builder)


def test_serve_args_parse_as_app_config(app_entry):
    from app.config import AppConfig, Mode

    cfg = AppConfig.from_args(app_entry["args"])
    assert cfg.mode is Mode.BIDIR
    assert cfg.model == "Qwen/Qwen3-32B"
    assert cfg.dtype == "bfloat16"
    assert cfg.transfer.kv_buffer_device == "cuda"
    assert cfg.transfer.backend in ("UCX", "LIBFABRIC")
    assert cfg.block_size % 16 == 0
    assert cfg.app_name == app_entry["name"]


def test_serve_gpu_fields_match_cluster_pools(app_entry, cluster):
    assert role_problems(app_entry, cluster) == []


def test_serve_yaml_sets_replica_counts_outside_args(app_entry):
    """`serve deploy` versions every deployment by a hash of the `args`: counts there
    would make a scale a restart of the fleet. They are `deployments:` overrides, named
    as the app names its deployments."""
    from app.engines.servers import DecodeServer, PrefillServer

    overrides = {d["name"]: d for d in app_entry["deployments"]}
    assert set(overrides) == {PrefillServer.name, DecodeServer.name} == set(ROLE_DEPLOYMENT.values())
    assert all(overrides[name]["num_replicas"] >= 1 for name in overrides)
    for role in ROLE_POOL:
        assert "num_replicas" not in app_entry["args"][role], role


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"prefill.num_gpus": 4}, "num_gpus 4.0 != tensor_parallel_size 2"),
        ({"decode.resources": {"prefill_pool": 2}}, "must name exactly 'decode_pool'"),
        ({"decode.resources": {"decode_pool": 1}}, "asks 1.0 decode_pool units for 2.0 GPUs"),
        ({"PrefillServer.num_replicas": 9}, "offers at most 16"),
        ({"decode.num_replicas": 9, "DecodeServer.num_replicas": None}, "offers at most 16"),
        (
            {
                "prefill.tensor_parallel_size": 3,
                "decode.tensor_parallel_size": 3,
                "prefill.num_gpus": 3,
                "decode.num_gpus": 3,
                "prefill.resources": {"prefill_pool": 3},
                "decode.resources": {"decode_pool": 3},
            },
            "do not pack",
        ),
    ],
)
def test_role_rules_catch_mistakes(app_entry, cluster, change, expected):
    entry = copy.deepcopy(app_entry)
    deployments = {d["name"]: d for d in entry["deployments"]}
    for key, value in change.items():
        section, field = key.split(".")
        if section in deployments:  # a `deployments:` override (None: left out)
            deployments[section].pop(field)
            if value is not None:
                deployments[section][field] = value
        else:
            entry["args"][section][field] = value
    problems = role_problems(entry, cluster)
    assert any(expected in p for p in problems), problems


def test_serve_env_agrees_with_cluster_env(app_entry, cluster):
    runtime_env = app_entry["runtime_env"]["env_vars"]
    node_env = exported_env(cluster["worker_start_ray_commands"])
    assert all(isinstance(v, str) for v in runtime_env.values()), "Ray env_vars must be strings"
    for name, value in runtime_env.items():
        if name in node_env:
            assert value == node_env[name], name
    for name, value in EFA_ENV.items():
        assert runtime_env.get(name) == value, name
    assert UCX_TLS_REQUIRED <= set(runtime_env["UCX_TLS"].split(","))
    engine_env = app_entry["args"].get("env", {})
    for name, value in engine_env.items():
        if name in runtime_env:
            assert value == runtime_env[name], name


def test_ec2_doc_names_the_commands(cluster):
    doc = EC2_DOC.read_text()
    for command in (
        "ray up cluster.yaml",
        "ray attach cluster.yaml",
        "serve deploy",
        "ray down cluster.yaml",
        "fi_info -p efa",
        "create-placement-group",
        "--strategy cluster",
        "base-oss-nvidia-driver-gpu-ubuntu-22.04",
    ):
        assert command in doc, command
    for node_type in GPU_NODE_TYPES:
        assert node_type in doc, node_type
