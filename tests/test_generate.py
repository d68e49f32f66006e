"""`rekv generate`: greedy decoding on the handed-off cache equals single-process greedy decoding
for BF16 actions (shipped model, a random HF checkpoint, two real processes)."""

import json
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from test_hf import hf_model

from rekv_jax.action import Action
from rekv_jax.model.loader import SHIPPED_MODEL, load_model
from rekv_jax.model.transformer import greedy_decode, prefill
from rekv_jax.serving.generate import Request, first_divergence, generate
from rekv_jax.sizes import action_bytes

PROMPT = "The game began development in 2010 , carrying over a large portion of the work"


def single_process_tokens(spec: str, ids: list[int], steps: int, dtype: str) -> list[int]:
    model = load_model(spec, dtype=jnp.dtype(dtype), orbax=False)
    cfg, params = model.cfg, model.params
    kv, logits = prefill(cfg, params, jnp.asarray([ids], jnp.int32))
    return np.asarray(greedy_decode(cfg, params, kv, logits, steps))[0].tolist()


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


@pytest.mark.parametrize("prefill_mode", ["split", "full"])
def test_bf16_action_on_shipped_model_decodes_exactly(prefill_mode):
    tok = load_model(str(SHIPPED_MODEL), orbax=False).tokenizer
    ids = tok.encode(PROMPT).ids
    out = generate(Request(token_ids=ids, action="bf16:r=2", max_new_tokens=8, transport="local",
                           prefill=prefill_mode, compare=True))
    assert out.tokens == single_process_tokens(str(SHIPPED_MODEL), ids, 8, "bfloat16")
    assert out.first_divergence is None and not out.fallback
    assert out.text == tok.decode(out.tokens) and out.prefill == prefill_mode
    assert out.ttft_ms > 0 and out.tpot_ms > 0 and out.tokens_per_s > 0


def test_bf16_action_on_random_hf_checkpoint(tmp_path):
    hf_model("qwen2").save_pretrained(tmp_path)  # no tokenizer: ids only
    ids = np.random.default_rng(0).integers(0, 128, 40).tolist()
    spec = f"hf:{tmp_path}"
    out = generate(Request(token_ids=ids, model=spec, action="bf16:r=1", max_new_tokens=6,
                           transport="local", compare=True))
    assert out.tokens == single_process_tokens(spec, ids, 6, "bfloat16")
    assert out.first_divergence is None and out.text is None


def test_cli_two_processes_prints_every_field():
    out = subprocess.run(
        [sys.executable, "-m", "rekv_jax.cli", "generate", "--action", "bf16:r=2", "--prompt",
         PROMPT, "--max-new-tokens", "6", "--compare", "--json", "--timeout", "120"],
        capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    record = json.loads(out.stdout.splitlines()[-1])
    assert set(record) == {"tokens", "text", "ttft_ms", "tpot_ms", "tokens_per_s",
                           "payload_bytes", "action", "prefill", "chunks", "fallback",
                           "first_divergence"}
    assert record["first_divergence"] is None and len(record["tokens"]) == 6
    model = load_model(str(SHIPPED_MODEL), orbax=False)
    cfg, tok = model.cfg, model.tokenizer
    ids = tok.encode(PROMPT).ids
    assert record["tokens"] == single_process_tokens(str(SHIPPED_MODEL), ids, 6, "bfloat16")
    assert record["payload_bytes"] == action_bytes(
        cfg, Action.parse("bf16:r=2", cfg.num_layers), len(ids)).total_bytes


def test_cli_without_prompt_is_a_user_error(tmp_path):
    out = subprocess.run([sys.executable, "-m", "rekv_jax.cli", "generate", "--model",
                          f"hf:{tmp_path}", "--prompt", "hi"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "--token-ids" in out.stderr
    assert "Traceback" not in out.stderr
