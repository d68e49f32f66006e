"""Train the small shipped model: Qwen2 architecture, WikiText-2 `valid.txt` + passkey sequences.

Reproduces `rekv_jax/assets/wt2-tiny/` (its training time: `train_seconds` in its train_log.json):
  python scripts/train_tiny.py [--out DIR] [--wikitext DIR]
It fits a byte-level BPE on valid.txt, trains with optax (AdamW, warmup + cosine) through the
project's own `forward`, first on short then on long sequences (so NIAH holds at 1024 tokens),
and writes: tokenizer.json, tokenizer_config.json (its EOS and a plain chat template),
generation_config.json (its EOS id, the tokenizer's `<|endoftext|>`), the BF16 weights as an orbax
checkpoint (`orbax/`) and as HF safetensors + config.json (top level, for `load_hf`),
train_log.json and loss.png.
It ends by printing JSON: training time, BF16 WikiText-2 test perplexity and NIAH pass rate.
`test.txt` is read only for that final evaluation.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax
from tokenizers import Tokenizer
from tqdm import tqdm

from rekv_jax.config import ModelConfig
from rekv_jax.model.params import save_hf, save_params
from rekv_jax.model.transformer import forward, init_params
from rekv_jax.quality import data, niah
from rekv_jax.quality import gate as quality

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "rekv_jax" / "assets" / "wt2-tiny"
# "Role: content" lines, then "Assistant:" where the reply starts (a WikiText model has no chat
# turns of its own; this gives /v1/chat/completions a prompt it can continue)
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] | capitalize }}: "
                 "{{ message['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}Assistant:{% endif %}")
TOKENIZER_CONFIG = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
                    "eos_token": data.EOS, "model_max_length": 4096,
                    "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}


def model_config(vocab_size: int) -> ModelConfig:
    """4 layers, D=256, 4 query / 2 KV heads of head_dim 64 (one quantization group per head)."""
    return ModelConfig("wt2-tiny", "qwen2", num_layers=4, hidden_size=256, num_heads=4,
                       num_kv_heads=2, head_dim=64, intermediate_size=768, vocab_size=vocab_size,
                       rope_theta=10000.0, rms_norm_eps=1e-6, qkv_bias=True, tie_embeddings=True,
                       max_position_embeddings=4096)


@dataclasses.dataclass(frozen=True)
class Phase:
    """`steps` steps on `batch` rows of `length` tokens, a `passkey` share of them passkey rows."""

    length: int
    batch: int
    steps: int
    passkey: float


# A curriculum: retrieval is learned within ~200 steps on short prompts (at lr 1e-3; at 3e-3 it
# stays on the plateau), then carried to longer haystacks alongside language modelling.
PHASES = (
    Phase(64, 16, 250, passkey=1.0),
    Phase(256, 16, 220, passkey=0.5),
    Phase(1024, 4, 260, passkey=0.6),
)


def sample_batch(tok, ids: np.ndarray, phase: Phase, answer_weight: float, min_episode: int,
                 rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """tokens [batch, length + 1] and per-target loss weights [batch, length].

    Rows are random windows of the training text; a `phase.passkey` share of them start with a
    passkey episode (prompt + answer, the answer weighted `answer_weight`) of a random length in
    `min_episode..length + 1`, so retrieval is trained at every distance, followed by text.
    """
    n, length = phase.batch, phase.length
    tokens = np.empty((n, length + 1), np.int32)
    weights = np.ones((n, length), np.float32)
    for b in range(n):
        start = rng.integers(0, ids.size - length - 1)
        tokens[b] = ids[start:start + length + 1]
        if rng.random() < phase.passkey:
            size = rng.integers(min(min_episode, length + 1), length + 2)
            tokens[b, :size], mask = niah.passkey_example(tok, ids, size, rng)
            weights[b, :size - 1][mask[1:]] = answer_weight
    return tokens, weights


def make_step(cfg: ModelConfig, optimizer: optax.GradientTransformation):
    """One jitted AdamW step on (tokens, weights): the weighted mean next-token cross-entropy.

    Also returns the count of passkey answer tokens (weight > 1) and of those predicted right
    (teacher-forced argmax), to watch retrieval being learned.
    """

    def loss_fn(params, tokens, weights):
        logits = forward(cfg, params, tokens[:, :-1])  # [B, S, V] f32
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])  # [B, S]
        answer = weights > 1
        hits = jnp.sum((jnp.argmax(logits, -1) == tokens[:, 1:]) & answer)
        return jnp.sum(ce * weights) / jnp.sum(weights), (hits, jnp.sum(answer))

    @jax.jit
    def step(params, opt_state, tokens, weights):
        (loss, answers), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, tokens,
                                                                           weights)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, answers

    return step


def running(x: list[float], k: int = 20) -> np.ndarray:
    """Sums over the last k steps (k - 1 fewer entries than x)."""
    return np.convolve(x, np.ones(k), "valid")


def plot_curves(losses: list[float], answers: list[tuple[int, int]], phase_starts: list[int],
                path: Path) -> None:
    """Loss and passkey-answer accuracy over the last 20 steps, phases marked by dashed lines."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    k = min(20, len(losses))
    hits, counts = zip(*answers, strict=True)
    acc = running(hits, k) / np.maximum(running(counts, k), 1)
    for ax, ys, label in ((top, running(losses, k) / k, "weighted cross-entropy (nats)"),
                          (bottom, acc, "passkey answer accuracy")):
        ax.plot(range(k - 1, len(losses)), ys)
        for s in phase_starts[1:]:
            ax.axvline(s, color="gray", ls="--", lw=0.8)
        ax.set_ylabel(label)
    bottom.set_xlabel("step")
    top.set_title("wt2-tiny training (dashed: next phase, longer sequences)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save_model(out: Path, cfg: ModelConfig, params) -> dict:
    """Write params in BF16 as an orbax checkpoint (`out/orbax`, what the loader reads) and as HF
    safetensors + config.json (`out`, for `load_hf`); returns the BF16 params."""
    params = jax.tree.map(lambda w: w.astype(jnp.bfloat16), params)
    shutil.rmtree(out / "orbax", ignore_errors=True)  # orbax refuses to overwrite
    save_params(out / "orbax", cfg, params)
    save_hf(out, cfg, params)
    return params


@dataclasses.dataclass
class Curves:
    """What training recorded per step: the loss, the passkey answers (hits, count), and the
    step at which each phase began."""

    losses: list[float] = dataclasses.field(default_factory=list)
    answers: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    phase_starts: list[int] = dataclasses.field(default_factory=list)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--wikitext", default=None, help="WikiText-2 folder (default: see data.py)")
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--steps-scale", type=float, default=1.0,
                    help="multiply the step count of every phase (e.g. 0.1 for a smoke run)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--answer-weight", type=float, default=8.0)
    ap.add_argument("--min-episode", type=int, default=64,
                    help="shortest passkey episode (tokens) in training rows")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-lengths", default="512,1024,2048")
    return ap.parse_args()


