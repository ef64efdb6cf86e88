"""Issue 25, items 11, 13, 14, 16: what `megagrpo train/sft/eval` refuses before any process starts, and the
argument forms it accepts. `megagrpo.cli.main` runs in this process with the stage entry replaced by a
recorder, so a case that reaches it would have started the learner and the engines."""

from __future__ import annotations

import dataclasses
import json
import time
import types
from pathlib import Path

import pytest
import yaml

from megagrpo.bridge.hf_config import arch_from_hf
from megagrpo.cli import main
from megagrpo.learner.checkpoint import FORMAT, CheckpointMeta

MESH = {"tp": 1, "pp": 1, "ep": 1, "etp": 1, "cp": 1, "dp": 1, "vpp": 1, "world_size": 1}


@pytest.fixture
def started(monkeypatch):
    """The stage entry (`megagrpo.trainer.entry.run`), recording its calls instead of starting anything."""
    calls: list[tuple[str, object, str | None]] = []

    def run(mode, cfg, *, resume=None):
        calls.append((mode, cfg, resume))
        return 0

    monkeypatch.setattr("megagrpo.trainer.entry.run", run)
    return calls


def write_config(tmp_path: Path, model: Path, **sections) -> Path:
    tree = {"model": {"hf_path": str(model)}, "checkpoint": {"dir": str(tmp_path / "ckpt")}, **sections}
    p = tmp_path / "config.yaml"
    p.write_text(yaml.safe_dump(tree))
    return p


def fake_checkpoint(path: Path, model: Path, *, stage: str = "train", optimizer: bool = True) -> Path:
    """A checkpoint directory as `read_meta` sees it: meta.json (of `model`'s architecture) and megatron's
    metadata.json. The shards are never read before the learner starts."""
    path.mkdir(parents=True)
    (path / "metadata.json").write_text("{}")
    meta = CheckpointMeta(
        step=2,
        consumed_samples=8,
        arch=json.loads(json.dumps(arch_from_hf(model).to_dict())),
        mesh=MESH,
        has_optimizer=optimizer,
        has_scheduler=optimizer,
        megagrpo_version="test",
        format=FORMAT,
        extra={"step": 2, "stage": stage, "prompts": {}},
    )
    (path / "meta.json").write_text(json.dumps(dataclasses.asdict(meta)))
    return path


def run_cli(argv: list[str], capsys) -> tuple[int, str, float]:
    t0 = time.perf_counter()
    rc = main([str(a) for a in argv])
    return rc, capsys.readouterr().err, time.perf_counter() - t0


# -- item 11: the resume target is checked before anything starts ---------------------------------------


def test_a_missing_resume_path_fails_before_start(tiny_model, tmp_path, capsys, started):
    cfg = write_config(tmp_path, tiny_model("qwen3"))
    fake_checkpoint(tmp_path / "ckpt" / "step_00000002", tiny_model("qwen3"))
    wrong = tmp_path / "ckpt" / "step_00000020"
    rc, err, seconds = run_cli(["train", cfg, "--resume", wrong], capsys)
    assert rc == 2 and not started
    assert f"checkpoint {wrong} does not exist" in err and "step_00000002" in err  # the newest one there
    assert "Traceback" not in err and err.count("megagrpo: error:") == 1
    assert seconds < 60, seconds  # imports included; the learner and engine start took 237 s


def test_a_checkpoint_of_another_model_names_the_model_field(tiny_model, tmp_path, capsys, started):
    moe, dense = tiny_model("qwen3_moe"), tiny_model("qwen3")
    ckpt = fake_checkpoint(tmp_path / "other" / "step_00000002", moe)
    for stage in ("train", "eval"):
        rc, err, _ = run_cli([stage, write_config(tmp_path, dense), "--resume", ckpt], capsys)
        assert rc == 2 and not started, err
        assert f"checkpoint {ckpt} was saved for a different model architecture than model.hf_path=" in err
        assert str(dense) in err and "num_experts" in err


