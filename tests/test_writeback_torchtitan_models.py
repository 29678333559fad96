"""TorchTitan write-back for models that ask more of a pipeline plan than a decoder's modules, on
fixtures modelled on TorchTitan's own configs (each names the upstream file it imitates): the vision
tower of Qwen3.5 and Kimi K2.5 in the first model part, the renamed transformers backend's shared rotary
embedding in every part, MTP models refused a pipeline degree above 1, and the key names an installed
torchtitan package answers for, with a note."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import shutil
from pathlib import Path

import pytest
import tomllib
from test_writeback_torchtitan import EVERY_SECOND, FIXTURES, PARTS_OUTPUT, plan, settings

from sapp_hook.writeback import layout_of, write_config
from simulator import InputError

# no head name in these configs nor a TorchTitan beside them: the last part lists both names
PARTS_BOTH_HEADS = [*PARTS_OUTPUT[:3], ["layers.7", "norm", "output", "lm_head"]]
WITH_VISION = [["vision_encoder", *PARTS_BOTH_HEADS[0]], *PARTS_BOTH_HEADS[1:]]


def in_package(tmp_path: Path, fixture: str, model: str) -> Path:
    """The fixture as `torchtitan/models/MODEL/config_registry.py`, where TorchTitan keeps it."""
    path = tmp_path / "models" / model / "config_registry.py"
    path.parent.mkdir(parents=True)
    shutil.copy(FIXTURES / fixture, path)
    return path


@pytest.mark.parametrize(
    ("fixture", "model", "function", "size"),
    [
        ("kimi_k2_5_config_registry.py", "kimi_k2_5", "kimi_k2_5_debugmodel_mm", 1),
        ("kimi_k2_5_config_registry.py", "kimi_k2_5", "kimi_k2_5_1t_a32b", 2),  # local batch 16 in 8
        ("qwen3_5_config_registry.py", "qwen3_5", "qwen35_debugmodel_moe", 1),
    ],
)
def test_a_vision_language_model_keeps_its_vision_tower_in_the_first_part(tmp_path, fixture, model, function, size):
    """pipeline_kimi_k2_5 and Qwen35Model.pipeline_first_stage_module_fqns put `vision_encoder` first only in
    lists TorchTitan generates; a list written without it leaves the vision tower in no stage."""
    path = in_package(tmp_path, fixture, model)
    write_config("torchtitan", f"{path}:{function}", layout_of(plan(EVERY_SECOND)))
    parallelism, checkpoint = settings(path, function)
    assert parallelism["module_fqns_per_model_part"] == WITH_VISION
    assert parallelism["pipeline_parallel_degree"] == 4 and parallelism["pipeline_parallel_microbatch_size"] == size
    assert checkpoint == {"expr": "ActivationCheckpointConfig(mode='selective', selective_ac_option='2')"}


def test_a_user_config_that_imports_a_vlm_registry_gets_the_vision_tower_too(tmp_path):
    path = tmp_path / "my_kimi_job.py"
    path.write_text(
        "from torchtitan.config import ParallelismConfig, TrainingConfig\n"
        "from torchtitan.models.kimi_k2_5 import model_registry\n"
        "from torchtitan.trainer import Trainer\n\n\n"
        "def kimi_pp() -> Trainer.Config:\n"
        "    return Trainer.Config(model_spec=model_registry('debugmodel_mm'), "
        "training=TrainingConfig(local_batch_size=8), parallelism=ParallelismConfig())\n"
    )
    write_config("torchtitan", path, layout_of(plan()))
    assert settings(path, "kimi_pp")[0]["module_fqns_per_model_part"] == WITH_VISION


def test_the_renamed_transformers_backend_lists_its_rotary_embedding_in_every_part(tmp_path):
    path = tmp_path / "debug_model.toml"
    shutil.copy(FIXTURES / "transformers_modeling_backend_debug_model.toml", path)
    write_config("torchtitan", path, layout_of(plan()))
    parts = tomllib.loads(path.read_text())["parallelism"]["module_fqns_per_model_part"]
    assert parts == [[*part, "rotary_emb"] for part in PARTS_OUTPUT]


MTP_MESSAGE = (
    r"deepseek_v4_mtp_debugmodel trains multi-token-prediction layers \({}\); TorchTitan refuses a "
    r"pipeline_parallel_degree above 1 beside them \(\"MTP does not support pipeline parallelism yet\"\), so "
    r"the plan's 4 pipeline ranks would stop the job at launch"
)


def test_a_model_with_mtp_layers_is_refused_a_pipeline_plan(tmp_path):
    path = in_package(tmp_path, "deepseek_v4_mtp_config_registry.py", "deepseek_v4")
    before = path.read_bytes()
    with pytest.raises(InputError, match=MTP_MESSAGE.format(r"n_mtp_layers=1 \(line 40\)")):
        write_config("torchtitan", f"{path}:deepseek_v4_mtp_debugmodel", layout_of(plan()))
    assert path.read_bytes() == before
    # the same file's model without MTP takes the plan
    write_config("torchtitan", f"{path}:deepseek_v4_debugmodel", layout_of(plan()))
    assert settings(path, "deepseek_v4_debugmodel")[0]["pipeline_parallel_degree"] == 4


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        (("n_mtp_layers=1", "n_mtp_layers=N_MTP"), "n_mtp_layers=N_MTP"),  # a name bound to 1 in the function
        (
            ('model_spec = model_registry("debugmodel", seq_len=seq_len, n_mtp_layers=1)', "model_spec = None"),
            "MTPLoss",
        ),
    ],
)
def test_mtp_said_through_a_name_or_by_its_loss_is_refused(tmp_path, edit, said):
    path = in_package(tmp_path, "deepseek_v4_mtp_config_registry.py", "deepseek_v4")
    text = path.read_text().replace(*edit)
    if "N_MTP" in text:
        text = text.replace(
            '    model_spec = model_registry("debugmodel", seq_len=seq_len, n_mtp',
            '    N_MTP = 1\n    model_spec = model_registry("debugmodel", seq_len=seq_len, n_mtp',
        )
    path.write_text(text)
    with pytest.raises(InputError, match=rf"trains multi-token-prediction layers \({said}"):
        write_config("torchtitan", f"{path}:deepseek_v4_mtp_debugmodel", layout_of(plan()))


def test_a_toml_config_with_mtp_modules_is_refused_a_pipeline_plan(tmp_path):
    """torchtitan-npu's DeepSeek-V4 TOMLs set training.num_mtp_modules; its model refuses PP beside it."""
    path = tmp_path / "deepseek_v4_285b_43layers_4k_128die.toml"
    path.write_text(
        "[training]\nlocal_batch_size = 8\nnum_mtp_modules = 1\n\n[parallelism]\npipeline_parallel_degree = 1\n"
    )
    with pytest.raises(InputError, match=r"trains multi-token-prediction layers \(training.num_mtp_modules = 1\)"):
        write_config("torchtitan", path, layout_of(plan()))


