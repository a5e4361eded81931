"""The typed stack configuration: YAML + dotted overrides, errors that name the key and the value."""

from __future__ import annotations

import pytest

from dgrpo.cli.stack import StackConfig
from dgrpo.common.config import ConfigError, describe, load_config, parse_override


def test_defaults_load_and_overrides_apply(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("sampler:\n  max_model_len: 1024\n  enforce_eager: true\n")
    cfg = load_config(StackConfig, path, ["sampler.gpu_memory_utilization=0.35", "sampler.addresses=[a:1, b:2]"])
    assert cfg.sampler.max_model_len == 1024 and cfg.sampler.enforce_eager is True
    assert cfg.sampler.gpu_memory_utilization == 0.35
    assert cfg.sampler.addresses == ["a:1", "b:2"]


def test_override_values_parse_as_yaml():
    assert parse_override("a.b=0.5") == (["a", "b"], 0.5)
    assert parse_override("a=true") == (["a"], True)
    assert parse_override("a=null") == (["a"], None)
    assert parse_override("a=hello") == (["a"], "hello")


@pytest.mark.parametrize(
    "override,expected",
    [
        ("sampler.gpu_memory_utilisation=0.3", "sampler.gpu_memory_utilisation: unknown key"),
        ("sampler.gpu_memory_utilization=1.5", "sampler.gpu_memory_utilization=1.5"),
        ("sampler.port=-1", "sampler.port=-1"),
        ("sampler.max_model_len=lots", "sampler.max_model_len='lots'"),
        ("model.dtype=int3", "model.dtype='int3'"),
        ("nonsense.key=1", "nonsense: unknown key"),
    ],
)
def test_bad_keys_and_values_name_the_key_and_value(override, expected):
    with pytest.raises(ConfigError) as err:
        load_config(StackConfig, None, [override])
    assert expected in str(err.value)


def test_malformed_override_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not KEY=VALUE"):
        load_config(StackConfig, None, ["sampler.port"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(StackConfig, tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(StackConfig, bad)
    scalar_then_section = tmp_path / "s.yaml"
    scalar_then_section.write_text("sampler: 3\n")
    with pytest.raises(ConfigError, match="sampler"):
        load_config(StackConfig, scalar_then_section)


def test_every_option_is_documented():
    """A docstring under every field: each command's --help lists the options with them (common.config.describe)."""
    lines = describe(StackConfig)
    undocumented = [line for line in lines if line.startswith("  ") and line.rstrip().endswith(":")]
    assert not undocumented, undocumented
    assert any("sampler.gpu_memory_utilization" in line for line in lines)
