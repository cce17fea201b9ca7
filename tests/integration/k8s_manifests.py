"""examples/k8s's Kubeflow Trainer v2 manifests against Trainer v2.3.0's own CRD schemas.

No Kubernetes API server can run here, so this does what one does on `kubectl apply` with strict
field validation (kubectl's default), with the real schemas (tests/fixtures/kubeflow-trainer:
the CRDs of kubeflow/trainer at tag v2.3.0, gzipped) and a real JSON Schema validator:
  - the OpenAPI v3 schema of each kind, as a structural schema is read: an object that lists its
    properties takes no others (unless x-kubernetes-preserve-unknown-fields), int-or-string
    fields take either, nullable fields take null;
  - the CEL rules (x-kubernetes-validations) that apply to the fields a manifest sets: each must
    be one this file has reviewed and written in Python (REVIEWED); a rule it has not seen fails
    the test, naming it. Transition rules (they read oldSelf) only apply on updates: skipped.
Then what the API server would only find out later, at run time: Trainer's conventions (the
"node" job and container, the runtime a TrainJob names), Kubernetes Job rules the CRD does not
carry (backoffLimitPerIndex needs completionMode: Indexed), every $(VAR) defined, and every flag
of the flotilla command lines accepted by the flotilla CLI given as the first argument.

Usage: python k8s_manifests.py FLOTILLA_CLI [manifest.yaml ...]   (default: examples/k8s/trainjob*.yaml)
"""
import copy
import gzip
import pathlib
import re
import subprocess
import sys

import jsonschema
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
CRDS = ROOT / "tests" / "fixtures" / "kubeflow-trainer"


# The create-time CEL rules of the two CRDs that a flotilla manifest can reach, in Python. The
# keys are the rules' text as the CRDs carry them.
REVIEWED = {
    # mlPolicy
    "[has(self.torch), has(self.mpi), has(self.jax), has(self.xgboost),has(self.flux)]"
    ".filter(x, x).size() <= 1":
        lambda s: sum(k in s for k in ("torch", "mpi", "jax", "xgboost", "flux")) <= 1,
    # torch.envInjection.targets[].containerNames
    "!self.exists(c, c == 'node')": lambda s: "node" not in s,
    # JobSet spec
    "!(has(self.startupPolicy) && self.startupPolicy.startupPolicyOrder == 'InOrder' && "
    "self.replicatedJobs.exists(x, has(x.dependsOn)))":
        lambda s: not ("startupPolicy" in s and s["startupPolicy"].get("startupPolicyOrder") ==
                       "InOrder" and any("dependsOn" in j for j in s["replicatedJobs"])),
    # TrainJob: its name becomes the JobSet's and the pods' DNS names
    "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')":
        lambda s: re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", s["metadata"]["name"]) is not None,
    "size(self.metadata.name) <= 63": lambda s: len(s["metadata"]["name"]) <= 63,
    # TrainJob managedBy (a default; never set by these manifests, listed for completeness)
    "self in ['trainer.kubeflow.org/trainjob-controller', 'kueue.x-k8s.io/multikueue']":
        lambda s: s in ("trainer.kubeflow.org/trainjob-controller", "kueue.x-k8s.io/multikueue"),
}


def _normalise_rule(rule):
    return re.sub(r"\s+", " ", rule.strip())


REVIEWED = {_normalise_rule(k): v for k, v in REVIEWED.items()}