def test_resume_auto_checks_the_newest_checkpoint(tiny_model, tmp_path, capsys, started):
    moe, dense = tiny_model("qwen3_moe"), tiny_model("qwen3")
    fake_checkpoint(tmp_path / "ckpt" / "step_00000002", moe)
    rc, err, _ = run_cli(["train", write_config(tmp_path, dense), "--resume", "auto"], capsys)
    assert rc == 2 and not started and "step_00000002 was saved for a different model" in err
    # checkpoint.resume=auto (the default) is the same request
    rc, err, _ = run_cli(["train", write_config(tmp_path, dense)], capsys)
    assert rc == 2 and not started and "step_00000002 was saved for a different model" in err


def test_train_refuses_an_sft_checkpoint_and_names_the_sft_output(tiny_model, tmp_path, capsys, started):
    model = tiny_model("qwen3")
    ckpt = fake_checkpoint(tmp_path / "ckpt" / "sft" / "step_00000002", model, stage="sft")
    cfg = write_config(tmp_path, model, sft={"output_dir": str(tmp_path / "sft_out")})
    rc, err, _ = run_cli(["train", cfg, "--resume", ckpt], capsys)
    assert rc == 2 and not started
    assert "was written by `megagrpo sft`" in err and f"sft.output_dir={str(tmp_path / 'sft_out')!r}" in err
    weights_only = fake_checkpoint(tmp_path / "w" / "step_00000002", model, optimizer=False)
    rc, err, _ = run_cli(["train", cfg, "--resume", weights_only], capsys)
    assert rc == 2 and not started and "holds no optimizer state" in err


def test_a_matching_checkpoint_reaches_the_stage(tiny_model, tmp_path, capsys, started):
    model = tiny_model("qwen3")
    ckpt = fake_checkpoint(tmp_path / "ckpt" / "step_00000002", model)
    rc, err, _ = run_cli(["train", write_config(tmp_path, model), "--resume", ckpt], capsys)
    assert rc == 0, err
    assert [(m, r) for m, _, r in started] == [("train", str(ckpt))]


# -- item 13: routing replay needs a MoE model ------------------------------------------------------------


@pytest.mark.parametrize("replay", ["R2", "R3"])
def test_replay_on_a_dense_model_is_refused(tiny_model, tmp_path, capsys, started, replay):
    dense = tiny_model("qwen3")
    rc, err, _ = run_cli(["train", write_config(tmp_path, dense, replay=replay)], capsys)
    assert rc == 2 and not started
    assert f"replay: {replay} replays MoE routing, but model.hf_path={str(dense)!r} is a dense model" in err
    assert "set replay=none" in err
    # The same config on a MoE model starts.
    rc, err, _ = run_cli(["train", write_config(tmp_path, tiny_model("qwen3_moe"), replay=replay)], capsys)
    assert rc == 0 and len(started) == 1, err


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_the_moe_families_start_for_every_stage(tiny_model, tmp_path, capsys, started, arch):
    """SGLang serves MLA and the router's correction bias is synced (issue 37, part 2): train and eval
    start on these families, with routing replay, as sft always did."""
    model = tiny_model(arch)
    for stage in ("train", "eval", "sft"):
        rc, err, _ = run_cli([stage, write_config(tmp_path, model, replay="R3")], capsys)
        assert rc == 0, err
    assert [m for m, _, _ in started] == ["train", "eval", "sft"]


# -- item 14: overrides after options --------------------------------------------------------------------


def test_overrides_after_resume_are_applied(tiny_model, tmp_path, capsys, started):
    model = tiny_model("qwen3")
    ckpt = fake_checkpoint(tmp_path / "ckpt" / "step_00000002", model)
    cfg = write_config(tmp_path, model)
    rc, err, _ = run_cli(
        ["train", cfg, "algo.clip_high=0.3", "--resume", ckpt, "schedule.steps=7", "optimizer.lr=3e-6"],
        capsys,
    )
    assert rc == 0, err
    (mode, got, resume), *_ = started
    assert (mode, resume) == ("train", str(ckpt))
    assert got.schedule.steps == 7 and got.optimizer.lr == 3e-6 and got.algo.clip_high == 0.3
    # A misspelt option after them is still an argparse error, not an override.
    with pytest.raises(SystemExit) as exit_:
        main(["train", str(cfg), "--resume", str(ckpt), "a.b=1", "--bogus"])
    assert exit_.value.code == 2 and "unrecognized arguments: a.b=1 --bogus" in capsys.readouterr().err