def _installed(tmp_path: Path, monkeypatch, fields: list[str], *, python_configs: bool) -> Path:
    """An installed torchtitan package, as much of it as sapp-hook reads."""
    package = tmp_path / "site-packages" / "torchtitan"
    (package / "config").mkdir(parents=True)
    (package / "distributed").mkdir()
    (package / "__init__.py").write_text("")
    (package / "config" / "configs.py").write_text(
        "class ParallelismConfig:\n" + "".join(f"    {name}: int = 1\n" for name in fields)
    )
    (package / "distributed" / "pipeline_parallel.py").write_text('FQNS = [["norm", "lm_head"]]\n')
    if python_configs:
        (package / "trainer.py").write_text("class Trainer:\n    pass\n")
    init = str(package / "__init__.py")
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: importlib.machinery.ModuleSpec(name, None, origin=init) if name == "torchtitan" else None,
    )
    return package


# a config that changes another module's config; its local_batch_size is of the older key names' time
CHANGES_AN_IMPORTED_CONFIG = (
    "from torchtitan.models.kimi_k2_5.config_registry import kimi_k2_5_debugmodel_mm\n\n\n"
    "def kimi_pp():\n"
    "    config = kimi_k2_5_debugmodel_mm()\n"
    "    config.training.local_batch_size = 8\n"
    "    config.parallelism.pipeline_parallel_degree = 1\n"
    "    return config\n"
)


def test_the_installed_torchtitan_names_the_keys_and_a_note_says_so(tmp_path, monkeypatch):
    """The installed TorchTitan is the one the job runs on: its names win over the config's dating keys."""
    package = _installed(
        tmp_path,
        monkeypatch,
        ["pipeline_parallel_degree", "pipeline_parallel_module_fqns_per_model_part", "num_pp_microbatches"],
        python_configs=True,
    )
    path = tmp_path / "jobs" / "kimi_pp.py"
    path.parent.mkdir()
    path.write_text(CHANGES_AN_IMPORTED_CONFIG)
    notes = write_config("torchtitan", path, layout_of(plan())).notes
    text = path.read_text()
    assert "config.parallelism.pipeline_parallel_module_fqns_per_model_part = [" in text
    assert "config.parallelism.num_pp_microbatches = 8" in text
    assert settings(path, "kimi_pp")[0]["pipeline_parallel_module_fqns_per_model_part"] == [
        ["vision_encoder", *PARTS_OUTPUT[0]],
        *PARTS_OUTPUT[1:3],
        ["layers.7", "norm", "lm_head"],
    ]
    assert (
        f"{path}: kimi_pp: wrote pipeline_parallel_module_fqns_per_model_part and num_pp_microbatches, the names the "
        f"installed torchtitan ({package}, its config classes read, not imported) takes; a job launched with "
        "another TorchTitan may read other names: run apply where that one is installed"
    ) in notes


def test_an_installed_torchtitan_from_before_python_configs_does_not_name_a_python_configs_keys(tmp_path, monkeypatch):
    """torchtitan 0.2.2 (TOML configs, no trainer.py) installed beside a config_registry.py of 2026: its
    `output` head and fields are not those of the TorchTitan the config runs on."""
    package = _installed(
        tmp_path,
        monkeypatch,
        ["pipeline_parallel_degree", "module_fqns_per_model_part", "pipeline_parallel_microbatch_size"],
        python_configs=False,
    )
    path = in_package(tmp_path, "kimi_k2_5_config_registry.py", "kimi_k2_5")
    notes = write_config("torchtitan", f"{path}:kimi_k2_5_1t_a32b", layout_of(plan())).notes
    assert settings(path, "kimi_k2_5_1t_a32b")[0]["module_fqns_per_model_part"] == WITH_VISION
    assert (
        f"{path}: kimi_k2_5_1t_a32b: the installed torchtitan ({package}) predates Python configs (it has no "
        "torchtitan/trainer.py), so it is not the TorchTitan this config runs on: the key names were taken from "
        "the config itself"
    ) in notes
