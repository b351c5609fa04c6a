"""Command-line errors as a user reads them (issue 38): every bad flag of a line at once,
each with a "did you mean" hint, no usage block; unique prefixes everywhere (servers,
router, generate), ambiguous ones naming the candidates; the draft default of
--speculative-algorithm; "Coming from SGLang" in the README kept true."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.config import ConfigError, ServerArgs
from pdserve.flags import FlagParser, error_lines

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.fast
def test_every_problem_of_a_line_is_reported_at_once():
    with pytest.raises(ConfigError) as exc:
        ServerArgs.from_cli(["--page-sise", "4", "--dtype", "fp8", "--tp-size", "two", "--speculative-num", "2",
                             "--max-total-tokens", "lots", "--context-length", "1024"])
    lines = str(exc.value).splitlines()
    assert sorted(lines) == sorted([
        "--page-sise: unknown flag (did you mean --page-size?)",
        "--dtype: invalid choice 'fp8' (choose from auto, float32, float16, bfloat16)",
        "--tp-size: invalid int value: 'two'",
        "ambiguous option: --speculative-num could match --speculative-num-steps, --speculative-num-draft-tokens",
        "--max-total-tokens: invalid int value: 'lots' (an integer, or none)",
    ]), lines
    # The values after an unknown flag are its own: not reported again as stray arguments.
    with pytest.raises(ConfigError) as exc:
        ServerArgs.from_cli(["--served-model-names", "a", "b"])
    assert str(exc.value) == "--served-model-names: unknown flag (did you mean --served-model-name?)"
    # A flag missing its value stops argparse: it is reported with the prefixes' problems.
    with pytest.raises(ConfigError) as exc:
        ServerArgs.from_cli(["--zzz", "--port"])
    assert str(exc.value).splitlines() == ["--zzz: unknown flag", "--port: expected one argument"]


@pytest.mark.fast
def test_prefixes_expand_in_both_spellings_and_aliases_are_not_ambiguous():
    args = ServerArgs.from_cli(["--speculative-algo=EAGLE3", "--page", "4", "--chunked", "-1"])
    assert (args.speculative_algorithm, args.page_size, args.chunked_prefill_size) == ("EAGLE3", 4, -1)
    parser = FlagParser(prog="t", error_class=ConfigError)
    parser.add_argument("--worker-urls", "--worker", nargs="+", dest="urls")
    parser.add_argument("--mode", choices=("a", "b"), default="a")
    assert parser.parse_or_raise(["--work", "u1", "u2", "--mo", "b"]).urls == ["u1", "u2"]
    with pytest.raises(ConfigError, match=r"^--mode: invalid choice 'c' \(choose from a, b\)$"):
        parser.parse_or_raise(["--mode", "c"])
    with pytest.raises(ConfigError, match=r"^'stray': unexpected argument"):
        parser.parse_or_raise(["stray"])


@pytest.mark.fast
def test_error_lines_are_the_problems_only():
    text = error_lines("pdserve serve", ConfigError("--a: x\n--b: y"))
    assert text == "pdserve serve: error: --a: x\npdserve serve: error: --b: y\n"


@pytest.mark.fast
def test_router_takes_prefixes_and_reports_every_bad_flag():
    from pdserve.router.config import ConfigError as RouterConfigError
    from pdserve.router.config import from_cli

    cfg = from_cli(["--pd-dis", "--prefill", "http://h:1", "--decode", "http://h:2", "--decode-pol", "cache_aware",
                    "--health-check-int", "2", "--max-request-b", "4096"])
    assert (cfg.pd_disaggregation, cfg.decode_policy, cfg.health_check_interval, cfg.max_request_bytes) == \
        (True, "cache_aware", 2.0, 4096)
    assert [w.url for w in from_cli(["--work", "http://h:1"]).workers] == ["http://h:1"]  # --worker-urls / --worker
    with pytest.raises(RouterConfigError) as exc:
        from_cli(["--pd-disaggregation", "--prefill", "http://h:1", "--decode", "http://h:2", "--retries", "x",
                  "--polcy", "random", "--policy", "best", "--health-check", "1"])
    assert sorted(str(exc.value).splitlines()) == sorted([
        "--retries: invalid int value: 'x'",
        "--polcy: unknown flag (did you mean --policy?)",
        "--policy: invalid choice 'best' (choose from round_robin, random, power_of_two, cache_aware)",
        "ambiguous option: --health-check could match --health-check-interval, --health-check-timeout",
    ])


def test_cli_errors_print_no_usage_block():
    """One `PROG: error:` line per problem, exit 2, for the server and generate commands."""
    for argv, prog, problems in (
            (["-m", "pdserve.launch_server", "--page-sise", "4", "--dtype", "fp8", "--log-lvl", "info"],
             "pdserve serve", 3),
            (["-m", "pdserve.generate", "--max-new-tokns", "3", "--temperature", "hot"],
             "python -m pdserve.generate", 3)):  # the third: --prompt missing
        r = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120)
        lines = r.stderr.splitlines()
        assert r.returncode == 2 and len(lines) == problems, r.stderr
        assert all(x.startswith(f"{prog}: error: ") for x in lines) and "usage:" not in r.stderr, r.stderr
        assert "did you mean" in r.stderr


# ---- the draft of --speculative-algorithm without --speculative-draft-model-path -----------
@pytest.mark.fast
def test_draft_default_rule(tmp_path):
    from pdserve import assets
    from pdserve.config_checks import default_draft_model_path
    from pdserve.testing import build_random_model

    # A draft shipped with the model: the demo model's heads (given by path or not at all).
    for algo, head in (("EAGLE", "demo-eagle"), ("EAGLE3", "demo-eagle3")):
        assert ServerArgs.from_cli(["--speculative-algorithm", algo]).speculative_draft_model_path == \
            str(assets.path(head))
        assert default_draft_model_path(str(assets.path("demo")), algo) == str(assets.path(head))
    # The checkpoint's own MTP layer (GLM-4.5): the model path is the draft, as in SGLang.
    glm = build_random_model(tmp_path / "glm", "glm4_moe")
    for algo in ("EAGLE", "NEXTN"):
        args = ServerArgs.from_cli(["--model-path", str(glm), "--speculative-algorithm", algo])
        assert (args.speculative_algorithm, args.speculative_draft_model_path) == ("EAGLE", str(glm))
    # NextN layers of an architecture pdserve does not draft them for: refused saying so.
    mtp = build_random_model(tmp_path / "mtp", "llama", num_nextn_predict_layers=1)
    with pytest.raises(ConfigError, match="^--speculative-draft-model-path: is required with --speculative-"
                                          "algorithm EAGLE: .* has multi-token-prediction \\(NextN\\) layers "
                                          "\\(num_nextn_predict_layers = 1\\), but pdserve drafts with them only "
                                          "for Glm4MoeForCausalLM"):
        ServerArgs.from_cli(["--model-path", str(mtp), "--speculative-algorithm", "EAGLE"])
    # Neither: the flag is asked for.
    plain = build_random_model(tmp_path / "plain", "llama")
    with pytest.raises(ConfigError, match="^--speculative-draft-model-path: is required with --speculative-"
                                          "algorithm EAGLE3: .* ships no draft head"):
        ServerArgs(model_path=str(plain), speculative_algorithm="EAGLE3")
    # A given draft is taken as it is.
    assert ServerArgs(speculative_algorithm="EAGLE", speculative_draft_model_path=str(assets.path("demo-eagle3"))
                      ).speculative_draft_model_path == str(assets.path("demo-eagle3"))


# ---- README "Coming from SGLang" --------------------------------------------------------------
def _coming_from_sglang() -> str:
    text = README.read_text()
    return text[text.index("## Coming from SGLang"):text.index("## On a GPU")]


@pytest.mark.fast
def test_readme_sglang_section_is_true():
    from pdserve.config_checks import DTYPES, LOAD_FORMATS, SCHEDULE_POLICIES
    from pdserve.model import attention_backends
    from pdserve.model.registry import supported_architectures

    section = _coming_from_sglang()
    for name in attention_backends.SGLANG_STAND_INS:  # every stand-in named
        assert f"`{name}`" in section, name
    unknown = re.search(r"SGLang flags pdserve does not have are unknown flags, e\.g\. (.*?)\n\n", section, re.S)
    assert unknown is not None
    names = re.findall(r"`(--[a-z0-9-]+)`", unknown.group(1))
    parser = ServerArgs.cli_parser()
    assert len(names) >= 5 and not set(names) & set(parser.flag_names)
    for flag in names:  # and no prefix of a pdserve flag either: each is refused as unknown
        with pytest.raises(ConfigError, match=f"^{flag}: unknown flag"):
            ServerArgs.from_cli([flag])
    for flag, accepted in (("--dtype", DTYPES), ("--load-format", LOAD_FORMATS),
                           ("--schedule-policy", SCHEDULE_POLICIES)):
        listed = re.search(rf"`{flag}` `([a-z0-9_|]+)`", section)
        assert listed is not None and tuple(listed.group(1).split("|")) == accepted, flag
    with pytest.raises(ConfigError) as exc:
        ServerArgs(trust_remote_code=True)
    assert all(arch in str(exc.value) for arch in supported_architectures())


def test_ctrl_c_while_the_server_imports_prints_no_traceback():
    """A Ctrl-C in the first seconds (torch still importing, before the server's own
    handlers) ends the launcher quietly with 130, as a shell expects."""
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", "pdserve.launch_server", "--port", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(0.5)  # the interpreter is up; the imports take seconds more
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:  # it went on to serve: stop it (and fail below)
            proc.kill()
            out, err = proc.communicate()
    assert proc.returncode == 130, (proc.returncode, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
