"""Where the GPU preset's processes run (docs/scaling.md): 7 GPUs train, the 8th serves the simulator through
`vllm serve` with its memory share, the real arms ask one served retriever, and the dry run names each arm's
simulator and retriever and lists missing inputs under the plan."""

from pathlib import Path

import yaml

from simulators.openai_server import VLLMEngineArgs, start_simulator_server, vllm_command

ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "configs" / "experiments" / "zerosearch-qwen2.5-3b.yaml"


def test_vllm_command_keeps_dtype_and_forwards_engine_arguments():
    command = vllm_command(
        "/models/sim",
        dtype="bfloat16",
        engine=VLLMEngineArgs(gpu_memory_utilization=0.9, tensor_parallel_size=2, max_model_len=4096),
    )
    flags = dict(zip(command[3::2], command[4::2], strict=False))
    assert flags["--dtype"] == "bfloat16"
    assert flags["--gpu-memory-utilization"] == "0.9"
    assert flags["--tensor-parallel-size"] == "2"
    assert flags["--max-model-len"] == "4096"
    plain = vllm_command("/models/sim")  # unset: vLLM's own defaults, no flag
    assert not {"--gpu-memory-utilization", "--tensor-parallel-size", "--max-model-len"} & set(plain)
    assert plain[plain.index("--dtype") + 1] == "auto"


def test_simulator_serve_passes_the_engine_arguments_to_vllm(tiny_model_dir, monkeypatch, zerosim_cli):
    import simulators.openai_server as server

    ran = []
    monkeypatch.setattr(server, "vllm_available", lambda: True)
    monkeypatch.setattr(server.subprocess, "run", lambda cmd, check: ran.append(cmd) or _Done())
    zerosim_cli(
        "simulator", "serve", "--model", tiny_model_dir, "--served-model-name", "simulator",
        "--dtype", "bfloat16", "--gpu-memory-utilization", "0.9", "--tensor-parallel-size", "1",
        "--max-model-len", "4096",
    )  # fmt: skip
    command = ran[0]
    assert command[1:3] == ["serve", str(tiny_model_dir)]
    for flag, value in [
        ("--dtype", "bfloat16"),
        ("--gpu-memory-utilization", "0.9"),
        ("--max-model-len", "4096"),
    ]:
        assert command[command.index(flag) + 1] == value


def test_in_process_server_refuses_vllm_only_arguments(tiny_model_dir, monkeypatch):
    import pytest

    import simulators.openai_server as server

    monkeypatch.setattr(server, "vllm_available", lambda: False)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        start_simulator_server(str(tiny_model_dir), engine=VLLMEngineArgs(gpu_memory_utilization=0.5))


class _Done:
    returncode = 0


def test_gpu_preset_layout_seven_trainers_one_simulator_one_retriever():
    preset = yaml.safe_load(PRESET.read_text())
    text = PRESET.read_text()
    assert "configs/accelerate/zero2-7.yaml" in preset["train_launcher"]
    assert "CUDA_VISIBLE_DEVICES=7" in text and "--gpu-memory-utilization" in text
    assert "zerosim serve retriever --index indexes/wiki18-e5" in text
    for arm in ("real", "mixed"):
        overrides = preset["arms"][arm]["overrides"]
        assert "search.engine=http" in overrides or "search.mixed.real=http" in overrides, arm
    recipe = yaml.safe_load((ROOT / preset["base"]).read_text())["trainer"]
    per_gpu = recipe["per_device_train_batch_size"] * recipe["gradient_accumulation_steps"]
    trajectories = 7 * per_gpu
    prompts = trajectories // recipe["num_generations"]
    assert (per_gpu, trajectories, prompts) == (40, 280, 56)
    assert f"7 x {per_gpu} = {trajectories} trajectories = {prompts} prompts per step" in text


def test_gpu_preset_dry_run_names_simulator_and_retriever_and_lists_missing_inputs(monkeypatch, zerosim_cli):
    monkeypatch.chdir(ROOT)
    dry = zerosim_cli("experiment", "--config", str(PRESET), "--dry-run", code=2)
    out = dry.output
    assert "train-sim-s0" in out and "report" in out  # the plan is printed ...
    assert out.index("report") < out.index("missing")  # ... and the missing inputs under it
    assert "data/flashrag/nq/test.jsonl" in out.split("missing", 1)[1]
    train = {line.split("│")[1].strip(): line.split("│")[4] for line in out.splitlines()
             if line.count("│") >= 4 and "train-" in line}  # fmt: skip
    assert "simulator at http://127.0.0.1:8001" in train["train-sim-s0"]
    assert "retriever at http://127.0.0.1:8000" in train["train-real-s0"]
    assert "simulator at" in train["train-mixed-s0"] and "retriever at" in train["train-mixed-s0"]


def test_the_real_run_still_refuses_before_any_stage(monkeypatch, zerosim_cli, tmp_path):
    monkeypatch.chdir(ROOT)
    run = zerosim_cli(
        "experiment", "--config", str(PRESET), f"output_dir={tmp_path}", "tracking.tracking_uri=" + f"sqlite:///{tmp_path}/m.db", code=2
    )  # fmt: skip
    assert "data/flashrag/nq/test.jsonl does not exist" in run.output
    assert not (tmp_path / "zerosearch-qwen2.5-3b" / "stages").exists()
