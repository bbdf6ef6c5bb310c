import argparse
import os
import re
import subprocess
import sys

import pytest

from kvstrata.cli.engine_args import add_engine_arguments, engine_config_from_args
from kvstrata.cli.main import main

pytestmark = pytest.mark.slow


def run_cli(*args):
    env = dict(os.environ)
    return subprocess.run(
        [sys.executable, "-m", "kvstrata.cli.main", *args], capture_output=True, text=True, env=env, timeout=300, check=False
    )


def test_generate_help_describes_every_flag(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = capsys.readouterr().out
    for flag in ("--max-tokens", "--temperature", "--seed", "--model", "--kv-cache-memory", "--scheduler",
                 "--chunk-size", "--tile", "--block-size", "--device", "--max-num-seqs", "--stop", "--chat",
                 "--repetition-penalty", "--presence-penalty", "--frequency-penalty", "--min-p", "--min-tokens",
                 "--json-schema", "--json-object", "--regex", "--choice", "--grammar", "--compact-json"):
        assert flag in text


def test_memory_sizes_are_taken_as_written_on_the_command_line():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--kv-cache-memory", "512MiB", "--kv-offload", "infinigen", "--kv-host-memory", "1GiB"])
    config = engine_config_from_args(args)
    assert config.kv_cache_memory == 512 * 2**20 and config.kv_host_memory == 2**30
    args = parser.parse_args(["--kv-offload", "infinigen", "--kv-host-memory", "1048576"])  # bytes
    assert engine_config_from_args(args).kv_host_memory == 2**20


def test_generate_streams_text(tiny_llama, capsys):
    assert main(["generate", "Emma", "--model", str(tiny_llama), "--max-tokens", "8", "--kv-cache-memory", "8MiB"]) == 0
    assert capsys.readouterr().out.strip()
    assert main(["generate", "Emma", "--model", str(tiny_llama), "--max-tokens", "8", "--kv-cache-memory", "8MiB",
                 "--repetition-penalty", "1.3", "--min-tokens", "8", "--min-p", "0.1"]) == 0
    assert capsys.readouterr().out.strip()
    assert main(["generate", "Emma", "--model", str(tiny_llama), "--min-tokens", "300"]) == 2
    assert "--min-tokens 300 exceeds --max-tokens 256" in capsys.readouterr().err  # the flags, not the fields


def test_generate_prints_the_beams_of_a_search(tiny_llama, capsys):
    from kvstrata import LLM, BeamSearchParams

    tiny = ["--model", str(tiny_llama), "--max-tokens", "8", "--kv-cache-memory", "8MiB"]
    assert main(["generate", "Emma", *tiny, "--beam-width", "3", "--length-penalty", "0.5",
                 "--early-stopping", "never"]) == 0
    params = BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=0.5, early_stopping="never")
    expected = LLM(str(tiny_llama), kv_cache_memory="8MiB").beam_search("Emma", params)[0]
    assert capsys.readouterr().out == "".join(
        f"[{rank}] score {beam.score:.4f} ({beam.finish_reason}, {len(beam.token_ids)} tokens)\n{text}\n"
        for rank, (beam, text) in enumerate(zip(expected.sequences, expected.texts), start=1))
    assert main(["generate", "Emma", *tiny, "--beam-width", "2", "--temperature", "0.7"]) == 2
    assert "temperature 0.7 cannot be combined with --beam-width" in capsys.readouterr().err


def test_generate_runs_on_a_lora_adapter(tiny_llama, tmp_path, capsys):
    from kvstrata import LLM, SamplingParams
    from kvstrata.bench.lora_adapters import write_random_adapter
    from kvstrata.model.config import ModelConfig

    adapter = write_random_adapter(tmp_path / "a", ModelConfig.from_checkpoint(tiny_llama), rank=4, std=0.2)
    tiny = ["--model", str(tiny_llama), "--max-tokens", "8", "--kv-cache-memory", "8MiB", "--lora-modules",
            f"mine={adapter}"]
    assert main(["generate", "Emma", *tiny, "--lora", "mine"]) == 0
    expected = LLM(str(tiny_llama), kv_cache_memory="8MiB", lora_modules=f"mine={adapter}").generate(
        "Emma", SamplingParams(max_tokens=8, temperature=0.0, lora_name="mine"))[0].text
    assert capsys.readouterr().out.strip() == expected.strip()
    assert main(["generate", "Emma", *tiny, "--lora", "other"]) == 2
    assert "LoRA adapter 'other' is not loaded (loaded: mine)" in capsys.readouterr().err


