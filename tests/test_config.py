"""`app.config.AppConfig`: defaults, `from_args` and the rules that stop a bad start."""

from __future__ import annotations

import pytest
import yaml
from pydantic import ValidationError

from app.config import AppConfig, Mode


@pytest.fixture
def model_dir(tmp_path):
    path = tmp_path / "my-model"
    path.mkdir()
    return str(path)


def test_defaults_validate(model_dir):
    cfg = AppConfig.model_validate({"model": model_dir})
    assert cfg.mode is Mode.BIDIR
    assert cfg.reuses_kv and cfg.disaggregated
    assert cfg.model == model_dir
    assert cfg.model_name == "my-model"
    assert cfg.prefill.num_replicas == 1 and cfg.decode.num_replicas == 1
    assert cfg.sessions.handle_ttl_s < cfg.transfer.decoder_kv_blocks_ttl_s
    # Agents' first requests are tens of thousands of tokens; an answer without a limit
    # may take what the context leaves (vLLM's rule).
    assert cfg.max_model_len >= 65536 and cfg.default_max_tokens is None


def test_modes(model_dir):
    oneway = AppConfig.model_validate({"model": model_dir, "mode": "oneway"})
    assert oneway.mode is Mode.ONEWAY and not oneway.reuses_kv and oneway.disaggregated
    single = AppConfig.model_validate({"model": model_dir, "mode": "single"})
    assert single.mode is Mode.SINGLE and not single.reuses_kv and not single.disaggregated


def test_hub_model_id_is_not_checked_on_disk():
    cfg = AppConfig.model_validate({"model": "Qwen/Qwen3-0.6B", "served_model_name": "qwen"})
    assert cfg.model == "Qwen/Qwen3-0.6B"
    assert cfg.model_name == "qwen"


def test_from_args_dotted_keys_and_strings(model_dir):
    cfg = AppConfig.from_args(
        {
            "model": model_dir,
            "mode": "oneway",
            "max_model_len": "2048",
            "prefill.num_replicas": "2",
            "decode.num_replicas": "3",
            "decode.enable_prefix_caching": "false",
            "sessions.handle_ttl_s": "60",
            "transfer.recompute_threshold_tokens": "0",
        }
    )
    assert cfg.mode is Mode.ONEWAY
    assert cfg.max_model_len == 2048
    assert cfg.prefill.num_replicas == 2
    assert cfg.decode.num_replicas == 3
    assert cfg.decode.enable_prefix_caching is False
    assert cfg.prefill.enable_prefix_caching is True
    assert cfg.sessions.handle_ttl_s == 60.0
    assert cfg.transfer.recompute_threshold_tokens == 0


def test_from_args_json_values(model_dir):
    cfg = AppConfig.from_args(
        {
            "model": model_dir,
            "env": '{"UCX_NET_DEVICES": "lo", "FI_PROVIDER": "efa"}',
            "decode.resources": '{"decode_pool": 1}',
            "prefill.engine_kwargs": '{"max_num_batched_tokens": 512}',
            "sessions": '{"max_sessions": 5}',
        }
    )
    assert cfg.env == {"UCX_NET_DEVICES": "lo", "FI_PROVIDER": "efa"}
    assert cfg.decode.resources == {"decode_pool": 1.0}
    assert cfg.prefill.engine_kwargs == {"max_num_batched_tokens": 512}
    assert cfg.sessions.max_sessions == 5


def test_from_args_plain_equals_model_validate(model_dir):
    assert AppConfig.from_args({"model": model_dir}) == AppConfig.model_validate({"model": model_dir})


def test_from_args_config_file_with_overrides(tmp_path, model_dir):
    path = tmp_path / "app.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "model": model_dir,
                "mode": "bidir",
                "max_model_len": 1024,
                "decode": {"num_replicas": 2, "num_gpus": 1},
                "sessions": {"handle_ttl_s": 100, "max_sessions": 50},
            }
        )
    )
    cfg = AppConfig.from_args({"config": str(path), "decode.num_replicas": "4", "sessions.max_sessions": "7"})
    assert cfg.max_model_len == 1024
    assert cfg.decode.num_replicas == 4  # override
    assert cfg.decode.num_gpus == 1.0  # kept from the file next to the override
    assert cfg.sessions.handle_ttl_s == 100.0
    assert cfg.sessions.max_sessions == 7


def test_from_args_config_file_must_be_mapping(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="mapping"):
        AppConfig.from_args({"config": str(path)})


def test_from_args_dotted_key_under_scalar(model_dir):
    with pytest.raises(ValueError, match="non-mapping"):
        AppConfig.from_args({"model": model_dir, "mode": "single", "mode.x": "1"})


def test_handle_ttl_must_be_below_decoder_ttl(model_dir):
    with pytest.raises(ValidationError, match="handle_ttl_s must be shorter"):
        AppConfig.model_validate(
            {
                "model": model_dir,
                "sessions": {"handle_ttl_s": 480},
                "transfer": {"decoder_kv_blocks_ttl_s": 480},
            }
        )
    with pytest.raises(ValidationError, match="handle_ttl_s must be shorter"):
        AppConfig.from_args({"model": model_dir, "sessions.handle_ttl_s": "600"})


@pytest.mark.parametrize(
    "extra",
    [
        {"unknown_key": 1},
        {"prefill": {"num_replica": 2}},
        {"sessions": {"ttl": 5}},
        {"transfer": {"backend": "UCX", "extra": True}},
    ],
)
def test_unknown_keys_are_refused(model_dir, extra):
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        AppConfig.model_validate({"model": model_dir, **extra})


