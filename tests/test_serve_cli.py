"""`rekv serve`: flags that pass their checks become one ServeConfig, handed to `serve`."""

import pytest

from rekv_jax.cli import main as cli
from rekv_jax.cli.serve import serve_config
from rekv_jax.config import ModelConfig
from rekv_jax.model.loader import SHIPPED_MODEL
from rekv_jax.planning.costmodel import Profile
from rekv_jax.planning.queueing import TPOT_STRETCH
from rekv_jax.serving import serve as serving
from rekv_jax.serving import serve_config as run_config
from rekv_jax.transport.cores import CPUS_ENV, HOST_CPUS_ENV, THREADS_ENV

FAKE = Profile.for_config(ModelConfig.preset("tiny"), 64, hardware="test", link="test",
                          link_gbps=0.25, source="analytic", quantize_ms={16: 0, 8: 0.1},
                          restore_ms={16: 0, 8: 0.1}, suffix_layer_ms=1.0, join_ms=0.1)


def _config(argv: list[str]) -> run_config.ServeConfig:
    return serve_config(cli.build_parser("serve").parse_args(["serve", *argv]))


def test_a_sweep_serves_the_same_streams_under_every_policy():
    c = _config(["--model", "tiny-7b", "--rates", "0.5,1", "--requests", "12", "--seed", "3",
                 "--prompt-lens", "256,512", "--max-new-tokens", "8", "--policy",
                 "bf16:full,adaptive", "--slo-ttft-ms", "900", "--link-gbps", "0.01"])
    assert [s.rate for s in c.streams] == [0.5, 1.0] and c.policies == ("bf16:full", "adaptive")
    assert all(len(s.requests) == 12 for s in c.streams)
    assert {r.prompt_len for s in c.streams for r in s.requests} <= {256, 512}
    assert c.slo.ttft_ms == 900 and c.http is None and c.workers.link_gbps == 0.01
    assert c == _config(["--model", "tiny-7b", "--rates", "0.5,1", "--requests", "12", "--seed",
                         "3", "--max-new-tokens", "8", "--policy", "bf16:full,adaptive",
                         "--slo-ttft-ms", "900", "--link-gbps", "0.01"])  # deterministic
    default = _config(["--rate", "2"])
    assert default.model == str(SHIPPED_MODEL)  # it takes text, as `rekv generate`'s does
    assert len(default.streams[0].requests) == 100
    assert default.policies == ("bf16:full", "q8:full", "q8:balanced", "adaptive")
    assert default.tpot_stretch == TPOT_STRETCH
    assert _config(["--rate", "2", "--tpot-stretch", "none"]).tpot_stretch is None
    assert _config(["--rate", "2", "--tpot-stretch", "1.5"]).tpot_stretch == 1.5


def test_wikitext_prompts_with_the_shipped_tokenizer():
    c = _config(["--model", str(SHIPPED_MODEL), "--rate", "1", "--requests", "3",
                 "--prompts", "wikitext", "--prompt-lens", "64"])
    assert all(r.prompt_len == 64 and max(r.tokens) < 2048 for r in c.streams[0].requests)


def test_http_serves_one_policy_and_the_command_reaches_serve(monkeypatch):
    from rekv_jax.cli import serve as cli_serve

    c = _config(["--http", "0.0.0.0:8080", "--api-key", "k"])
    assert c.http == run_config.HttpBind("0.0.0.0", 8080, "k") and c.policies == ("adaptive",)
    assert c.streams == ()
    profiled, given = [], []
    monkeypatch.setattr(cli_serve, "measured_profiles",
                        lambda config, args: profiled.append(config) or (FAKE,))
    monkeypatch.setattr(serving, "serve", lambda config, on_event, stop=None: given.append(config))
    cli.main(["serve", "--model", "tiny", "--rate", "1", "--requests", "2", "--prompt-lens",
              "64", "--link-gbps", "paper"])
    assert len(profiled) == 1 and not profiled[0].profiles  # measured: none was given
    # `paper` becomes the link the profiles were measured over
    assert given[0].profiles == (FAKE,) and given[0].workers.link_gbps == 0.25


def test_ctrl_c_before_the_server_is_up_is_one_line_exit_130(monkeypatch, capsys):
    """An interrupt while the workers start (their group is killed on the way out)."""
    from rekv_jax.cli import serve as cli_serve

    def interrupted(config, on_event, stop=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_serve, "measured_profiles", lambda config, args: (FAKE,))
    monkeypatch.setattr(serving, "serve", interrupted)
    with pytest.raises(SystemExit) as stop:
        cli.main(["serve", "--model", "tiny", "--http", "127.0.0.1:0", "--link-gbps", "1"])
    assert stop.value.code == 130
    err = capsys.readouterr().err.strip().splitlines()  # after how its workers were to run
    assert err[-1] == "rekv serve: interrupted" and len(err) <= 2 and "Traceback" not in err


