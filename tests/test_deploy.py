"""The deployment examples say what the CLI does: every manifest parses, every streamquake
command and option in them exists (asked of the real CLI's --help), the compose scenario
validates, and the master Job waits for as many workers as the Deployment runs."""

from __future__ import annotations

from pathlib import Path

from ruamel.yaml import YAML

from tests.conftest import REPO, run_cli

DEPLOY = REPO / "deploy"


def _docs() -> dict[Path, list[dict[str, object]]]:
    out = {}
    for path in sorted(DEPLOY.rglob("*.yaml")):
        out[path] = [d for d in YAML(typ="safe").load_all(path.read_text()) if d]
    return out


def _containers(doc: dict[str, object]) -> list[dict[str, object]]:
    spec = doc.get("spec", {})
    template = spec.get("template", {}) if isinstance(spec, dict) else {}
    pod = template.get("spec", {}) if isinstance(template, dict) else {}
    return list(pod.get("containers", [])) if isinstance(pod, dict) else []


def _invocations() -> list[list[str]]:
    """Every streamquake argument list in the manifests and the compose file."""
    found = []
    for path, docs in _docs().items():
        for doc in docs:
            for c in _containers(doc):
                args = [*c.get("command", []), *c.get("args", [])]  # type: ignore[misc]
                if args and args[0] == "streamquake":
                    args = args[1:]
                found.append([str(a) for a in args])
            if path.name.startswith("docker-compose"):
                for svc in doc.get("services", {}).values():  # type: ignore[union-attr]
                    found.append([str(a) for a in svc["command"]])
    return found


def test_every_command_and_option_in_the_examples_exists() -> None:
    invocations = _invocations()
    assert {args[0] for args in invocations} >= {"agent", "run", "worker", "target"}
    helps: dict[str, str] = {}
    for args in invocations:
        command = args[:2] if args[0] == "target" else args[:1]
        key = " ".join(command)
        if key not in helps:
            proc = run_cli(*command, "--help")
            assert proc.returncode == 0, (key, proc.stderr)
            helps[key] = proc.stdout
        for arg in args:
            if arg.startswith("--"):
                option = arg.split("=", 1)[0]
                assert option in helps[key], f"{key} has no {option}"


def test_the_compose_scenario_validates_and_the_job_matches_the_deployment() -> None:
    proc = run_cli("validate", str(DEPLOY / "compose" / "scenario.yaml"), "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    docs = _docs()
    (job,) = [d for d in docs[DEPLOY / "k8s" / "load-master-job.yaml"] if d["kind"] == "Job"]
    (deployment,) = docs[DEPLOY / "k8s" / "load-workers-deployment.yaml"]
    args = [str(a) for a in _containers(job)[0]["args"]]  # type: ignore[union-attr]
    replicas = deployment["spec"]["replicas"]  # type: ignore[index]
    assert args[args.index("--remote-workers") + 1] == str(replicas)
    worker_args = _containers(deployment)[0]["args"]
    assert "streamquake-master:5557" in worker_args  # type: ignore[operator]
