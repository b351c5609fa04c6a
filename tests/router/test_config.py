"""CLI parsing: SGLang's flag shapes, defaults, and errors that name the flag."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.router.config import DEFAULT_BOOTSTRAP_PORT, ConfigError, from_cli


@pytest.mark.fast
def test_pd_flags_and_defaults():
    cfg = from_cli(["--pd-disaggregation", "--prefill", "http://10.0.0.1:30001", "9001",
                    "--prefill", "http://10.0.0.2:30001/", "--decode", "http://10.0.0.3:30002",
                    "--decode", "http://10.0.0.4:30002", "--port", "8000", "--prefill-policy", "cache_aware"])
    assert [(w.url, w.bootstrap_port, w.host) for w in cfg.prefill] == [
        ("http://10.0.0.1:30001", 9001, "10.0.0.1"), ("http://10.0.0.2:30001", DEFAULT_BOOTSTRAP_PORT, "10.0.0.2")]
    assert [w.url for w in cfg.decode] == ["http://10.0.0.3:30002", "http://10.0.0.4:30002"]
    assert (cfg.prefill_policy, cfg.decode_policy) == ("cache_aware", "round_robin")
    assert (cfg.health_check_interval, cfg.retries, cfg.port) == (1.0, 1, 8000)
    none = from_cli(["--pd-disaggregation", "--prefill", "http://h:1", "none", "--decode", "http://h:2"])
    assert none.prefill[0].bootstrap_port is None


@pytest.mark.fast
def test_policy_defaults_follow_policy_flag():
    cfg = from_cli(["--pd-disaggregation", "--prefill", "http://h:1", "--decode", "http://h:2",
                    "--policy", "power_of_two"])
    assert (cfg.prefill_policy, cfg.decode_policy) == ("power_of_two", "power_of_two")
    plain = from_cli(["--worker-urls", "http://h:1", "http://h:2", "--policy", "random"])
    assert not plain.pd_disaggregation and [w.role for w in plain.workers] == ["plain", "plain"]


PD = ["--pd-disaggregation", "--prefill", "http://h:1", "--decode", "http://h:2", "--decode", "http://h:3"]


@pytest.mark.fast
@pytest.mark.parametrize("flags, prefill, decode", [
    # As SGLang's router: --policy is both roles' policy; a role's own flag overrides it.
    ([], "round_robin", "round_robin"),
    (["--policy", "cache_aware"], "cache_aware", "cache_aware"),
    (["--decode-policy", "cache_aware"], "round_robin", "cache_aware"),
    (["--policy", "cache_aware", "--decode-policy", "power_of_two"], "cache_aware", "power_of_two"),
    (["--policy", "random", "--prefill-policy", "cache_aware", "--decode-policy", "cache_aware"],
     "cache_aware", "cache_aware"),
])
def test_decode_policy_may_be_cache_aware(flags, prefill, decode):
    cfg = from_cli([*PD, *flags])
    assert (cfg.prefill_policy, cfg.decode_policy) == (prefill, decode)


@pytest.mark.fast
def test_cache_aware_on_both_roles_builds_two_trees():
    from pdserve.router.app import create_app
    app = create_app(from_cli([*PD, "--policy", "cache_aware", "--cache-threshold", "0.4",
                               "--balance-abs-threshold", "7"]))
    proxy = app.state.router.proxy
    pre, dec = proxy.prefill_policy, proxy.decode_policy
    assert (pre.name, dec.name) == ("cache_aware", "cache_aware")
    assert pre.tree is not dec.tree
    assert (dec.threshold, dec.balance_abs_threshold) == (0.4, 7)


def test_cli_refuses_an_unknown_decode_policy():
    r = subprocess.run([sys.executable, "-m", "pdserve.router", *PD, "--decode-policy", "sticky"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "--decode-policy" in r.stderr and "sticky" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.fast
@pytest.mark.parametrize("argv, flag", [
    (["--prefill", "http://h:1", "--decode", "http://h:2"], "--pd-disaggregation"),
    (["--pd-disaggregation", "--decode", "http://h:2"], "--prefill"),
    (["--pd-disaggregation", "--prefill", "http://h:1"], "--decode"),
    (["--pd-disaggregation", "--prefill", "http://h:1", "x", "--decode", "http://h:2"], "--prefill"),
    (["--pd-disaggregation", "--prefill", "http://h:1", "70000", "--decode", "http://h:2"], "--prefill"),
    (["--pd-disaggregation", "--prefill", "http://h:1", "1", "2", "--decode", "http://h:2"], "--prefill"),
    (["--pd-disaggregation", "--prefill", "h:1", "--decode", "http://h:2"], "--prefill"),
    (["--pd-disaggregation", "--prefill", "http://h:1", "--decode", "http://h:2/v1"], "--decode"),
    (["--pd-disaggregation", "--prefill", "http://h:1", "--decode", "http://h:1"], "listed twice"),
    (["--pd-disaggregation", "--prefill", "http://h:1", "--decode", "http://h:2", "--prefill-policy", "best"],
     "--prefill-policy"),
    (["--pd-disaggregation", "--prefill", "http://h:1", "--decode", "http://h:2", "--decode-policy",
      "cache-aware"], "--decode-policy"),
    (["--pd-disaggregation", "--prefill", "http://h:1", "--decode", "http://h:2", "--policy", "least_load"],
     "--policy"),
    (["--worker-urls", "http://h:1", "--policy", "prefix"], "--policy"),
    (["--pd-disaggregation", "--prefill", "http://h:1", "--decode", "http://h:2", "--retries", "-1"], "--retries"),
    (["--pd-disaggregation", "--prefill", "http://h:1", "--decode", "http://h:2", "--health-check-interval",
      "0"], "--health-check-interval"),
    (["--pd-disaggregation", "--prefill", "http://h:1", "--decode", "http://h:2", "--port", "abc"], "--port"),
    (["--pd-disaggregation", "--prefill", "http://h:1", "--decode", "http://h:2", "--bogus"], "--bogus"),
    ([], "--worker-urls"),
] + [(["--worker-urls", "http://h:1", "--send-timeout", bad], "--send-timeout") for bad in ("0", "-1", "nan", "inf")])
def test_bad_flags_name_the_flag(argv, flag):
    with pytest.raises(ConfigError) as exc:
        from_cli(argv)
    assert flag in str(exc.value)


def test_cli_exits_with_the_message():
    r = subprocess.run([sys.executable, "-m", "pdserve.router", "--pd-disaggregation", "--prefill", "http://h:1",
                        "--decode", "http://h:2", "--retries", "-3"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "--retries" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.fast
def test_send_timeout_reaches_the_config():
    assert from_cli(["--worker-urls", "http://h:1"]).send_timeout == 60.0
    assert from_cli(["--worker-urls", "http://h:1", "--send-timeout", "2.5"]).send_timeout == 2.5


@pytest.mark.fast
def test_admin_api_key_from_a_file(tmp_path):
    key = tmp_path / "admin-api-key"
    key.write_text("  adm-0123456789abcdef\n")
    base = ["--worker-urls", "http://h:1"]
    assert from_cli([*base, "--admin-api-key-file", str(key)]).admin_api_key == "adm-0123456789abcdef"
    assert from_cli([*base, "--admin-api-key", "k"]).admin_api_key == "k"
    (tmp_path / "empty").write_text("")
    for extra, message in ((["--admin-api-key", "k", "--admin-api-key-file", str(key)], "not both"),
                           (["--admin-api-key-file", str(tmp_path / "missing")], "cannot read"),
                           (["--admin-api-key-file", str(tmp_path / "empty")], "is empty")):
        with pytest.raises(ConfigError, match=f"--admin-api-key.*{message}"):
            from_cli([*base, *extra])
