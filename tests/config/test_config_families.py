"""highrank.config model families: model.backbone picks the keys a config may set and holds."""

from __future__ import annotations

import tomllib

import pytest

import highrank.config.families as families_module
from highrank.config import (
    FAMILIES,
    ConfigError,
    Family,
    applies_to,
    config_from_dict,
    config_to_dict,
    dump_toml,
    key_families,
    load_config,
)


def test_every_existing_key_is_read_by_the_default_family():
    config = load_config()
    assert config.model.backbone == "awd-lstm"
    table = config_to_dict(config)
    for section, keys in FAMILIES["awd-lstm"].keys.items():
        assert set(keys) <= table[section].keys()
    assert key_families("model.d_hidden") == ("awd-lstm",)
    assert key_families("model.d_embed") == () and applies_to("train.lr", "any-family")


@pytest.fixture
def other_family(monkeypatch):
    """A second family that reads model.d_hidden and not model.weight_drop (as if the schema
    had grown one), while awd-lstm keeps its own keys but d_hidden."""
    awd = FAMILIES["awd-lstm"]
    keys = dict(awd.keys)
    keys["model"] = {k: rule for k, rule in keys["model"].items() if k != "d_hidden"}
    families = {
        "awd-lstm": Family(awd.name, keys, awd.check),
        "other": Family("other", {"model": {"d_hidden": awd.keys["model"]["d_hidden"]}}),
    }
    monkeypatch.setattr(families_module, "FAMILIES", families)


def test_a_key_of_another_family_is_an_error_naming_it_and_where_it_was_set(other_family, tmp_path):
    path = tmp_path / "x.toml"
    path.write_text('[model]\nbackbone = "awd-lstm"\nd_hidden = 10\n')
    with pytest.raises(ConfigError) as error:
        load_config(path)
    message = str(error.value)
    assert "x.toml, line 3" in message and "model.d_hidden is a key of model.backbone" in message
    assert "'other'" in message and "'awd-lstm'" in message
    with pytest.raises(ConfigError, match="override 'model.d_hidden=10'"):
        load_config(None, ["model.d_hidden=10"])


def test_a_resolved_config_holds_only_its_familys_keys_and_reads_back(other_family):
    config = load_config(None, ["model.weight_drop=0.25"])
    table = config_to_dict(config)
    assert "d_hidden" not in table["model"] and table["model"]["weight_drop"] == 0.25
    assert "d_hidden" not in tomllib.loads(dump_toml(config))["model"]
    assert config_from_dict(table) == config
