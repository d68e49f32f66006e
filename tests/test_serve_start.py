"""`rekv serve --http` as a user runs it: the CLI in a subprocess with its default model and with
each `--model` form (a preset, a trained-model folder, `hf:PATH`), driven by the official
`openai` client. With `--json` every served request writes its record; SIGINT and SIGTERM stop
the server within `STOP_S`, the requests in flight finished or aborted, no worker left."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest
from stdout_lines import StdoutLines

from rekv_jax.action import ACTION_KINDS
from rekv_jax.cli import main as cli
from rekv_jax.cli.serve import serve_config
from rekv_jax.model.loader import SHIPPED_MODEL, load_config, load_model, load_tokenizer
from rekv_jax.planning.costmodel import Profile, load_profiles
from rekv_jax.serving.shutdown import ABORTED
from rekv_jax.transport.cores import usable_cpus

REPO = Path(__file__).resolve().parents[1]
FOLDER = "rekv_jax/assets/wt2-tiny"  # the shipped model's folder, relative to the repository
QUICK = ("--link-gbps", "unpaced", "--no-pin")  # no link to calibrate; each side on every core
START_S = 300  # the most a server may take to start (a newcomer's measures its profiles first)
STOP_S = 10  # the most SIGINT or SIGTERM may take to end it
PROMPT = "The tower is"
TOKENIZER = load_tokenizer(SHIPPED_MODEL)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "rekv_jax.cli", *args]


def _env() -> dict[str, str]:
    return os.environ | {"PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command's name (state first), None if none."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _workers(pid: int) -> list[int]:
    """The worker processes `pid` spawned (multiprocessing's spawn, not its resource tracker)."""
    found = []
    for entry in Path("/proc").iterdir():
        stat = _proc_stat(int(entry.name)) if entry.name.isdigit() else None
        if stat is not None and int(stat[1]) == pid:
            try:
                if b"spawn_main" in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def _running(pid: int) -> bool:
    stat = _proc_stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


class Server:
    """`rekv serve --http 127.0.0.1:0 ARGS` in a subprocess of its own session, up once its
    first line on stdout names its URL (a line for a person, or a JSON record with --json).
    `sigint_ignored`: started as a shell starts a background job, SIGINT ignored."""

    def __init__(self, args: list[str], tmp_path: Path, sigint_ignored: bool = False) -> None:
        self.stderr = tmp_path / "serve-stderr.txt"
        before = signal.signal(signal.SIGINT, signal.SIG_IGN if sigint_ignored
                               else signal.default_int_handler)
        try:  # a disposition the child inherits
            with open(self.stderr, "w") as err:
                self.process = subprocess.Popen(
                    _cli("serve", "--http", "127.0.0.1:0", *args), cwd=REPO, env=_env(),
                    stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
        finally:
            signal.signal(signal.SIGINT, before)
        self._lines = StdoutLines(self.process)
        self.workers: list[int] = []
        try:
            self._started()
        except BaseException:
            self.close()
            raise

    def _started(self) -> None:
        first = self._line(START_S)
        if first.startswith("{"):
            banner = json.loads(first)
            assert banner["kind"] == "http_server", banner
            self.url, self.model = banner["url"], banner["model"]
        else:
            found = re.search(r"at (http://\S+/v1), model '([^']+)'", first)
            assert found, first
            self.url, self.model = found[1], found[2]
        self.workers = _workers(self.process.pid)
        assert len(self.workers) == 2, self.workers  # one prefill and one decode worker

    def _line(self, timeout: float) -> str:
        line = self._lines.next(timeout)
        assert line is not None, f"no line on stdout in {timeout} s: {self.tail()}"
        return line

    def tail(self) -> str:
        return self.stderr.read_text()[-3000:]

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key="none", max_retries=0, timeout=120)

    def stop(self, signum: int, whole_group: bool = False) -> list[str]:
        """Send `signum` to the server alone (`whole_group`: to its process group, as a
        terminal's Ctrl-C does); it must end well within `STOP_S` leaving no worker. Its
        remaining lines on stdout."""
        start = time.monotonic()
        if whole_group:
            os.killpg(self.process.pid, signum)
        else:
            os.kill(self.process.pid, signum)
        try:
            code = self.process.wait(STOP_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running {STOP_S} s after {signal.Signals(signum).name}"
                                 f": {self.tail()}") from None
        took = time.monotonic() - start
        assert code == 0, f"exit {code}: {self.tail()}"
        assert not [w for w in self.workers if _running(w)], "a worker outlived the server"
        print(f"stopped by {signal.Signals(signum).name} in {took:.1f} s")
        return self._lines.rest(STOP_S)

    def close(self) -> None:
        """Whatever a failed test left: the server's session and its workers, killed."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(STOP_S)
        for pid in self.workers:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


class InFlight:
    """A streamed completion on a thread: its chunks, and the error that ended it if one did."""

    def __init__(self, client: openai.OpenAI, model: str, prompt, max_tokens: int) -> None:
        self.chunks: list = []
        self.error: Exception | None = None
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        args=(client, model, prompt, max_tokens))
        self._thread.start()

    def _run(self, client, model, prompt, max_tokens) -> None:
        try:
            for chunk in client.completions.create(model=model, prompt=prompt,
                                                   max_tokens=max_tokens, stream=True):
                self.chunks.append(chunk)
        except Exception as e:  # asserted by the test
            self.error = e

    def started(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.chunks and self.error is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.chunks, f"no token in {timeout} s ({self.error})"

    def ended(self, timeout: float) -> str:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the stream outlived the server"
        return "".join(c.choices[0].text for c in self.chunks if c.choices)


def _analytic_profile(spec: str, path: Path) -> Path:
    """A profile of plausible per-layer costs (they only steer the router's choices)."""
    p = Profile.for_config(load_config(spec), 128, hardware="test", link="test", link_gbps=0.05,
                           source="analytic", quantize_ms={16: 0.0, 8: 0.05},
                           restore_ms={16: 0.0, 8: 0.02}, suffix_layer_ms=0.5,
                           join_ms=dict.fromkeys(ACTION_KINDS, 0.1))
    path.write_text(json.dumps(p.to_json()) + "\n")
    return path


@pytest.fixture(scope="module")
def shipped_profile(tmp_path_factory) -> Path:
    """`rekv profile --json` through the CLI on the shipped model's folder, given relative."""
    done = subprocess.run(_cli("profile", "--model", FOLDER, "--json", "--seq-len", "128",
                               "--reps", "2", "--link-gbps", "unpaced"),
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    path = tmp_path_factory.mktemp("profile") / "wt2-tiny.jsonl"
    path.write_text(done.stdout)
    return path


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory) -> Path:
    """A tiny random Qwen2 checkpoint saved by `transformers`, the shipped tokenizer beside it
    (so it takes text)."""
    import torch
    import transformers

    folder = tmp_path_factory.mktemp("hf") / "qwen2-tiny"
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=TOKENIZER.get_vocab_size(), hidden_size=128, intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=4096)
    transformers.Qwen2ForCausalLM(config).save_pretrained(folder)
    shutil.copy(SHIPPED_MODEL / "tokenizer.json", folder)
    return folder


def test_a_trained_model_folder_has_one_name_however_it_is_read(shipped_profile, monkeypatch):
    """Its config names it by its own name (`rekv_config.json`), relative or absolute, whether
    its weights are restored or read as safetensors; so the profile `rekv profile` measured on
    it serves it in either form."""
    monkeypatch.chdir(REPO)
    own = json.loads((SHIPPED_MODEL / "orbax" / "rekv_config.json").read_text())["name"]
    assert [p.model for p in load_profiles(shipped_profile)] == [own]
    for spec in (FOLDER, str(SHIPPED_MODEL)):
        assert load_config(spec).name == own
        assert load_model(spec, orbax=False).cfg.name == load_model(spec).cfg.name == own
        args = cli.build_parser("serve").parse_args(
            ["serve", "--model", spec, "--http", "127.0.0.1:0", "--profile", str(shipped_profile)])
        assert [p.model for p in serve_config(args).profiles] == [own]


def test_a_newcomers_start_serves_text_and_ctrl_c_stops_it(tmp_path, monkeypatch):
    """The command a newcomer types, every other flag its default: the shipped model (it takes
    text), the profiles measured at the start (an empty cache folder: a newcomer's first),
    the paper's link calibrated, each side pinned. Ctrl-C (SIGINT to the process group, as a
    terminal sends it) stops it."""
    monkeypatch.setenv("REKV_CACHE_DIR", str(tmp_path / "cache"))
    server = Server([], tmp_path)
    try:
        assert server.model == str(SHIPPED_MODEL)
        answer = server.client().completions.create(model=server.model, prompt=PROMPT,
                                                    max_tokens=8)
        assert answer.choices[0].text and answer.usage.completion_tokens >= 1
        assert answer.usage.prompt_tokens == len(TOKENIZER.encode(PROMPT).ids)
        assert "measuring the cost model's profiles" in server.tail()
        cpus = usable_cpus()  # a core each where there are two: its own, as its own GPU
        words = ("pinned: prefill-0 cpu 0, decode-0 cpu 1" if cpus == [0, 1] else
                 "pinned: prefill-0 cpu" if len(cpus) >= 2 else "cores shared")
        assert f"rekv serve: workers {words}" in server.tail()
        server.stop(signal.SIGINT, whole_group=True)
    finally:
        server.close()


# form -> (the signal that stops it, whether SIGINT is ignored at its start, tokens in flight)
FORMS = {
    # the case: started as a shell's background job, SIGINT to the server alone; its
    # request in flight is too long to end within the grace: it is aborted
    "folder": (signal.SIGINT, True, 2000),
    "hf": (signal.SIGTERM, False, 6),
    "preset": (signal.SIGTERM, False, 6),
}


@pytest.mark.parametrize("form", list(FORMS))
def test_each_model_form_serves_writes_its_records_and_stops(form, tmp_path, request):
    """The preset (it has no tokenizer: a text prompt is a 400 saying so, token ids are
    served), the trained-model folder (with the profile `rekv profile` measured on it) and an
    `hf:PATH` checkpoint, each with --json: every request writes its record, holding the tokens
    its client got; a signal ends the server with the request in flight finished or aborted.
    The preset runs with `--tpot-stretch none`: its requests book no TPOT slack; the others
    book the default bound's."""
    signum, sigint_ignored, in_flight_tokens = FORMS[form]
    if form == "folder":
        spec, profile = FOLDER, request.getfixturevalue("shipped_profile")
    elif form == "hf":
        spec = f"hf:{request.getfixturevalue('hf_checkpoint')}"
        profile = _analytic_profile(spec, tmp_path / "profile.json")
    else:
        spec, profile = "tiny", _analytic_profile("tiny", tmp_path / "profile.json")
    stretch = ["--tpot-stretch", "none"] if form == "preset" else []  # else the default bound
    server = Server(["--model", spec, "--profile", str(profile), "--json", *stretch, *QUICK],
                    tmp_path, sigint_ignored)
    try:
        assert server.model == spec
        client = server.client()
        prompt = PROMPT
        if form == "preset":
            with pytest.raises(openai.BadRequestError, match="tiny has no tokenizer"):
                client.completions.create(model=spec, prompt=PROMPT, max_tokens=4)
            prompt = TOKENIZER.encode(PROMPT).ids
        texts = [client.completions.create(model=spec, prompt=prompt, max_tokens=6
                                           ).choices[0].text for _ in range(2)]
        flying = InFlight(client, spec, prompt, in_flight_tokens)
        flying.started(120)
        lines = server.stop(signum)
        texts.append(flying.ended(STOP_S))
    finally:
        server.close()
    served = [json.loads(line) for line in lines]
    assert [r["kind"] for r in served] == ["served_request"] * 3  # in the order they ended
    assert served[0]["completed"] and served[1]["completed"]
    slack = [r["assignment"]["why"]["tpot_slack_ms"] for r in served[:2]]  # of 6 tokens each
    assert slack == [None, None] if stretch else all(ms > 0 for ms in slack)
    for record, text in zip(served, texts, strict=True):
        if record["completed"]:
            got = (TOKENIZER.decode(record["tokens"]) if form != "preset"
                   else "".join(f" {t}" for t in record["tokens"]))
            assert got == text
        else:  # only the request in flight may end so, and its client is told
            assert record["error"] == ABORTED and ABORTED in str(flying.error), record
    if in_flight_tokens > 1000:  # hundreds of decode steps past the grace
        assert not served[2]["completed"]