def _key_file(path, text: str | bytes) -> str:
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    path.chmod(0o600)
    return str(path)


def test_the_api_key_comes_from_a_file_or_the_environment_and_on_the_command_line_warns(
        tmp_path, monkeypatch, capsys):
    from rekv_jax.cli import serve as cli_serve

    monkeypatch.delenv("REKV_API_KEY", raising=False)
    given = _key_file(tmp_path / "api.key", "from-file\n")
    assert _config(["--http", "0.0.0.0:8080", "--api-key-file", given]).http.api_key == "from-file"
    monkeypatch.setenv("REKV_API_KEY", "from-env")
    assert _config(["--http", "0.0.0.0:8080"]).http.api_key == "from-env"
    assert _config(["--http", "0.0.0.0:8080", "--api-key-file", given]).http.api_key == "from-file"
    (tmp_path / "api.key").chmod(0o640)
    with pytest.raises(ValueError, match="may be read by others"):
        _config(["--http", "0.0.0.0:8080", "--api-key-file", given])
    monkeypatch.setattr(cli_serve, "measured_profiles", lambda config, args: (FAKE,))
    monkeypatch.setattr(serving, "serve", lambda config, on_event, stop=None: None)
    cli.main(["serve", "--model", "tiny", "--http", "127.0.0.1:0", "--link-gbps", "1",
              "--api-key", "on-the-line"])
    line = capsys.readouterr().err.strip().splitlines()[0]  # then how its workers run
    assert "`ps` shows to every user" in line and "--api-key-file PATH or $REKV_API_KEY" in line


SLURM = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "gpu[017-021]", "SLURM_NTASKS": "5",
         "SLURM_LOCALID": "0"}


def test_role_auto_maps_the_clusters_rank_router_first_then_decode_then_prefill(
        tmp_path, monkeypatch):
    """Under SLURM, --role auto takes each process's rank and the coordinator JAX would
    detect (the step's first node, the port from the job id); --coordinator overrides it; a
    cluster of another size is refused; a run across nodes takes the link as it is."""
    from rekv_jax.cli.serve import across_nodes
    from rekv_jax.transport import JobKey

    key = _key_file(tmp_path / "key", b"the job's key, in one shared file")
    monkeypatch.delenv("JAX_COORDINATOR_PORT", raising=False)
    for name, value in SLURM.items():
        monkeypatch.setenv(name, value)
    parse = cli.build_parser("serve").parse_args
    auto = ["serve", "--role", "auto", "--prefill-workers", "2", "--decode-workers", "2",
            "--secret-file", key]
    names = []
    for rank in range(5):
        monkeypatch.setenv("SLURM_PROCID", str(rank))
        name, rendezvous = across_nodes(parse(auto))
        names.append(name)
        assert rendezvous.address == f"gpu017:{65536 - 4096 + 4242 % 4096}"
        assert rendezvous.key == JobKey.from_file(key)
    assert names == ["router", "decode-0", "decode-1", "prefill-0", "prefill-1"]
    args = parse([*auto, "--coordinator", "10.0.0.1:7000", "--http", "127.0.0.1:0"])
    name, rendezvous = across_nodes(args)
    assert (name, rendezvous.address) == ("prefill-1", "10.0.0.1:7000")
    workers = serve_config(args, rendezvous).workers
    assert workers.rendezvous == rendezvous and workers.link_gbps is None  # `paper`: the real one
    monkeypatch.setenv("SLURM_NTASKS", "4")
    with pytest.raises(ValueError, match="the cluster runs 4 processes; .* need 5: router, "):
        across_nodes(parse(auto))


@pytest.mark.parametrize("cores, pinned", [([0, 1], True), ([0, 1], False), ([3], True)])
def test_each_cpu_worker_computes_on_its_own_core_unless_no_pin(monkeypatch, cores, pinned):
    """As each worker of a GPU run has its own GPU: pinned (the default), each CPU member's
    device is its own core, its host threads may use every core; `--no-pin`, or one core for
    two workers, and they share."""
    monkeypatch.setattr(run_config, "usable_cpus", lambda: cores)
    monkeypatch.setattr(run_config, "visible_gpus", lambda: [])
    workers = _config(["--rate", "1", *["--no-pin"] * (not pinned)]).workers
    envs = workers.environments()
    assert list(envs) == ["decode-0", "prefill-0"]
    if pinned and len(cores) == 2:
        assert {name: env[CPUS_ENV] for name, env in envs.items()} == {
            "prefill-0": "0", "decode-0": "1"}
        assert all(env[HOST_CPUS_ENV] == "0,1" and env[THREADS_ENV] == "2"
                   for env in envs.values())
        assert workers.pinning() == "pinned: prefill-0 cpu 0, decode-0 cpu 1"
    else:
        assert not any(k in env for k in (CPUS_ENV, HOST_CPUS_ENV, THREADS_ENV)
                       for env in envs.values())
        assert workers.pinning().startswith("cores shared")