def structural(schema):
    """A CRD's OpenAPI v3 schema as JSON Schema with Kubernetes' reading of it."""
    s = copy.copy(schema)
    if s.pop("x-kubernetes-int-or-string", False):
        s.pop("type", None)
        s["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if "properties" in s:
        s["properties"] = {k: structural(v) for k, v in s["properties"].items()}
    if s.get("x-kubernetes-embedded-resource"):
        props = s.setdefault("properties", {})
        for k in ("apiVersion", "kind"):
            props.setdefault(k, {"type": "string"})
        props.setdefault("metadata", {"type": "object"})
    if isinstance(s.get("additionalProperties"), dict):
        s["additionalProperties"] = structural(s["additionalProperties"])
    elif ("properties" in s and "additionalProperties" not in s and
          not s.get("x-kubernetes-preserve-unknown-fields")):
        s["additionalProperties"] = False  # strict field validation: unknown fields are errors
    if "items" in s:
        s["items"] = structural(s["items"])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in s:
            s[key] = [structural(x) for x in s[key]]
    if s.pop("nullable", False) and "type" in s:
        s["type"] = [s["type"], "null"]
    return s


def load_crds():
    schemas = {}
    for path in sorted(CRDS.glob("*.yaml.gz")):
        crd = yaml.safe_load(gzip.decompress(path.read_bytes()))
        group = crd["spec"]["group"]
        kind = crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            schemas[(f"{group}/{version['name']}", kind)] = version["schema"]["openAPIV3Schema"]
    return schemas


def cel_rules(schema, value, path, found):
    """Every (path, rule, message, value) whose schema node has x-kubernetes-validations."""
    for v in schema.get("x-kubernetes-validations", []):
        found.append((path, v["rule"], v.get("message", ""), value))
    if isinstance(value, dict):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for k, sub in value.items():
            if k in props:
                cel_rules(props[k], sub, f"{path}.{k}", found)
            elif isinstance(extra, dict):
                cel_rules(extra, sub, f"{path}[{k}]", found)
    elif isinstance(value, list) and "items" in schema:
        for i, sub in enumerate(value):
            cel_rules(schema["items"], sub, f"{path}[{i}]", found)


def check_schema(doc, schemas, where, errors):
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key not in schemas:
        errors.append(f"{where}: no CRD for apiVersion {key[0]!r} kind {key[1]!r} "
                      f"(vendored: {sorted(schemas)})")
        return 0
    schema = schemas[key]
    validator = jsonschema.Draft7Validator(structural(schema))
    for e in sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path)):
        path = ".".join(str(p) for p in e.absolute_path) or "(root)"
        errors.append(f"{where}: {path}: {e.message[:300]}")
    found = []
    cel_rules(schema, doc, "", found)
    for path, rule, message, value in found:
        if "oldSelf" in rule:
            continue  # a transition rule: only updates have an old object
        check = REVIEWED.get(_normalise_rule(rule))
        if check is None:
            errors.append(f"{where}: {path or '(root)'}: CEL rule not reviewed by this test: "
                          f"{rule!r}; write it in REVIEWED")
        elif not check(value):
            errors.append(f"{where}: {path or '(root)'}: {message} (rule {rule!r})")
    return len(found)


def containers(runtime):
    for job in runtime["spec"]["template"]["spec"]["replicatedJobs"]:
        for c in job["template"]["spec"]["template"]["spec"]["containers"]:
            yield job, c


