"""Issue 16, item 4: `rollout.deterministic` reaches SGLang's server arguments on a GPU, and only there."""

from __future__ import annotations

import json

import pytest

from megagrpo.config import config_from_dict
from megagrpo.rollout import RolloutConfig
from megagrpo.rollout.engines.engine import RolloutEngine
from megagrpo.trainer.components import rollout_config


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_experts_per_tok": 2}))
    return str(tmp_path)


@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_maps_to_sglang_on_gpu_only(model_dir, deterministic):
    cfg = rollout_config(
        config_from_dict({"model": {"hf_path": model_dir}, "rollout": {"deterministic": deterministic}}),
        model_dir,
    )
    assert cfg.deterministic is deterministic
    engine = RolloutEngine(cfg)
    engine.on_cpu = False  # the GPU mapping, without a GPU: engine_kwargs only reads the config
    gpu = engine.engine_kwargs()
    assert gpu["enable_memory_saver"] is True
    assert gpu.get("enable_deterministic_inference", False) is deterministic
    engine.on_cpu = True  # the CPU engine honours request seeds itself; SGLang's flag would reject its
    assert "enable_deterministic_inference" not in engine.engine_kwargs()  # torch_native attention


def test_default_is_off():
    assert RolloutConfig("m").deterministic is False
    assert config_from_dict({"model": {"hf_path": "m"}}).rollout.deterministic is False


class _Proc:
    def __init__(self, cmdline):
        self._cmdline = cmdline

    def cmdline(self):
        return self._cmdline


WARN = "-Wignore:resource_tracker:UserWarning:multiprocessing.resource_tracker"  # console.py's child filter


@pytest.mark.parametrize(
    "cmdline,helper",
    [
        # a scheduler or detokenizer not yet retitled by SGLang: its -W option names the resource tracker
        (
            [
                "python",
                "-B",
                WARN,
                "-c",
                "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5)",
                "--multiprocessing-fork",
            ],
            False,
        ),  # fmt: skip
        (["sglang::detokenizer", "", ""], False),
        (["python", WARN, "-c", "from multiprocessing.resource_tracker import main;main(7)"], True),
        (["python", "-c", "from multiprocessing.forkserver import main; main(3, 4, None)"], True),
        (["python", "-c"], False),
    ],
)
def test_only_multiprocessing_helpers_are_left_out_of_the_engines_processes(cmdline, helper):
    """An engine's processes are recorded at start and killed by shutdown; a child misread as the shared
    resource tracker was never killed and hung the trainer's exit (multiprocessing joins live children)."""
    from megagrpo.rollout.engines.engine import _is_mp_helper

    assert _is_mp_helper(_Proc(cmdline)) is helper


def test_gpu_engine_runs_triton_attention_without_fa3_and_eager_prefill(model_dir, monkeypatch):
    """The bundle's sglang-kernel has no FlashAttention-3 (trimmed to sm_90): SGLang's Hopper default would
    fail, so the engine asks for Triton attention; prefill CUDA graphs are off (seen failing on an H200)."""
    import megagrpo.rollout.engines.engine as eng

    cfg = rollout_config(config_from_dict({"model": {"hf_path": model_dir}}), model_dir)
    engine = RolloutEngine(cfg)
    engine.on_cpu = False
    monkeypatch.setattr(eng, "has_flash_attention_3", lambda: False)
    kw = engine.engine_kwargs()
    assert kw["attention_backend"] == "triton" and kw["cuda_graph_backend_prefill"] == "disabled"
    monkeypatch.setattr(eng, "has_flash_attention_3", lambda: True)
    assert "attention_backend" not in engine.engine_kwargs()
    import dataclasses

    engine.cfg = dataclasses.replace(cfg, extra_engine_args={"cuda_graph_backend_prefill": "breakable"})
    assert engine.engine_kwargs()["cuda_graph_backend_prefill"] == "breakable"  # the user's choice wins


def test_small_head_dim_is_refused_on_a_gpu_before_sglang_starts(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 128, "num_attention_heads": 4}))
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    with pytest.raises(Exception, match="head_dim 32.*>= 64"):
        RolloutEngine(RolloutConfig(str(tmp_path)))
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    RolloutEngine(RolloutConfig(str(tmp_path)))  # the CPU engine has no such limit


@pytest.mark.parametrize("on_cpu", [True, False])
def test_idle_cpu_scheduler_sleeps_unless_the_user_says_otherwise(model_dir, on_cpu):
    """An idle SGLang scheduler spins by default (0.59 of a core measured on the CPU), a core taken from the
    colocated learner; asleep it blocks in a zmq poll that a request ends at once. GPU engines keep SGLang's
    default (unmeasured there). The user's `extra_engine_args` still wins."""
    import dataclasses

    cfg = rollout_config(config_from_dict({"model": {"hf_path": model_dir}}), model_dir)
    engine = RolloutEngine(cfg)
    engine.on_cpu = on_cpu
    assert engine.engine_kwargs()["sleep_on_idle"] is on_cpu
    engine.cfg = dataclasses.replace(cfg, extra_engine_args={"sleep_on_idle": not on_cpu})
    assert engine.engine_kwargs()["sleep_on_idle"] is (not on_cpu)


def test_the_disaggregated_server_s_key_is_redacted_from_sglang_s_logs(tiny_model, monkeypatch):
    """Issue 43: at log_level info SGLang logs its whole ServerArgs, api_key and admin_api_key among them,
    as the server starts; the engine rank's launch key never reaches a log."""
    import io
    import logging
    import signal
    import threading

    from sglang.srt.entrypoints import engine as sgl_engine
    from sglang.srt.entrypoints import http_server

    import megagrpo.rollout.engines.server as server

    rc = RolloutConfig(str(tiny_model()), log_level="info")
    out, logged, keys = io.StringIO(), threading.Event(), []

    def launch_server(server_args, **kw):  # SGLang's own log line, from its own logger, then no server
        keys.append(server_args.api_key)
        lg = logging.getLogger(sgl_engine.__name__)
        handler = logging.StreamHandler(out)
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)
        try:
            lg.info(f"server_args={sgl_engine._server_args_for_logging(server_args)}")
            lg.info("key %s", server_args.admin_api_key)  # and through a record's args
        finally:
            lg.removeHandler(handler)
            logged.set()

    monkeypatch.setattr(http_server, "launch_server", launch_server)
    factory, quit_handler = logging.getLogRecordFactory(), signal.getsignal(signal.SIGQUIT)
    try:
        server._start_server(rc, store=None, engine=0, where="test", host="127.0.0.1")
        assert logged.wait(60)
    finally:
        logging.setLogRecordFactory(factory)
        signal.signal(signal.SIGQUIT, quit_handler)
    text = out.getvalue()
    assert keys and len(keys[0]) >= 32 and "api_key" in text
    assert keys[0] not in text and text.count(server.REDACTED) >= 3