# -- item 16: sft.data null is the main data section -----------------------------------------------------


def test_sft_with_null_data_trains_on_the_main_data_section(tiny_model, tmp_path, monkeypatch):
    from megagrpo.config import load_config
    from megagrpo.data.sets import build_prompt_sets
    from megagrpo.trainer.session import Session
    from megagrpo.trainer.sft import SFTTrainer

    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "".join(json.dumps({"prompt": f"{i}+1=", "completion": f"{i + 1}"}) + "\n" for i in range(4))
    )
    data = {"train_path": str(rows), "heldout_fraction": 0.0}
    cfg = load_config(write_config(tmp_path, tiny_model("qwen3"), data=data, sft={"steps": 1}), stage="sft")
    assert cfg.sft.data is None

    def bare_session(self, cfg, *, resume=None):  # the learner and the data are not needed here
        self.cfg = cfg
        self.sets = types.SimpleNamespace(train=[])

    monkeypatch.setattr(Session, "__init__", bare_session)
    monkeypatch.setattr(SFTTrainer, "restore", lambda self: None)
    trainer = SFTTrainer(cfg)  # refused with "sft.data is not set" before
    assert trainer.data_config() is cfg.data and trainer.data_section() == "data"
    sets = build_prompt_sets(trainer.data_config(), purpose="sft", section=trainer.data_section())
    assert [s["completion"] for s in sets.train] == ["1", "2", "3", "4"]
    # An sft.data section still wins.
    cfg = load_config(
        write_config(tmp_path, tiny_model("qwen3"), data=data, sft={"steps": 1, "data": data}), stage="sft"
    )
    trainer = SFTTrainer(cfg)
    assert trainer.data_config() is cfg.sft.data and trainer.data_section() == "sft.data"


def test_submit_makes_the_same_checks_before_asking_the_cluster(tiny_model, tmp_path, capsys, monkeypatch):
    """A job starts its stage with `--resume auto`: submit refuses what that stage would refuse on the
    allocation (replay on a dense model, the newest checkpoint of another model), before any Slurm call."""
    from megagrpo.submit import slurm

    asked = []
    monkeypatch.setattr(slurm, "partitions", lambda *a, **k: asked.append(a) or [])
    dense, moe = tiny_model("qwen3"), tiny_model("qwen3_moe")
    job = ["--nodes", "1", "--gpus-per-node", "1", "--device", "cpu", "--dry-run"]
    rc, err, _ = run_cli(["submit", write_config(tmp_path, dense, replay="R3"), *job], capsys)
    assert rc == 2 and "is a dense model" in err and "set replay=none" in err
    fake_checkpoint(tmp_path / "ckpt" / "step_00000002", moe)  # the newest checkpoint is the MoE model's
    rc, err, _ = run_cli(["submit", write_config(tmp_path, dense, replay="none"), *job], capsys)
    assert rc == 2 and "model.hf_path" in err, err
    assert asked == []


# -- issue 26: a multi-turn environment or tool parser that cannot work is refused before any process --