def test_generate_holds_the_output_to_a_structured_constraint(tiny_llama, tmp_path, capsys):
    tiny = ["--model", str(tiny_llama), "--max-tokens", "12", "--kv-cache-memory", "8MiB"]
    assert main(["generate", "Emma", *tiny, "--regex", "[0-9]{3}-[a-z]+", "--temperature", "1", "--seed", "3"]) == 0
    assert re.fullmatch(r"[0-9]{3}-[a-z]+", capsys.readouterr().out.strip())
    assert main(["generate", "Emma", *tiny, "--choice", "yes", "--choice", "no"]) == 0
    assert capsys.readouterr().out.strip() in ("yes", "no")
    grammar = tmp_path / "answer.gbnf"
    grammar.write_text('root ::= "tea" | "milk"')
    assert main(["generate", "Emma", *tiny, "--grammar", str(grammar)]) == 0
    assert capsys.readouterr().out.strip() in ("tea", "milk")
    assert main(["generate", "Emma", *tiny, "--json-schema", str(tmp_path / "missing.json")]) == 2
    assert "cannot read the json file" in capsys.readouterr().err
    assert main(["generate", "Emma", *tiny, "--regex", "[0-9"]) == 2
    assert "regex is not valid" in capsys.readouterr().err
    assert main(["generate", "Emma", *tiny, "--compact-json"]) == 2
    assert "give it with --json-schema or --json-object" in capsys.readouterr().err
    assert main(["generate", "Emma", *tiny, "--regex", ""]) == 2
    assert "regex must be a non-empty string" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "Emma", *tiny, "--regex", "a", "--choice", "b"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_bad_input_prints_an_error_without_traceback(tmp_path):
    result = run_cli("generate", "hi", "--model", str(tmp_path / "missing"))
    assert result.returncode == 2
    assert "error: model path" in result.stderr and "Traceback" not in result.stderr
    result = run_cli("generate", "hi", "--temperature", "-1", "--model", str(tmp_path / "missing"))
    assert result.returncode == 2 and "temperature must be in" in result.stderr


@pytest.mark.parametrize("command", [("kv", "save"), ("calibrate", "oaken"), ("calibrate", "infinigen"),
                                     ("calibrate", "cachegen")])
def test_commands_that_write_a_file_refuse_bad_counts_and_paths_before_loading_a_model(command, tmp_path, capsys):
    """A negative count once sliced the text from its end (kv save kept all but the last tokens), and a path under a
    file was found out after the work; the model named here does not exist, so each refusal comes first."""
    text, under_a_file = tmp_path / "text.txt", tmp_path / "plain"
    text.write_text("Emma Woodhouse, handsome, clever, and rich.")
    under_a_file.write_text("")
    base = [*command, "--text", str(text), "--model", str(tmp_path / "missing"), "--out", str(tmp_path / "o")]
    count = "--max-context-tokens" if command[0] == "kv" else "--window-tokens"
    for extra, said in [((count, "-3"), f"argument {count}: must be an integer >= 1, got '-3'"),
                        (("--out", str(tmp_path)), f"argument --out: {tmp_path} is a directory"),
                        (("--out", str(under_a_file / "sub" / "o")), f"{under_a_file} is a file, not a directory")]:
        with pytest.raises(SystemExit):
            main([*base, *extra])
        assert said in capsys.readouterr().err
    assert main(base) == 2  # the arguments pass: the missing model is what stops it
    assert "model path" in capsys.readouterr().err


