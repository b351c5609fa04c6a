"""ServerArgs: SGLang flag names, strict validation, frozen."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve.config import ConfigError, ServerArgs

pytestmark = pytest.mark.fast


def test_defaults_construct():
    args = ServerArgs()
    assert args.model_path is None
    assert args.tp_size == 1
    assert args.page_size == 1
    assert args.chunked_prefill_size == 8192
    assert args.disable_radix_cache is False
    assert args.schedule_policy == "fcfs"
    assert args.dtype == "auto"
    assert args.kv_cache_dtype == "auto"
    assert args.max_total_tokens is None
    assert args.random_seed is None
    assert 0.0 < args.mem_fraction_static < 1.0


def test_from_cli_empty_equals_defaults():
    assert ServerArgs.from_cli([]) == ServerArgs()


def test_from_cli_parses_sglang_flags(tmp_path):
    args = ServerArgs.from_cli([
        "--model-path", str(tmp_path),
        "--tp-size", "2",
        "--page-size", "16",
        "--chunked-prefill-size", "-1",
        "--disable-radix-cache",
        "--schedule-policy", "lpm",
        "--max-total-tokens", "4096",
        "--context-length", "512",
        "--random-seed", "1234",
        "--dtype", "bfloat16",
        "--kv-cache-dtype", "float16",
        "--mem-fraction-static", "0.5",
    ])
    assert args.model_path == str(tmp_path)
    assert args.tp_size == 2 and isinstance(args.tp_size, int)
    assert args.page_size == 16
    assert args.chunked_prefill_size == -1
    assert args.disable_radix_cache is True
    assert args.schedule_policy == "lpm"
    assert args.max_total_tokens == 4096 and isinstance(args.max_total_tokens, int)
    assert args.context_length == 512
    assert args.random_seed == 1234
    assert args.dtype == "bfloat16"
    assert args.kv_cache_dtype == "float16"
    assert args.mem_fraction_static == pytest.approx(0.5)
    # Flags not given keep their defaults.
    assert args.max_running_requests == ServerArgs().max_running_requests


def test_from_cli_matches_from_kwargs(tmp_path):
    cli = ServerArgs.from_cli(["--model-path", str(tmp_path), "--page-size", "4",
                               "--max-total-tokens", "64", "--disable-radix-cache"])
    kw = ServerArgs.from_kwargs(model_path=str(tmp_path), page_size=4, max_total_tokens=64,
                                disable_radix_cache=True)
    assert cli == kw


@pytest.mark.parametrize("argv", [["--no-such-flag"], ["--no-such-flag", "3"], ["positional"]])
def test_unknown_cli_flag_raises(argv):
    with pytest.raises(ConfigError) as exc:
        ServerArgs.from_cli(argv)
    assert argv[0] in str(exc.value)


@pytest.mark.parametrize("argv, flag_name", [
    (["--page-size", "0"], "--page-size"),
    (["--page-size", "abc"], "--page-size"),
    (["--tp-size", "0"], "--tp-size"),
    (["--mem-fraction-static", "1.5"], "--mem-fraction-static"),
    (["--mem-fraction-static", "0"], "--mem-fraction-static"),
    (["--dtype", "fp8"], "--dtype"),
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype"),
    (["--schedule-policy", "foo"], "--schedule-policy"),
    (["--trust-remote-code"], "--trust-remote-code"),
    (["--attention-backend", "fa9"], "--attention-backend"),
    (["--chunked-prefill-size", "0"], "--chunked-prefill-size"),
    (["--chunked-prefill-size", "-2"], "--chunked-prefill-size"),
    (["--max-total-tokens", "0"], "--max-total-tokens"),
    (["--context-length", "1"], "--context-length"),
    (["--random-seed", "-1"], "--random-seed"),
    (["--max-running-requests", "0"], "--max-running-requests"),
    (["--model-path", "/nonexistent/pdserve/model/dir"], "--model-path"),
    (["--tokenizer-path", "/nonexistent/pdserve/tok/dir"], "--tokenizer-path"),
])
def test_invalid_cli_value_names_flag(argv, flag_name):
    with pytest.raises(ConfigError) as exc:
        ServerArgs.from_cli(argv)
    assert flag_name in str(exc.value)


def test_max_total_tokens_smaller_than_page(tmp_path):
    with pytest.raises(ConfigError, match="--max-total-tokens"):
        ServerArgs.from_cli(["--page-size", "16", "--max-total-tokens", "8"])
    # exactly one page is fine
    assert ServerArgs.from_cli(["--page-size", "16", "--max-total-tokens", "16"]).max_total_tokens == 16


def test_device_cuda_without_cuda_raises(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="--device"):
        ServerArgs.from_cli(["--device", "cuda"])
    with pytest.raises(ConfigError, match="--device"):
        ServerArgs(device="cuda")
    # cpu and auto are always fine; auto resolves to cpu here
    assert ServerArgs(device="cpu").resolved_device() == torch.device("cpu")
    assert ServerArgs(device="auto").resolved_device() == torch.device("cpu")


def test_from_kwargs_unknown_names_flag():
    with pytest.raises(ConfigError) as exc:
        ServerArgs.from_kwargs(bogus=1)
    assert "--bogus" in str(exc.value)
    with pytest.raises(ConfigError) as exc:
        ServerArgs.from_kwargs(page_size=4, other_thing=2)
    assert "--other-thing" in str(exc.value)


@pytest.mark.parametrize("kwargs, flag_name", [
    ({"page_size": "16"}, "--page-size"),
    ({"tp_size": True}, "--tp-size"),
    ({"tp_size": 1.0}, "--tp-size"),
    ({"max_total_tokens": "64"}, "--max-total-tokens"),
    ({"mem_fraction_static": "0.5"}, "--mem-fraction-static"),
    ({"mem_fraction_static": True}, "--mem-fraction-static"),
    ({"disable_radix_cache": 1}, "--disable-radix-cache"),
    ({"dtype": None}, "--dtype"),
    ({"random_seed": 1.5}, "--random-seed"),
])
def test_wrong_python_types_raise(kwargs, flag_name):
    with pytest.raises(ConfigError) as exc:
        ServerArgs.from_kwargs(**kwargs)
    assert flag_name in str(exc.value)


def test_int_accepted_for_float_field():
    assert ServerArgs(mem_fraction_static=0.5).mem_fraction_static == 0.5
    assert ServerArgs(cpu_kv_budget_gb=2).cpu_kv_budget_gb == 2


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


def test_frozen():
    args = ServerArgs()
    with pytest.raises(dataclasses.FrozenInstanceError):
        args.page_size = 4  # type: ignore[misc]
    assert args.page_size == 1


def test_replace_revalidates():
    args = ServerArgs()
    assert args.replace(page_size=8).page_size == 8
    assert args.page_size == 1
    with pytest.raises(ConfigError, match="--page-size"):
        args.replace(page_size=0)


def test_security_flags():
    from pdserve.config_checks import is_loopback
    args = ServerArgs.from_cli(["--disaggregation-allowed-prefill", "10.0.0.1:8998", "prefill-0",
                                "--admin-api-key", "adm", "--max-request-bytes", "4096"])
    assert args.disaggregation_allowed_prefill == ("10.0.0.1:8998", "prefill-0")
    assert (args.admin_api_key, args.max_request_bytes, args.allow_client_chat_template) == ("adm", 4096, False)
    # A PD server listening beyond loopback needs the control-plane secret; the error says why.
    with pytest.raises(ConfigError, match=r"--disaggregation-secret: a decode server on '0.0.0.0'.*shared secret"):
        ServerArgs(disaggregation_mode="decode", host="0.0.0.0")
    assert ServerArgs(disaggregation_mode="decode", host="0.0.0.0",
                      disaggregation_secret="s" * 16).control_secret() == b"s" * 16
    ServerArgs(disaggregation_mode="decode", host="127.0.0.1")  # loopback: no secret needed
    assert is_loopback("localhost") and is_loopback("::1") and not is_loopback("10.1.2.3")
    for kwargs, flag_name in (({"disaggregation_secret": "short"}, "--disaggregation-secret"),
                              ({"disaggregation_allowed_prefill": ("h:99999",)}, "--disaggregation-allowed-prefill"),
                              ({"max_request_bytes": 10}, "--max-request-bytes"),
                              ({"request_read_timeout": 0.0}, "--request-read-timeout")):
        with pytest.raises(ConfigError, match=flag_name):
            ServerArgs(**kwargs)


# ---- paths, served names, chat template (issue 25) -----------------------------------------
def _path_tree(tmp_path):
    model, tok, draft = tmp_path / "model", tmp_path / "tok", tmp_path / "draft"
    for d in (model, tok, draft):
        d.mkdir()
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    return model, tok, draft, secret, template


def test_path_objects_accepted_and_kept_as_str(tmp_path):
    """Any os.PathLike wherever a path is taken; the frozen config holds str."""
    model, tok, draft, secret, template = _path_tree(tmp_path)
    args = ServerArgs(model_path=model, tokenizer_path=tok, speculative_algorithm="EAGLE",
                      speculative_draft_model_path=draft, disaggregation_secret_file=secret, chat_template=template)
    for name, want in (("model_path", model), ("tokenizer_path", tok), ("speculative_draft_model_path", draft),
                       ("disaggregation_secret_file", secret), ("chat_template", template)):
        value = getattr(args, name)
        assert type(value) is str and value == str(want), name
    same = ServerArgs(model_path=str(model), tokenizer_path=str(tok), speculative_algorithm="EAGLE",
                      speculative_draft_model_path=str(draft), disaggregation_secret_file=str(secret),
                      chat_template=str(template))
    assert args == same
    assert args.control_secret() == b"s" * 32
    # replace() goes through the same normalisation
    assert args.replace(model_path=tok).model_path == str(tok)
    # A path that does not exist is still refused, naming the flag.
    with pytest.raises(ConfigError, match="--model-path"):
        ServerArgs(model_path=tmp_path / "missing")


def test_from_cli_accepts_path_objects(tmp_path):
    model, tok, draft, secret, template = _path_tree(tmp_path)
    argv = ["--model-path", model, "--tokenizer-path", tok, "--speculative-algorithm", "EAGLE",
            "--speculative-draft-model-path", draft, "--disaggregation-secret-file", secret,
            "--chat-template", template]
    args = ServerArgs.from_cli(argv)
    assert args == ServerArgs.from_cli([str(a) for a in argv])
    assert args.model_path == str(model) and args.chat_template == str(template)


def test_served_model_name_is_repeatable():
    """vLLM's spelling (several values after one flag) and a repeated flag both work."""
    args = ServerArgs.from_cli(["--served-model-name", "a", "b", "--served-model-name", "c"])
    assert args.served_model_name == ("a", "b", "c")
    assert args.served_names() == ("a", "b", "c")
    assert ServerArgs.from_cli(["--served-model-name", "only"]).served_names() == ("only",)
    # Engine(served_model_name="x") and lists are accepted too.
    assert ServerArgs(served_model_name="x").served_model_name == ("x",)
    assert ServerArgs(served_model_name=["x", "y"]).served_model_name == ("x", "y")
    with pytest.raises(ConfigError, match="--served-model-name"):
        ServerArgs(served_model_name=("a", " "))
    with pytest.raises(ConfigError, match="--served-model-name"):
        ServerArgs.from_cli(["--served-model-name"])


