"""deploy/k8s/: every overlay renders with `kubectl kustomize` (or the standalone `kustomize build`) and every object
validates strictly, offline, against the Kubernetes OpenAPI schemas of pinned versions (the `kubernetes-validate`
package bundles them); then the promises the manifests make are checked on the rendered objects: configs that dgrpo
accepts, probes on the ports the servers listen on, the token from the Secret, resources and devices, security contexts,
the NetworkPolicies' reachability matrix, DNS discovery of the samplers, images as deploy/build.sh tags them.

No cluster is needed. Without kustomize (kubectl's or standalone) or kubernetes-validate the tests skip, saying so.
tests/deploy/test_k8s_run.py runs the cpu overlay's pod specs for real with Docker.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from k8s_support import MISSING, kustomize_command, render

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
VARIANTS = {"cpu": "cpu-demo.yaml", "cuda": "cuda-node.yaml", "npu": "npu-node.yaml"}
DEVICE_RESOURCE = {"cpu": None, "cuda": "nvidia.com/gpu", "npu": "huawei.com/Ascend910"}
# The oldest Kubernetes these manifests support (grpc probes are GA since 1.27; 1.30 is the oldest release still
# maintained by major providers when this was written) and the newest schema kubernetes-validate bundles.
K8S_VERSIONS = ["1.30.0", "1.37.0"]
TOKEN_PATH = "/var/run/secrets/dgrpo/token"
SERVER_PORT_KEY = {"sampler": "sampler.port", "rewarder": "rewarder.port", "learner": "learner.trainer.control_port"}
SERVER_HOST_KEY = {"sampler": "sampler.host", "rewarder": "rewarder.host", "learner": "learner.trainer.control_host"}
# Public config.json shapes of the overlays' models (huggingface.co/Qwen/Qwen2.5-1.5B-Instruct, -7B-Instruct).
MODEL_SHAPES = {
    "/models/Qwen2.5-1.5B-Instruct": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                                      "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936,
                                      "tie_word_embeddings": True},
    "/models/Qwen2.5-7B-Instruct": {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                                    "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                                    "tie_word_embeddings": False},
}

needs_kustomize = pytest.mark.skipif(kustomize_command() is None, reason=MISSING)
# Rendered by kustomize (a child process): integration tier (tests/tiers.py).
pytestmark = pytest.mark.usefixtures("child_processes")


@functools.cache
def rendered(variant: str) -> tuple[dict, ...]:
    return tuple(render(K8S / "overlays" / variant))


def objects(variant: str, kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in rendered(variant) if o["kind"] == kind}


def workloads(variant: str) -> dict[str, dict]:
    """component name -> its workload (learner and sampler StatefulSets, rewarder Deployment)."""
    out = {}
    for o in rendered(variant):
        if o["kind"] in ("StatefulSet", "Deployment"):
            out[o["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]] = o
    assert set(out) == {"learner", "sampler", "rewarder"}, set(out)
    return out


def overrides(container: dict) -> dict[str, str]:
    return dict(a.split("=", 1) for a in container["args"][2:] if "=" in a and not a.startswith("--"))


POD_IP = "10.244.1.7"


def expanded_args(container: dict) -> list[str]:
    """The args as the kubelet passes them: $(VAR) replaced by the container's env (status.podIP: POD_IP); a
    reference to an undefined variable would stay literal, which dgrpo would then reject or, worse, bind."""
    env = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif e["valueFrom"].get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[e["name"]] = POD_IP
    args = [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), a) for a in container["args"]]
    assert not any("$(" in a for a in args), f"undefined variable in {args}"
    return args


def config_data(variant: str) -> str:
    (cm,) = [o for name, o in objects(variant, "ConfigMap").items() if name.startswith("dgrpo-config-")]
    return cm["data"]["stack.yaml"]


# --- rendering and schemas ---------------------------------------------------------------------------------------


@needs_kustomize
@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_object_validates_strictly_against_the_kubernetes_schema(variant, version):
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (the dev extra has it)")
    kinds = set()
    for obj in rendered(variant):
        kv.validate(obj, version, strict=True)  # raises ValidationError naming the field
        kinds.add(obj["kind"])
    assert {"StatefulSet", "Deployment", "Service", "ConfigMap", "NetworkPolicy", "ServiceAccount",
            "PodDisruptionBudget"} <= kinds


@needs_kustomize
def test_strict_validation_rejects_an_unknown_field_and_a_wrong_type():
    """The validator is not a no-op: a typo'd field and a string where an integer belongs are refused."""
    kv = pytest.importorskip("kubernetes_validate")
    sts = json.loads(json.dumps(objects("cpu", "StatefulSet")["sampler"]))
    sts["spec"]["template"]["spec"]["containers"][0]["imagePullPolice"] = "Always"
    with pytest.raises(kv.ValidationError):
        kv.validate(sts, K8S_VERSIONS[-1], strict=True)
    sts = json.loads(json.dumps(objects("cpu", "StatefulSet")["sampler"]))
    sts["spec"]["replicas"] = "two"
    with pytest.raises(kv.ValidationError):
        kv.validate(sts, K8S_VERSIONS[-1], strict=True)