PET = {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"}


_HELP = {}  # (cli, subcommand) -> its --help: the CLI loads LibTorch, so once each


def check_semantics(docs, where, cli, errors):
    runtimes = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ClusterTrainingRuntime"}
    jobs = [d for d in docs if d["kind"] == "TrainJob"]
    if not runtimes or not jobs:
        errors.append(f"{where}: expected a ClusterTrainingRuntime and a TrainJob")
        return
    def flags_of(sub):
        if (cli, sub) not in _HELP:
            out = subprocess.run([cli, sub, "--help"], capture_output=True, text=True)
            _HELP[(cli, sub)] = out.stdout
        return _HELP[(cli, sub)]

    for job in jobs:
        name = job["spec"]["runtimeRef"]["name"]
        if name not in runtimes:
            errors.append(f"{where}: TrainJob {job['metadata']['name']} names runtime {name!r}, "
                          f"not in this file ({sorted(runtimes)})")
            continue
        runtime = runtimes[name]
        trainer = job["spec"]["trainer"]
        if trainer.get("numProcPerNode") != 1:
            errors.append(f"{where}: trainer.numProcPerNode is {trainer.get('numProcPerNode')!r}: "
                          "flotilla started directly refuses anything but 1")
        spec = runtime["spec"]["template"]["spec"]
        names = [j["name"] for j in spec["replicatedJobs"]]
        if "node" not in names:
            errors.append(f"{where}: runtime {name} has no replicated job named node "
                          "(Trainer gives PET_* to its container named node)")
        injected = {(t["jobName"], c) for t in runtime["spec"]["mlPolicy"].get("torch", {})
                    .get("envInjection", {}).get("targets", []) for c in t["containerNames"]}
        for t in injected:
            if t[0] not in names:
                errors.append(f"{where}: envInjection names job {t[0]!r}, not in {names}")
        for j in spec["replicatedJobs"]:
            for dep in j.get("dependsOn", []):
                if dep["name"] not in names or names.index(dep["name"]) >= names.index(j["name"]):
                    errors.append(f"{where}: job {j['name']} depends on {dep['name']!r}, which "
                                  "is not an earlier replicated job")
            jspec = j["template"]["spec"]
            if "backoffLimitPerIndex" in jspec and jspec.get("completionMode") != "Indexed":
                errors.append(f"{where}: job {j['name']}: backoffLimitPerIndex needs "
                              "completionMode: Indexed (Kubernetes Job validation)")
        for j, c in containers(runtime):
            is_trainer = j["name"] == "node" and c["name"] == "node"
            defined = set(PET) if is_trainer or (j["name"], c["name"]) in injected else set()
            env = list(c.get("env", [])) + (trainer.get("env", []) if is_trainer else [])
            for e in env:
                for ref in re.findall(r"\$\((\w+)\)", e.get("value", "")):
                    if ref not in defined:
                        errors.append(f"{where}: {j['name']}/{c['name']}: env {e['name']} uses "
                                      f"$({ref}), not defined before it")
                defined.add(e["name"])
            command = list(c.get("command", []))
            args = trainer.get("args", []) if is_trainer and "args" in trainer else c.get("args", [])
            for a in args:
                for ref in re.findall(r"\$\((\w+)\)", a):
                    if ref not in defined:
                        errors.append(f"{where}: {j['name']}/{c['name']}: argument {a!r} uses "
                                      f"$({ref}), not in the container's environment")
            if command[:1] != ["flotilla"] or len(command) < 2:
                errors.append(f"{where}: {j['name']}/{c['name']}: command {command} is not "
                              "flotilla SUBCOMMAND")
                continue
            usage = flags_of(command[1])
            for a in command[2:] + args:
                flag = a.split("=", 1)[0]
                if flag.startswith("--") and not re.search(r"(?<![\w-])" + re.escape(flag) + r"(?![\w-])", usage):
                    errors.append(f"{where}: {j['name']}/{c['name']}: flotilla {command[1]} "
                                  f"has no option {flag}")


# Wrong manifests the checks must refuse: (what, change to the parsed documents).
def _mutations():
    def trainer(docs):
        return next(d for d in docs if d["kind"] == "TrainJob")["spec"]["trainer"]

    def node(docs):
        runtime = next(d for d in docs if d["kind"] == "ClusterTrainingRuntime")
        return next(j for j in runtime["spec"]["template"]["spec"]["replicatedJobs"]
                    if j["name"] == "node")

    yield "a misspelt field", lambda d: trainer(d).update(numNode=3)
    yield "a number as a string", lambda d: trainer(d).update(numNodes="3")
    yield "an unknown container field", lambda d: node(d)["template"]["spec"]["template"][
        "spec"]["containers"][0].update(commands=["flotilla"])
    yield "a TrainJob name that is no DNS label", lambda d: next(
        x for x in d if x["kind"] == "TrainJob")["metadata"].update(name="Flotilla_CNN")
    yield "numProcPerNode auto", lambda d: trainer(d).pop("numProcPerNode")
    yield "backoffLimitPerIndex without Indexed", lambda d: node(d)["template"]["spec"].update(
        backoffLimitPerIndex=3, completionMode="NonIndexed")
    yield "a flag flotilla lacks", lambda d: trainer(d)["args"].append("--epoch=3")
    yield "an undefined $(VAR)", lambda d: trainer(d)["args"].append("--epochs=$(EPOCHS)")


def check(docs, name, schemas, cli, errors, verbose=True):
    for i, doc in enumerate(docs):
        where = f"{name}#{i} ({doc.get('kind')} {doc.get('metadata', {}).get('name')})"
        rules = check_schema(doc, schemas, where, errors)
        if verbose:
            print(f"{where}: schema checked, {rules} CEL rule(s) on its fields")
    check_semantics(docs, name, cli, errors)


def main():
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    cli = sys.argv[1]
    paths = [pathlib.Path(p) for p in sys.argv[2:]] or sorted(
        (ROOT / "examples" / "k8s").glob("trainjob*.yaml"))
    schemas = load_crds()
    errors = []
    for path in paths:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        check(docs, path.name, schemas, cli, errors)
        # The checks can fail: each wrong variant of this file must be refused.
        for what, change in _mutations():
            wrong = copy.deepcopy(docs)
            change(wrong)
            found = []
            check(wrong, path.name, schemas, cli, found, verbose=False)
            if not found:
                errors.append(f"{path.name}: {what} was not found by these checks")
            else:
                print(f"{path.name} with {what}: refused ({found[0][:160]})")
    for e in errors:
        print("ERROR", e)
    print(f"{len(paths)} file(s), {len(errors)} error(s)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
