"""The kv_store engine argument: clear errors naming the field, the CLI flag, and models whose KV it cannot hold."""

from __future__ import annotations

import pytest

from deepserve import LLM
from deepserve.cli import main
from deepserve.config import EngineArgs, KVStoreConfig


@pytest.mark.parametrize("value, field", [
    ({"backend": "s3"}, "kv_store.backend"),
    ({}, "kv_store.backend"),
    ({"backend": "disk"}, "kv_store.path"),
    ({"backend": "redis", "url": "http://x"}, "kv_store.url"),
    ({"backend": "memory", "memory_bytes": -1}, "kv_store.memory_bytes"),
    ({"backend": "memory", "memory_bytes": 0}, "kv_store.memory_bytes"),
    ({"backend": "disk", "path": "/tmp/x", "disk_bytes": "big"}, "kv_store.disk_bytes"),
    ({"backend": "redis", "url": "redis://h:1", "timeout_s": 0}, "kv_store.timeout_s"),
    ({"backend": "memory", "max_fetch_bytes": -5}, "kv_store.max_fetch_bytes"),
    ({"backend": "memory", "fetch_timeout_s": 0}, "kv_store.fetch_timeout_s"),
    ({"backend": "memory", "bakend": 1}, "unknown field"),
    ("{not json", "kv_store: not valid JSON"),
    (["memory"], "kv_store must be a dict"),
])
def test_bad_kv_store_is_a_value_error_naming_the_field(value, field):
    with pytest.raises(ValueError, match=field):
        EngineArgs(kv_store=value)


def test_kv_store_needs_prefix_caching():
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineArgs(kv_store={"backend": "memory"}, enable_prefix_caching=False)


def test_unusable_disk_path_is_a_value_error(tiny_llama, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="kv_store.path"):
        EngineArgs(model=tiny_llama, kv_store={"backend": "disk", "path": str(blocker / "kv")}).create_engine_config()


def test_json_text_is_accepted():
    config = KVStoreConfig.parse('{"backend": "redis", "url": "redis://127.0.0.1:6379", "memory_bytes": 0}')
    assert config.backend == "redis" and config.memory_bytes == 0 and config.redis_bytes == 1 << 30


def test_cli_reports_a_bad_kv_store_and_exits_2(tiny_llama, capsys):
    assert main(["generate", "hi", "--model", tiny_llama, "--kv-store", '{"backend": "tape"}']) == 2
    assert "kv_store.backend" in capsys.readouterr().err


def test_serve_accepts_the_flag():
    from deepserve.cli import build_parser, engine_kwargs
    args = build_parser().parse_args(["serve", "--kv-store", '{"backend": "memory"}'])
    assert EngineArgs(**engine_kwargs(args)).kv_store == '{"backend": "memory"}'


def test_model_with_paged_states_is_refused(tmp_path):
    from deepserve.tools.make_tiny_checkpoint import write_deepseek_v41
    write_deepseek_v41(str(tmp_path), "mixed", quantize=False)
    with pytest.raises(ValueError, match="kv_store is not supported for this model.*PagedState"):
        LLM(str(tmp_path), skip_tokenizer_init=True, max_model_len=256, kv_store={"backend": "memory"})
