"""Flows take plain values only: Prefect stores every flow run's parameters in its database and
shows them in the UI, so a settings object (catalog URL with its password, credentials) or a
callable must never be one."""

from __future__ import annotations

import importlib
import pkgutil

import pytest
from prefect import Flow


def all_flows() -> list[Flow]:
    import flows

    found = []
    for mod in pkgutil.iter_modules(flows.__path__):
        module = importlib.import_module(f"flows.{mod.name}")
        found += [obj for obj in vars(module).values() if isinstance(obj, Flow) and obj.__module__ == module.__name__]
    return found


def test_every_flow_module_is_seen():
    names = {f.name for f in all_flows()}
    assert {"promote-checkpoint", "archive-checkpoint", "enforce-retention", "reconcile", "scrub",
            "restore-drill", "restore-checkpoint"} <= names


@pytest.mark.parametrize("flow", all_flows(), ids=lambda f: f.name)
def test_no_flow_takes_settings_or_a_callable(flow):
    schema = flow.parameters.model_dump()
    text = str(schema).lower()
    assert "settings" not in text, f"{flow.name} takes a settings object: {schema['properties']}"
    for name, prop in schema["properties"].items():
        assert "callable" not in str(prop).lower(), f"{flow.name}.{name} is a callable"
        types = {t.get("type") for t in prop.get("anyOf", [prop])} - {None}
        assert types <= {"string", "integer", "number", "boolean", "null", "array"}, (flow.name, name, prop)
