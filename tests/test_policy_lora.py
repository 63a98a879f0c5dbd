"""LoRA for the RL policy (``policy.lora``, docs/training.md "LoRA"): the base stays as it was, the adapters
move, no reference copy is built, an adapter checkpoint resumes, the merged model computes what the adapted one
does, and the precision check takes a bf16 base under fp32 adapters but no bf16 trainable weight."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from zerosim.core.config import ConfigError
from zerosim.training.config import TrainConfig, load_train_config

REPO = Path(__file__).resolve().parents[1]


def _config(out: Path, model: str, qa: Path, corpus: Path, db: str, *extra: str) -> TrainConfig:
    return load_train_config(
        REPO / "configs" / "demo.yaml",
        [
            f"run.output_dir={out}",
            "run.name=run",
            f"policy.model={model}",
            "policy.lora.enabled=true",
            "policy.lora.r=4",
            "policy.lora.alpha=8",
            "search.engine=bm25",
            f"search.bm25.corpus={corpus}",
            f"data.train={qa}",
            "trainer.max_steps=2",
            "trainer.save_steps=1",
            "trainer.beta=0.04",  # a KL term: TRL scores the reference with the adapters disabled, no copy
            "trainer.learning_rate=1e-2",
            "trainer.collapse_patience=0",
            "trainer.per_device_train_batch_size=2",
            "trainer.num_generations=2",
            "rollout.max_new_tokens=6",
            "rollout.max_turns=1",
            "rollout.max_completion_tokens=64",
            "warmstart.enabled=false",
            "validation.every=0",
            f"tracking.tracking_uri={db}",
            "tracking.num_sample_trajectories=1",
            *extra,
        ],
    )


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_model_dir):
    """Two GRPO steps of the tiny model with LoRA (merge_final on), the trainer kept; then a resume to step 3."""
    from zerosim.training import recipe

    root = tmp_path_factory.mktemp("lora")
    qa, corpus = root / "qa.jsonl", root / "corpus.jsonl"
    qa.write_text(
        "".join(
            json.dumps(
                {
                    "id": f"q{i}",
                    "question": f"What is the capital of country {c}?",
                    "golden_answers": [f"City{c}"],
                }
            )  # fmt: skip
            + "\n"
            for i, c in enumerate("ABCD")
        )
    )
    corpus.write_text(
        "".join(
            json.dumps({"id": f"p{i}", "contents": f"Country {c}\nThe capital of country {c} is City{c}."})
            + "\n"
            for i, c in enumerate("ABCD")
        )
    )
    db = f"sqlite:///{root / 'mlflow.db'}"
    kept = []

    class Kept(recipe.SearchTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            kept.append(self)

    def alternating(
        prompts, completions, **kwargs
    ):  # rewards that differ in each group: a gradient to follow
        return [float(i % 2) for i in range(len(completions))]

    mp = pytest.MonkeyPatch()
    mp.setattr(recipe, "SearchTrainer", Kept)
    mp.setattr(recipe, "_reward_funcs", lambda *args: [alternating])
    try:
        cfg = _config(root / "out", str(tiny_model_dir), qa, corpus, db, "policy.lora.merge_final=true")
        first = recipe.train(cfg)
        adapter_at_2 = (root / "out" / "run" / "checkpoint-2" / "adapter_model.safetensors").read_bytes()
        resumed = _config(root / "out", str(tiny_model_dir), qa, corpus, db, "run.resume=true", "trainer.max_steps=3", "policy.lora.merge_final=true")  # fmt: skip
        second = recipe.train(resumed)
    finally:
        mp.undo()
    return {"root": root, "run": root / "out" / "run", "trainers": kept, "first": first, "second": second,
            "adapter_at_2": adapter_at_2}  # fmt: skip


def test_two_steps_leave_the_base_bit_identical_and_move_the_adapters_with_no_reference_copy(
    lora_run, tiny_model_dir
):
    from safetensors.torch import load_file

    trainer = lora_run["trainers"][0]
    assert trainer.ref_model is None and trainer.beta == 0.04  # the KL term is on, and no second model exists
    base = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    trained = {
        k.replace("base_model.model.", "", 1).replace(".base_layer", ""): v
        for k, v in trainer.model.state_dict().items()
        if "lora_" not in k
    }
    assert set(base) <= set(trained)
    assert all(torch.equal(base[k], trained[k]) for k in base)  # bit for bit
    assert all(v.dtype == torch.float32 for k, v in trainer.model.state_dict().items() if "lora_" in k)
    moved = [
        k for k, v in trainer.model.state_dict().items() if "lora_B" in k and v.abs().max() > 0
    ]  # B starts at zero
    assert len(moved) == sum("lora_B" in k for k in trainer.model.state_dict())
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)


def test_checkpoints_and_final_hold_the_adapter_naming_its_base(lora_run, tiny_model_dir):
    run = lora_run["run"]
    for folder in (run / "checkpoint-2", run / "final"):
        names = {p.name for p in folder.iterdir()}
        assert {"adapter_config.json", "adapter_model.safetensors"} <= names
        assert "model.safetensors" not in names
        base = json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"]
        assert base == str(Path(tiny_model_dir).resolve())
    # the optimizer holds the adapters' moments only: far smaller than the model
    assert (run / "checkpoint-2" / "optimizer.pt").stat().st_size < (
        Path(tiny_model_dir) / "model.safetensors"
    ).stat().st_size


def test_an_adapter_checkpoint_resumes(lora_run):
    import mlflow

    second, first = lora_run["second"], lora_run["first"]
    assert second.run_id == first.run_id and second.steps == 3
    resumed = lora_run["trainers"][1]
    assert resumed.state.global_step == 3
    tags = mlflow.MlflowClient(f"sqlite:///{lora_run['root'] / 'mlflow.db'}").get_run(second.run_id).data.tags
    assert tags["zerosim.resumed_from"].endswith("checkpoint-2")
    at_3 = (lora_run["run"] / "checkpoint-3" / "adapter_model.safetensors").read_bytes()
    assert at_3 != lora_run["adapter_at_2"]  # it trained on from the adapter


def test_the_merged_model_computes_what_the_adapted_one_does(lora_run):
    from zerosim.core.models import load_causal_lm

    adapted = lora_run["trainers"][1].model.eval()
    ids = torch.tensor([[1, 57, 300, 1024, 7, 99, 5, 2048]])
    with torch.no_grad():
        want = adapted(input_ids=ids).logits
        merged = load_causal_lm(str(lora_run["run"] / "merged")).eval()(input_ids=ids).logits
        loaded = (
            load_causal_lm(str(lora_run["run"] / "final")).eval()(input_ids=ids).logits
        )  # as eval loads it
    # fp32: merging W + s B A reorders one sum per weight; logits of magnitude ~1 agree to ~1e-6
    torch.testing.assert_close(merged, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(loaded, want, atol=1e-4, rtol=1e-4)
    assert not (lora_run["run"] / "merged" / "adapter_config.json").exists()


def test_a_bf16_base_with_fp32_adapters_passes_the_precision_check_and_bf16_trainable_weights_do_not(
    tiny_model_dir,
):
    from peft import get_peft_model

    from zerosim.core.models import load_causal_lm, training_dtype
    from zerosim.training.config import PolicyLoraConfig
    from zerosim.training.precision import check_master_weights

    with pytest.raises(ConfigError, match="policy.lora.enabled=true"):
        training_dtype("bfloat16")  # a bf16 model the optimizer would step: refused, LoRA named as a way out
    assert training_dtype("bfloat16", frozen=True) == torch.bfloat16
    lora = PolicyLoraConfig(enabled=True, r=4).peft_config()
    base = load_causal_lm(str(tiny_model_dir), "bfloat16", trained=True, frozen=True)
    model = get_peft_model(base, lora)  # peft casts the adapters up to fp32 (TRL's default outside ZeRO-3)
    assert {p.dtype for n, p in model.named_parameters() if "lora_" not in n} == {torch.bfloat16}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    assert "fp32" in check_master_weights(optimizer)
    low = get_peft_model(
        load_causal_lm(str(tiny_model_dir), "bfloat16", trained=True, frozen=True),
        lora,
        autocast_adapter_dtype=False,
    )
    with pytest.raises(ConfigError, match="steps bfloat16 weights"):
        check_master_weights(torch.optim.AdamW([p for p in low.parameters() if p.requires_grad]))


def test_lora_with_a_vllm_mode_is_refused_naming_why(tmp_path):
    from zerosim.core.config import load_config

    with pytest.raises(ConfigError, match="no adapter sync"):
        load_config(
            None,
            ["policy.lora.enabled=true", "trainer.generation=vllm_colocate"],
            schema=TrainConfig,
        )


def test_the_collapse_guard_rolls_a_lora_policy_back_to_its_saved_adapter(lora_run, tmp_path):
    """What the guard saves of a LoRA policy (``save_model``: the adapter under peft's names) loads back into
    the adapters; before, the full-model loader found every key unexpected and stopped the run."""
    from safetensors.torch import load_file

    from zerosim.training.guard import load_saved

    model = lora_run["trainers"][1].model
    saved = lora_run["run"] / "checkpoint-2"
    want = {k: v.clone() for k, v in model.state_dict().items() if "lora_" in k}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(1.0)
    load_saved(model, load_file(str(saved / "adapter_model.safetensors")), saved)
    back = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert back.keys() == want.keys() and all(
        torch.equal(back[k], want[k]) is False for k in want
    )  # step 2 != 3
    reloaded = load_file(str(saved / "adapter_model.safetensors"))
    assert all(
        torch.equal(back[k], reloaded[k.replace(".default", "")]) for k in back
    )  # exactly the saved adapter
    with pytest.raises(RuntimeError, match="does not fit the policy"):
        load_saved(model, {"base_model.model.nonsense.lora_A.weight": torch.zeros(1)}, saved)


def test_an_adapters_digest_covers_the_base_it_sits_on(lora_run, tiny_model_dir, tmp_path):
    import shutil

    from zerosim.experiment.provenance import model_digest

    base, adapter = tmp_path / "base", tmp_path / "final"
    shutil.copytree(tiny_model_dir, base)
    shutil.copytree(lora_run["run"] / "final", adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(base)}))
    before = model_digest(adapter)
    assert any(name.startswith("base/") and name.endswith("model.safetensors") for name in before["files"])
    generation = base / "config.json"
    generation.write_text(generation.read_text().replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e-05'))
    assert model_digest(adapter)["sha256"] != before["sha256"]  # the base changed under the same adapter


def test_eval_takes_the_adapter_as_it_takes_the_merged_model(lora_run, zerosim_cli, mlflow_db, tmp_path):
    """``zerosim eval --policy <run>/final`` (an adapter) and ``--policy`` the folder `zerosim policy merge`
    writes give the same greedy transcripts; the in-process vLLM path refuses an adapter naming the merged one."""
    import mlflow

    run = lora_run["run"]
    merged = tmp_path / "merged"
    zerosim_cli("policy", "merge", "--adapter", run / "final", "--out", merged)
    assert (merged / "model.safetensors").is_file() and not (merged / "adapter_config.json").exists()
    qa, corpus = lora_run["root"] / "qa.jsonl", lora_run["root"] / "corpus.jsonl"

    def transcripts(policy, name: str) -> list[str]:
        zerosim_cli(
            "eval", "--policy", policy, "--dataset", qa, "--search", "bm25", "--method", "agent",
            f"search.bm25.corpus={corpus}", "batch_size=4", "rollout.temperature=0", "rollout.max_new_tokens=8",
            "rollout.max_turns=1", "num_sample_trajectories=4", f"run_name={name}", f"output_dir={tmp_path / name}",
            f"tracking.tracking_uri={mlflow_db}",
        )  # fmt: skip
        mlflow.set_tracking_uri(mlflow_db)
        (found,) = mlflow.search_runs(
            experiment_names=["zerosim-eval"],
            filter_string=f"tags.mlflow.runName = '{name}'",
            output_format="list",
        )
        text = mlflow.artifacts.load_text(f"runs:/{found.info.run_id}/samples/trajectories.jsonl")
        return [json.loads(line)["transcript"] for line in text.splitlines()]

    assert transcripts(run / "final", "adapter") == transcripts(merged, "merged")
    refused = zerosim_cli(
        "eval", "--policy", run / "final", "--dataset", qa, "--search", "bm25", "--method", "agent",
        f"search.bm25.corpus={corpus}", "generation=vllm", f"output_dir={tmp_path / 'v'}",
        f"tracking.tracking_uri={mlflow_db}", code=None,
    )  # fmt: skip
    assert refused.exit_code != 0
    assert "LoRA adapter" in refused.stderr + refused.stdout or "LoRA adapter" in str(refused.exception)


def test_an_adapter_moved_with_its_base_finds_it_and_keeps_its_digest(lora_run, tiny_model_dir, tmp_path):
    """An experiment's folder imported elsewhere keeps its warm start where it was relative to its runs: the
    adapter's absolute base path, gone, is found at the same place under the adapter's ancestors."""
    import shutil

    from zerosim.core.models import adapter_base, load_causal_lm
    from zerosim.experiment.provenance import model_digest

    here = tmp_path / "here" / "stages"
    shutil.copytree(tiny_model_dir, here / "warmstart" / "final")
    shutil.copytree(lora_run["run"] / "final", here / "train-s0" / "final")
    adapter = here / "train-s0" / "final"
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(here / "warmstart" / "final")
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    digest = model_digest(adapter)
    ids = torch.tensor([[1, 57, 300, 1024]])
    with torch.no_grad():
        want = load_causal_lm(str(adapter))(input_ids=ids).logits
    shutil.move(tmp_path / "here", tmp_path / "there")
    moved = tmp_path / "there" / "stages" / "train-s0" / "final"
    assert adapter_base(moved) == str(tmp_path / "there" / "stages" / "warmstart" / "final")
    assert model_digest(moved) == digest
    with torch.no_grad():
        torch.testing.assert_close(load_causal_lm(str(moved))(input_ids=ids).logits, want)


def test_a_lora_runs_best_and_final_folders_count_as_models(lora_run, tmp_path):
    """The collapse guard's best/ and an experiment's finished final/ of a LoRA run hold an adapter, no
    config.json: both count as a model (before, the guard lost its rollback target and final_policy=best, and a
    LoRA arm's stage was refused as having left no final model)."""
    import shutil

    from zerosim.experiment.kinds import finished_training
    from zerosim.training.guard import BEST_DIR, CollapseGuard

    run = tmp_path / "run"
    shutil.copytree(lora_run["run"] / "final", run / BEST_DIR)
    guard = CollapseGuard(1, action="rollback")
    guard.run_dir, guard.best_step = run, 2
    assert guard.best_dir == run / BEST_DIR
    shutil.copytree(lora_run["run"] / "final", run / "final")
    shutil.copy(lora_run["run"] / "result.json", run / "result.json")
    shutil.copy(lora_run["run"] / "mlflow_run.json", run / "mlflow_run.json")
    cfg = _config(
        tmp_path, "smollm2", tmp_path / "qa", tmp_path / "c", f"sqlite:///{lora_run['root'] / 'mlflow.db'}"
    )
    assert finished_training(cfg, run, "zerosim train")


def test_a_lora_policy_trains_from_a_full_model_and_logs_a_full_one(lora_run, tmp_path):
    from zerosim.training.dry_run import _check_start

    with pytest.raises(ConfigError, match="is a LoRA adapter; training starts from a full model"):
        _check_start(load_train_config(None, [f"policy.model={lora_run['run'] / 'final'}"]))
    with pytest.raises(ConfigError, match="policy.lora.merge_final=true"):
        load_train_config(None, ["policy.lora.enabled=true", "tracking.log_model=true"])
    load_train_config(
        None, ["policy.lora.enabled=true", "tracking.log_model=true", "policy.lora.merge_final=true"]
    )


def test_a_lora_policy_generates_from_itself_not_a_bf16_copy(lora_run, tiny_model_dir):
    """A bf16 copy of a PeftModel would split neither its adapters nor the forwards TRL patched under peft's
    wrapper (they call the live model): a LoRA policy in training generates as it is."""
    from zerosim.core.generation import HFGenerator
    from zerosim.core.models import load_causal_lm, load_tokenizer

    tokenizer = load_tokenizer(str(tiny_model_dir))
    assert not HFGenerator(lora_run["trainers"][1].model, tokenizer, bf16=True).bf16
    assert HFGenerator(
        load_causal_lm(str(tiny_model_dir)), tokenizer, bf16=True
    ).bf16  # a plain fp32 model does
