"""What makes a second `rekv serve` start fast, through the CLI: the start profile read back
from the user cache folder (`REKV_CACHE_DIR`), and JAX's persistent compilation cache filled by
the router and its workers; and the compile clock's honesty with that cache on: a program read
back from disk is still counted as a wait."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from stdout_lines import StdoutLines

REPO = Path(__file__).resolve().parents[1]
QUICK = ("--link-gbps", "unpaced", "--no-pin")
START_S = 300
PROMPT = [5, 17, 99, 3, 42, 7, 7, 1000]  # token ids: the answer needs no tokenizer round trip


def _env(cache: Path) -> dict[str, str]:
    path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    return os.environ | {"PYTHONPATH": path, "REKV_CACHE_DIR": str(cache)}


def _served_once(cache: Path, log: Path) -> list[int]:
    """Start `rekv serve --http`, take one greedy completion's record, stop it by SIGTERM; the
    record's tokens. The start's stderr is in `log`."""
    import openai

    with open(log, "w") as err:
        process = subprocess.Popen(
            [sys.executable, "-m", "rekv_jax.cli", "serve", "--http", "127.0.0.1:0", "--json",
             *QUICK], cwd=REPO, env=_env(cache), stdout=subprocess.PIPE, stderr=err, text=True,
            start_new_session=True)
    try:
        lines = StdoutLines(process)
        banner = lines.next(START_S)
        assert banner is not None, log.read_text()[-3000:]
        url = json.loads(banner)["url"]
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
        client.completions.create(model=json.loads(banner)["model"], prompt=PROMPT,
                                  max_tokens=6, temperature=0)
        record = json.loads(lines.next(60))
        os.kill(process.pid, signal.SIGTERM)
        assert process.wait(30) == 0, log.read_text()[-3000:]
        return record["tokens"]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


def test_a_second_start_reads_the_profile_and_the_programs_back(tmp_path):
    """The first start in an empty cache folder measures its profile and says where it cached
    it, and its processes fill the compilation cache; the second start says it read that same
    file back, and greedy decoding gives the same tokens."""
    cache = tmp_path / "cache"
    first = _served_once(cache, tmp_path / "first.txt")
    said = (tmp_path / "first.txt").read_text()
    assert "measuring the cost model's profiles" in said, said[-3000:]
    (path,) = list((cache / "profiles").glob("*.jsonl"))
    assert f"profile: measured, cached at {path}; programs cached in {cache / 'jax'}" in said
    assert len(list((cache / "jax").iterdir())) > 10  # the router's and both workers' programs
    second = _served_once(cache, tmp_path / "second.txt")
    said = (tmp_path / "second.txt").read_text()
    assert f"profile: cached at {path}" in said, said[-3000:]
    assert "measuring the cost model's profiles" not in said
    assert second == first


CLOCKED = """
import sys
import jax, jax.numpy as jnp
from rekv_jax.compile_cache import use_compile_cache
from pathlib import Path
use_compile_cache(Path(sys.argv[1]))
from rekv_jax.serving.compile_clock import compiled_ms
x = jnp.ones(13)
start = compiled_ms()
jax.block_until_ready(jax.jit(lambda x: jnp.sin(x) * 3 + 1)(x))
print(compiled_ms() - start)
"""


def test_a_program_read_back_from_the_cache_is_still_a_wait(tmp_path):
    """Two processes compile the same program with the cache on: the second reads it back
    (the cache grew only in the first), and its clock still counts a wait."""
    def run() -> float:
        out = subprocess.run([sys.executable, "-c", CLOCKED, str(tmp_path)], cwd=REPO,
                             env=_env(tmp_path), capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        return float(out.stdout.split()[-1])

    assert run() > 0
    entries = set((tmp_path / "jax").iterdir())
    assert entries
    assert run() > 0
    assert set((tmp_path / "jax").iterdir()) == entries