# --- configuration -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_overlay_configs_are_the_repository_configs(variant):
    copy = K8S / "overlays" / variant / "stack.yaml"
    source = ROOT / "configs" / VARIANTS[variant]
    assert copy.read_text() == source.read_text(), f"{copy} differs from {source}: run deploy/k8s/sync-configs.sh"


@needs_kustomize
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_container_command_is_a_valid_stack_config(variant, tmp_path):
    from dgrpo.cli.stack import StackConfig
    from dgrpo.common.config import load_config

    assert config_data(variant) == (ROOT / "configs" / VARIANTS[variant]).read_text()
    (tmp_path / "stack.yaml").write_text(config_data(variant))
    for component, w in workloads(variant).items():
        c = w["spec"]["template"]["spec"]["containers"][0]
        assert c["args"][:3] == ["dgrpo", component, "--config=/opt/dgrpo/configs/stack.yaml"], c["args"]
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in w["spec"]["template"]["spec"]["volumes"]}
        assert volumes[mounts["/opt/dgrpo/configs"]]["configMap"]["name"].startswith("dgrpo-config-")
        load_config(StackConfig, tmp_path / "stack.yaml", expanded_args(c)[3:])  # raises ConfigError naming the key


@needs_kustomize
def test_learner_command_passes_dgrpo_show_config(child_processes, tmp_path):
    """The real CLI, as the container runs it: `dgrpo show-config` resolves the learner's command line."""
    (tmp_path / "stack.yaml").write_text(config_data("cpu"))
    c = workloads("cpu")["learner"]["spec"]["template"]["spec"]["containers"][0]
    args = [a for a in expanded_args(c)[3:] if not a.startswith("auth.token_file")]  # the file is in the pod only
    proc = subprocess.run([sys.executable, "-m", "dgrpo.cli", "show-config", "--config", str(tmp_path / "stack.yaml"),
                           *args], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shown = yaml.safe_load(proc.stdout)
    assert shown["weights"]["transport"] == "collective" and shown["weights"]["bind_host"] == POD_IP
    assert shown["learner"]["trainer"]["on_end"] == "idle"
    assert shown["sampler"]["addresses"] == ["dns:///sampler:50051"]


@needs_kustomize
def test_reward_spec_configmap_is_the_compose_spec():
    cm = objects("cpu", "ConfigMap")["dgrpo-rewards"]
    assert yaml.safe_load(cm["data"]["spec.yaml"]) == yaml.safe_load((ROOT / "deploy/rewards/spec.yaml").read_text())
    rewarder = workloads("cpu")["rewarder"]["spec"]["template"]["spec"]
    c = rewarder["containers"][0]
    mount = next(m for m in c["volumeMounts"] if m["name"] == "rewards")
    assert "subPath" not in mount, "a subPath mount never sees ConfigMap updates: the hot swap needs the folder"
    assert overrides(c)["rewarder.spec_file"] == f"{mount['mountPath']}/spec.yaml"
    assert overrides(c)["rewarder.allowed_dirs"] == f"[{mount['mountPath']}]"
    vol = next(v for v in rewarder["volumes"] if v["name"] == "rewards")
    assert vol["configMap"]["name"] == "dgrpo-rewards", "the rewards ConfigMap must keep its name (edited in place)"


# --- servers, probes, discovery ----------------------------------------------------------------------------------


@needs_kustomize
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_probes_ask_grpc_health_on_the_port_each_server_listens_on(variant):
    for component, w in workloads(variant).items():
        c = w["spec"]["template"]["spec"]["containers"][0]
        port = int(overrides(c)[SERVER_PORT_KEY[component]])
        assert overrides(c)[SERVER_HOST_KEY[component]] == "0.0.0.0", "the kubelet probes the pod's address"
        assert port in {p["containerPort"] for p in c["ports"]}
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c[kind]
            assert probe["grpc"]["port"] == port, f"{variant} {component} {kind} asks {probe['grpc']['port']}"
            assert set(probe) & {"exec", "httpGet", "tcpSocket"} == set()
            assert probe["timeoutSeconds"] >= 3, "healthcheck answers in ~0.2 s, but under load allow seconds"
        startup = c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"]
        # An engine start takes minutes (compose allows 10 min on CPU, 15 on accelerators).
        minimum = {"sampler": 600 if variant == "cpu" else 900, "learner": 300, "rewarder": 60}[component]
        assert startup >= minimum, f"{variant} {component}: startup budget {startup} s < {minimum} s"
        live = c["livenessProbe"]["failureThreshold"] * c["livenessProbe"]["periodSeconds"]
        assert live >= 60, f"{variant} {component}: liveness restarts after {live} s of silence"


@needs_kustomize
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_learner_finds_samplers_and_rewarder_through_headless_services(variant):
    services = objects(variant, "Service")
    w = workloads(variant)
    learner = overrides(w["learner"]["spec"]["template"]["spec"]["containers"][0])
    for component, address in (("sampler", learner["sampler.addresses"]),
                               ("rewarder", learner["learner.rollout.rewarder_address"])):
        name, port = re.fullmatch(r"\[?dns:///([a-z-]+):(\d+)\]?", address).groups()
        svc = services[name]
        assert svc["spec"]["clusterIP"] == "None", f"{name}: a headless Service answers with every ready pod"
        labels = w[component]["spec"]["template"]["metadata"]["labels"]
        assert svc["spec"]["selector"].items() <= labels.items()
        assert int(port) in {p["port"] for p in svc["spec"]["ports"]}
        assert not svc["spec"].get("publishNotReadyAddresses"), "replicas still loading must not be in DNS"
    sts = w["sampler"]
    assert sts["spec"]["serviceName"] == "sampler" and sts["spec"]["podManagementPolicy"] == "Parallel"
    # The replicas each overlay ships (tests/deploy/test_k8s_run.py starts the cpu one at 1 and scales it to 2).
    assert sts["spec"]["replicas"] == {"cpu": 2, "cuda": 4, "npu": 4}[variant]
    # Weights: each sampler pod's relay reaches the learner pod itself (a headless Service: the collective's group
    # uses ephemeral ports, which a ClusterIP would not forward), and the learner binds its pod address only.
    from dgrpo.weights.config import WeightSyncConfig

    ports = {p["port"] for p in services["learner"]["spec"]["ports"]}
    defaults = WeightSyncConfig()
    assert {defaults.announce_port, defaults.control_port, 50053} == ports
    assert services["learner"]["spec"]["clusterIP"] == "None"
    assert services["learner"]["spec"]["publishNotReadyAddresses"] is True, "relays join while the learner loads"
    sampler = overrides(sts["spec"]["template"]["spec"]["containers"][0])
    assert sampler["weights.host"] == "learner" and sampler["weights.transport"] == "collective"
    learner_container = w["learner"]["spec"]["template"]["spec"]["containers"][0]
    assert learner["weights.transport"] == "collective"
    assert overrides({"args": expanded_args(learner_container)})["weights.bind_host"] == POD_IP
    assert services["learner"]["spec"]["selector"].items() <= \
        w["learner"]["spec"]["template"]["metadata"]["labels"].items()


@needs_kustomize
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_learner_is_a_statefulset_of_one_that_idles_when_its_run_ends(variant):
    sts = objects(variant, "StatefulSet")["learner"]
    assert not objects(variant, "Job")
    spec = sts["spec"]
    assert spec["replicas"] == 1 and spec["serviceName"] == "learner"
    assert spec["template"]["spec"].get("restartPolicy", "Always") == "Always"
    c = spec["template"]["spec"]["containers"][0]
    # A StatefulSet restarts every exit: the ended run must stay up instead (learner/records/run_end.py).
    assert overrides(c)["learner.trainer.on_end"] == "idle"
    for key in ("learner.checkpoint.dir", "learner.trainer.log_dir"):  # checkpoints and the run-end record
        assert overrides(c)[key].startswith("/opt/dgrpo/runs"), f"{key} must outlive the container"
    (claim,) = spec["volumeClaimTemplates"]
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/opt/dgrpo/runs")
    assert mount["name"] == claim["metadata"]["name"] and not mount.get("readOnly")
    assert spec["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": "Retain", "whenScaled": "Retain"}
    assert not objects(variant, "PersistentVolumeClaim"), "the runs claim comes from the StatefulSet's template"


# --- security ----------------------------------------------------------------------------------------------------


@needs_kustomize
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_token_comes_from_the_secret_and_nothing_else(variant):
    for w in workloads(variant).values():
        spec = w["spec"]["template"]["spec"]
        c = spec["containers"][0]
        assert overrides(c)["auth.token_file"] == TOKEN_PATH
        mount = next(m for m in c["volumeMounts"] if m["mountPath"] == str(Path(TOKEN_PATH).parent))
        vol = next(v for v in spec["volumes"] if v["name"] == mount["name"])
        assert vol["secret"]["secretName"] == "dgrpo-token"
        assert vol["secret"]["items"] == [{"key": "token", "path": "token"}]
        assert vol["secret"]["defaultMode"] & 0o007 == 0, "the token must not be world-readable"
        assert "DGRPO_TOKEN" not in {e["name"] for e in c.get("env", [])}
    # The Secret is created by the operator (kubectl create secret), never rendered from the repository.
    assert "dgrpo-token" not in objects(variant, "Secret")


# Pods that cannot run as a non-root user with a read-only root filesystem, and why (docs/kubernetes.md).
ROOT_PODS = {("npu", "sampler"), ("npu", "learner")}


@needs_kustomize
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_security_contexts(variant):
    for component, w in workloads(variant).items():
        spec = w["spec"]["template"]["spec"]
        assert spec["automountServiceAccountToken"] is False and spec["serviceAccountName"] == "dgrpo"
        assert not any(spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC", "shareProcessNamespace"))
        assert not any("hostPath" in v for v in spec["volumes"]), f"{variant} {component} mounts a host path"
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        for c in spec["containers"] + spec.get("initContainers", []):
            sec = c["securityContext"]
            assert sec["allowPrivilegeEscalation"] is False and not sec.get("privileged")
            assert not sec.get("capabilities", {}).get("add")
            if (variant, component) in ROOT_PODS:
                assert spec["securityContext"]["runAsUser"] == 0
                continue
            assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] > 0
            assert sec["readOnlyRootFilesystem"] is True and sec["capabilities"]["drop"] == ["ALL"]
            writable = {m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")}
            if c in spec["containers"]:
                assert "/tmp" in writable, "HOME and caches live in /tmp: it must be a writable emptyDir"
        env = {e["name"]: e.get("value") for e in spec["containers"][0].get("env", [])}
        assert env.get("HOME") == "/tmp"
    assert objects(variant, "ServiceAccount")["dgrpo"]["automountServiceAccountToken"] is False


def _selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, selector
    return selector.get("matchLabels", {}).items() <= labels.items()


def _any_namespace(peer: dict) -> bool:
    """A peer by pod labels alone (this namespace) or with `namespaceSelector: {}` (every namespace, this one
    included): the only kinds these manifests use; IP blocks and namespace labels are not modelled here."""
    assert set(peer) in ({"podSelector"}, {"podSelector", "namespaceSelector"}), peer
    return peer.get("namespaceSelector", {}) == {}


def _allowed(policies: list[dict], direction: str, pod: dict, peer: dict, port: int) -> bool:
    """NetworkPolicy semantics: isolated in `direction` when a policy of that type selects the pod; then some rule
    of such a policy must admit the peer and the port."""
    selecting = [p for p in policies if _selects(p["spec"]["podSelector"], pod)
                 and direction.capitalize() in p["spec"]["policyTypes"]]
    if not selecting:
        return True
    for p in selecting:
        for rule in p["spec"].get(direction, []):
            peers = rule.get("from" if direction == "ingress" else "to")
            ports = rule.get("ports")
            if (peers is None or any(_selects(x["podSelector"], peer) for x in peers if _any_namespace(x))) \
                    and (ports is None or any(x["port"] <= port <= x.get("endPort", x["port"]) for x in ports)):
                return True
    return False


@needs_kustomize
def test_network_policies_let_only_the_learner_reach_servers_and_only_samplers_reach_weights():
    policies = list(objects("cpu", "NetworkPolicy").values())
    w = workloads("cpu")
    labels = {k: v["spec"]["template"]["metadata"]["labels"] for k, v in w.items()}
    labels["other"] = {"app.kubernetes.io/name": "something-else"}  # any other pod in the namespace
    ports = {k: {p["containerPort"] for p in v["spec"]["template"]["spec"]["containers"][0]["ports"]}
             for k, v in w.items()}
    # The collective's groups: a TCPStore on the learner and gloo's pairs on both ends bind ephemeral ports (the
    # Linux default range, 32768-60999); one port in it, and one just outside, stand for the range.
    ephemeral = {32768, 45000, 60999}
    for component in ("learner", "sampler"):
        ports[component] |= ephemeral | {32767, 61000}
    expected = {("learner", "sampler", 50051), ("learner", "rewarder", 50052),
                ("sampler", "learner", 55701), ("sampler", "learner", 55702),
                *{("learner", "sampler", p) for p in ephemeral}, *{("sampler", "learner", p) for p in ephemeral}}
    seen = set()
    for src, src_labels in labels.items():
        for dst, dst_ports in ports.items():
            for port in dst_ports:
                ok = (_allowed(policies, "egress", src_labels, labels[dst], port)
                      and _allowed(policies, "ingress", labels[dst], src_labels, port))
                if ok:
                    seen.add((src, dst, port))
    assert seen == expected
    for component in w:  # DNS, and nothing else outside
        assert _allowed(policies, "egress", labels[component], {}, 53)
        assert not _allowed(policies, "egress", labels[component], {}, 443), f"{component} reaches the internet"


METRICS_KEY = {"sampler": "sampler", "rewarder": "rewarder", "learner": "learner.trainer"}


@needs_kustomize
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_metrics_component_opens_each_metrics_port_to_prometheus_alone(variant, tmp_path):
    """components/metrics on each overlay: strictly valid; each server's metrics_port is its container port
    `metrics` and its prometheus.io/port annotation, bound to the pod's address, in a config dgrpo accepts; a
    Prometheus pod (any namespace) reaches exactly those ports, and no other pod reaches them."""
    from dgrpo.cli.stack import StackConfig
    from dgrpo.common.config import load_config

    kv = pytest.importorskip("kubernetes_validate")
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(K8S / "overlays" / variant, tmp_path)],
        "components": [os.path.relpath(K8S / "components" / "metrics", tmp_path)]}))
    objs = render(tmp_path)
    for obj in objs:
        kv.validate(obj, K8S_VERSIONS[-1], strict=True)
    (tmp_path / "stack.yaml").write_text(config_data(variant))
    policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
    prometheus = {"app.kubernetes.io/name": "prometheus"}
    other = {"app.kubernetes.io/name": "something-else"}
    metrics_ports = set()
    for obj in objs:
        if obj["kind"] not in ("StatefulSet", "Deployment"):
            continue
        template = obj["spec"]["template"]
        component = template["metadata"]["labels"]["app.kubernetes.io/component"]
        c = template["spec"]["containers"][0]
        cfg = load_config(StackConfig, tmp_path / "stack.yaml", expanded_args(c)[3:])
        section = cfg.learner.trainer if component == "learner" else getattr(cfg, component)
        assert section.metrics_host == POD_IP, f"{component} metrics bound to {section.metrics_host}"
        (port,) = [p["containerPort"] for p in c["ports"] if p["name"] == "metrics"]
        assert section.metrics_port == port == int(template["metadata"]["annotations"]["prometheus.io/port"])
        assert template["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
        assert overrides(c)[f"{METRICS_KEY[component]}.metrics_port"] == str(port)
        metrics_ports.add(port)
        pod = template["metadata"]["labels"]
        assert _allowed(policies, "ingress", pod, prometheus, port), f"Prometheus cannot scrape {component}"
        assert not _allowed(policies, "ingress", pod, other, port), f"any pod scrapes {component}"
        for server in (p["containerPort"] for p in c["ports"] if p["name"] != "metrics"):
            assert not _allowed(policies, "ingress", pod, prometheus, server), \
                f"Prometheus reaches {component}:{server}"
    assert len(metrics_ports) == 3, "one metrics port per service"


# --- resources and devices ---------------------------------------------------------------------------------------


def _slot_bytes(variant: str, container: dict, tmp_path: Path) -> int:
    """The weight slots a sampler pod holds in /dev/shm, as `dgrpo plan` counts them for its command line."""
    from dgrpo.cli.doctor import memory as plan
    from dgrpo.cli.stack import StackConfig
    from dgrpo.common.config import load_config

    (tmp_path / "stack.yaml").write_text(config_data(variant))
    raw = yaml.safe_load(config_data(variant))
    # model.dtype auto is decided on each node: size for the larger of its choices (fp32).
    widest = ["model.dtype=float32"] if raw["model"]["dtype"] == "auto" else []
    cfg = load_config(StackConfig, tmp_path / "stack.yaml", [*expanded_args(container)[3:], *widest])
    if cfg.model.path is None:
        shape = plan._bundled_shape()
    else:
        (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"],
                                                          **MODEL_SHAPES[cfg.model.path]}))
        shape = plan.read_shape(tmp_path)
    return plan._weight_slots(shape, cfg, variant).bytes  # the variant names the device


