"""MokvOptions: `--mokv-config` files, every key checked, no value echoed."""

from __future__ import annotations

import pytest
from mokv import HostTierConfig, KVEventsConfig, RemoteTierConfig, SessionConfig
from mokv.pipelines import MokvConfigError, MokvOptions


def test_each_section_builds_mokv_s_config_of_that_feature(tmp_path):
    path = tmp_path / "mokv.yaml"
    path.write_text(
        "host_tier: {swap_space_gb: 1}\n"
        "remote_tier: {url: 'redis://127.0.0.1:6379/0', namespace: tiny}\n"
        "kv_events: {endpoint: 'tcp://*:5557'}\n"
        "sessions: {ttl_s: 60, max_share: 0.25}\n"
    )
    options = MokvOptions.from_file(path)
    assert options.tiers == (
        HostTierConfig(swap_space_gb=1),
        RemoteTierConfig(url="redis://127.0.0.1:6379/0", namespace="tiny"),
    )
    assert options.kv_events == KVEventsConfig(endpoint="tcp://*:5557")
    assert options.sessions == SessionConfig(ttl_s=60, max_share=0.25)
    assert MokvOptions.from_mapping(None) == MokvOptions() == MokvOptions.from_mapping({})


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"disk_tier": {}}, r"unknown section\(s\) \['disk_tier'\]"),
        ({"host_tier": {"swap_space_gb": 1, "size": 2}}, r"unknown key\(s\) \['size'\]"),
        ({"sessions": {"ttl_s": -1}}, "section 'sessions'.*ttl_s"),
        ({"host_tier": "s3cret"}, "must be a mapping, got a str"),
        (["s3cret"], "must be a mapping of sections, got a list"),
    ],
)
def test_what_mokv_cannot_honour_is_an_error_naming_the_key(sections, message):
    with pytest.raises(MokvConfigError, match=message) as error:
        MokvOptions.from_mapping(sections)
    assert "s3cret" not in str(error.value)


def test_an_unreadable_or_malformed_file_is_an_error_naming_it(tmp_path):
    with pytest.raises(MokvConfigError, match="cannot read"):
        MokvOptions.from_file(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("host_tier: [unclosed\n")
    with pytest.raises(MokvConfigError, match="is not YAML"):
        MokvOptions.from_file(bad)
