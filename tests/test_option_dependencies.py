"""Options that act only beside another option are refused where they would act nowhere (they were ignored)."""

import argparse
from dataclasses import fields

import pytest

from kvstrata.cli.engine_args import add_engine_arguments, engine_config_from_args
from kvstrata.cli.main import main
from kvstrata.config import EngineConfig
from kvstrata.errors import KvstrataError
from kvstrata.eval.compare import compared_options, configurations
from kvstrata.option_dependencies import DEPENDENCIES

# (flags that do nothing alone, what the error says, flags that make them act)
CASES = [
    (["--kivi-residual", "64"], ("--kivi-residual 64 acts only with --kv-format kivi4 or kivi2; this command has no "
                                "--kv-format"), ["--kv-format", "kivi2"]),
    (["--int4-group-size", "32", "--kv-format", "int8"], "this command has --kv-format int8",
     ["--kv-format", "int8/int4"]),
    (["--oaken-ratios", "0.04,0.9,0.06", "--no-oaken-key-centering"],
     "--oaken-ratios 0.04,0.9,0.06, --no-oaken-key-centering acts only with --kv-format oaken",
     ["--kv-format", "oaken"]),
    (["--h2o-budget", "0.5", "--kv-offload", "full"], ("--h2o-budget 0.5 acts only with --kv-offload h2o; this command "
                                                      "has --kv-offload full"), ["--kv-offload", "h2o"]),
    (["--infinigen-alpha", "3"], "acts only with --kv-offload infinigen", ["--kv-offload", "infinigen"]),
    (["--kv-link", "pcie5"], "acts only with --kv-offload full, infinigen or h2o", ["--kv-offload", "full"]),
    (["--kv-host-eviction", "lru", "--kv-offload", "infinigen"], "no --kv-host-memory", ["--kv-host-memory", "1GiB"]),
    (["--tile", "64", "--scheduler", "static"], "acts only with --scheduler sarathi", ["--scheduler", "sarathi"]),
    (["--max-prefill-tokens", "4096"], "acts only with --scheduler prefill-first", ["--scheduler", "prefill-first"]),
    (["--prompt-lookup-max", "6"], "acts only with --num-speculative-tokens 1 or more",
     ["--num-speculative-tokens", "3"]),
    (["--lora-dtype", "float32"], "acts only with --enable-lora or --lora-modules", ["--enable-lora"]),
    (["--kv-store-format", "medium"], "acts only with --kv-store; this command has no --kv-store",
     ["--kv-store", "host:1GiB"]),
    (["--kv-store-eviction", "lfu", "--kv-store", "disk:/tmp/kvstrata-unused:1GiB"], "a host tier in --kv-store",
     ["--kv-store", "host:1GiB"]),
    (["--kv-store-timeout-ms", "50", "--kv-store", "host:1GiB"], "a Redis tier in --kv-store",
     ["--kv-store", "host:1GiB,redis://127.0.0.1:1"]),
    (["--kv-store-level", "low", "--kv-store", "host:1GiB,redis://127.0.0.1:1", "--kv-store-format", "redis=medium"],
     "a --kv-store tier stored in the levels form", ["--kv-store-format", "redis=levels"]),
    (["--ttft-slo", "0.5", "--kv-store", "host:1GiB", "--kv-store-format", "levels", "--kv-store-level", "low"],
     "--kv-store-level auto", ["--kv-store-level", "auto"]),
    (["--impress-rule", "union", "--kv-store", "host:1GiB", "--prefix-loading", "h2o-keys"],
     "acts only with --prefix-loading impress", ["--prefix-loading", "impress"]),
]


def _config(*flags, varied=()):
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return engine_config_from_args(parser.parse_args(flags), varied)


@pytest.mark.parametrize(("alone", "said", "needed"), CASES, ids=[case[0][0] for case in CASES])
def test_an_option_that_would_act_nowhere_is_refused_and_taken_beside_what_it_needs(alone, said, needed):
    with pytest.raises(KvstrataError, match="Drop the option, or give what it needs") as refused:
        _config(*alone)
    assert said in str(refused.value)
    _config(*alone, *needed)


def test_a_command_that_sets_an_option_itself_takes_the_options_it_decides():
    """bench offload runs every --kv-offload mode, so --h2o-budget acts in one of its engines."""
    assert _config("--h2o-budget", "0.5", varied=("kv_offload",)).h2o_budget == 0.5
    with pytest.raises(KvstrataError, match="--h2o-budget"):  # what it varies decides nothing else
        _config("--h2o-budget", "0.5", "--kivi-residual", "8", varied=("kv_format",))


def test_every_option_scoped_to_a_technique_in_its_help_depends_on_what_turns_it_on():
    """A new option whose help says it belongs to a format, an offload mode, the store or the scheduler is refused
    alone too: here, or by EngineConfig's own checks."""
    ruled = {option for dependency in DEPENDENCIES for option in dependency.options}
    scopes = ("int4:", "kivi:", "oaken:", "infinigen", "h2o:", "kv offload:", "kv store", "sarathi:", "prefill-first:",
              "speculative decoding:", "prefix loading", "lpm:")
    scoped = {f.name for f in fields(EngineConfig) if f.metadata["help"].startswith(scopes)}
    acting_elsewhere = {"chunk_size"}  # also the steps of KIVI's window, of direct forwards and of evaluations
    refused_by_config = {"lpm_aging_tokens_per_s": 1.0, "kv_host_memory": "1GiB", "prefix_loading": "impress"}
    assert scoped - acting_elsewhere - set(refused_by_config) <= ruled, sorted(scoped - ruled)
    for name, value in refused_by_config.items():
        with pytest.raises(KvstrataError, match=name):
            EngineConfig(**{name: value})


def test_a_comparison_varies_options_and_each_configuration_is_checked_alone():
    assert compared_options("kv_format=kivi2+kivi_residual=64,kv_format=fp16") == ("kv_format", "kivi_residual")
    base = _config("--kivi-residual", "64", varied=compared_options("kv_format=kivi2,kv_format=fp16"))
    assert [config.kv_format for _, config in configurations(base, "kv_format=kivi2,kv_format=fp16")] == ["kivi2",
                                                                                                         "fp16"]
    with pytest.raises(KvstrataError, match="--compare 'kivi_residual=32': --kivi-residual 32 acts only with"):
        configurations(_config(), "kv_format=kivi2+kivi_residual=64,kivi_residual=32")


def test_generate_refuses_options_that_would_act_nowhere_before_loading_a_model(tmp_path, capsys):
    missing = ["--model", str(tmp_path / "missing")]
    for flags, said in [(["--kv-store-format", "medium"], "--kv-store-format medium acts only with --kv-store"),
                        (["--context-level", "low"], "--context-level low picks a level of a saved context"),
                        (["--length-penalty", "0.5"], ("--length-penalty shape beam search: give them with "
                                                      "--beam-width")),
                        (["--early-stopping", "true", "--length-penalty", "2"],
                         "--length-penalty and --early-stopping shape beam search")]:
        assert main(["generate", "Emma", *missing, *flags]) == 2
        assert said in capsys.readouterr().err
    assert main(["generate", "Emma", *missing, "--beam-width", "2", "--length-penalty", "0.5"]) == 2
    assert "model path" in capsys.readouterr().err  # the flags pass: the missing model is what stops it
