"""The chart, rendered offline: `helm template` through helm-python-sdk (Helm's own Go SDK), parsed into objects.

    objects = render({"prefill": {"replicas": 3}})       # [dict, ...] every manifest, NOTES.txt apart
    find(objects, "Deployment", "prefill")               # the object of that kind whose name ends in "-prefill"
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parents[2] / "helm" / "splitserve"
RELEASE = "demo"
NAMESPACE = "serving"


def render(values: dict[str, Any] | None = None, *, notes: bool = False) -> list[dict[str, Any]] | str:
    """Every object the chart renders for `values` (or, with notes=True, the rendered NOTES.txt).
    Raises helm_python.HelmValuesError when values.schema.json rejects `values`."""
    import helm_python as helm

    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values or {}, name=RELEASE, namespace=NAMESPACE, is_install=True)
    if notes:
        return next(text for path, text in manifests.items() if path.endswith("NOTES.txt"))
    objects = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return objects


def find(objects: list[dict[str, Any]], kind: str, suffix: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"].endswith(f"-{suffix}")]
    assert len(found) == 1, f"{len(found)} {kind} named *-{suffix}: {[o['metadata']['name'] for o in found]}"
    return found[0]


def of_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    return obj["spec"]["template"]["spec"]["containers"]
