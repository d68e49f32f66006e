"""Bad input ends in one line on stderr, exit 2, no traceback, before any process or weight."""

import json

import pytest

from rekv_jax.cli import main as cli
from rekv_jax.config import ModelConfig
from rekv_jax.errors import describe


def _folders(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    (truncated / "config.json").write_text('{"model_type": "qwen2", "num_hidden')
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text(json.dumps(ModelConfig.preset("tiny").to_hf()))
    lacking = tmp_path / "lacking"
    lacking.mkdir()
    (lacking / "config.json").write_text('{"model_type": "qwen2"}')
    unreadable = tmp_path / "unreadable"  # a config.json no one can read, even root
    (unreadable / "config.json").mkdir(parents=True)
    (tmp_path / "empty.json").write_text("{}")
    (tmp_path / "key").write_bytes(b"a job's key, 32 bytes or so long")
    (tmp_path / "key").chmod(0o600)
    (tmp_path / "gate.jsonl").write_text(json.dumps(  # a quality gate result of another model
        {"model": "other", "seq_len": 8192, "action": "q8:full", "eligible": True}) + "\n")
    return tmp_path


# One case a line: argv | the words its one line must hold, separated by "; " ({tmp}: the
# folder of `_folders`)
TABLE = """
info --model hf:/missing                | /missing; no such
handoff --model hf:/missing             | /missing; no such
quality --model hf:/missing             | /missing; no such
handoff --model hf:{tmp}/empty          | empty; no config.json
handoff --model hf:{tmp}/truncated      | truncated/config.json; not valid JSON
handoff --model hf:{tmp}/lacking        | lacking/config.json; num_attention_heads
handoff --model hf:{tmp}/unreadable     | unreadable/config.json; cannot read
handoff --model hf:{tmp}/no_weights     | no_weights; safetensors
plan --profile /missing.json            | /missing.json; cannot read
plan --profile {tmp}/empty.json         | empty.json; lacks; suffix_layer_ms
handoff --seq-len 100000000             | 4096; 100000000
handoff --actions q8:r=99               | q8:r=99; 99; 0..6
handoff --actions q8:7                  | q8:7; 0..6
plan --actions q4:r=-1                  | q4:r=-1; -1
handoff --link-gbps 0                   | --link-gbps; positive
handoff --link-gbps -1                  | --link-gbps; positive
handoff --link-gbps fast                | --link-gbps; fast
plan --link-gbps 0                      | positive
handoff --reps 0                        | reps; positive
handoff --warmup -1                     | warmup
handoff --batch 0                       | batch; positive
handoff --timeout 0                     | timeout; positive
profile --reps 0                        | reps; positive
sweep --out {tmp}/s --link-gbps unpaced | paced; unpaced block
plan --schedule both                    | schedule; both
plan --chunks 0                         | --chunks; positive
plan --prefill streamed                 | --prefill; streamed
plan --prefill full,pipelined           | pipelined prefill streams; 'prompt'
plan --quality /missing.jsonl           | /missing.jsonl; cannot read
plan --quality {tmp}/empty.json         | empty.json; not a quality gate result
plan --quality {tmp}/gate.jsonl         | none for model 'tiny' at 8192; other
serve --rate 0                          | --rate; positive
serve --rates 1,x                       | --rates; '1,x'
serve --rate 1 --rates 2                | --rates; not allowed with argument --rate
serve --requests 0 --rate 1             | --requests; positive
serve --rate 1 --requests 5 --duration 2  | --duration; not allowed with argument --requests
serve --rate 1 --max-new-tokens 0       | --max-new-tokens; positive
serve --rate 1 --prompt-lens 100..50    | 100..50; LO <= HI
serve --rate 1 --prompt-lens 256,x      | --prompt-lens; 256,x
serve --rate 1 --prompt-lens 5000       | 5000; 4096
serve --model tiny --rate 1 --prompts wikitext | 2048; 512; --prompts synthetic
serve --rate 1 --policy q8:full,fast    | policy 'fast'; adaptive
serve --rate 1 --policy bf16:full,bf16:full | name one twice
serve --model tiny --rate 1 --policy q8:r=9 | q8:r=9; 0..6
serve --rate 1 --adaptive-bits 8        | --adaptive-bits; holding 16
serve --rate 1 --slo-ttft-ms 0          | --slo-ttft-ms; positive
serve --rate 1 --slo-tpot-ms -5         | --slo-tpot-ms; positive
serve --rate 1 --tpot-stretch 0.5       | --tpot-stretch; at least 1
serve --rate 1 --tpot-stretch fast      | --tpot-stretch; or none
serve --rate 1 --profile /missing.json  | /missing.json; cannot read
serve --model tiny --rate 1 --quality {tmp}/gate.jsonl | no results for tiny; other
serve --link-gbps 0 --rate 1            | --link-gbps; positive
serve --rate 1 --timeout 0              | --timeout; positive
serve --requests 5                      | --rate R; --http
serve --http 0.0.0.0:8000               | beyond loopback; --api-key
serve --http 8000                       | --http; HOST:PORT
serve --http 127.0.0.1:99999            | 99999; 0..65535
serve --http 127.0.0.1:8000 --rate 1    | --rate; generated load
serve --http 127.0.0.1:8000 --policy adaptive,q8:full | one policy
serve --http 127.0.0.1:8000 --plot {tmp}/p | --plot; --http
serve --rate 1 --api-key k              | --api-key; --http
serve --http 127.0.0.1:8000 --api-key-file /missing | /missing; cannot read the API key file
serve --rate 1 --api-key-file {tmp}/key | --api-key-file; --http
serve --http 127.0.0.1:8000 --api-key k --api-key-file {tmp}/key | not allowed with argument
serve --role router --http 127.0.0.1:8000 | a run across nodes (--role); needs the job's key
serve --role prefill                    | --role; 'prefill'; prefill-1
serve --role auto --secret-file {tmp}/key --http 127.0.0.1:8000 | --role auto; none was found
serve --role router --secret-file {tmp}/key --http 127.0.0.1:8000 | --coordinator HOST:PORT
serve --coordinator 127.0.0.1:1 --http 127.0.0.1:8000 | --coordinator; --role
serve --role decode-0 --coordinator 8000 | --coordinator; HOST:PORT
serve --rate 1 --prefill-workers 0      | --prefill-workers; positive
serve --rate 1 --decode-workers x       | --decode-workers; 'x'
"""
CASES = [(argv.split(), words.split("; ")) for argv, words in
         (line.split(" | ") for line in TABLE.strip().splitlines())]


@pytest.mark.parametrize("argv,words", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_input_is_one_line_exit_2(argv, words, tmp_path, capsys, monkeypatch):
    tmp = _folders(tmp_path)
    for name in ("REKV_SECRET_FILE", "REKV_API_KEY", "SLURM_JOB_ID"):  # the rows give their own
        monkeypatch.delenv(name, raising=False)
    started = []  # no process may start for bad input
    monkeypatch.setattr("subprocess.Popen", lambda *a, **k: started.append(a) or 1 / 0)
    monkeypatch.setattr("multiprocessing.process.BaseProcess.start",
                        lambda self: started.append(self) or 1 / 0)  # the launcher's
    with pytest.raises(SystemExit) as exit_info:
        cli.main([a.replace("{tmp}", str(tmp)) for a in argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"rekv {argv[0]}: error: ")
    for word in words:
        assert word.replace("{tmp}", str(tmp)) in lines[0], lines[0]
    assert not started


def test_debug_shows_the_traceback():
    with pytest.raises(ValueError, match="no such HF checkpoint folder"):
        cli.main(["--debug", "info", "--model", "hf:/missing"])


def test_a_fresh_processs_failure_is_one_line():
    """What a sweep or a command runs in a fresh process (the link calibration) fails in one
    line naming it, and bad input stays bad input (exit 2)."""
    from rekv_jax.study.calibrate import calibrate_link_in_child

    with pytest.raises(ValueError, match=r"^link calibration: .*/missing") as bad:
        calibrate_link_in_child("hf:/missing", 32, timeout=120)
    assert "\n" not in str(bad.value) and describe(bad.value).status == 2


@pytest.mark.parametrize("command", ["calibrate", "profile", "quality"])
def test_commands_that_measure_one_prompt_take_no_batch(command, capsys):
    """They would ignore it: argparse refuses the flag instead (exit 2)."""
    with pytest.raises(SystemExit) as stop:
        cli.main([command, "--batch", "4"])
    assert stop.value.code == 2 and "--batch" in capsys.readouterr().err
