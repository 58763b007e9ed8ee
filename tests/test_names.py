"""Device and model names as users type them: any case, aliases, near misses suggested, a Hub id and `cpu`
answered with what to do instead."""

from __future__ import annotations

import pytest

from flexmesh.errors import SpecError
from flexmesh.spec.cluster import parse_mixed_cluster
from flexmesh.spec.devices import DEVICE_PRESETS, device
from flexmesh.spec.model import MODEL_PRESETS, parse_model


@pytest.mark.parametrize("name", list(DEVICE_PRESETS))
def test_every_preset_in_any_case(name):
    assert device(name.lower()).name == name and device(name.upper()).name == name
    assert parse_mixed_cluster(f"2x8x{name.lower()}").groups[0].device.name == name


def test_aliases_in_any_case():
    assert device("h100").name == device("H100-SXM").name == device("h100-sxm").name == "H100-80GB"


@pytest.mark.parametrize("typed,suggested", [("H10", "H100"), ("L40", "L40S"), ("a100-80", "A100-80GB")])
def test_a_near_miss_is_suggested(typed, suggested):
    with pytest.raises(SpecError, match=rf"did you mean [^?]*\b{suggested}\b"):
        device(typed)


@pytest.mark.parametrize("cluster", ["2xcpu", "1x2xCPU", "local"])
def test_cpu_points_at_the_local_cluster(cluster):
    with pytest.raises(SpecError, match="--cluster local"):
        parse_mixed_cluster(cluster if "x" in cluster else f"1x{cluster}")


@pytest.mark.parametrize("name", list(MODEL_PRESETS))
def test_model_presets_in_any_case(name):
    assert parse_model(name.upper()) == MODEL_PRESETS[name]


def test_a_hub_id_says_flexmesh_downloads_nothing():
    with pytest.raises(SpecError, match="Hugging Face Hub id.*downloads nothing"):
        parse_model("meta-llama/Llama-3.1-8B")


def test_a_near_model_is_suggested_and_a_far_one_is_not():
    with pytest.raises(SpecError, match="did you mean .*llama3-8b"):
        parse_model("llama3-7b")
    with pytest.raises(SpecError) as e:
        parse_model("zzzz")
    assert "did you mean" not in str(e.value) and "known presets" in str(e.value)