def test_unknown_dotted_key_is_refused(model_dir):
    with pytest.raises(ValidationError, match="Extra inputs"):
        AppConfig.from_args({"model": model_dir, "decode.replicas": "2"})


def test_missing_local_model_path(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(ValidationError, match="does not exist"):
        AppConfig.model_validate({"model": missing})
    with pytest.raises(ValidationError, match="does not exist"):
        AppConfig.model_validate({"model": "models/definitely-not-here"})


@pytest.mark.parametrize(
    "tree, message",
    [
        ({"mode": "both"}, "mode"),
        ({"prefill": {"num_replicas": 0}}, "num_replicas"),
        ({"decode": {"num_replicas": "0"}}, "num_replicas"),
        ({"ingress": {"num_replicas": 0}}, "num_replicas"),
        ({"transfer": {"backend": "TCP"}}, "backend"),
        ({"max_model_len": 8}, "max_model_len"),
        ({"max_model_len": 4096, "default_max_tokens": 4096}, "default_max_tokens must be below"),
        ({"prefill": {"tensor_parallel_size": 2}}, "tensor_parallel_size"),
    ],
)
def test_bad_values(model_dir, tree, message):
    with pytest.raises(ValidationError, match=message):
        AppConfig.model_validate({"model": model_dir, **tree})


def test_tp_may_differ_in_single_mode(model_dir):
    cfg = AppConfig.model_validate(
        {"model": model_dir, "mode": "single", "decode": {"tensor_parallel_size": 2}}
    )
    assert cfg.decode.tensor_parallel_size == 2


def test_config_is_frozen(model_dir):
    cfg = AppConfig.model_validate({"model": model_dir})
    with pytest.raises(ValidationError):
        cfg.max_model_len = 10


def _deployments(app) -> dict:
    """name -> (num_replicas, constructor args) of an app graph's deployments."""
    from ray.serve.deployment import Application

    out, todo = {}, [app]
    while todo:
        node = todo.pop()._bound_deployment
        out[node.name] = (node.num_replicas, node.init_args, node.init_kwargs)
        todo += [a for a in (*node.init_args, *node.init_kwargs.values()) if isinstance(a, Application)]
    return out


def test_a_new_replica_count_changes_only_that_deployments_options(tmp_path):
    """Serve restarts a deployment's replicas when its constructor arguments change: with
    only a count changed, every constructor gets equal arguments and the roles that kept
    their count (and the KV they hold) keep running."""
    from app.builder import build

    base = {"model": str(tmp_path), "decode": {"num_replicas": 2}, "prefill": {"num_replicas": 1}}
    before = _deployments(build(AppConfig.model_validate(base)))
    after = _deployments(
        build(
            AppConfig.model_validate({**base, "decode": {"num_replicas": 1}, "prefill": {"num_replicas": 3}})
        )
    )
    assert set(before) == set(after) == {"Ingress", "DecodeServer", "PrefillServer", "SessionStore"}
    assert (before["DecodeServer"][0], after["DecodeServer"][0]) == (2, 1)
    assert (before["PrefillServer"][0], after["PrefillServer"][0]) == (1, 3)
    for name in before:
        _, args_before, kwargs_before = before[name]
        _, args_after, kwargs_after = after[name]
        plain = lambda args: [a for a in args if not hasattr(a, "_bound_deployment")]  # noqa: E731
        assert plain(args_before) == plain(args_after) and kwargs_before == kwargs_after, name


def test_versions_change_with_settings_and_code_but_not_with_counts(tmp_path, monkeypatch):
    """Serve restarts replicas whose version changed; `serve.run` alone would give every
    deployment a new random version on every deploy."""
    from app import builder

    def versions(tree) -> dict:
        app = builder.build(AppConfig.model_validate(tree))
        out, todo = {}, [app]
        while todo:
            node = todo.pop()._bound_deployment
            out[node.name] = node.version
            todo += [
                a for a in (*node.init_args, *node.init_kwargs.values()) if hasattr(a, "_bound_deployment")
            ]
        return out

    base = {"model": str(tmp_path), "decode": {"num_replicas": 2}}
    first = versions(base)
    assert all(first.values()) and first == versions(base)  # stable across deploys
    assert versions({**base, "decode": {"num_replicas": 1}}) == first
    changed = versions({**base, "sessions": {"handle_ttl_s": 100}})
    assert all(changed[name] != first[name] for name in first)  # every constructor gets the new config
    monkeypatch.setattr(builder, "code_fingerprint", lambda: "another release")
    assert all(v != first[k] for k, v in versions(base).items())


def test_the_code_fingerprint_covers_every_module_of_the_packages(monkeypatch):
    """A change in any module, a subpackage's included, is a new release."""
    from pathlib import Path

    from app import builder

    first = builder.code_fingerprint()
    read = Path.read_bytes

    def changed(path: Path) -> bytes:
        data = read(path)
        return data + b"# changed" if path.parts[-3:] == ("app", "turn", "legs.py") else data

    monkeypatch.setattr(Path, "read_bytes", changed)
    assert builder.code_fingerprint() != first


def test_from_args_sets_dotted_keys_over_a_tree_without_changing_it(model_dir):
    """A nested tree with dotted keys over it (as tests/conftest.py's `config_with` builds
    configs): the keys land in the tree's sections, and the caller's mappings stay as given."""
    decode = {"num_replicas": 2, "num_gpus": 1}
    cfg = AppConfig.from_args({"model": model_dir, "decode": decode, "decode.num_replicas": 3})
    assert (cfg.decode.num_replicas, cfg.decode.num_gpus) == (3, 1.0)
    assert decode == {"num_replicas": 2, "num_gpus": 1}