@pytest.mark.parametrize(
    ("multi_turn", "message"),
    [
        ({"environment": "no_such_env"}, "rollout.multi_turn.environment: 'no_such_env' is not a built-in"),
        (
            {"environment": "no_pkg.envs:Env"},
            "rollout.multi_turn.environment: cannot import 'no_pkg.envs:Env'",
        ),
        ({"environment_options": {"colour": 1}}, "options {'colour': 1} do not fit 'calculator'"),
        ({"environment_options": {"max_turns": 0}}, "are not valid for 'calculator': max_turns must be >= 1"),
        (
            {"tool_parser": "qwen9"},
            "rollout.multi_turn.tool_parser: 'qwen9' is not an SGLang tool-call parser",
        ),
        (
            {"reasoning_parser": "qwen-3"},
            "rollout.multi_turn.reasoning_parser: 'qwen-3' is not an SGLang reasoning parser; choose one of",
        ),
    ],
)
def test_a_multi_turn_section_that_cannot_run_is_refused(
    tiny_model, tmp_path, capsys, started, multi_turn, message
):
    cfg = write_config(tmp_path, tiny_model("qwen3"), rollout={"multi_turn": {"enabled": True, **multi_turn}})
    rc, err, _ = run_cli(["train", cfg], capsys)
    assert rc == 2 and not started, err
    assert message in err and "Traceback" not in err


def test_chat_template_options_megagrpo_sets_itself_are_refused(tiny_model, tmp_path, capsys, started):
    cfg = write_config(tmp_path, tiny_model("qwen3"))
    rc, err, _ = run_cli(["train", str(cfg), "model.chat_template_kwargs={tools: []}"], capsys)
    assert rc == 2 and not started, err
    assert "model.chat_template_kwargs" in err and "['tools'] are set by megagrpo itself" in err


def test_the_python_environment_reaches_the_stage(tiny_model, tmp_path, capsys, started):
    mt = {"enabled": True, "environment": "python", "environment_options": {"memory_mb": 256}}
    rc, err, _ = run_cli(
        ["train", write_config(tmp_path, tiny_model("qwen3"), rollout={"multi_turn": mt})], capsys
    )
    assert rc == 0 and started, err


def test_a_host_that_denies_the_sandbox_namespaces_is_refused_before_any_process_starts(
    tiny_model, tmp_path, capsys, started, monkeypatch
):
    """The probe's verdict of a container without CAP_SYS_ADMIN (the real one: tests/unit/envs/
    test_sandbox.py under setpriv) stops `megagrpo train` in one line, unless the config accepts it."""
    from megagrpo.envs import sandbox

    denied = sandbox.Isolation(sandbox.ISOLATIONS, "unshare: Operation not permitted")
    monkeypatch.setitem(sandbox._PROBES, False, denied)
    mt = {"enabled": True, "environment": "python"}
    rc, err, _ = run_cli(
        ["train", write_config(tmp_path, tiny_model("qwen3"), rollout={"multi_turn": mt})], capsys
    )
    assert rc == 2 and not started, err
    assert "the code sandbox cannot enforce network isolation, PID namespace, private mounts" in err
    assert "rollout.multi_turn.sandbox_isolation: best_effort" in err and "Traceback" not in err
    mt["sandbox_isolation"] = "best_effort"
    rc, err, _ = run_cli(
        ["train", write_config(tmp_path, tiny_model("qwen3"), rollout={"multi_turn": mt})], capsys
    )
    assert rc == 0 and started, err


# -- issue 37 section 4: uneven pipeline stages must add up to the model's layers ------------------------


def test_stage_layer_counts_that_do_not_add_up_fail_before_start(tiny_model, tmp_path, capsys, monkeypatch):
    spawned: list = []
    monkeypatch.setattr("megagrpo.cli._spawn_torchrun", lambda *a: spawned.append(a) or 0)
    model = tiny_model("qwen3_moe", layers=3)  # 3 layers: PP2 needs the ends set
    cases = {
        None: "set mesh.first_stage_layers and/or mesh.last_stage_layers",
        3: "do not add up to the model's 3 layers",
    }
    for first, words in cases.items():
        cfg = write_config(tmp_path, model, mesh={"pp": 2, "first_stage_layers": first})
        rc, err, _ = run_cli(["train", cfg, "--nproc", "2"], capsys)
        assert rc == 2 and not spawned and words in err, err
    cfg = write_config(tmp_path, model, mesh={"pp": 2, "first_stage_layers": 1})
    rc, err, _ = run_cli(["train", cfg, "--nproc", "2"], capsys)
    assert rc == 0 and len(spawned) == 1, err  # 1 + 2 layers: the launch goes ahead