def test_chat_template_kwargs_reach_the_template_and_bad_ones_are_refused(tiny_llama):
    base = ("generate", "hi", "--model", str(tiny_llama), "--kv-cache-memory", "8MiB", "--max-tokens", "2")
    without_chat = run_cli(*base, "--chat-template-kwargs", '{"enable_thinking": false}')
    assert without_chat.returncode == 2 and "give them with --chat" in without_chat.stderr
    not_an_object = run_cli(*base, "--chat", "--chat-template-kwargs", "[1]")
    assert not_an_object.returncode == 2 and "needs a JSON object" in not_an_object.stderr
    reserved = run_cli(*base, "--chat", "--chat-template-kwargs", '{"messages": []}')  # reached the template
    assert reserved.returncode == 2 and "variables messages are the template's own" in reserved.stderr
    assert run_cli(*base, "--chat", "--chat-template-kwargs", '{"enable_thinking": false}').returncode == 0
    no_template = run_cli(*base, "--chat", "--chat-template", "missing.jinja")  # a template in place of the model's
    assert no_template.returncode == 2 and "is neither a file nor a template" in no_template.stderr


def test_chat_session(tiny_llama):
    result = subprocess.run(
        [sys.executable, "-m", "kvstrata.cli.main", "chat", "--model", str(tiny_llama), "--max-tokens", "5",
         "--kv-cache-memory", "8MiB", "--chat-template-kwargs", '{"enable_thinking": false}'],
        input="Hello\n/reset\nAgain\n/exit\n", capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(">") >= 3


def test_vllms_kv_cache_dtype_flag_runs_the_format_it_names(tiny_llama, capsys):
    tiny = ["generate", "Emma Woodhouse", "--model", str(tiny_llama), "--max-tokens", "12", "--kv-cache-memory", "8MiB",
            "--temperature", "0"]
    assert main([*tiny, "--kv-format", "fp8_e5m2"]) == 0
    named = capsys.readouterr().out
    assert main([*tiny, "--kv-format", "fp8"]) == 0
    assert capsys.readouterr().out != named  # the two formats differ on this prompt, so the flag below is told apart
    assert main([*tiny, "--kv-cache-dtype", "fp8_e5m2"]) == 0
    assert capsys.readouterr().out == named
    assert main([*tiny, "--kv-cache-dtype", "fp8", "--kv-format", "int8"]) == 2
    assert "--kv-cache-dtype 'fp8' (--kv-format fp8) and --kv-format 'int8' disagree" in capsys.readouterr().err


def test_generate_with_speculative_decoding_prints_what_plain_decoding_prints(tiny_llama, capsys):
    tiny = ["generate", "Emma Woodhouse", "--model", str(tiny_llama), "--max-tokens", "24", "--kv-cache-memory", "8MiB",
            "--temperature", "0"]
    assert main(tiny) == 0
    plain = capsys.readouterr().out
    assert main([*tiny, "--num-speculative-tokens", "3", "--prompt-lookup-min", "1"]) == 0
    assert capsys.readouterr().out == plain
    assert main([*tiny, "--num-speculative-tokens", "3", "--kv-format", "kivi4"]) == 2
    assert ("--num-speculative-tokens 3 needs a --kv-format of fp32, fp16, bf16, int8, int4, fp8, fp8_e5m2, oaken (or "
            "two of them, KEYS/VALUES), not 'kivi4'") in capsys.readouterr().err


@pytest.mark.parametrize("command", [("kv", "save"), ("calibrate", "oaken"), ("calibrate", "cachegen")])
def test_an_empty_text_file_is_refused_naming_it(command, tiny_llama, tmp_path, capsys):
    """It was refused for holding fewer than N windows of M tokens, or 'a context must have 1 to 8192 tokens'."""
    empty = tmp_path / "empty.txt"
    empty.write_text(" \n")
    flags = ["--text", str(empty), "--model", str(tiny_llama), "--kv-cache-memory", "8MiB", "--out", str(tmp_path / "o")]
    assert main([*command, *flags]) == 2
    assert f"text file {empty} holds no text" in capsys.readouterr().err


def test_errors_name_options_as_the_command_line_spells_them():
    from kvstrata.cli.main import spelled_as_flags

    args = argparse.Namespace(max_tokens=256, kv_host_memory=None, text=None)
    said = spelled_as_flags("kv_host_memory needs kv_offload infinigen; max_tokens 0 in /tmp/max_tokens/a, text", args)
    assert said == "--kv-host-memory needs kv_offload infinigen; --max-tokens 0 in /tmp/max_tokens/a, text"