def _quantity(q) -> float:
    q = str(q)
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "m": 1e-3}
    for suffix, mult in units.items():
        if q.endswith(suffix):
            return float(q[: -len(suffix)]) * mult
    return float(q)


@needs_kustomize
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_resources_devices_and_shared_memory(variant, tmp_path):
    resource = DEVICE_RESOURCE[variant]
    for component, w in workloads(variant).items():
        spec = w["spec"]["template"]["spec"]
        for c in spec["containers"] + spec.get("initContainers", []):
            req, lim = c["resources"]["requests"], c["resources"]["limits"]
            for key in ("cpu", "memory"):
                assert key in req and key in lim, f"{variant} {component}/{c['name']}: no {key} request and limit"
                assert _quantity(req[key]) <= _quantity(lim[key])
            assert req["memory"] == lim["memory"], "memory request = limit: no overcommit of a training job"
        c = spec["containers"][0]
        devices = c["resources"]["limits"].get(resource, 0) if resource else 0
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        if component == "sampler":
            assert devices == (1 if resource else 0)
        elif component == "learner":
            assert devices == (int(env["DGRPO_NPROC_PER_NODE"]) if resource else 0)
        else:
            assert devices == 0
            if variant == "cuda":
                assert env["NVIDIA_VISIBLE_DEVICES"] == "void"
            if variant == "npu":
                assert env["ASCEND_VISIBLE_DEVICES"] == "void"
        assert not any(k.startswith(("nvidia.com", "huawei.com")) and k != resource for k in c["resources"]["limits"])
        assert {"CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES"}.isdisjoint(env) or component == "rewarder", \
            "the device plugin picks the devices; *_VISIBLE_DEVICES would re-number them"
        # /dev/shm: memory-backed, counted in the memory limit; the sampler's relay holds two weight slots there.
        shm = [v for v in spec["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
        if component == "rewarder":
            continue
        (dshm,) = shm
        size = _quantity(dshm["emptyDir"]["sizeLimit"])
        assert size < _quantity(c["resources"]["limits"]["memory"]) / 2
        assert any(m["name"] == dshm["name"] and m["mountPath"] == "/dev/shm" for m in c["volumeMounts"])
        if component == "sampler":
            slots = _slot_bytes(variant, c, tmp_path)
            assert slots * 1.02 < size < slots * 2, f"{variant}: /dev/shm {size / 2**30:.1f} GiB for " \
                                                     f"{slots / 2**30:.2f} GiB of weight slots"


@needs_kustomize
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_images_are_the_ones_build_sh_tags(variant):
    build = (ROOT / "deploy" / "build.sh").read_text()
    assert 'tag="${TAG:-dgrpo:$variant}"' in build, "build.sh changed how it tags images: update the overlays"
    dockerfile = (ROOT / "deploy" / f"Dockerfile.{variant}").read_text()
    assert "dgrpo.cli.tasks write /opt/dgrpo-data" in dockerfile, "the learner's default data must be in the image"
    for w in workloads(variant).values():
        spec = w["spec"]["template"]["spec"]
        for c in spec["containers"] + spec.get("initContainers", []):
            assert c["image"] == f"dgrpo:{variant}", (c["name"], c["image"])
            assert c["imagePullPolicy"] == "IfNotPresent"


@needs_kustomize
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tls_component_mounts_the_secret_and_probes_over_tls(variant, tmp_path):
    """components/tls on each overlay: strictly valid, every server gets the Secret and the auth.tls.* overrides, and
    every probe becomes an exec of the image's health check over mutual TLS on the same port, keeping the overlay's
    budgets (tests/deploy/test_k8s_run.py runs it)."""
    kv = pytest.importorskip("kubernetes_validate")
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(K8S / "overlays" / variant, tmp_path)],  # kustomize takes no absolute path
        "components": [os.path.relpath(K8S / "components" / "tls", tmp_path)]}))
    objs = render(tmp_path)
    plain = workloads(variant)
    for obj in objs:
        kv.validate(obj, K8S_VERSIONS[-1], strict=True)
        if obj["kind"] not in ("StatefulSet", "Deployment"):
            continue
        component = obj["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
        spec = obj["spec"]["template"]["spec"]
        c = spec["containers"][0]
        args = overrides(c)
        port = args[SERVER_PORT_KEY[component]]
        assert args["auth.tls.require_client_cert"] == "true" and args["auth.tls.server_name"] == "dgrpo"
        folder = str(Path(args["auth.tls.ca_file"]).parent)
        mount = next(m for m in c["volumeMounts"] if m["mountPath"] == folder)
        assert next(v for v in spec["volumes"] if v["name"] == mount["name"])["secret"]["secretName"] == "dgrpo-tls"
        before = plain[component]["spec"]["template"]["spec"]["containers"][0]
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c[kind]
            assert "grpc" not in probe, "Kubernetes' grpc probes cannot present or verify a certificate"
            command = probe["exec"]["command"]
            assert command[:3] == ["python3", "/opt/dgrpo/deploy/healthcheck.py", port]
            for flag, key in (("--ca-file", "ca_file"), ("--cert-file", "cert_file"), ("--key-file", "key_file")):
                assert command[command.index(flag) + 1] == args[f"auth.tls.{key}"]
            assert {k: v for k, v in probe.items() if k != "exec"} == \
                {k: v for k, v in before[kind].items() if k != "grpc"}, f"{variant} {component} {kind} budget changed"


@needs_kustomize
def test_docs_name_objects_and_paths_the_manifests_have():
    """docs/kubernetes.md's kubectl commands name objects, ports and mount paths that the rendered cpu overlay has."""
    text = (ROOT / "docs" / "kubernetes.md").read_text()
    kinds = {"deploy": "Deployment", "deployment": "Deployment", "statefulset": "StatefulSet", "job": "Job",
             "svc": "Service"}
    kubectl_lines = "\n".join(line for line in text.splitlines() if "kubectl" in line)
    refs = set(re.findall(r"\b(deploy|deployment|statefulset|job|svc)/([a-z][a-z-]*)\b(?![./])", kubectl_lines))
    assert {("statefulset", "sampler"), ("deploy", "rewarder"), ("statefulset", "learner")} <= refs
    for short, name in refs:
        assert name in objects("cpu", kinds[short]), f"docs/kubernetes.md names {short}/{name}"
    for name in re.findall(r"secret generic ([a-z-]+)", text):
        assert name in {"dgrpo-token", "dgrpo-tls"}, name
    assert re.search(r"create configmap dgrpo-rewards --from-file=spec\.yaml=", text)
    mounts = {m["mountPath"] for w in workloads("cpu").values()
              for m in w["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]}
    for path in set(re.findall(r"(/opt/dgrpo/[a-z]+|/var/run/secrets/dgrpo)/", text)):
        assert path in mounts, f"docs/kubernetes.md uses {path}, which no container mounts"
    for port in set(re.findall(r"port-forward \S+ (\d+):\1", text)):
        assert any(int(port) == p["port"] for s in objects("cpu", "Service").values() for p in s["spec"]["ports"])
    for overlay in set(re.findall(r"deploy/k8s/overlays/([a-z]+)", text)):
        assert overlay in VARIANTS