def test_served_names_default_to_the_model_path(tmp_path):
    assert ServerArgs().served_names() == ("pdserve-demo",)
    assert ServerArgs(model_path=tmp_path).served_names() == (str(tmp_path),)
    assert ServerArgs(model_path=tmp_path, served_model_name=("m",)).served_names() == ("m",)


def test_chat_template_file_or_builtin_name(tmp_path):
    from pdserve.chat_templates import BUILTIN_CHAT_TEMPLATES

    for name in ("chatml", "llama-3-instruct", "llama-3", "llama-2-chat", "mistral"):
        assert name in BUILTIN_CHAT_TEMPLATES
        assert ServerArgs.from_cli(["--chat-template", name]).chat_template == name
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0]['content'] }}")
    assert ServerArgs.from_cli(["--chat-template", str(f)]).chat_template == str(f)
    with pytest.raises(ConfigError) as exc:
        ServerArgs.from_cli(["--chat-template", str(tmp_path / "nope.jinja")])
    msg = str(exc.value)
    assert msg.startswith("--chat-template:") and "nope.jinja" in msg and "chatml" in msg
    with pytest.raises(ConfigError, match="--chat-template"):
        ServerArgs(chat_template=str(tmp_path))  # a directory is not a template


def test_reasoning_parser_names():
    assert ServerArgs().reasoning_parser is None
    for name in ("qwen3", "deepseek-r1"):
        assert ServerArgs.from_cli(["--reasoning-parser", name]).reasoning_parser == name
        assert ServerArgs(reasoning_parser=name).reasoning_parser == name
    for make in (lambda: ServerArgs.from_cli(["--reasoning-parser", "qwen2"]),
                 lambda: ServerArgs(reasoning_parser="qwen2")):
        with pytest.raises(ConfigError) as e:
            make()
        assert "--reasoning-parser" in str(e.value) and "qwen3" in str(e.value) and "deepseek-r1" in str(e.value)


def test_admin_api_key_from_a_file(tmp_path):
    """A mounted secret (compose `secrets:`, a Kubernetes Secret volume) instead of a flag
    value that `ps` and `docker inspect` show; its trailing newline is not part of the key."""
    key = tmp_path / "admin-api-key"
    key.write_text("adm-0123456789abcdef\n")
    args = ServerArgs.from_cli(["--admin-api-key-file", str(key)])
    assert args.admin_key() == "adm-0123456789abcdef" and args.admin_api_key is None
    assert ServerArgs(admin_api_key="inline").admin_key() == "inline" and ServerArgs().admin_key() is None
    with pytest.raises(ConfigError, match="--admin-api-key: give it or --admin-api-key-file, not both"):
        ServerArgs(admin_api_key="inline", admin_api_key_file=key)
    with pytest.raises(ConfigError, match="--admin-api-key-file: .*is not a file"):
        ServerArgs(admin_api_key_file=tmp_path / "missing")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="--admin-api-key-file: .*is empty"):
        ServerArgs(admin_api_key_file=tmp_path / "empty").admin_key()