def train(cfg: ModelConfig, tok: Tokenizer, ids: np.ndarray, phases: list[Phase],
          args: argparse.Namespace) -> tuple[dict, Curves]:
    """The f32 params after every phase's steps (AdamW, warmup + cosine, clipped), and the
    curves."""
    total = sum(p.steps for p in phases)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, args.warmup, total, args.lr / 10)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                            optax.adamw(schedule, b2=0.98, weight_decay=0.01))
    params = init_params(cfg, jax.random.key(args.seed), jnp.float32)
    opt_state = optimizer.init(params)
    step = make_step(cfg, optimizer)
    rng = np.random.default_rng(args.seed)
    curves = Curves()
    with tqdm(total=total, desc="train", unit="step") as bar:
        for phase in phases:
            curves.phase_starts.append(len(curves.losses))
            for _ in range(phase.steps):
                tokens, weights = sample_batch(tok, ids, phase, args.answer_weight,
                                               args.min_episode, rng)
                params, opt_state, loss, (hits, count) = step(params, opt_state, tokens, weights)
                curves.losses.append(float(loss))
                curves.answers.append((int(hits), int(count)))
                recent = np.sum(curves.answers[-20:], axis=0)
                bar.set_postfix(len=phase.length, loss=f"{curves.losses[-1]:.3f}",
                                key_acc=f"{recent[0] / max(recent[1], 1):.2f}")
                bar.update()
    return params, curves


def evaluate(cfg: ModelConfig, params: dict, tok: Tokenizer, args: argparse.Namespace) -> dict:
    """The BF16 baseline (WikiText-2 test perplexity, NIAH) at each of `--eval-lengths`."""
    test_ids = data.encode(tok, data.read_split("test", args.wikitext))
    lengths = [int(x) for x in args.eval_lengths.split(",")]
    return {n: dataclasses.asdict(quality.bf16_baseline(cfg, params, tok, test_ids, n))
            for n in lengths}


def main() -> None:
    args = parse_args()
    t0 = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    train_text = data.read_split("valid", args.wikitext)
    tok = data.train_tokenizer(train_text, args.vocab_size)
    tok.save(str(args.out / "tokenizer.json"))
    (args.out / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2) + "\n")
    (args.out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": tok.token_to_id(data.EOS)}, indent=2) + "\n")
    ids = data.encode(tok, train_text)
    cfg = model_config(tok.get_vocab_size())
    phases = [dataclasses.replace(p, steps=max(1, round(p.steps * args.steps_scale)))
              for p in PHASES]
    params, curves = train(cfg, tok, ids, phases, args)
    train_s = time.perf_counter() - t0

    params = save_model(args.out, cfg, params)
    plot_curves(curves.losses, curves.answers, curves.phase_starts, args.out / "loss.png")
    summary = {"train_seconds": round(train_s, 1), "steps": sum(p.steps for p in phases),
               "phases": [dataclasses.asdict(p) for p in phases],
               "final_loss": float(np.mean(curves.losses[-20:])),
               "eval": evaluate(cfg, params, tok, args)}
    (args.out / "train_log.json").write_text(json.dumps({**summary, "losses": curves.losses,
                                                            "answer_hits_count": curves.answers}))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
